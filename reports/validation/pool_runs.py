"""Pool the engine runs of several ``tangram-validate`` calls on the same trace and configs.

One device call holds only a few repeats; a config's measured throughput spreads 5-30% between runs (a first run
that compiles a Triton specialisation inside the timed loop is the worst), so the prediction is compared with the
mean over every run of every call. Also reported: the same with runs that spent > ``--compile-s`` seconds in
Triton compiles left out, since the simulator prices kernels, not their JIT.

    python reports/validation/pool_runs.py reports/validation/h100_session5/run2 reports/validation/h100_session5/run3 \
        --out reports/validation/h100_session5/pooled.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import kendalltau


def load(dirs: list[str]) -> pd.DataFrame:
    rows, preds = [], {}
    for d in dirs:
        p = Path(d) / "validation.json"
        j = json.loads(p.read_text())
        if "runs" not in j:
            raise SystemExit(f"{p}: no per-run metrics ('runs'); it was written by a tangram-validate before they "
                             "were kept")
        for name, r in j["runs"].items():
            pred = r["predicted"]["throughput_rps"]
            if name in preds and not np.isclose(preds[name], pred, rtol=1e-9):
                raise SystemExit(f"{p}: config {name} predicted {pred} here but {preds[name]} in an earlier folder; "
                                 "pool only calls with the same trace, configs and calibration")
            preds[name] = pred
            for i, m in enumerate(r["measured"]):
                rows.append({"config": name, "call": Path(d).name, "run": i, "pred": pred,
                             "meas": m["throughput_rps"],
                             "compile_s": float(m.get("triton_compiles_in_run", {}).get("seconds", 0.0))})
    return pd.DataFrame(rows)


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, float]:
    g = df.groupby("config", sort=False).agg(pred=("pred", "first"), meas=("meas", "mean"), n=("meas", "size"),
                                              meas_min=("meas", "min"), meas_max=("meas", "max"))
    g["relerr"] = (g["pred"] - g["meas"]) / g["meas"]
    return g, float(kendalltau(g["pred"], g["meas"]).statistic)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="tangram-validate output folders (validation.json with 'runs')")
    ap.add_argument("--compile-s", type=float, default=0.05, help="a run with more compile seconds is 'compiling'")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    df = load(a.dirs)
    lines = ["# Pooled validation runs", "",
             "Command: `python reports/validation/pool_runs.py " + " ".join(sys.argv[1:] if argv is None else argv)
             + "`", "", "relative error = (predicted - mean measured) / mean measured; throughput in req/s", ""]
    for title, sub in (("All runs", df),
                       (f"Runs without Triton compiles in the timed loop (> {a.compile_s} s left out)",
                        df[df["compile_s"] <= a.compile_s])):
        g, tau = table(sub)
        lines += [f"## {title}", "", "| config | predicted | measured (mean) | runs | min | max | rel. error |",
                  "|---|---|---|---|---|---|---|"]
        for c, r in g.iterrows():
            lines.append(f"| {c} | {r['pred']:.3f} | {r['meas']:.3f} | {int(r['n'])} | {r['meas_min']:.3f} | "
                         f"{r['meas_max']:.3f} | {100 * r['relerr']:+.1f}% |")
        worst = g["relerr"].abs().max()
        lines += ["", f"Kendall tau = {tau:.3f}; largest |error| {100 * worst:.1f}% "
                      f"({'within' if worst <= 0.10 else 'outside'} 10%)", ""]
    lines += ["## Every run", "", "| config | call | run | measured | compile s |", "|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r['config']} | {r['call']} | {r['run']} | {r['meas']:.3f} | {r['compile_s']:.2f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

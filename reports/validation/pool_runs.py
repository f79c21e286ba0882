"""Pool the engine runs of several ``tangram-validate`` calls on the same trace and configs.

One device call holds only a few repeats; a config's measured throughput spreads 5-30% between runs (a first run
that compiles a Triton specialisation inside the timed loop is the worst), so the prediction is compared with the
mean over every run of every call. Also reported: the same with runs that spent > ``--compile-s`` seconds in
Triton compiles left out, since the simulator prices kernels, not their JIT, and (several calls) each call's own
mean, since each call runs on whichever machine it is lent. ``--predicted-from DIR`` prices every call with one
folder's predictions (a call validated under an older calibration, on the same trace and configs).

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


def predictions(d: str) -> dict[str, float]:
    j = json.loads((Path(d) / "validation.json").read_text())
    return {name: r["predicted"]["throughput_rps"] for name, r in j["runs"].items()}


def load(dirs: list[str], pred_from: str | None = None) -> pd.DataFrame:
    rows, preds = [], {}
    fixed = predictions(pred_from) if pred_from else None
    for d in dirs:
        p = Path(d) / "validation.json"
        j = json.loads(p.read_text())
        if "runs" not in j:
            raise SystemExit(f"{p}: no per-run metrics ('runs'); it was written by a tangram-validate before they "
                             "were kept")
        for name, r in j["runs"].items():
            pred = r["predicted"]["throughput_rps"]
            if fixed is not None:
                if name not in fixed:
                    raise SystemExit(f"{p}: config {name} has no prediction in {pred_from}")
                pred = fixed[name]
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
    ap.add_argument("--predicted-from", metavar="DIR",
                    help="compare every call's measurements with this folder's predictions (calls priced with an "
                         "older calibration, measured on the same trace and configs)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    df = load(a.dirs, a.predicted_from)
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
    if df["call"].nunique() > 1:  # each call ran on whatever machine it got: the spread between machines
        calls = list(dict.fromkeys(df["call"]))
        lines += ["## Per call", "", "| config | predicted | " + " | ".join(f"{c} measured (error)" for c in calls)
                  + " |", "|---" * (len(calls) + 2) + "|"]
        per = {c: table(df[df["call"] == c]) for c in calls}
        for name in dict.fromkeys(df["config"]):
            cells = [f"{per[c][0].loc[name, 'meas']:.3f} ({100 * per[c][0].loc[name, 'relerr']:+.1f}%)" for c in calls]
            lines.append(f"| {name} | {per[calls[0]][0].loc[name, 'pred']:.3f} | " + " | ".join(cells) + " |")
        lines += ["| Kendall tau | | " + " | ".join(f"{per[c][1]:.3f}" for c in calls) + " |",
                  "| largest abs. error | | " + " | ".join(f"{100 * per[c][0]['relerr'].abs().max():.1f}%" for c in calls)
                  + " |", ""]
    lines += ["## Every run", "", "| config | call | run | measured | compile s |", "|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r['config']} | {r['call']} | {r['run']} | {r['meas']:.3f} | {r['compile_s']:.2f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the simulator predicts for the engine's acceptance run with and without decode CUDA graphs.

python reports/engine/predict_graphs.py [--out reports/engine/predicted]

For the issue-5 trace recipe (reports/engine/make_trace.py: first turns ~12K tokens, 96 output tokens, KV pool
capped at 2.5 GiB) at several session and turn counts, runs ``tangram-sim`` on the H100 calibration in three
pricings: ``eager`` (cuda_graph_max_bs 0: every step priced with the fitted eager-engine overhead),
``graphs`` (pure-decode steps priced as graph replays: kernels + graph_s; the shipped fit predates graphs, so
graph_s = its sync_s) and ``kernels`` (--no-engine-overhead: every kernel back to back). Writes
``predicted.csv`` and ``README.md`` with the command. These are predictions to check on the GPU, not results.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
POOL = 2.5 * 2**30
MODES = "full,dynamic,br,br+rp,tangram"
PRICINGS = {"eager": ({"cuda_graph_max_bs": 0}, []), "graphs": ({}, []), "kernels": ({}, ["--no-engine-overhead"])}


def _markdown(df: pd.DataFrame) -> str:
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    head = "| " + " | ".join(map(str, df.columns)) + " |\n|" + "---|" * len(df.columns)
    body = ["| " + " | ".join(map(cell, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, *body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "predicted"))
    ap.add_argument("--sessions", default="6,8,12,16")
    ap.add_argument("--turns", default="3,5")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = [(int(s), int(t)) for s in a.sessions.split(",") for t in a.turns.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for s, t in tqdm(grid, desc="traces", file=sys.stderr):
            trace = tmp / f"t{s}_{t}.jsonl"
            subprocess.run([sys.executable, str(HERE / "make_trace.py"), str(trace), "--sessions", str(s), "--turns",
                            str(t), "--first", "12000", "--out-tokens", "96"], check=True, capture_output=True)
            for name, (cfg, flags) in PRICINGS.items():
                cfg_path = tmp / f"{name}.json"
                cfg_path.write_text(json.dumps({"kv_pool_bytes": int(POOL), **cfg}))
                d = tmp / f"o{s}_{t}_{name}"
                subprocess.run([sys.executable, "-m", "tangram.sim.cli", str(trace), "--mode", MODES, "--config",
                                str(cfg_path), "--no-plots", "--out", str(d), *flags], check=True, capture_output=True)
                m = json.loads((d / "metrics.json").read_text())
                for mode, v in m.items():
                    rows.append({"sessions": s, "turns": t, "pricing": name, "mode": mode,
                                 "throughput_rps": v["throughput_rps"], "busy_s": v["busy_s"], "steps": v["steps"]})
    df = pd.DataFrame(rows)
    df.to_csv(out / "predicted.csv", index=False)
    wide = df.pivot_table(index=["sessions", "turns", "pricing"], columns="mode", values="throughput_rps")
    wide["tangram/full"] = wide["tangram"] / wide["full"]
    wide["tangram/dynamic"] = wide["tangram"] / wide["dynamic"]
    wide = wide.reset_index()
    cmd = "python reports/engine/predict_graphs.py " + " ".join(sys.argv[1:])
    lines = ["# Predicted engine throughput with and without decode CUDA graphs (simulator, H100 calibration)", "",
             f"Command: `{cmd.strip()}`", "", __doc__.split("\n\n", 2)[2].strip(), "",
             "req/s per mode and the two acceptance ratios:", "",
             _markdown(wide), ""]
    (out / "README.md").write_text("\n".join(lines))
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()

"""Smoke matrix of ``tangram-sim`` configurations on a slice of a trace: every model x GPU preset, tensor
parallelism, replicas and routers, page sizes, head-group sizes, score methods, budget scopes, ablation switches,
the capacity search. Each configuration runs in its own process with a time limit; a configuration fails when it
exits with a traceback, or with an error other than a one-line ``error:`` (a refused input is a valid answer, e.g.
a 70B model on one 80 GB GPU), or runs out of time. What the issue's "inputs you will not see" asks a user to try.

Run: ``python benchmarks/sim_config_matrix.py TRACE [--window 0:90] [--timeout 400] [--only SUBSTR] --out DIR``;
one line per configuration (exit code, seconds, name; stderr's tail for a failure), last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "qwen3-4b", "qwen2.5-7b", "smollm2-135m")
GPUS = ("h100-80gb", "h200", "a100-80gb")
SCORE_METHODS = ("ada-snapkv", "pyramidkv", "keydiff", "tova", "streaming-llm", "expected-attention", "kvzip")
VARIANTS = (
    "--tp 2", "--tp 4", "--tp 8", "--replicas 3 --router round-robin", "--replicas 2 --router least-outstanding",
    "--no-session-cache", "--decode-partition runtime --mode tangram,dynamic", "--page-size 32", "--page-size 1",
    "--page-size 48", "--budget-scope cross-layer", "--budget-scope uniform", "--rho 1.0", "--rho 0.01",
    "--alpha 0", "--chunk-size 512", "--max-num-seqs 1", "--no-fast-forward --mode tangram,dynamic",
    "--kv-pool-gib 1", "--cuda-graph-max-bs 0", "--no-engine-overhead", "--split-rounding ceil", "--no-clustering",
    "--hp 1", "--hp 8", "--hp 2 --tp 2", "--max-batched-tokens 2048", "--rate-scale 20 --mode tangram,full",
    "--placement balanced --tp 2", "--no-ragged-paging --mode tangram", "--no-budget-reservation --mode tangram",
    "--no-aot-balancing --mode tangram", "--capacity --jobs 2 --mode tangram,full",
    "--capacity --target-rate 8 --mode tangram", "--slo ttft_p99=5s --mode tangram,uniform",
    "--model llama-3.1-70b --tp 4 --gpu h200", "--model llama-3.1-70b --tp 8", "--model qwen3-4b --tp 2",
    "--model smollm2-135m --tp 3", "--model smollm2-135m --hp 1",
)


def configurations() -> list[str]:
    out = [f"--model {m} --gpu {g}" for m in MODELS for g in GPUS]
    out += list(VARIANTS)
    out += [f"--score-method {s} --mode tangram,dynamic,uniform" for s in SCORE_METHODS]
    return out


def run_one(trace: str, window: str, args: str, out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "tangram.sim.cli", trace, "--trace-window", window, "--no-plots", "--out", str(out),
           *args.split()]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired:
        rc, err = None, ""
    tail = err.strip().splitlines()[-1] if err.strip() else ""
    refused = rc == 2 and "Traceback" not in err and tail.startswith("error:")
    ok = rc == 0 and "Traceback" not in err or refused
    return {"args": args, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "ok": ok,
            "refused": tail if refused else None, "stderr_tail": None if ok else err.strip()[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--window", default="0:90", help="--trace-window of every run (default 0:90)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a configuration may take (default 400)")
    ap.add_argument("--only", default="", help="run only the configurations containing this text")
    ap.add_argument("--out", required=True, help="folder for each run's output (one subfolder a configuration)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, args in enumerate(c for c in configurations() if a.only in c):
        r = run_one(a.trace, a.window, args, out / f"c{i:03d}", a.timeout)
        rows.append(r)
        status = "ok" if r["ok"] else "FAIL"
        print(f"{i:3d} {status:4s} rc={r['rc']} {r['seconds']:7.1f}s  {args}"
              + (f"\n      {r['refused']}" if r["refused"] else "")
              + (f"\n      {r['stderr_tail']}" if r["stderr_tail"] else ""), flush=True)
    print(json.dumps({"trace": a.trace, "window": a.window, "configurations": len(rows),
                      "failed": [r["args"] for r in rows if not r["ok"]],
                      "refused": {r["args"]: r["refused"] for r in rows if r["refused"]},
                      "seconds": {r["args"]: r["seconds"] for r in rows}}))
    return 1 if any(not r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""``tangram-sim``: capacity planning for multi-turn serving with per-head KV compression.

With no arguments it simulates the bundled default trace in every mode side by
side and prints one table; see docs/simulator.md for the options and formulas.
"""
from __future__ import annotations

import argparse
import math
import sys

from tangram.config import MODES
from tangram.errors import cli_errors, parse_cli

DEFAULT_OUT = "tangram-sim-out"
TABLE_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "kv_utilization", "fragmentation",
              "preemptions", "session_evictions"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        print(f"error: {message} (see tangram-sim --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tangram-sim", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", help="multi-turn JSONL trace (default: the bundled default trace)")
    p.add_argument("--model", help="model preset (default llama-3.1-8b)")
    p.add_argument("--gpu", help="GPU preset (default h100-80gb)")
    p.add_argument("--mode", action="append", help=f"serving mode(s), repeatable or comma list (default all: "
                                                   f"{','.join(MODES)})")
    p.add_argument("--rho", type=float, help="target global retention ratio (default 0.25)")
    p.add_argument("--hp", type=int, help="heads per group H_p of ragged paging (default 4)")
    p.add_argument("--alpha", type=float, help="safety margin of the budgets, eq. 5 (default 2)")
    p.add_argument("--profile", help="budget profile file (.npz/.json); default: a synthetic profile (labelled)")
    p.add_argument("--page-size", type=int)
    p.add_argument("--chunk", type=int, help="prefill chunk size in tokens")
    p.add_argument("--max-batched-tokens", type=int)
    p.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    p.add_argument("--router", choices=["round-robin", "least-outstanding", "session-affinity"])
    p.add_argument("--seed", type=int, help="seed of the cost model's random draws and the synthetic profile")
    p.add_argument("--out", help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--rate-scale", type=float, help="multiply the trace's session arrival rate")
    p.add_argument("--config", help="JSON file of EngineConfig fields plus model/gpu/trace/... (as the tuner writes)")
    p.add_argument("--tables", "--calibration", dest="tables",
                   help="folder of cost tables (default sim/tables/<gpu>/; 'none': "
                                         "roofline only)")
    p.add_argument("--probe", metavar="FILE",
                   help="rescale the cost tables to the machine a tangram-probe JSON was measured on")
    p.add_argument("--no-engine-overhead", dest="engine_overhead", action="store_false", default=None,
                   help="price kernels back to back (a CUDA-graph engine) instead of the eager engine's fitted "
                        "issue/sync overhead (engine_overhead.json of the tables folder)")
    p.add_argument("--slo", help="e.g. 'ttft_p99=2s,tpot_p99=0.1s'")
    p.add_argument("--capacity", action="store_true", help="bisect the arrival-rate scale for the max load meeting --slo")
    p.add_argument("--target-rate", type=float, help="requests/s to provision for (capacity mode: replicas_needed)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def run(args) -> dict:
    from tqdm import tqdm

    from tangram.metrics import records_frame, write_metrics, write_requests_csv

    from tangram.harness import offered_rps
    from tangram.spec import resolve

    from .report import write_report
    from .run import capacity_search, simulate

    r = resolve(args, DEFAULT_OUT)
    spec, trace, modes = r["spec"], r["trace"], r["modes"]
    total = len(trace.turns) * len(modes)
    bar = tqdm(total=total, desc="tangram-sim", unit="req", disable=None if total >= 1000 else True,
               file=sys.stderr, leave=False)
    metrics, results, frames = {}, {}, []
    for mode in modes:
        summ, res = simulate(trace, spec, mode, progress=bar.update)
        metrics[mode] = summ
        results[mode] = res
        frames.append(records_frame(res.records, mode=mode))
    bar.close()
    curves = {}
    if args.capacity:
        cbar = tqdm(total=len(modes) * 10, desc="capacity", unit="sim", disable=None, file=sys.stderr, leave=False)
        for mode in modes:
            # first guess: the load this mode served when saturated by the trace as given (rounded to 2^k/4)
            sat = metrics[mode]["throughput_rps"] / offered_rps(trace) if metrics[mode]["throughput_rps"] else 1.0
            start = 2.0 ** (round(math.log2(max(sat, 1e-3)) * 4) / 4) if sat > 0 else 1.0
            cap = capacity_search(trace, spec, mode, r["slo"], start=min(1.0, start), progress=cbar.update)
            m = metrics[mode]
            m["max_rate_rps"] = cap["max_rate_rps"]
            m["max_rate_scale"] = cap["max_rate_scale"]
            if cap.get("bound"):
                m["max_rate_bound"] = cap["bound"]
            m["capacity_probes"] = [list(p) for p in cap["probes"]]
            curves[mode] = cap["probes"]
            if r["target_rate"] is not None:
                per_replica = cap["max_rate_rps"] / spec.replicas
                m["replicas_needed"] = math.ceil(r["target_rate"] / per_replica - 1e-9) if per_replica > 0 else None
        cbar.close()
    common = {"trace": str(r["trace_path"]), "model": spec.model.name, "gpu": spec.gpu.name, "seed": spec.seed,
              "router": spec.router, "profile": r["profile_label"], "offered_rps": offered_rps(trace)
              if len({t.arrival_s for t in trace.turns if t.turn == 0}) > 1 else None,
              "slo": r["slo"], "target_rate": r["target_rate"]}
    for m in metrics.values():
        m["peak_kv_gib"] = m["peak_kv_bytes"] / 2**30
        m["run"] = common
    out = r["out"]
    out.mkdir(parents=True, exist_ok=True)
    write_metrics(out / "metrics.json", metrics)
    write_requests_csv(out / "requests.csv", frames)
    write_report(out, metrics, results, curves, common, argv=getattr(args, "_argv", None),
                 plots=not args.no_plots)
    _print_table(metrics, args.capacity)
    print(f"wrote {out}/metrics.json, requests.csv, report.md")
    return metrics


def _print_table(metrics: dict, capacity: bool) -> None:
    import pandas as pd

    cols = TABLE_COLS + (["max_rate_rps", "replicas_needed"] if capacity else [])
    if any("prefix_hit_rate_tokens" in v for v in metrics.values()):  # a trace with shared prefixes
        cols += ["prefix_hit_rate_requests", "prefix_hit_rate_tokens", "prefix_tokens_saved",
                 "prefix_shared_pages_peak"]
    df = pd.DataFrame({m: {c: v.get(c) for c in cols} for m, v in metrics.items()}).T
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(df.to_string())


@cli_errors
def main(argv=None) -> int:
    run(parse_cli(_parser(), argv))
    return 0


if __name__ == "__main__":
    main()

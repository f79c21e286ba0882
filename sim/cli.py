"""``tangram-sim``: capacity planning for multi-turn serving with per-head KV compression.

With no arguments it simulates the bundled default trace in every mode side by
side and prints one table; see docs/simulator.md for the options and formulas.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tangram.config import MODES, EngineConfig, get_gpu, get_model
from tangram.errors import ConfigError, InputError, cli_errors, parse_cli

DEFAULT_OUT = "tangram-sim-out"
TABLE_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "kv_utilization", "fragmentation",
              "preemptions", "session_evictions"]
# keys of a --config JSON that are not EngineConfig fields
RUN_KEYS = {"model", "gpu", "trace", "rate_scale", "replicas", "router", "seed", "profile", "modes", "mode",
            "tables", "calibration", "slo", "target_rate", "engine_overhead", "accuracy_table"}


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
    p.add_argument("--no-engine-overhead", dest="engine_overhead", action="store_false", default=None,
                   help="price kernels back to back (a CUDA-graph engine) instead of the eager engine's fitted "
                        "issue/sync overhead (engine_overhead.json of the tables folder)")
    p.add_argument("--slo", help="e.g. 'ttft_p99=2s,tpot_p99=0.1s'")
    p.add_argument("--capacity", action="store_true", help="bisect the arrival-rate scale for the max load meeting --slo")
    p.add_argument("--target-rate", type=float, help="requests/s to provision for (capacity mode: replicas_needed)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--accuracy-table", help="measured accuracy table file, or a model whose shipped table to use "
                   "(default: the model's own; another model's is labelled borrowed)")
    return p


def _load_config(path: str) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(path, None, None, "config file not found") from None
    except json.JSONDecodeError as e:
        raise InputError(path, e.lineno, None, f"invalid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise InputError(path, None, None, "expected a JSON object of options")
    return d


def _modes(values) -> list[str]:
    from tangram.config import MODE_ALIASES

    if not values:
        return list(MODES)
    out = []
    for v in values:
        for m in str(v).split(","):
            m = m.strip().lower()
            if not m:
                continue
            m = MODE_ALIASES.get(m, m)
            if m not in MODES:
                raise ConfigError(f"--mode: unknown mode {m!r}; choose from {', '.join(MODES)}")
            if m not in out:
                out.append(m)
    return out


def resolve(args) -> dict:
    """Merge --config (lowest), then command-line flags, into everything a run needs."""
    from tangram.budgets import BudgetProfile
    from tangram.traces import default_trace_path, load_trace

    from .run import SimSpec, default_profile, parse_slo

    cfg = _load_config(args.config) if args.config else {}
    eng_d = {k: v for k, v in cfg.items() if k not in RUN_KEYS}
    flag_map = {"rho": "rho", "hp": "heads_per_group", "alpha": "alpha", "page_size": "page_size",
                "chunk": "chunk_size", "max_batched_tokens": "max_batched_tokens"}
    for a, f in flag_map.items():
        if getattr(args, a) is not None:
            eng_d[f] = getattr(args, a)
    try:
        engine = EngineConfig.from_dict(eng_d)
    except TypeError as e:
        raise ConfigError(f"bad engine option: {e}") from None
    except ConfigError as e:
        if args.config:
            raise InputError(args.config, None, None, str(e)) from None
        raise
    model = get_model(args.model or cfg.get("model", "llama-3.1-8b"))
    gpu = get_gpu(args.gpu or cfg.get("gpu", "h100-80gb"))
    if engine.ragged_paging or engine.mode in ("br+rp", "tangram") or any(m in ("br+rp", "tangram") for m in _modes(args.mode)):
        if model.num_kv_heads % engine.heads_per_group:
            raise ConfigError(f"--hp {engine.heads_per_group} must divide {model.name}'s {model.num_kv_heads} KV heads")
    seed = args.seed if args.seed is not None else int(cfg.get("seed", 0))
    prof_path = args.profile or cfg.get("profile")
    if prof_path:
        profile = BudgetProfile.load(prof_path)
        try:
            profile.check_model(model.num_layers, model.num_kv_heads, model.name)
        except ConfigError as e:
            raise InputError(str(prof_path), None, None, str(e)) from None
        profile_label = str(prof_path)
    else:
        profile = default_profile(model, engine.rho, engine.alpha, seed)
        profile_label = f"synthetic (tangram.budgets.synthetic_profile, seed {seed}, rho {engine.rho:g})"
    trace_path = args.trace or cfg.get("trace") or str(default_trace_path())
    trace = load_trace(trace_path)
    rate_scale = args.rate_scale if args.rate_scale is not None else cfg.get("rate_scale")
    if rate_scale is not None:
        trace = trace.scaled(float(rate_scale))
    replicas = args.replicas if args.replicas is not None else int(cfg.get("replicas", 1))
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    router = args.router or cfg.get("router", "session-affinity")
    if router not in ("round-robin", "least-outstanding", "session-affinity"):
        raise ConfigError(f"unknown router {router!r}")
    modes = _modes(args.mode or cfg.get("modes") or ([cfg["mode"]] if "mode" in cfg else None))
    slo_text = args.slo or cfg.get("slo")
    slo = parse_slo(slo_text) if slo_text else None
    if args.capacity and not slo:
        raise ConfigError("--capacity needs --slo, e.g. --slo 'ttft_p99=2s,tpot_p99=0.1s'")
    target = args.target_rate if args.target_rate is not None else cfg.get("target_rate")
    if target is not None and not (math.isfinite(float(target)) and float(target) > 0):
        raise ConfigError(f"--target-rate must be > 0 requests/s, got {target}")
    # "calibration" is the config key's name before the tables were renamed (one release of grace)
    tables = args.tables or cfg.get("tables") or cfg.get("calibration") or "auto"
    if str(tables).lower() == "none":  # roofline only, whatever tables are installed
        tables = None
    elif tables != "auto" and not Path(tables).is_dir():
        raise ConfigError(f"--tables: {tables} is not a folder of cost tables")
    from tangram.sim.costmodel import CostParams

    eo = cfg.get("engine_overhead", True) if getattr(args, "engine_overhead", None) is None else args.engine_overhead
    if not isinstance(eo, bool):
        raise ConfigError(f"engine_overhead must be true or false, got {eo!r}")
    spec = SimSpec(model, gpu, engine, profile, replicas, router, seed, tables,
                   CostParams(engine_overhead=eo))
    from tangram.profiles.accuracy import AccuracyModel

    acc, acc_label = AccuracyModel.for_run(model.name, profile, getattr(args, "accuracy_table", None)
                                           or cfg.get("accuracy_table"))
    return {"spec": spec, "trace": trace, "trace_path": trace_path, "modes": modes, "slo": slo,
            "target_rate": float(target) if target is not None else None, "profile_label": profile_label,
            "out": Path(args.out or cfg.get("out", DEFAULT_OUT)), "accuracy": acc, "accuracy_label": acc_label}


def run(args) -> dict:
    from tqdm import tqdm

    from tangram.metrics import records_frame, write_metrics, write_requests_csv

    from .report import write_report
    from .run import capacity_search, offered_rps, simulate

    r = resolve(args)
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
    common["accuracy"] = r["accuracy_label"]
    for mode, m in metrics.items():
        m["peak_kv_gib"] = m["peak_kv_bytes"] / 2**30
        m["run"] = common
        if r["accuracy"] is not None:  # measured task accuracy at the mode's kept share
            e = spec.engine
            est = r["accuracy"].estimate(mode, spec.profile, e.alpha, e.rho)
            m.update(kv_share=est.kv_share, accuracy=est.value, accuracy_rel=est.relative, accuracy_source=est.source)
        else:
            from tangram.profiles.accuracy import mode_kv_share
            m.update(kv_share=mode_kv_share(mode, spec.profile, spec.engine.alpha, spec.engine.rho), accuracy=None,
                     accuracy_rel=None, accuracy_source=r["accuracy_label"])
    out = r["out"]
    out.mkdir(parents=True, exist_ok=True)
    write_metrics(out / "metrics.json", metrics)
    write_requests_csv(out / "requests.csv", frames)
    write_report(out, metrics, results, curves, common, argv=getattr(args, "_argv", None),
                 plots=not args.no_plots)
    _print_table(metrics, args.capacity)
    print(r["accuracy_label"])
    print(f"wrote {out}/metrics.json, requests.csv, report.md")
    return metrics


def _print_table(metrics: dict, capacity: bool) -> None:
    import pandas as pd

    cols = TABLE_COLS + ["kv_share", "accuracy"] + (["max_rate_rps", "replicas_needed"] if capacity else [])
    df = pd.DataFrame({m: {c: v.get(c) for c in cols} for m, v in metrics.items()}).T
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(df.to_string())


@cli_errors
def main(argv=None) -> int:
    run(parse_cli(_parser(), argv))
    return 0


if __name__ == "__main__":
    main()

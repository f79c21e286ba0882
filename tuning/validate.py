"""``tangram-validate CONFIGS... --trace TRACE.jsonl``: the simulator's prediction against the engine's measurement.

Each config is a ``tangram-sim --config`` JSON (EngineConfig fields plus model/gpu/profile/...). For each, the
same trace runs through the simulator (``tangram.sim.run.simulate``) and through the engine (the
``tangram-bench`` code path, per-operator CUDA-event times on); the report tabulates predicted vs measured
throughput, TTFT and TPOT percentiles with relative errors ((predicted - measured) / measured), Kendall's tau
of predicted vs measured throughput across configs, and, per cost-model term, predicted vs measured seconds
so a >10% miss names the operator that is off.

``--gpu`` prices every config on another GPU preset than its file names (a GPU model without tables of its own is
priced with tables transferred by datasheet, and the report says so). ``--probe`` first runs ``tangram-probe`` on
this device (or reads ``--probe FILE``) and prices the simulator side with the tables rescaled to this machine; the
probe, the scales applied and the prediction of the unscaled tables are kept in the outputs. ``--predict-only``
writes the simulator side alone (``predicted.json``/``predicted.csv``), without a GPU: the prediction to commit
before the machine it predicts is measured.

``--repeats N`` runs the engine N times per config, round-robin over the configs (so a drift of the machine
during the call touches every config alike), and compares the prediction with the mean of the N measurements;
the report gives each config's spread (min, max, coefficient of variation), since a run-to-run spread above the
tolerance makes a single measurement unable to confirm or refute the model.

``--pool DIR...`` runs nothing: it pools the engine runs of several earlier calls' ``validation.json`` (same trace
and configs) into one report, each config's prediction against the mean of every run (:mod:`tangram.tuning.pooling`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tangram.cli import cli_main, from_cli, output_dir, parse, spec_overrides, spec_parser
from tangram.errors import ConfigError
from tangram.sim.engine_overhead import TERM_KEYS

from .pooling import kendall_tau, pool_report, rel_err

METRICS = ["throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"]
# the work done, predicted vs measured: a throughput miss with equal work is a per-step cost error, one with more
# evictions/steps in the engine than in the simulator is a scheduling divergence
WORK = ["makespan_s", "busy_s", "steps", "session_evictions", "preemptions"]
# cost-model term -> the engine's measured operators that do the same work
TERMS = {
    "dense (gemm + elementwise)": TERM_KEYS["dense"],
    **{t: TERM_KEYS[t] for t in ("decode_attention", "prefill_attention", "compression")},
    "host (scheduler, reclaim, runtime plan)": (("host", "reclaim", "runtime_plan"), ("host", "runtime_plan")),
    "step overhead (launches, copies, sync)": (("engine_overhead",), ("step_overhead",)),
}


def _parser():
    p = spec_parser("tangram-validate", __doc__, ("trace", "gpu", "tables", "engine", "run"), trace="flag", config=False,
                    skip=("temperature", "top_p"), defaults={"weights": "random"})
    p.add_argument("configs", nargs="*", metavar="CONFIG",
                   help="config JSON files (the tangram-sim --config format); the spec options given here override "
                        "every config's (--trace is required unless --pool, --gpu prices every config on that GPU)")
    p.add_argument("--no-time-ops", action="store_true", help="skip per-operator CUDA-event timing")
    p.add_argument("--repeats", type=int, default=1,
                   help="engine runs per config, round-robin over the configs; the mean is compared (default 1)")
    p.add_argument("--probe", nargs="?", const="run", metavar="FILE",
                   help="rescale the cost tables to this machine: run tangram-probe here first (no value) or read "
                        "a probe JSON; the probe and the scales go into the outputs")
    p.add_argument("--predict-only", action="store_true",
                   help="only the simulator side: write predicted.json/.csv (no engine runs, no GPU needed)")
    p.add_argument("--out", default="reports/validation",
                   help="output folder (default reports/validation); with --pool: the report's file (a .md path) or "
                        "folder (OUT/pooled.md)")
    pool = p.add_argument_group("pooling earlier calls (nothing runs)")
    pool.add_argument("--pool", nargs="+", metavar="DIR",
                      help="pool the engine runs of these tangram-validate output folders (validation.json) into one "
                           "report: every config's prediction against the mean of all its runs")
    pool.add_argument("--compile-s", type=float, default=0.05,
                      help="with --pool: runs with more seconds of Triton compiles in their timed loop are also "
                           "reported left out (default 0.05)")
    pool.add_argument("--predicted-from", metavar="DIR",
                      help="with --pool: compare every call's measurements with this folder's predictions (calls "
                           "priced with an older calibration, on the same trace and configs)")
    return p


def _trace(a) -> str | None:
    """The --trace given (every config replays it)."""
    return spec_overrides(a).get("trace")


def _kv_pool_gib(spec) -> float | None:
    return None if spec.engine.kv_pool_bytes is None else spec.engine.kv_pool_bytes / 2**30


def term_table(pred_ops: dict, meas_ops: dict) -> list[dict]:
    rows = []
    for term, (sim_keys, eng_keys) in TERMS.items():
        p = sum(pred_ops.get(k, 0.0) for k in sim_keys)
        m = sum(meas_ops.get(k, 0.0) for k in eng_keys)
        if p == 0 and m == 0:
            continue
        rows.append({"term": term, "predicted_s": p, "measured_s": m, "rel_err": rel_err(p, m)})
    return rows


def pool(a) -> dict:
    """``--pool DIR...``: one report over the runs of earlier calls."""
    if a.configs or _trace(a):
        raise ConfigError("--pool reads earlier calls' folders; give no CONFIG files or --trace with it")
    if not (a.compile_s >= 0):
        raise ConfigError(f"--compile-s must be >= 0, got {a.compile_s}")
    out = Path(a.out)
    target = out if out.suffix == ".md" else out / "pooled.md"
    text, numbers = pool_report(a.pool, compile_s=a.compile_s, predicted_from=a.predicted_from,
                                command="tangram-validate " + " ".join(getattr(a, "_argv", [])))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print("\n".join(text.split("\n## Every run")[0].splitlines()))
    print(f"wrote {target}")
    return numbers


def run(a) -> dict:
    import pandas as pd

    from tangram.engine.bench import device_dtype
    from tangram.engine.weights import load_model
    from tangram.sim.run import simulate
    from tangram.sim.tables import resolve as resolve_tables

    if a.pool:
        return pool(a)
    for flag, given in (("--compile-s", a.compile_s != 0.05), ("--predicted-from", a.predicted_from)):
        if given:
            raise ConfigError(f"{flag} applies to --pool only")
    if not a.configs:
        raise ConfigError("give CONFIG files to validate (or --pool DIR... to pool earlier calls)")
    if not _trace(a):
        raise ConfigError("--trace is required: the trace both the simulator and the engine replay")
    if a.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {a.repeats}")
    predict_only = getattr(a, "predict_only", False)
    probe_arg = getattr(a, "probe", None)
    if predict_only and probe_arg == "run":
        raise ConfigError("--predict-only takes a probe FILE, not a probe run (it uses no device)")
    out = output_dir(a.out)  # before any run: an unwritable --out must not throw the measurements away
    resolved = []
    for path in a.configs:  # each config under the command line's options
        spec = from_cli(a, config=path)
        if resolved and spec.model.name != resolved[0][1].model.name:
            raise ConfigError(f"{path}: model {spec.model.name} differs from the first config's "
                              f"{resolved[0][1].model.name}; validate one model per run")
        resolved.append((path, spec))
    first = resolved[0][1]
    device = dtype = None
    if not predict_only:
        device, dtype = device_dtype(first.device, first.dtype)
    mismatch = None if predict_only else device_mismatch(device, first.gpu, probe_arg is not None)
    if mismatch:
        print(f"warning: {mismatch}", file=sys.stderr, flush=True)
    probe = None
    if probe_arg == "run":
        from tangram.sim.probe import run_probe, save_probe

        probe = run_probe([first.model], device=device.type,
                          command="tangram-validate --probe (" + " ".join(getattr(a, "_argv", [])) + ")")
        probe["_path"] = str(save_probe(probe, out / "probe.json"))
        print(f"probe of {probe['device']['name']}: {probe['elapsed_s']:.1f} s, written to {probe['_path']}",
              flush=True)
    elif probe_arg is not None:
        from tangram.sim.probe import load_probe

        probe = load_probe(probe_arg)
    model = info = None
    dyn = None
    jobs = []
    for path, spec in resolved:
        trace, mode = spec.load_trace(), spec.run_mode
        if model is None and not predict_only:
            model, info = load_model(spec.model, spec.weights, dtype=dtype, device=device, seed=spec.seed)
            dyn = spec.dynamic_keep if spec.dynamic_keep != "auto" else \
                ("profile" if info.get("source") == "random" else "topk")
        job = {"name": Path(path).stem, "spec": spec, "trace": trace, "mode": mode, "meas": []}
        if probe is not None:  # the shipped tables' prediction, then the one rescaled to this machine
            job["pred_shipped"], _ = simulate(trace, spec, mode)
            spec.tables = resolve_tables(spec.tables, spec.gpu, probe)
        job["pred"], _ = simulate(trace, spec, mode)
        jobs.append(job)
    tables_info = _tables_info(jobs[0]["spec"], probe)
    if predict_only:
        return write_predictions(out, jobs, a, tables_info)
    from tangram.engine.bench import run_mode

    for rep in range(a.repeats):
        for j in jobs:
            meas, _, leak = run_mode(j["trace"], j["spec"], j["mode"], model, device=device, seed=j["spec"].seed,
                                     time_ops=not a.no_time_ops, dynamic_keep=dyn)
            meas["leak_ok"] = leak["ok"]
            j["meas"].append(meas)
            print(f"{j['name']} (run {rep + 1}/{a.repeats}): throughput predicted {j['pred']['throughput_rps']:.4g} "
                  f"measured {meas['throughput_rps']:.4g} req/s", flush=True)
    rows, terms = [], {}
    for j in jobs:
        spec, pred, runs = j["spec"], j["pred"], j["meas"]
        row = {"config": j["name"], "mode": j["mode"], "H_p": spec.engine.heads_per_group, "alpha": spec.engine.alpha,
               "leak_ok": all(m["leak_ok"] for m in runs), "repeats": len(runs)}
        for k in METRICS + WORK:
            vals = [m.get(k) for m in runs if m.get(k) is not None]
            row[f"{k}_pred"], row[f"{k}_meas"] = pred.get(k), (float(np.mean(vals)) if vals else None)
        for k in METRICS:
            row[f"{k}_relerr"] = rel_err(row[f"{k}_pred"], row[f"{k}_meas"])
        if "pred_shipped" in j:  # what the tables as shipped predicted, before the probe rescaled them
            row["throughput_rps_pred_shipped"] = j["pred_shipped"].get("throughput_rps")
            row["throughput_rps_relerr_shipped"] = rel_err(row["throughput_rps_pred_shipped"],
                                                           row["throughput_rps_meas"])
        row["triton_compiles_in_run"] = sum(int(m.get("triton_compiles_in_run", {}).get("count", 0)) for m in runs)
        thr = np.array([m["throughput_rps"] for m in runs], dtype=float)
        row["throughput_rps_meas_min"], row["throughput_rps_meas_max"] = float(thr.min()), float(thr.max())
        row["throughput_rps_meas_cv"] = float(thr.std(ddof=1) / thr.mean()) if len(thr) > 1 else None
        rows.append(row)
        if not a.no_time_ops:  # without per-operator times the engine's side of every term would read 0
            meas_ops: dict[str, float] = {}
            for m in runs:
                for k, v in m.get("time_by_operator_s", {}).items():
                    meas_ops[k] = meas_ops.get(k, 0.0) + v / len(runs)
            terms[j["name"]] = term_table(pred.get("time_by_operator_s", {}), meas_ops)
        print(f"{j['name']}: throughput predicted {row['throughput_rps_pred']:.4g} measured {row['throughput_rps_meas']:.4g} "
              f"req/s ({100 * row['throughput_rps_relerr']:+.1f}%)", flush=True)
    df = pd.DataFrame(rows)
    tau = kendall_tau(df["throughput_rps_pred"], df["throughput_rps_meas"])
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "validation.csv", index=False)
    tdf = pd.DataFrame([dict(config=c, **t) for c, ts in terms.items() for t in ts])
    tdf.to_csv(out / "terms.csv", index=False)
    summary = {"kendall_tau_throughput": tau, "rows": rows, "terms": terms, "trace": _trace(a),
               "device": str(device), "weights": info.get("source") if info else None, "dynamic_keep": dyn,
               "ops_timed": not a.no_time_ops, "device_mismatch": mismatch, **tables_info,
               # every run's own metrics (the engine's and the simulator's), for diagnosis after the GPU is gone
               "runs": {j["name"]: {"predicted": _scalars(j["pred"]), "measured": [_scalars(m) for m in j["meas"]]}
                        for j in jobs}}
    (out / "validation.json").write_text(json.dumps(summary, indent=1, default=float))
    write_report(out, df, tdf, tau, a, summary)
    print(f"Kendall tau (throughput) = {tau}")
    print(f"wrote {out}/report.md, validation.csv, terms.csv, validation.json")
    return summary


def _tables_info(spec, probe) -> dict:
    """What priced the simulator side: the tables' provenance (transfer, probe scales) and the probe itself."""
    from tangram.sim.tables import resolve as resolve_tables

    t = resolve_tables(spec.tables, spec.gpu)
    info = {"gpu": spec.gpu.name, "tables": str(t.directory) if t.directory is not None else None,
            "tables_provenance": t.provenance}
    if probe is not None:
        info["probe"] = {k: v for k, v in probe.items() if not k.startswith("_")}
        info["probe_file"] = probe.get("_path")
    return info


def write_predictions(out: Path, jobs: list, a, tables_info: dict) -> dict:
    """The simulator side alone, with what priced it: the prediction to commit before the measurement."""
    import datetime as _dt

    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for j in jobs:
        spec, pred = j["spec"], j["pred"]
        row = {"config": j["name"], "mode": j["mode"], "H_p": spec.engine.heads_per_group, "alpha": spec.engine.alpha,
               "gpu": spec.gpu.name, **{f"{k}_pred": pred.get(k) for k in METRICS + WORK}}
        if "pred_shipped" in j:
            row["throughput_rps_pred_shipped"] = j["pred_shipped"].get("throughput_rps")
        rows.append(row)
    df = pd.DataFrame(rows)
    df.to_csv(out / "predicted.csv", index=False)
    summary = {"command": "tangram-validate " + " ".join(getattr(a, "_argv", [])),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "trace": _trace(a),
               "kv_pool_gib": _kv_pool_gib(jobs[0]["spec"]), **tables_info, "rows": rows,
               "cost_model_source": jobs[0]["pred"].get("cost_model_source"),
               "runs": {j["name"]: _scalars(j["pred"]) for j in jobs}}
    (out / "predicted.json").write_text(json.dumps(summary, indent=1, default=float, sort_keys=True) + "\n")
    for r in rows:
        print(f"{r['config']}: predicted {r['throughput_rps_pred']:.4g} req/s on {r['gpu']}", flush=True)
    for p in tables_info["tables_provenance"]:
        print(f"tables: {p['label']}")
    print(f"wrote {out}/predicted.csv, predicted.json")
    return summary


def _scalars(m: dict) -> dict:
    """A metrics dict without its per-request lists (kept: numbers, strings and small dicts)."""
    return {k: v for k, v in m.items() if not isinstance(v, list)}


def _fmt(x):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def device_mismatch(device, gpu, probed: bool) -> str | None:
    """Why this run's errors would not measure the simulator, or None: the engine measured on the CPU (the kernels'
    torch references, not the GPU the tables price), or on a CUDA device of another GPU model than ``--gpu``
    without a probe rescaling the tables to it."""
    import torch

    from tangram.config import gpu_for_device_name

    if device is None:
        return None
    if device.type != "cuda":
        return (f"measuring on the {device.type}: the engine runs the kernels' torch references there, not the "
                f"{gpu.name} the simulator prices, so the errors check the plumbing, not the predictions")
    name = torch.cuda.get_device_name(device)
    here = gpu_for_device_name(name)
    if not probed and (here is None or here.family != gpu.family):
        return (f"measuring on {name} against predictions for {gpu.name} (--gpu) without --probe: pass the GPU "
                f"preset of this device or --probe to rescale the tables to it")
    return None


def write_report(out: Path, df, tdf, tau, a, summary) -> None:
    lines = ["# tangram-validate: simulator vs engine", "",
             "Command: `tangram-validate " + " ".join(getattr(a, "_argv", [])) + "`", "",
             f"- trace: {_trace(a)}; device: {summary['device']}; weights: {summary['weights']}; "
             f"dynamic keep: {summary['dynamic_keep']}",
             "- relative error = (predicted - measured) / measured", ""]
    if summary.get("device_mismatch"):
        lines[-1:-1] = [f"- **warning: {summary['device_mismatch']}**"]
    prov = summary.get("tables_provenance") or []
    if prov:
        lines[-1:-1] = ["- cost tables: " + "; then ".join(p["label"] for p in prov)]
    if summary.get("probe"):
        pr = summary["probe"]
        lines[-1:-1] = [f"- machine probe: {pr['device'].get('name')}, {pr.get('elapsed_s', 0):.1f} s "
                        f"({summary.get('probe_file')}); `throughput_rps_pred_shipped` is the prediction of the "
                        "tables as shipped, before the probe rescaled them"]
    cols = ["config", "mode", "H_p", "alpha"]
    for k in METRICS:
        cols += [f"{k}_pred", f"{k}_meas", f"{k}_relerr"]
    if "throughput_rps_pred_shipped" in df.columns:
        cols += ["throughput_rps_pred_shipped", "throughput_rps_relerr_shipped"]
    if int(df["repeats"].max()) > 1:
        lines[-1:-1] = [f"- measured = mean of {int(df['repeats'].max())} engine runs per config (round-robin); "
                        "spread columns: min, max, coefficient of variation of the measured throughput"]
        cols += ["throughput_rps_meas_min", "throughput_rps_meas_max", "throughput_rps_meas_cv"]
    lines += ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    lines += ["", f"Kendall tau of predicted vs measured throughput: {_fmt(tau)}", "",
              "## Work done, predicted vs measured", "",
              "Equal work with a throughput miss means a per-step cost is off; different evictions or steps mean "
              "the schedules diverged (step durations feed back into batching).", ""]
    wcols = ["config"] + [f"{k}_{s}" for k in WORK for s in ("pred", "meas")] + ["triton_compiles_in_run"]
    lines += ["| " + " | ".join(wcols) + " |", "|---" * len(wcols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in wcols) + " |")
    lines.append("")
    if not summary["ops_timed"]:
        lines += ["Operators were not timed (`--no-time-ops`: CUDA-event timing disables decode graphs and adds "
                  "syncs), so there is no per-term table.", ""]
    if len(tdf):
        lines += ["## Per cost-model term (seconds summed over the run)", "",
                  "| config | term | predicted_s | measured_s | rel_err |", "|---|---|---|---|---|"]
        for _, r in tdf.iterrows():
            lines.append(f"| {r['config']} | {r['term']} | {_fmt(r['predicted_s'])} | {_fmt(r['measured_s'])} | "
                         f"{_fmt(r['rel_err'])} |")
        bad = df[df["throughput_rps_relerr"].abs() > 0.10] if "throughput_rps_relerr" in df else []
        if len(bad):
            w = tdf.loc[(tdf["predicted_s"] - tdf["measured_s"]).abs().idxmax()]
            lines += ["", f"Throughput error exceeds 10% on {len(bad)} config(s). The largest absolute gap is "
                          f"`{w['term']}` in `{w['config']}`: predicted {w['predicted_s']:.3g} s vs measured "
                          f"{w['measured_s']:.3g} s."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


@cli_main
def main(argv=None) -> int:
    run(parse(_parser(), argv))
    return 0


if __name__ == "__main__":
    main()

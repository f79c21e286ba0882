"""``python -m tangram.sim.fit_engine TRACE``: fit the engine's per-step overhead on a GPU.

Runs the real engine (the ``tangram-bench`` path) over TRACE in several modes; at every step the same
:class:`~tangram.plan.StepPlan` is also priced by the cost model with ``engine_overhead`` off (kernels back to
back). The executor's measured seconds against that kernel prediction, with the step's decode rows and prefill
chunks, fit the coefficients of :mod:`tangram.sim.engine_overhead`; they are written to
``engine_overhead.json`` in the tables folder (``--out-dir``, default the GPU preset's), and every step
to ``--steps-csv`` with the cost model's per-term kernel prediction (``pred_<term>`` columns), which is how a
term that is off shows itself: regress the measured seconds of one kind of step on those columns. ``--configs``
runs config files (the ``tangram-sim --config`` format) instead of ``--modes``, so the fit sees the H_p, chunk
sizes and split maps a tuner will price. Use a trace other than the one you validate on.

``--plans FILE`` also keeps every step's plan with its measured seconds (gzip'd pickle); ``python -m
tangram.sim.fit_engine --refit FILE`` then re-prices those plans with the current cost model and fits again, on
any machine without a GPU: a change of the simulator's pricing gets its overhead refit from the same engine
measurements instead of a new device call (the measured seconds do not depend on the simulator).
"""
from __future__ import annotations

import datetime as _dt
import gzip
import os
import pickle
import platform
import sys
from pathlib import Path


from tangram.cli import Parser, cli_main, from_cli, output_file, parse, spec_parser, writable
from tangram.errors import ConfigError
from tangram.spec import parse_modes

from . import engine_overhead
from .costmodel import HOST_TERMS, CostModel, CostParams


PLANS_VERSION = 1


def step_row(label: str, cm: CostModel, plan, pred, measured_s: float, graphed: bool, meas_ops: dict) -> dict:
    """One recorded step: the kernel-only prediction ``pred`` of ``plan`` next to the engine's seconds."""
    kern = pred.duration_s - sum(pred.breakdown.get(k, 0.0) for k in HOST_TERMS + ("engine_overhead",))
    return {"mode": label, "step": plan.step, "kd": plan.num_decode, "kp": plan.num_prefill,
            "tokens": plan.num_tokens, "compress": cm.compress, "aot": cm.partition == "aot", "graphed": graphed,
            "hp": cm.layout.heads_per_group, "tables": cm.layout.n_tables, "kernel_pred_s": kern, "measured_s": measured_s,
            **{f"pred_{k}": v for k, v in pred.breakdown.items() if k not in HOST_TERMS + ("engine_overhead",)},
            **{f"meas_{k}": v for k, v in meas_ops.items()}}


class StepRecorder:
    """Wraps an executor: runs the step on it, prices the same plan with the kernel-only cost model, records both
    (and, with ``plans``, the plan itself with its measured seconds, for :func:`refit`)."""

    def __init__(self, exe, cost_model: CostModel, label: str, rows: list, plans: list | None = None):
        self._exe, self._cm, self._label, self._rows, self._plans = exe, cost_model, label, rows, plans

    def __getattr__(self, name):
        return getattr(self._exe, name)

    def execute(self, plan):
        pred = self._cm.execute(plan)
        res = self._exe.execute(plan)
        # an in-step graph capture is a one-off, not the step's cost
        meas = res.duration_s - sum(res.breakdown.get(k, 0.0) for k in HOST_TERMS + ("graph_capture",))
        graphed = "engine_graph" in res.breakdown
        # per-operator seconds when the executor times operators (--time-ops)
        ops = {k: v for k, v in res.breakdown.items() if k not in HOST_TERMS + ("graph_capture", "engine",
                                                                                 "engine_graph")}
        self._rows.append(step_row(self._label, self._cm, plan, pred, meas, graphed, ops))
        if self._plans is not None:
            self._plans.append((plan, meas, graphed))
        return res


def term_table(df):
    """Seconds per (config, step kind, term), predicted vs measured, from a --time-ops steps frame. Eager
    decode-only steps are left out: there the events also time the host issuing launches."""
    import pandas as pd

    df = df[df["kp"] > 0]
    out = []
    for (label, mixed), g in df.groupby(["mode", df["kd"] > 0], sort=False):
        for term, (pk, mk) in engine_overhead.TERM_KEYS.items():
            p = sum(g[f"pred_{k}"].fillna(0).sum() for k in pk if f"pred_{k}" in g)
            m = sum(g[f"meas_{k}"].fillna(0).sum() for k in mk if f"meas_{k}" in g)
            if p or m:
                out.append({"config": label, "steps": "prefill+decode" if mixed else "prefill", "n": len(g),
                            "term": term, "pred_s": p, "meas_s": m, "meas/pred": m / p if p else float("nan")})
    return pd.DataFrame(out)


def step_terms(df) -> dict:
    """The steps frame's per-term kernel predictions as :func:`engine_overhead.fit` takes them."""
    col = lambda k: df[f"pred_{k}"].fillna(0.0).to_numpy(float) if f"pred_{k}" in df else 0.0  # noqa: E731
    return {t: sum(col(k) for k in keys) for t, (keys, _) in engine_overhead.TERM_KEYS.items()}


def _extra_terms(p) -> None:
    p.add_argument("--extra-terms", nargs="+", default=[], metavar="COEFF", choices=engine_overhead.EXTRA,
                   help="also fit these terms, held at 0 otherwise: " + ", ".join(engine_overhead.EXTRA)
                        + " (sim/engine_overhead.py)")


def _parser():
    p = spec_parser("tangram-fit-engine", __doc__, ("model", "gpu", "trace", "engine", "run"), trace="required",
                    skip=("dynamic_keep", "temperature", "top_p"), config=False, defaults={"weights": "random"})
    p.add_argument("--modes", default="tangram,full,dynamic", help="comma list of modes to run (default %(default)s)")
    p.add_argument("--configs", nargs="+", metavar="FILE",
                   help="config JSON files to run instead of --modes (each its own mode, H_p, alpha, chunk size...; "
                        "the spec options given here override theirs)")
    p.add_argument("--time-ops", action="store_true",
                   help="time every operator (CUDA events; eager decode, no graphs) into meas_<op> columns of "
                        "--steps-csv and print predicted vs measured per term; fits nothing")
    p.add_argument("--out-dir", help="tables folder to write engine_overhead.json into (default: the GPU's)")
    p.add_argument("--steps-csv", help="also write every recorded step here")
    p.add_argument("--plans", metavar="FILE",
                   help="also keep every step's plan and measured seconds in FILE (gzip'd pickle) for --refit")
    p.add_argument("--probe", nargs="?", const="run", metavar="FILE",
                   help="record this machine's probe (tangram-probe; or a probe JSON of it) as the folder's "
                        "reference_probe.json: later probes of other machines are compared with it")
    _extra_terms(p)
    return p


def _check_outputs(a) -> None:
    """The tables folder and the CSV / plans files a fit writes, checked before any work (nothing is created)."""
    if getattr(a, "out_dir", None):
        writable(a.out_dir, "--out-dir", folder=True)
    for flag in ("steps_csv", "plans"):
        v = getattr(a, flag, None)
        if v:
            output_file(v, "--" + flag.replace("_", "-"))


def run(a) -> dict:
    import pandas as pd
    import torch

    from tangram.engine.bench import device_dtype, run_mode
    from tangram.engine.weights import load_model

    from .tables import tables_dir_for

    _check_outputs(a)  # before the engine runs the trace (minutes): what they end by writing must be writable
    if a.configs:  # (label, spec): each config under the command line's options
        runs = [(Path(c).stem, from_cli(a, config=c)) for c in a.configs]
    else:
        runs = [(m, from_cli(a, modes=m)) for m in parse_modes(a.modes)]
    device, dtype = device_dtype(runs[0][1].device, runs[0][1].dtype)
    model = info = spec0 = None
    rows: list[dict] = []
    recorded: list[dict] = []  # --plans: per run, the cost model's inputs and its steps
    for label, spec in runs:
        trace, mode = spec.load_trace(), spec.run_mode
        if model is None:
            spec0 = spec
            model, info = load_model(spec.model, spec.weights, dtype=dtype, device=device, seed=spec.seed)
        elif spec.model.name != spec0.model.name:
            raise ConfigError(f"{label}: model {spec.model.name} differs from {spec0.model.name}; fit one model per run")
        dyn = "profile" if info.get("source") == "random" else "topk"
        kernel_params = CostParams(engine_overhead=False)

        def wrap(exe, label=label, spec=spec, kernel_params=kernel_params):
            args = dict(model=spec.model, gpu=spec.gpu, engine=exe.engine, layout=exe.sched.layout,
                        profile=exe.sched.profile, tables=spec.tables, seed=spec.seed)
            cm = CostModel(**args, params=kernel_params)
            plans = None
            if a.plans:
                recorded.append({"label": label, "cost_model": args, "steps": []})
                plans = recorded[-1]["steps"]
            return StepRecorder(exe, cm, label, rows, plans)

        n0 = len(rows)
        meas, _, _ = run_mode(trace, spec, mode, model, device=device, seed=spec.seed, dynamic_keep=dyn, wrap=wrap,
                              time_ops=a.time_ops)
        tc, gc = meas.get("triton_compiles_in_run", {}), meas.get("gc_pauses", {})
        print(f"{label}: {len(rows) - n0} steps recorded; in the run: {tc.get('count', 0)} Triton compiles "
              f"({tc.get('seconds', 0.0):.2f} s), {gc.get('count', 0)} GC pauses ({gc.get('seconds', 0.0):.2f} s)",
              flush=True)
    spec, modes = spec0, [label for label, _ in runs]
    df = pd.DataFrame(rows)
    if a.steps_csv:
        Path(a.steps_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(a.steps_csv, index=False)
    if a.time_ops:
        print(term_table(df).to_string(float_format=lambda x: f"{x:.4g}"))
        return {"steps": int(len(df))}
    directory = Path(a.out_dir) if a.out_dir else tables_dir_for(spec.gpu.name)
    if directory is None:
        raise ConfigError(f"no tables folder for GPU {spec.gpu.name}; pass --out-dir")
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'cpu'})"
    prov = {"command": "python -m tangram.sim.fit_engine " + " ".join(a._argv), "device": dev,
            "torch": torch.__version__, "trace": spec.trace_path, "modes": modes, "weights": info.get("source"),
            "date": _dt.date.today().isoformat(), "host_cpu_count": os.cpu_count()}
    try:
        import triton
        prov["triton"] = triton.__version__
    except ImportError:
        pass
    if a.plans:
        save_plans(a.plans, recorded, spec.model.name, prov)
        print(f"wrote {len(df)} steps' plans to {a.plans}")
    if a.probe:  # the machine the coefficients describe: tables rescaled to another machine go by probe / this
        from .probe import load_probe, run_probe, save_probe
        from .tables import REFERENCE_PROBE

        probe = run_probe([spec.model], device=device.type, command="tangram-fit-engine --probe") \
            if a.probe == "run" else load_probe(a.probe)
        save_probe(probe, directory / REFERENCE_PROBE)
        prov["reference_probe"] = REFERENCE_PROBE  # beside this file: a path that travels with the tables
        print(f"reference probe of {probe['device'].get('name')} written to {directory / REFERENCE_PROBE}")
    return fit_and_save(df, spec.model.name, spec.model.num_layers, directory, prov, extra=tuple(a.extra_terms))


def fit_and_save(df, model: str, num_layers: int, directory: Path, prov: dict, extra: tuple = ()) -> dict:
    """Fit the overhead coefficients to a steps frame, print the per-config totals, write engine_overhead.json.
    ``extra``: the extra terms fitted (:func:`engine_overhead.fit`)."""
    L = num_layers
    ov, stats = engine_overhead.fit(step_terms(df), df["measured_s"], L, df["kd"], df["kp"], df["compress"],
                                    df["aot"], df["graphed"], df["tables"], df["tokens"] - df["kd"],
                                    extra=extra)
    per_mode = {}
    for mode, g in df.groupby("mode", sort=False):
        pred = ov.step_s(step_terms(g), L, g["kd"], g["kp"], g["compress"], g["aot"], g["graphed"], g["tables"],
                         g["tokens"] - g["kd"])
        per_mode[mode] = {"steps": int(len(g)), "total_rel_err": float(pred.sum() / g["measured_s"].sum() - 1),
                          "kernels_only_total_rel_err": float(g["kernel_pred_s"].sum() / g["measured_s"].sum() - 1)}
    stats["per_mode"] = per_mode
    path = engine_overhead.save(directory, model, ov, stats, prov)
    print("coefficients (s): " + ", ".join(f"{k}={v:.3g}" for k, v in ov.coefficients().items()))
    print(f"fit over {stats['steps']} steps: median |rel err| {stats['median_abs_rel_err']:.3f}, total "
          f"{stats['total_rel_err']:+.3f} (kernels only: {stats['kernels_only_total_rel_err']:+.3f}); "
          f"{stats['one_off_steps']} one-off steps left out ({stats['one_off_excess_s']:.2f} s over their fit)")
    for mode, pm in per_mode.items():
        print(f"  {mode}: {pm['steps']} steps, total {pm['total_rel_err']:+.3f}")
    print(f"wrote {path}")
    return {"coefficients": ov.coefficients(), "fit": stats, "path": str(path)}


def save_plans(path: str | Path, recorded: list[dict], model: str, prov: dict) -> None:
    """The engine runs' plans and measured seconds, with what builds each run's cost model (pickled: plans are
    numpy arrays and dataclasses of this package; read back only by the same package version line)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as f:
        pickle.dump({"version": PLANS_VERSION, "model": model, "provenance": prov, "runs": recorded}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)


def load_plans(path: str | Path) -> dict:
    try:
        with gzip.open(path, "rb") as f:
            d = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ModuleNotFoundError) as e:
        raise ConfigError(f"{path}: not a plans file of tangram-fit-engine --plans ({type(e).__name__}: {e})") \
            from None
    if not isinstance(d, dict) or d.get("version") != PLANS_VERSION or not isinstance(d.get("runs"), list):
        raise ConfigError(f"{path}: plans file version {d.get('version') if isinstance(d, dict) else None!r}, this "
                          f"code reads version {PLANS_VERSION}")
    return d


def reprice(plans: dict):
    """The steps frame of recorded plans, priced by the current cost model (plans in their recorded order: the
    cost model keeps per-run state, e.g. the decode price it rescales while a batch runs)."""
    import pandas as pd

    rows = []
    for run in plans["runs"]:
        cm = CostModel(**run["cost_model"], params=CostParams(engine_overhead=False))
        for plan, meas, graphed in run["steps"]:
            rows.append(step_row(run["label"], cm, plan, cm.execute(plan), meas, graphed, {}))
    return pd.DataFrame(rows)


def refit(argv: list[str]) -> dict:
    """``--refit PLANS [--out-dir D] [--steps-csv CSV]``: refit from recorded plans, no engine, no GPU."""
    p = Parser(prog="tangram-fit-engine --refit",
               description="re-price recorded plans with the current cost model and refit")
    p.add_argument("--refit", required=True, metavar="PLANS", help="a file written by --plans")
    p.add_argument("--out-dir", required=True, help="tables folder to write engine_overhead.json into")
    p.add_argument("--steps-csv", help="also write the re-priced steps here")
    _extra_terms(p)
    p.add_argument("--configs", nargs="+", metavar="FILE",
                   help="with a steps CSV that has no 'tables' column: the config files its runs were (each run's "
                        "label is its file's name), for their page tables per row")
    a = parse(p, argv)
    _check_outputs(a)
    if a.refit.endswith((".csv", ".csv.gz")):
        return refit_steps(a, argv)
    if a.configs:
        raise ConfigError("--configs applies to a steps CSV only (a plans file has each run's layout)")
    plans = load_plans(a.refit)

    df = reprice(plans)
    if a.steps_csv:
        Path(a.steps_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(a.steps_csv, index=False)
    prov = {**plans["provenance"], "refit": {"command": "python -m tangram.sim.fit_engine " + " ".join(argv),
                                             "date": _dt.date.today().isoformat(),
                                             "plans": Path(a.refit).name},
            "command": plans["provenance"].get("command", "")}
    print(f"re-priced {len(df)} steps of {len(plans['runs'])} runs recorded on {prov.get('device', '?')}")
    return fit_and_save(df, plans["model"], int(plans["runs"][0]["cost_model"]["model"].num_layers),
                        Path(a.out_dir), prov, extra=tuple(a.extra_terms))


def refit_steps(a, argv: list[str]) -> dict:
    """``--refit STEPS.csv[.gz]``: refit the steps of a ``--steps-csv`` file as they were priced when recorded (a CSV
    holds no plans: nothing is re-priced). A calibration recorded before ``--plans`` existed (the shipped H100 fit)
    gets new terms fitted on its own steps this way, all coefficients jointly."""
    import json

    import pandas as pd

    from tangram.spec import load

    df = pd.read_csv(a.refit)
    if "tables" not in df:
        if not a.configs:
            raise ConfigError(f"{a.refit}: no 'tables' column (recorded before it was); pass --configs FILE... of "
                              f"its runs ({', '.join(df['mode'].unique())})")
        tables = {}
        for c in a.configs:
            spec = load(c, {})
            m, e = spec.model, spec.engine
            tables[Path(c).stem] = m.num_layers * (m.num_kv_heads // e.heads_per_group) if e.ragged else 1
        missing = sorted(set(df["mode"]) - set(tables))
        if missing:
            raise ConfigError(f"{a.refit}: runs {missing} have no config among --configs")
        df["tables"] = df["mode"].map(tables)
    if a.steps_csv:
        Path(a.steps_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(a.steps_csv, index=False)
    # the provenance of the fit written beside the CSV (its calibration folder), when there is one
    beside = Path(a.refit).parent / engine_overhead.FILENAME
    models = json.loads(beside.read_text()).get("models", {}) if beside.exists() else {}
    if len(models) != 1:
        raise ConfigError(f"{a.refit}: expected the calibration's {engine_overhead.FILENAME} of one model beside it")
    (model, entry), = models.items()
    prov = {k: v for k, v in entry.items() if k not in ("coefficients", "fit")}
    prov["refit"] = {"command": "python -m tangram.sim.fit_engine " + " ".join(argv),
                     "date": _dt.date.today().isoformat(), "steps_csv": Path(a.refit).name}
    print(f"refitting {len(df)} steps recorded on {prov.get('device', '?')} as priced then")
    from tangram.config import get_model

    return fit_and_save(df, model, get_model(model).num_layers, Path(a.out_dir), prov, extra=tuple(a.extra_terms))


@cli_main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(x == "--refit" or x.startswith("--refit=") for x in argv):
        refit(argv)
    else:
        run(parse(_parser(), argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


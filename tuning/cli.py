"""``tangram-tune``: search H_p, alpha, the split map and batching knobs on the simulator with Optuna.

Trials run the simulator's capacity search (sustained load under the SLO) and
price each alpha's fidelity by the overflow rate of its static budgets; see
docs/tuning.md. The study lives in an RDB storage (SQLite file by default, any
SQLAlchemy URL such as postgresql://...), so it survives a crash and resumes,
and several worker processes can share it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from tangram.cli import add_sweep, cli_main, from_cli, output_dir, parse, spec_overrides, spec_parser
from tangram.errors import ConfigError
from tangram.harness.slo import DEFAULT_SLO  # one definition for tangram-sim and tangram-tune

DEFAULT_BOUND = 0.05


def _parser() -> argparse.ArgumentParser:
    # the deployment the study tunes (the engine configuration is what it searches)
    p = spec_parser("tangram-tune", __doc__, ("model", "gpu", "profile", "seed", "trace", "tables", "slo",
                                              "capacity_tol", "accuracy_table", "output"),
                    skip=("rate_scale",), defaults={"out": "tangram-tune-out", "slo": DEFAULT_SLO}, config=False)
    p.add_argument("--trials", type=int, default=40, help="completed trials the study should hold (default 40)")
    p.add_argument("--storage", help="Optuna RDB URL (default sqlite:///OUT/study.db)")
    p.add_argument("--study", default="tangram-tune", help="study name inside the storage")
    p.add_argument("--n-jobs", type=int, default=1, help="worker processes sharing the study (default 1)")
    p.add_argument("--worker-index", type=int,
                   help="index of this worker when several are started by hand on one storage (distinct sampler "
                        "seeds); --n-jobs sets it for the workers it spawns")
    # tensor parallelism: the TP degrees and placements searched (EngineConfig's tp and placement fields)
    add_sweep(p, "tp", "tensor-parallel degrees to search (several: the objective is load per GPU)")
    add_sweep(p, "placement", "KV-head placements to search under tp > 1")
    # the compression operating point: several values are searched, each priced with its own shipped profile
    add_sweep(p, "rho", "target kept shares to search (each with the profile calibrated at it)")
    add_sweep(p, "score_method", "scoring methods to search")
    add_sweep(p, "budget_scope", "budget scopes to search")
    p.add_argument("--objective", default="pareto", choices=["pareto", "constrained"],
                   help="pareto: maximise load and minimise overflow; constrained: maximise load s.t. "
                        "overflow <= --overflow-bound")
    p.add_argument("--overflow-bound", type=float, default=DEFAULT_BOUND,
                   help=f"largest acceptable overflow rate (default {DEFAULT_BOUND})")
    p.add_argument("--accuracy-floor", type=float,
                   help="keep only configurations whose measured task accuracy is >= this share of the full "
                        "cache's (e.g. 0.95), from the model's accuracy table (tangram-accuracy)")
    p.add_argument("--accuracy-task", default="mean",
                   help="task whose accuracy counts (default: the mean over the table's tasks)")
    p.add_argument("--sampler", default="tpe", choices=["tpe", "nsga2", "random"])
    p.add_argument("--objective-fast", action="store_true",
                   help="one simulation at --fast-rate-scale instead of a capacity search (tests, smoke runs)")
    p.add_argument("--fast-rate-scale", type=float, default=1.0)
    p.add_argument("--capacity-iters", type=int, default=5, help="bisection steps of the capacity search")
    p.add_argument("--capacity-start", type=float, default=0.25, help="first arrival-rate scale probed")
    p.add_argument("--heartbeat", type=int, default=5, help="trial heartbeat interval in s (0: off)")
    p.add_argument("--grace", type=int, default=20, help="s without heartbeat before a RUNNING trial is failed")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-report", action="store_true", help="only run trials (what spawned workers do)")
    return p


def _build(args):
    from .objective import Evaluator
    from .space import SearchSpace
    from .study import Setup

    if args.trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {args.trials}")
    if args.n_jobs < 1:
        raise ConfigError(f"--n-jobs must be >= 1, got {args.n_jobs}")
    if not (0 <= args.overflow_bound <= 1):
        raise ConfigError(f"--overflow-bound must be in [0, 1], got {args.overflow_bound}")
    if args.fast_rate_scale <= 0 or args.capacity_start <= 0 or args.capacity_iters < 0:
        raise ConfigError("--fast-rate-scale and --capacity-start must be > 0, --capacity-iters >= 0")
    # the tuned engine starts from the space's fixed fields (mode tangram, EngineConfig's defaults): the default
    # profile is the one calibrated for them; every trial picks its own H_p among the model's divisors
    point = {n: getattr(args, n)[0] for n in ("rho", "score_method", "budget_scope") if len(set(getattr(args, n))) == 1}
    if len(point) < 3 and spec_overrides(args).get("profile"):
        raise ConfigError("--profile fixes the budget profile; several --rho/--score-method/--budget-scope values "
                          "search the shipped profiles instead (give one or the other)")
    spec = from_cli(args, modes="tangram", heads_per_group=1, **point)
    model, gpu, profile, tables = spec.model, spec.gpu, spec.profile, spec.tables
    if spec.trace:
        spec.trace = str(Path(spec.trace).resolve())  # the study's setup names the trace, wherever it was run from
    trace_path, trace = spec.trace_path, spec.load_trace()
    slo_text = spec.slo or DEFAULT_SLO
    slo = spec.slo_targets(DEFAULT_SLO)
    space = SearchSpace.for_model(model, tp=tuple(args.tp), placement=tuple(args.placement), rho=tuple(args.rho),
                                  score_method=tuple(args.score_method), budget_scope=tuple(args.budget_scope),
                                  fixed={"mode": "tangram"})
    from tangram.profiles.accuracy import AccuracyModel

    if args.accuracy_floor is not None and not (0 < args.accuracy_floor <= 1):
        raise ConfigError(f"--accuracy-floor must be in (0, 1] (a share of the full cache's accuracy), "
                          f"got {args.accuracy_floor}")
    acc, acc_label = AccuracyModel.for_run(model.name, profile, spec.accuracy_table, args.accuracy_task)
    if args.accuracy_floor is not None and acc is None:
        raise ConfigError(f"--accuracy-floor: {acc_label}")
    ev = Evaluator(model, gpu, space, profile, trace, slo, seed=spec.seed, tables=tables,
                   objective="fast" if args.objective_fast else "capacity", fast_rate_scale=args.fast_rate_scale,
                   capacity_start=args.capacity_start, capacity_iters=args.capacity_iters,
                   capacity_tol=spec.capacity_tol, accuracy=acc)
    ev.accuracy_label = acc_label
    prof_path = spec_overrides(args).get("profile")
    setup = Setup(model.name, gpu.name, trace_path, slo_text, args.objective, float(args.overflow_bound), spec.seed,
                  bool(args.objective_fast), str(Path(prof_path).resolve()) if prof_path else None,
                  args.accuracy_floor, str(Path(acc.table.path).resolve()) if acc is not None else None,
                  spec.capacity_tol)
    return ev, space, setup, spec


def _worker_argv(argv: list[str], i: int) -> list[str]:
    """A spawned worker's command line: the parent's, as one job, no outputs, its own sampler seed."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--n-jobs", "--worker-index"):
            skip = True
            continue
        if a.startswith(("--n-jobs=", "--worker-index=")):
            continue
        out.append(a)
    return out + ["--n-jobs", "1", "--worker-index", str(i), "--no-report"]


def run(args, argv: list[str]) -> int:
    from tqdm import tqdm

    from .study import make_sampler, make_storage, n_complete, open_study

    ev, space, setup, spec = _build(args)
    out = output_dir(spec.out)
    url = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    storage = make_storage(url, args.heartbeat or None, args.grace)
    spawned = args.no_report and args.worker_index is not None
    widx = args.worker_index or 0
    # sampler seed: distinct per worker, and per resume (so a restarted worker does not replay the same draws)
    probe = open_study(storage, args.study, setup, None, create=True, space=space)
    sseed = spec.seed * 1000 + widx + 97 * len(probe.trials)
    study = open_study(storage, args.study, setup, make_sampler(args.sampler, setup.objective, sseed,
                                                                setup.overflow_bound), create=False)
    before = n_complete(study)
    bar = tqdm(total=args.trials, initial=min(before, args.trials), desc=f"tangram-tune {args.study}", unit="trial",
               file=sys.stderr, disable=True if spawned else None)
    if args.n_jobs == 1:
        from .study import run_worker

        run_worker(study, ev, space, setup, args.trials, progress=lambda: bar.update(
            max(0, min(n_complete(study), args.trials) - bar.n)))
    else:
        procs = [subprocess.Popen([sys.executable, "-m", "tangram.tuning.cli", *_worker_argv(argv, i)])
                 for i in range(args.n_jobs)]
        try:
            while any(p.poll() is None for p in procs):
                time.sleep(1.0)
                bar.update(max(0, min(n_complete(study), args.trials) - bar.n))
        finally:
            for p in procs:  # only our own children, by handle
                if p.poll() is None:
                    p.terminate()
        bad = [p.returncode for p in procs if p.returncode]
        if bad:
            raise ConfigError(f"{len(bad)} of {args.n_jobs} workers failed (exit codes {bad}); "
                              f"rerun the same command to resume the study")
    bar.update(max(0, min(n_complete(study), args.trials) - bar.n))
    bar.close()
    if args.no_report:
        return 0
    from .study import fail_stale

    fail_stale(study)
    from .report import write_outputs

    files = write_outputs(study, ev, space, setup, out, url, argv, plots=not args.no_plots)
    print(f"{n_complete(study)} completed trials in study {args.study!r}; wrote " + ", ".join(files))
    return 0


@cli_main
def main(argv=None) -> int:
    args = parse(_parser(), argv)
    return run(args, args._argv)


if __name__ == "__main__":
    main()

"""Optuna plumbing: RDB storage with heartbeats, study creation/resume, the worker loop, best-trial choice.

Crash safety: every trial is a row in the RDB storage the moment it starts and
its values are committed when it completes, so a SIGKILLed worker loses at most
the trial it was running. That trial stays RUNNING until its heartbeat is older
than the grace period; the next worker to start a trial on the study marks it
FAIL (Optuna's ``fail_stale_trials``) and ``RetryHeartbeatStaleTrialCallback`` enqueues
a copy with the same parameters, so the search does not lose that point either.
"""
from __future__ import annotations

import json
import os
import time
import warnings
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tangram.errors import ConfigError
from tangram.harness.capacity import DEFAULT_TOL

from .objective import Evaluator
from .space import SearchSpace, paper_default_params

OBJECTIVES = ("pareto", "constrained")
SAMPLERS = ("tpe", "nsga2", "random")


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def make_storage(url: str, heartbeat_s: int | None = 5, grace_s: int | None = 20, max_retry: int = 2):
    """An RDBStorage for any SQLAlchemy URL; unreachable or malformed URLs become one-line ConfigErrors."""
    import optuna
    import sqlalchemy.exc

    _quiet_optuna()
    kw: dict = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    hb = {}
    if heartbeat_s:
        hb = {"heartbeat_interval": int(heartbeat_s), "grace_period": int(grace_s or 4 * heartbeat_s),
              "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)}
    try:
        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=kw, **hb)
            except sqlalchemy.exc.IntegrityError:
                # Two workers (or a worker and a monitor) creating the schema of a fresh database at once race
                # on Optuna's alembic_version row; the loser finds the schema complete on the next try.
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.OperationalError, sqlalchemy.exc.NoSuchModuleError,
            ImportError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ImportError):
            first = f"no database driver for this URL: {first}; for PostgreSQL pip install 'psycopg[binary]'"
        raise ConfigError(f"--storage {redact(url)}: cannot open the study database ({first})") from None


def redact(url: str) -> str:
    """Hide a password in a database URL before printing it."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url


def make_sampler(name: str, objective: str, seed: int, bound: float):
    """Constraints reach TPE/NSGA-II through ``trial.set_constraint`` (Optuna 5), set by the objective."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=16)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"--sampler: unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


def directions(objective: str) -> list[str]:
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective: unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    return ["maximize", "minimize"] if objective == "pareto" else ["maximize"]


@dataclass
class Setup:
    """What must match between every worker of one study (stored in the study's user attributes)."""

    model: str
    gpu: str
    trace: str
    slo: str
    objective: str
    overflow_bound: float
    seed: int
    fast: bool
    profile: str | None
    accuracy_floor: float | None = None  # minimum accuracy relative to the full cache's (measured table)
    accuracy_table: str | None = None  # the table the accuracy comes from (path), None: not measured
    capacity_tol: float = DEFAULT_TOL  # the capacity searches' bracket width

    def as_attrs(self) -> dict:
        return dict(self.__dict__)


_SETUP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Setup) if f.default is not dataclasses.MISSING}


def _stored(stored: dict, key: str):
    """A stored setup's value; a key a study created before it existed is missing and holds the field's default."""
    return stored[key] if key in stored else _SETUP_DEFAULTS.get(key)


def open_study(storage, name: str, setup: Setup, sampler, *, create: bool, space=None):
    """Create (or load) the study and check it was made with the same setup; enqueue the paper default first."""
    import optuna

    dirs = directions(setup.objective)
    if create:
        study = optuna.create_study(storage=storage, study_name=name, directions=dirs, sampler=sampler,
                                    load_if_exists=True)
    else:
        study = optuna.load_study(storage=storage, study_name=name, sampler=sampler)
    if len(study.directions) != len(dirs):
        raise ConfigError(f"study {name!r} exists with {len(study.directions)} objective(s); "
                          f"--objective {setup.objective} needs {len(dirs)}: use another --study name")
    stored = study.user_attrs.get("setup")
    if stored is None and create:
        study.set_user_attr("setup", setup.as_attrs())
        if not study.trials:
            study.enqueue_trial(paper_default_params(space), user_attrs={"role": "paper_default"})
    elif stored is not None and any(_stored(stored, k) != v for k, v in setup.as_attrs().items()):
        diff = [f"{k}: stored {_stored(stored, k)!r} vs now {v!r}" for k, v in setup.as_attrs().items()
                if _stored(stored, k) != v]
        raise ConfigError(f"study {name!r} was created with a different setup ({'; '.join(diff)}); "
                          f"resume with the same options or use another --study name")
    return study


def n_complete(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def make_objective(evaluator: Evaluator, space: SearchSpace, objective: str, bound: float,
                   floor: float | None = None):
    """Optuna objective: suggest, reuse an identical completed trial's results if any, else simulate."""
    from optuna.trial import TrialState

    def fn(trial):
        trial.set_user_attr("worker_pid", os.getpid())  # lets an operator (or a test) see who runs what
        params = space.suggest(trial)
        metrics = None
        for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.params == params and "load_rps" in t.user_attrs:
                metrics = {k: v for k, v in t.user_attrs.items() if k not in ("role", "cached_from", "worker_pid")}
                trial.set_user_attr("cached_from", t.number)
                break
        if metrics is None:
            metrics = evaluator(params)
        for k, v in metrics.items():
            trial.set_user_attr(k, v)
        if objective == "constrained":
            trial.set_constraint("overflow", metrics["overflow"] - bound)  # feasible when <= 0
        if floor is not None:  # not measured counts as infeasible
            rel = metrics.get("accuracy_rel")
            trial.set_constraint("accuracy", floor - rel if rel is not None else 1.0)
        if objective == "pareto":
            return metrics["load_rps"], metrics["overflow"]
        return metrics["load_rps"]

    return fn


def run_worker(study, evaluator: Evaluator, space: SearchSpace, setup: Setup, n_trials: int, progress=None) -> None:
    """Run trials until the study holds ``n_trials`` COMPLETE trials (counted over every worker)."""
    import optuna

    fail_stale(study)
    remaining = n_trials - n_complete(study)
    if remaining <= 0:
        return
    cbs = [optuna.study.MaxTrialsCallback(n_trials, states=(optuna.trial.TrialState.COMPLETE,))]
    if progress is not None:
        cbs.append(lambda st, t: progress())
    # a trial that fails for a reason other than a kill counts against n_trials: allow a few of them
    budget = remaining + 8
    while budget > 0 and n_complete(study) < n_trials:
        before = len(study.trials)
        try:
            study.optimize(make_objective(evaluator, space, setup.objective, setup.overflow_bound,
                                          setup.accuracy_floor),
                           n_trials=budget, callbacks=cbs, catch=())
            return
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError) as e:
            # Two workers can pop the same WAITING (enqueued) trial on SQLite: Optuna reads its state and marks it
            # RUNNING in one unlocked transaction each, so both run it and the slower one's tell finds it
            # COMPLETE. The other worker stored the same parameters' result, so nothing is lost; go on.
            # Likewise a trial whose heartbeats came late (a loaded machine: seen in CI with two test runs at once)
            # is failed as stale by another worker, which enqueues its retry; this worker's tell then finds it
            # finished (UpdateFinishedTrialError, or "Cannot tell a FAIL trial" where Optuna reads the state first).
            # The retry runs it again; go on.
            told = ("Cannot tell a COMPLETE trial", "Cannot tell a FAIL trial")
            if isinstance(e, ValueError) and not any(m in str(e) for m in told):
                raise
            mine = [t for t in study.get_trials(deepcopy=False)[before:] if t.user_attrs.get("worker_pid") == os.getpid()]
            budget -= max(1, len(mine))


def fail_stale(study) -> list[int]:
    """Mark RUNNING trials whose heartbeat is older than the grace period FAIL (and enqueue their retries).

    Optuna does this when a worker starts a trial; doing it at start-up and before the report as well means
    a study that is already complete when a killed worker is noticed still ends with no trial left RUNNING.
    """
    import optuna
    from optuna.trial import TrialState

    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    optuna.storages.fail_stale_trials(study)
    _fail_orphans(study)
    after = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return sorted(before - after)


def _fail_orphans(study) -> None:
    """FAIL (and retry) RUNNING trials that never recorded a heartbeat and started over a grace period ago.

    A worker killed between creating a trial and its first heartbeat leaves a RUNNING trial with no heartbeat
    row, which Optuna's stale check skips (``RDBStorage._get_stale_trial_ids``): it stayed RUNNING forever (seen
    as a flaky kill-and-resume test). Reads the heartbeat table through Optuna's RDB models: there is no public API
    for "no heartbeat yet"."""
    from datetime import datetime

    import optuna
    from optuna.storages._rdb import models
    from optuna.trial import TrialState

    storage = study._storage
    rdb = getattr(storage, "_backend", storage)
    interval = rdb.get_heartbeat_interval() if hasattr(rdb, "get_heartbeat_interval") else None
    if interval is None or not hasattr(rdb, "scoped_session"):
        return
    grace_s = float(rdb.grace_period if rdb.grace_period is not None else 2 * interval)
    session = rdb.scoped_session()
    try:
        now = datetime.now()  # Optuna stamps datetime_start with the worker's datetime.now()
        rows = (session.query(models.TrialModel)
                .filter(models.TrialModel.state == TrialState.RUNNING)
                .filter(models.TrialModel.study_id == study._study_id)
                .filter(~models.TrialModel.heartbeats.any()).all())
        ids = [r.trial_id for r in rows
               if r.datetime_start is not None and (now - r.datetime_start).total_seconds() > grace_s]
    finally:
        session.close()
    failed = []
    for tid in ids:
        try:
            if storage.set_trial_state_values(tid, state=TrialState.FAIL):
                failed.append(tid)
        except optuna.exceptions.UpdateFinishedTrialError:  # another process finished or failed it
            pass
    callback = rdb.get_heartbeat_stale_trial_callback()
    if callback is not None:
        for tid in failed:
            callback(study, storage.get_trial(tid))


def meets_accuracy(t, floor: float | None) -> bool:
    rel = t.user_attrs.get("accuracy_rel")
    return floor is None or (rel is not None and rel >= floor - 1e-12)


def choose_best(study, setup: Setup):
    """Highest sustained load among completed trials with overflow <= bound (ties: lower overflow).

    Pareto studies pick from the Pareto front; if no trial meets the bound, the lowest-overflow one wins. With an
    accuracy floor only trials whose measured accuracy meets it qualify (Pareto: from every completed trial, since
    the front is over load and overflow); if none does, the most accurate trial wins.
    """
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not done:
        raise ConfigError(f"study {study.study_name!r} has no completed trial")
    floor = setup.accuracy_floor
    if floor is not None:
        good = [t for t in done if meets_accuracy(t, floor)]
        if not good:
            return max(done, key=lambda t: (t.user_attrs.get("accuracy_rel") or -1.0, t.user_attrs["load_rps"]))
        ok = [t for t in good if t.user_attrs["overflow"] <= setup.overflow_bound] or good
        return max(ok, key=lambda t: (t.user_attrs["load_rps"], -t.user_attrs["overflow"], -t.number))
    pool = study.best_trials if setup.objective == "pareto" else done
    ok = [t for t in pool if t.user_attrs["overflow"] <= setup.overflow_bound]
    if not ok:
        return min(done, key=lambda t: (t.user_attrs["overflow"], -t.user_attrs["load_rps"]))
    return max(ok, key=lambda t: (t.user_attrs["load_rps"], -t.user_attrs["overflow"], -t.number))


def best_config_dict(params: dict, space: SearchSpace, setup: Setup, tables) -> dict:
    """The chosen configuration as a ``tangram-sim --config`` file: EngineConfig fields + run keys."""
    from tangram.traces import default_trace_path

    eng = space.engine(params).to_dict()
    d = {"model": setup.model, "gpu": setup.gpu, "seed": setup.seed, "slo": setup.slo, "mode": eng.pop("mode")}
    if setup.trace != str(default_trace_path()):  # the bundled trace stays implicit: the file is portable
        d["trace"] = setup.trace
    if setup.profile:
        d["profile"] = setup.profile
    if setup.accuracy_table:
        d["accuracy_table"] = setup.accuracy_table
    if setup.capacity_tol != DEFAULT_TOL:  # `tangram-sim --config F --capacity` searches alike
        d["capacity_tol"] = setup.capacity_tol
    if tables not in ("auto", None):
        d["tables"] = str(Path(tables).resolve())  # absolute, as the trace: the file works from any folder
    elif tables is None:
        d["tables"] = "none"
    d.update(eng)
    return json.loads(json.dumps(d))

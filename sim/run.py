"""The simulator's replicas (the shared scheduler with a cost model as executor) and its replay of a trace."""
from __future__ import annotations

import dataclasses

import numpy as np

from tangram.config import EngineConfig, kv_pool_bytes
from tangram.harness import ClusterResult, replay
from tangram.harness import capacity_search as _search
from tangram.harness.capacity import replicas_search as _replicas_search
from tangram.harness.slo import SLOMonitor
from tangram.paging import KVLayout
from tangram.scheduler import Scheduler
from tangram.spec import DeploymentSpec

from .costmodel import CostModel, CostParams
from .tp import TPCostModel, tp_pool_bytes
from .tables import resolve as resolve_tables


def build_replica(spec: DeploymentSpec, engine: EngineConfig, idx: int) -> tuple[Scheduler, CostModel]:
    """One replica: the shared scheduler and its cost model (``engine.tp`` GPUs: :class:`TPCostModel` and the
    pool of :func:`tp_pool_bytes`)."""
    if engine.tp > 1:
        m = spec.model
        prof = spec.profile.with_alpha(engine.alpha) if spec.profile is not None else None
        ones = np.ones((m.num_layers, m.num_kv_heads))
        lay = KVLayout.build(m, engine, prof.B if prof is not None else ones)  # the scheduler's layout
        # what a request keeps per head (full: everything; uniform: rho; static and dynamic: the budgets)
        keep = {"full": ones, "uniform": ones * engine.rho}.get(engine.retention, prof.B if prof is not None else ones)
        pool = tp_pool_bytes(m, spec.gpu, engine, lay, keep)
    else:
        pool = kv_pool_bytes(spec.model, spec.gpu, engine)
    # the cost model never reads page ids: private pages are counted, not named (the same decisions and counts)
    sched = Scheduler(spec.model, engine, spec.profile, pool_bytes=pool, private_ids=False)
    tables = resolve_tables(spec.tables, spec.gpu, spec.probe) if spec.probe else spec.tables  # cached per probe
    cls = TPCostModel if engine.tp > 1 else CostModel
    cm = cls(spec.model, spec.gpu, engine, sched.layout, sched.profile, tables=tables,
             params=CostParams(engine_overhead=spec.engine_overhead), seed=spec.seed * 1009 + idx)
    return sched, cm


def simulate(trace, spec: DeploymentSpec, mode: str | None = None, *, progress=None, record_kv: bool = True,
             fast_forward: bool = True, stop_slo: dict[str, float] | None = None) -> tuple[dict, ClusterResult]:
    """Run the trace through ``spec.replicas`` simulated replicas; returns (summary, raw result).

    ``fast_forward=False``: every decode step one by one (the reference path). ``stop_slo``: stop as soon as this
    SLO is certain to be missed (a capacity probe needs the verdict, not the hours an overloaded queue drains).
    """
    engine = spec.engine if mode is None else spec.engine.with_(mode=mode)
    reps = [build_replica(spec, engine, i) for i in range(spec.replicas)]
    mon = SLOMonitor(stop_slo, [t.output_tokens for t in trace.turns]) if stop_slo else None
    return replay(trace, reps, engine, spec.router, progress=progress, record_kv=record_kv, fast_forward=fast_forward,
                  slo_monitor=mon)


def capacity_search(trace, spec: DeploymentSpec, mode: str, slo: dict[str, float], *, fast_forward: bool = True,
                    early_stop: bool = True, **kw) -> dict:
    """:func:`tangram.harness.capacity_search` with simulated replays (keyword arguments as there); each probe
    stops as soon as its SLO verdict is certain unless ``early_stop`` is False."""
    return _search(trace, lambda t: probe(t, spec, mode, slo, None, fast_forward=fast_forward,
                                          early_stop=early_stop), slo, **kw)


def probe(trace, spec: DeploymentSpec, mode: str, slo: dict[str, float], scale: float | None, *,
          fast_forward: bool = True, early_stop: bool = True) -> dict:
    """One replay of a capacity search at ``scale`` (:func:`tangram.harness.capacity.capacity_steps` names it;
    None: the trace as it is): its summary, stopped once the SLO is certain to be missed."""
    t = trace if scale is None else trace.scaled(scale)
    return simulate(t, spec, mode, record_kv=False, fast_forward=fast_forward,
                    stop_slo=slo if early_stop else None)[0]


def replicas_needed(trace, spec: DeploymentSpec, mode: str, slo: dict[str, float], target_rps: float, start: int,
                    *, fast_forward: bool = True, early_stop: bool = True, **kw) -> dict:
    """:func:`tangram.harness.capacity.replicas_search`: simulate ``n`` replicas behind ``spec.router``."""
    def run_n(t, n: int) -> dict:
        return simulate(t, dataclasses.replace(spec, replicas=n), mode, record_kv=False, fast_forward=fast_forward,
                        stop_slo=slo if early_stop else None)[0]

    return _replicas_search(trace, run_n, slo, target_rps, start, **kw)

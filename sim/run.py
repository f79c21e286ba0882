"""The simulator's replicas (the shared scheduler with a cost model as executor) and its replay of a trace."""
from __future__ import annotations

from tangram.config import EngineConfig, kv_pool_bytes
from tangram.harness import ClusterResult, replay
from tangram.harness import capacity_search as _search
from tangram.scheduler import Scheduler
from tangram.spec import DeploymentSpec

from .costmodel import CostModel, CostParams
from .tables import resolve as resolve_tables


def build_replica(spec: DeploymentSpec, engine: EngineConfig, idx: int) -> tuple[Scheduler, CostModel]:
    pool = kv_pool_bytes(spec.model, spec.gpu, engine)
    sched = Scheduler(spec.model, engine, spec.profile, pool_bytes=pool)
    tables = resolve_tables(spec.tables, spec.gpu, spec.probe) if spec.probe else spec.tables  # cached per probe
    cm = CostModel(spec.model, spec.gpu, engine, sched.layout, sched.profile, tables=tables,
                   params=CostParams(engine_overhead=spec.engine_overhead), seed=spec.seed * 1009 + idx)
    return sched, cm


def simulate(trace, spec: DeploymentSpec, mode: str | None = None, *, progress=None, record_kv: bool = True
             ) -> tuple[dict, ClusterResult]:
    """Run the trace through ``spec.replicas`` simulated replicas; returns (summary, raw result)."""
    engine = spec.engine if mode is None else spec.engine.with_(mode=mode)
    reps = [build_replica(spec, engine, i) for i in range(spec.replicas)]
    return replay(trace, reps, engine, spec.router, progress=progress, record_kv=record_kv)


def capacity_search(trace, spec: DeploymentSpec, mode: str, slo: dict[str, float], **kw) -> dict:
    """:func:`tangram.harness.capacity_search` with simulated replays (keyword arguments as there)."""
    return _search(trace, lambda t: simulate(t, spec, mode, record_kv=False)[0], slo, **kw)

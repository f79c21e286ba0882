"""Replay a trace through replicas and summarise it: what ``tangram-sim`` and ``tangram-bench`` both run."""
from __future__ import annotations

from typing import Sequence

from tangram.config import EngineConfig
from tangram.plan import Executor
from tangram.scheduler import Scheduler

from .cluster import Cluster, ClusterResult
from .summary import summarize


def replay(trace, replicas: Sequence[tuple[Scheduler, Executor]], engine: EngineConfig,
           router: str = "session-affinity", *, progress=None, record_kv: bool = True,
           fast_forward: bool = True, slo_monitor=None) -> tuple[dict, ClusterResult]:
    """Serve ``trace`` on ``replicas`` (scheduler, executor pairs built for ``engine``); returns (summary, result).
    ``fast_forward=False`` steps every decode step (the reference the fast-forwarded runs are tested against);
    ``slo_monitor`` stops the replay once its SLO is certain to be missed."""
    res = Cluster(trace, replicas, router, progress=progress, record_kv=record_kv, fast_forward=fast_forward,
                  slo_monitor=slo_monitor).run()
    return summarize(res, engine, [e for _, e in replicas]), res

"""Replay a trace through replicas and summarise it: what ``tangram-sim`` and ``tangram-bench`` both run."""
from __future__ import annotations

from typing import Sequence

from tangram.config import EngineConfig
from tangram.plan import Executor
from tangram.scheduler import Scheduler

from .cluster import Cluster, ClusterResult
from .summary import summarize


def replay(trace, replicas: Sequence[tuple[Scheduler, Executor]], engine: EngineConfig,
           router: str = "session-affinity", *, progress=None, record_kv: bool = True) -> tuple[dict, ClusterResult]:
    """Serve ``trace`` on ``replicas`` (scheduler, executor pairs built for ``engine``); returns (summary, result)."""
    res = Cluster(trace, replicas, router, progress=progress, record_kv=record_kv).run()
    return summarize(res, engine, [e for _, e in replicas]), res

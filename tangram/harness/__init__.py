"""tangram.harness: the trace-replay harness shared by the engine and the simulator.

Replicas (a scheduler and an executor each), routers, arrivals and sessions (:mod:`.cluster`), the run's summary
(:mod:`.summary`), SLOs (:mod:`.slo`) and the capacity search (:mod:`.capacity`). The executor is whatever
prices or runs a step (:class:`tangram.plan.Executor`): this package imports neither the engine nor the simulator.
"""
from .capacity import capacity_search, offered_rps
from .cluster import ROUTERS, Cluster, ClusterResult, ReplicaTrace
from .replay import replay
from .slo import SLO_KEYS, meets_slo, parse_slo
from .summary import summarize

__all__ = ["Cluster", "ClusterResult", "ReplicaTrace", "ROUTERS", "replay", "summarize", "SLO_KEYS", "parse_slo",
           "meets_slo", "offered_rps", "capacity_search"]

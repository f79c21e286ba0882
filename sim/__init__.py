"""tangram.sim: the shared control plane in SimPy with a cost model in place of the GPU executor."""
from .cluster import ROUTERS, Cluster, ClusterResult
from .costmodel import CostModel, CostParams, HostCoeffs
from .run import SimSpec, capacity_search, parse_slo, simulate

__all__ = ["Cluster", "ClusterResult", "ROUTERS", "CostModel", "CostParams", "HostCoeffs", "SimSpec", "simulate",
           "capacity_search", "parse_slo"]

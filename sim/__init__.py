"""tangram.sim: the simulated executor (a cost model priced from GPU tables) for the shared trace-replay harness."""
from .costmodel import CostModel, CostParams, HostCoeffs
from .run import build_replica, capacity_search, simulate

__all__ = ["CostModel", "CostParams", "HostCoeffs", "build_replica", "simulate", "capacity_search"]

"""The capacity search: the highest arrival-rate scale of a trace whose replay still meets an SLO.

Generic over how a replay is run (``run(trace) -> summary``): the simulator passes its cost-model replay.
"""
from __future__ import annotations

import math
from typing import Callable

from tangram.errors import ConfigError

from .slo import meets_slo


def offered_rps(trace) -> float:
    """Requests per second the trace offers: all its turns over the span of its session arrivals."""
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:
        raise ConfigError("capacity search needs a trace whose sessions arrive over a time span > 0")
    return len(trace.turns) / span


def capacity_search(trace, run: Callable[[object], dict], slo: dict[str, float], *, iters: int = 7,
                    tol: float = 0.08, start: float = 1.0, progress=None) -> dict:
    """Highest arrival-rate scale meeting the SLO: bracket by doubling/halving from ``start``, then log-bisection.

    ``run(scaled_trace)`` replays one load and returns its summary. ``start`` is only a first guess (the CLI
    passes the saturation throughput over the offered load); the bracket search makes the result independent of
    it up to the bisection tolerance.
    """
    base = offered_rps(trace)
    probes: list[tuple[float, float | None, bool]] = []
    cache: dict[float, bool] = {}

    def ok(scale: float) -> bool:
        if scale in cache:
            return cache[scale]
        summ = run(trace.scaled(scale))
        good = meets_slo(summ, slo)
        probes.append((base * scale, summ.get("ttft_p99_s"), good))
        cache[scale] = good
        if progress:
            progress(1)
        return good

    lo = hi = None
    s = float(start) if start > 0 else 1.0
    for _ in range(12):
        if ok(s):
            lo = s
            if hi is not None:
                break
            s *= 2.0
        else:
            hi = s
            if lo is not None:
                break
            s /= 2.0
    if lo is None:
        return {"max_rate_rps": 0.0, "max_rate_scale": 0.0, "probes": sorted(probes)}
    if hi is None:  # never failed within the doubling budget: report the highest tested load
        return {"max_rate_rps": base * lo, "max_rate_scale": lo, "probes": sorted(probes), "bound": "lower"}
    for _ in range(iters):
        if hi / lo <= 1 + tol:
            break
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"max_rate_rps": base * lo, "max_rate_scale": lo, "probes": sorted(probes)}

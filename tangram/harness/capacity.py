"""The capacity search: the highest arrival-rate scale of a trace whose replay still meets an SLO, and the replicas
a target rate needs.

Generic over how a replay is run (``run(trace) -> summary``; ``run_replicas(trace, n) -> summary``): the simulator
passes its cost-model replay, stopped early once the SLO is certain to be missed (:class:`.slo.SLOMonitor`).
"""
from __future__ import annotations

import math
from typing import Callable

from tangram.errors import ConfigError

from .slo import meets_slo

BURST_SPAN_S = 1e-6  # the "whole trace at once" probe: every session arrives within this span


def offered_rps(trace) -> float:
    """Requests per second the trace offers: all its turns over the span of its session arrivals."""
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:
        raise ConfigError("capacity search needs a trace whose sessions arrive over a time span > 0")
    return len(trace.turns) / span


def _probe_row(rate: float, summ: dict, good: bool) -> list:
    """One probe as reported: [offered rps, TTFT p99 (s), meets the SLO, stopped early]. A probe stopped early
    reports the TTFT p99 of the turns that had arrived, the waiting ones at their wait so far (a lower bound)."""
    stopped = bool(summ.get("stopped_early"))
    p99 = summ.get("ttft_p99_at_stop_s") if stopped else summ.get("ttft_p99_s")
    return [rate, p99, bool(good), stopped]


def capacity_search(trace, run: Callable[[object], dict], slo: dict[str, float], *, iters: int = 7,
                    tol: float = 0.08, start: float = 1.0, progress=None) -> dict:
    """Highest arrival-rate scale meeting the SLO: the whole trace at once first, then bracket by doubling/halving
    from a first guess, then log-bisection.

    ``run(scaled_trace)`` replays one load and returns its summary. The burst probe (every session arriving within
    :data:`BURST_SPAN_S`) answers two questions: if it meets the SLO the trace is too small to saturate the
    deployment (no load it can offer finds the limit); if not, the rate it was served at (the saturation
    throughput, read from a probe that an SLO monitor may have stopped early) is the first guess of the limit.
    ``start`` (a scale) is the guess when the burst served nothing. The bracket search makes the result
    independent of the guess up to the bisection tolerance.

    Returns ``max_rate_rps`` / ``max_rate_scale`` (the highest load that met the SLO), ``bracket_rps`` (that load
    and the lowest that missed it: the true limit lies between), ``probes`` (:func:`_probe_row`, by rate; the
    burst has rate None) and ``saturated``. A trace too small to saturate has ``saturated`` False,
    ``max_rate_rps`` None and ``lower_bound_rps`` the rate the burst was served at within the SLO. ``note`` says
    why when there is no plain answer.
    """
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:  # every session at the same instant: there is no rate to scale
        summ = run(trace)
        good = meets_slo(summ, slo)
        if progress:
            progress(1)
        return {"max_rate_rps": None, "max_rate_scale": None, "bracket_rps": [None, None], "offered_rps": None,
                "probes": [_probe_row(None, summ, good)], "saturated": not good, "lower_bound_rps": None,
                "note": f"every session of the trace arrives at t = {arr[0]:g} s: no arrival rate to scale; as one "
                        f"burst it {'meets' if good else 'misses'} the SLO"}
    base = len(trace.turns) / span
    burst = span / BURST_SPAN_S
    probes: list[list] = []
    cache: dict[float, bool] = {}

    def ok(scale: float) -> bool:
        if scale in cache:
            return cache[scale]
        summ = run(trace.scaled(scale))
        good = meets_slo(summ, slo)
        probes.append(_probe_row(base * scale if scale != burst else None, summ, good))
        cache[scale] = good
        if progress:
            progress(1)
        if scale == burst:
            served["rps"] = summ.get("throughput_rps") or 0.0
        return good

    def result(lo, hi, **kw) -> dict:
        out = {"max_rate_rps": base * lo if lo is not None else None,
               "max_rate_scale": lo, "bracket_rps": [base * lo if lo is not None else 0.0,
                                                     base * hi if hi is not None and hi != burst else None],
               "probes": sorted(probes, key=lambda p: (p[0] is None, p[0] or 0.0)), "saturated": True,
               "offered_rps": base}
        out.update(kw)
        return out

    served = {"rps": 0.0}
    if ok(burst):  # the whole trace at once meets the SLO: no load this trace can offer finds the limit
        return result(None, None, saturated=False, lower_bound_rps=served["rps"] or None, max_rate_scale=None,
                      bracket_rps=[served["rps"] or None, None],
                      note=f"trace too small to saturate: all {len(trace.turns)} requests arriving at once meet the "
                           f"SLO (served at {served['rps']:.4g} requests/s), so the capacity is above any rate this "
                           f"trace offers (a longer trace finds it)")
    lo, hi = None, burst
    s = served["rps"] / base if served["rps"] > 0 else (float(start) if start > 0 else 1.0)
    for _ in range(16):  # double (or halve) until the SLO is met at one scale and missed at another
        if ok(s):
            lo = s
        else:
            hi = min(hi, s)
        if lo is not None and hi <= 2 * lo:
            break
        s = lo * 2.0 if lo is not None else s / 2.0
    if lo is None:
        return result(None, hi, max_rate_rps=0.0, max_rate_scale=0.0, bracket_rps=[0.0, base * hi],
                      note=f"SLO missed even at {base * hi:.3g} requests/s ({hi:g} x the trace's rate)")
    for _ in range(iters):
        if hi / lo <= 1 + tol:
            break
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    if hi / lo > 1 + tol:
        return result(lo, hi, note=f"bisection stopped after {iters} halvings: the limit lies in the bracket "
                                   f"(x{hi / lo:.3g} wide)")
    return result(lo, hi)


def replicas_search(trace, run_replicas: Callable[[object, int], dict], slo: dict[str, float],
                    target_rps: float, start: int, *, max_replicas: int = 256, progress=None) -> dict:
    """Fewest replicas whose cluster (the spec's router included) meets the SLO with the trace scaled to
    ``target_rps``: simulated, not divided from one replica's capacity (routing, session affinity and migration
    make n replicas serve less than n times one). Steps down from ``start`` while the SLO holds, up while not.

    Returns ``replicas_needed`` (None when even ``max_replicas`` miss it), ``scale`` and ``probes``
    ([replicas, TTFT p99 s, meets the SLO, stopped early], by replica count).
    """
    base = offered_rps(trace)
    scale = target_rps / base
    t = trace.scaled(scale)
    seen: dict[int, bool] = {}
    probes: list[list] = []

    def ok(n: int) -> bool:
        if n not in seen:
            summ = run_replicas(t, n)
            seen[n] = meets_slo(summ, slo)
            probes.append(_probe_row(n, summ, seen[n]))
            if progress:
                progress(1)
        return seen[n]

    n = max(1, min(int(start), max_replicas))
    if ok(n):
        while n > 1 and ok(n - 1):
            n -= 1
        need = n
    else:
        need = None
        step = 1
        while n < max_replicas:  # grow by 1, 2, 4, ... then close the gap one by one
            m = min(max_replicas, n + step)
            if ok(m):
                while m - 1 > n and ok(m - 1):
                    m -= 1
                need = m
                break
            n, step = m, step * 2
    return {"replicas_needed": need, "target_rps": target_rps, "scale": scale,
            "probes": sorted(probes, key=lambda p: p[0]),
            **({} if need is not None else {"note": f"SLO missed at {target_rps:g} requests/s with "
                                                    f"{max_replicas} replicas"})}

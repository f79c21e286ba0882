"""The capacity search: the highest arrival-rate scale of a trace whose replay still meets an SLO, and the replicas
a target rate needs.

Generic over how a replay is run (``run(trace) -> summary``; ``run_replicas(trace, n) -> summary``): the simulator
passes its cost-model replay, stopped early once the SLO is certain to be missed (:class:`.slo.SLOMonitor`).
"""
from __future__ import annotations

import math
from typing import Callable, Generator

from tangram.errors import ConfigError

from .slo import meets_slo, vacuous

BURST_SPAN_S = 1e-6  # the "whole trace at once" probe: every session arrives within this span
DEFAULT_TOL = 0.08  # the bracket's relative width (--capacity-tol)


def offered_rps(trace) -> float:
    """Requests per second the trace offers: all its turns over the span of its session arrivals."""
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:
        raise ConfigError("capacity search needs a trace whose sessions arrive over a time span > 0")
    return len(trace.turns) / span


def _probe_row(rate, summ: dict, good: bool, kind: str = "probe") -> list:
    """One probe as reported: [offered rps, TTFT p99 (s), meets the SLO, stopped early, kind]. A probe stopped early
    reports the TTFT p99 of the turns that had arrived, the waiting ones at their wait so far (a lower bound).
    ``kind``: "probe" (a replay of the whole trace run by the search), "burst" (the whole trace at once) or "reused"
    (a replay of the whole trace the caller had already run, e.g. tangram-sim's run at the trace's own load)."""
    stopped = bool(summ.get("stopped_early"))
    p99 = summ.get("ttft_p99_at_stop_s") if stopped else summ.get("ttft_p99_s")
    return [rate, p99, bool(good), stopped, kind]


def slo_usage(summ: dict, slo: dict[str, float]) -> dict[str, float] | None:
    """How much of each SLO bound a run used: {key: measured / bound} (all <= 1 when it meets them)."""
    vals = {k: summ.get(f"{k}_s") for k in slo if not vacuous(summ, k)}  # (a term with nothing to measure: none)
    if not vals or any(v is None for v in vals.values()):
        return None
    return {k: float(v) / float(slo[k]) for k, v in vals.items()}


def _predict(passes: list[tuple[float, dict | None]]) -> float | None:
    """The lowest :func:`predict_limit` over the SLO keys: the load at which the first bound is reached. Per key,
    since a key that is flat at these loads (TPOT while the queue, hence TTFT, grows) says nothing about the limit
    and a maximum over keys would hide the one that rises."""
    keys = {k for _, u in passes if u for k in u}
    lims = [predict_limit([(s, u[k]) for s, u in passes if u and k in u]) for k in sorted(keys)]
    lims = [x for x in lims if x is not None]
    return min(lims) if lims else None


def predict_limit(passes: list[tuple[float, float]]) -> float | None:
    """Scale at which the SLO usage reaches 1, from the two highest-load passing probes ``(scale, usage)``.

    Queueing delay near saturation grows like ``1 / (mu - s)`` (mu: the load the deployment sustains), so the model
    ``usage = b / (mu - s)`` through the two points gives mu and b, and the limit ``mu - b``. Only a guess of where
    to probe next: the answer is always a bracket of two replays (one met, one missed). None when the two points do
    not rise with load (the model has no finite mu above them).
    """
    pts = sorted(p for p in passes if p[1] is not None and p[1] > 0)
    if len(pts) < 2:
        return None
    (s0, u0), (s1, u1) = pts[-2], pts[-1]
    if not (u1 > u0 and s1 > s0):
        return None
    mu = (u1 * s1 - u0 * s0) / (u1 - u0)
    lim = mu - u1 * (mu - s1)
    return lim if math.isfinite(lim) and lim > s1 else None


FIRST_ABOVE_STEPS = 1  # the first probe this many w-steps above the guess: a miss costs less than a meet
DESCENT_STEPS = 3  # misses in a row stepped down by w before the steps grow
MODEL_AIM = 0.5  # while only passes are known, the model's limit L is probed at L w^MODEL_AIM: just above it


def _next_scale(lo, hi: float, hi_far: bool, passes, guess, w: float, up: int, down: int) -> float:
    """Where the next replay goes. ``lo`` / ``hi``: the highest scale met (None: none yet) and the lowest missed
    (``hi_far``: the burst's or a reused replay's, the search has not missed yet: an upper bound, not a bisection
    end, since the load it came from can be far above the limit); ``w = 1 + tol``; ``guess``: the first guess (only
    before any probe); ``up`` / ``down``: met / missed replays in a row.

    Replays do not cost the same: one that misses the SLO is stopped once the miss is certain (a Mooncake replay at
    ~40% of the trace, a third of a replay that meets it, which runs the whole trace at a lower load:
    reports/traces/README.md), and every answer needs one that meets it. So the search comes at the limit from
    above: the first probe one w-step above the guess (the rate an overloaded replay was served at, which lands
    within ~25% of the limit either side), then down one w-step per miss (:data:`DESCENT_STEPS` of them before the
    steps grow), so that the first replay that meets the SLO usually ends the search. Against the guess itself and
    growing steps from the first miss, over guesses 25% below to 25% above the limit (queue-like replays, a miss
    costing 0.35 of a meet), the expected cost is 11-15% lower, with about as many replays
    (tests/test_capacity.py::test_the_search_spends_less_than_the_guess_first_search). For the same reason, while
    only passes are known (the trace's own load met the SLO, or the first probes did) the model's limit L is probed
    just above, at ``L sqrt(w)``, not just below: the model underestimates a limit where the SLO usage rises more
    steeply than a queue's, and each step below it is a whole replay (test
    ``test_probing_above_the_model_costs_less_when_it_underestimates``).

    The search ends when a met scale and a missed one are within ``w``. With a good prediction L of the limit
    (:func:`_predict`) that takes two replays, one met just below L and one missed just above, so a probe aims
    at ``L / sqrt(w)`` (a pass, whose SLO usage sharpens the model) and, once the bracket is within ``w^2``, at the
    point of ``[hi / w, lo w]`` (where either outcome ends the search) nearest L. Without a prediction it gallops
    (steps of ``w``, ``w^2``, ``w^4``, ... up to the doubling of the old search) or bisects; a
    prediction more than twice the highest met load is not followed further than that. Model-placed probes stay in the middle half
    of the bracket's log-width (a wrong model still shrinks it) and at least ``w`` from its ends, so the search
    always ends.
    """
    def gallop(k: int) -> float:  # the k-th step in a row: w, w^2, w^4, ..., at most the old search's doubling
        return min(w ** min(2 ** max(k - 1, 0), 64), 2.0)

    lim = _predict(passes)
    if lo is None:  # only misses so far: above the first guess, then down in steps of w, then growing steps
        if guess is not None:
            for k in range(FIRST_ABOVE_STEPS, -1, -1):
                if guess * w ** (k + 1) <= hi:
                    return guess * w ** k
        return hi / (w if down <= DESCENT_STEPS else gallop(down - DESCENT_STEPS))
    if hi_far:  # only passes below the far miss: up in growing steps, or just above the prediction
        x = lo * gallop(up) if lim is None else min(max(lim * w ** MODEL_AIM, lo * w), lo * 2.0)
        return min(x, math.sqrt(lo * hi))
    if hi / lo <= w * w * (1 + 1e-9):  # one more replay ends it, whatever its outcome
        return min(max(lim, hi / w), lo * w) if lim is not None else math.sqrt(lo * hi)
    if lim is None:
        return math.sqrt(lo * hi)
    band = (lo ** 0.75 * hi ** 0.25, lo ** 0.25 * hi ** 0.75)  # keep shrinking the bracket if the model is off
    return min(max(lim / math.sqrt(w), lo * w, band[0]), hi / w, band[1])


def capacity_search(trace, run: Callable[[object], dict], slo: dict[str, float], *, iters: int = 7,
                    tol: float = DEFAULT_TOL, start: float = 1.0, progress=None, known: dict | None = None) -> dict:
    """:func:`capacity_steps` with each replay run here, one after the other: ``run(scaled_trace)`` (the trace
    itself for a trace with no arrival span). Keyword arguments as there; ``progress(1)`` after each replay."""
    steps = capacity_steps(trace, slo, iters=iters, tol=tol, start=start, known=known)
    return drive(steps, lambda scale: run(trace if scale is None else trace.scaled(scale)), progress)


def drive(steps: Generator, run: Callable[[object], dict], progress=None):
    """Run a search generator (:func:`capacity_steps`) to its end: each scale it yields is replayed by ``run``
    and the summary sent back; returns the generator's result."""
    try:
        scale = next(steps)
        while True:
            summ = run(scale)
            if progress:
                progress(1)
            scale = steps.send(summ)
    except StopIteration as stop:
        return stop.value


def capacity_steps(trace, slo: dict[str, float], *, iters: int = 7, tol: float = DEFAULT_TOL, start: float = 1.0,
                   known: dict | None = None) -> Generator[float | None, dict, dict]:
    """The capacity search as a generator: it yields the arrival-rate scale of each replay it needs (None: the trace
    as it is) and is sent that replay's summary, so a caller can run the replays of several searches side by side
    in worker processes (tangram-sim's modes) or one after the other (:func:`capacity_search`). Returns (as its
    ``StopIteration`` value) the search's result.

    The search: the highest arrival-rate scale meeting the SLO, as a bracket of two replays of the whole trace: one
    at a scale that met the SLO and one, at most ``1 + tol`` times higher, that missed it. ``known``: {scale:
    summary} of replays of the whole trace already run by the caller (tangram-sim's run at the trace's own load,
    scale 1), used as probes (marked "reused").

    1. Saturation. If no replay has missed the SLO yet, the burst probe (every session arriving within
       :data:`BURST_SPAN_S`) does: if even that meets the SLO the trace is too small to saturate the deployment (no
       load it can offer finds the limit). A known replay that missed answers the question without a burst.
    2. The first guess: the rate the missed replay (the burst, or the known one) was served at, its saturation
       throughput; ``start`` (a scale) when it served nothing. The first probe goes one w-step above it.
    3. Every next replay comes from :func:`_next_scale`: down in steps of w (misses are stopped early, hence
       cheap), or up in growing steps, until one load meets and another misses, then a model of the SLO usage of
       the passing replays near saturation (:func:`predict_limit`) places the probes so that the last two straddle
       the limit within ``1 + tol``, bisection where there is no model. The model only decides where to look; the
       answer is always two replays of the whole trace, so a wrong model costs replays, never accuracy.

    ``iters`` bounds the replays once the limit is bracketed (16 bound the bracketing). Returns ``max_rate_rps`` /
    ``max_rate_scale`` (the highest load that met the SLO), ``bracket_rps`` (that load and the lowest that missed it:
    the true limit lies between), ``probes`` (:func:`_probe_row`, by rate; the burst has rate None), ``replays``
    (the replays the search ran by kind: ``probe`` met / missed, ``stopped_early``, ``burst``, ``reused``) and
    ``saturated``. A trace too small to saturate has ``saturated`` False, ``max_rate_rps`` None and
    ``lower_bound_rps`` the rate the burst was served at within the SLO. ``note`` says why when there is no plain
    answer.
    """
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:  # every session at the same instant: there is no rate to scale
        summ = yield None
        good = meets_slo(summ, slo)
        return {"max_rate_rps": None, "max_rate_scale": None, "bracket_rps": [None, None], "offered_rps": None,
                "probes": [_probe_row(None, summ, good, "burst")], "saturated": not good, "lower_bound_rps": None,
                "replays": _count([_probe_row(None, summ, good, "burst")]),
                "note": f"every session of the trace arrives at t = {arr[0]:g} s: no arrival rate to scale; as one "
                        f"burst it {'meets' if good else 'misses'} the SLO"}
    base = len(trace.turns) / span
    burst = span / BURST_SPAN_S
    w = 1.0 + tol
    w_end = w * (1 + 1e-9)  # steps of w from both ends meet within a rounding
    probes: list[list] = []
    cache: dict[float, bool] = {}
    passes: list[tuple[float, dict | None]] = []
    served = {"rps": 0.0}

    def note(scale: float, summ: dict, kind: str) -> bool:
        good = meets_slo(summ, slo)
        probes.append(_probe_row(base * scale if kind != "burst" else None, summ, good, kind))
        cache[scale] = good
        if good and kind != "burst":
            passes.append((scale, slo_usage(summ, slo)))
        if kind == "burst" or kind == "reused" and not good:  # the rate a saturated replay was served at
            served["rps"] = summ.get("throughput_rps") or served["rps"]
        return good

    def ok(scale: float):  # a generator: ``good = yield from ok(scale)``
        if scale in cache:
            return cache[scale]
        summ = yield scale
        return note(scale, summ, "burst" if scale == burst else "probe")

    def result(lo, hi, **kw) -> dict:
        out = {"max_rate_rps": base * lo if lo is not None else None,
               "max_rate_scale": lo, "bracket_rps": [base * lo if lo is not None else 0.0,
                                                     base * hi if hi is not None and hi != burst else None],
               "probes": sorted(probes, key=lambda p: (p[0] is None, p[0] or 0.0)), "saturated": True,
               "offered_rps": base, "replays": _count(probes)}
        out.update(kw)
        return out

    for s, summ in sorted((known or {}).items()):
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ConfigError(f"capacity search: known replay at scale {s!r}: expected a finite scale > 0")
        note(float(s), summ, "reused")
    lo = max((s for s, g in cache.items() if g), default=None)
    hi = min((s for s, g in cache.items() if not g), default=None)
    if hi is None:
        if (yield from ok(burst)):  # the whole trace at once meets the SLO: no load it can offer finds the limit
            return result(None, None, saturated=False, lower_bound_rps=served["rps"] or None, max_rate_scale=None,
                          max_rate_rps=None, bracket_rps=[served["rps"] or None, None],
                          note=f"trace too small to saturate: all {len(trace.turns)} requests arriving at once meet "
                               f"the SLO (served at {served['rps']:.4g} requests/s), so the capacity is above any "
                               f"rate this trace offers (a longer trace finds it)")
        hi = burst
    guess = served["rps"] / base if served["rps"] > 0 else (float(start) if start > 0 else 1.0)
    if lo is not None and lo >= hi:  # a known replay met the SLO above one that missed: not monotone here
        lo = None
    up = down = bracketing = refining = 0
    hi_far = True  # hi is the burst's or a reused replay's until the search itself misses
    while lo is None or hi / lo > w_end:
        bracketed = lo is not None and not hi_far
        if bracketed and refining >= iters or not bracketed and bracketing >= 16:
            break
        refining, bracketing = refining + bracketed, bracketing + (not bracketed)
        s = _next_scale(lo, hi, hi_far, passes, guess if lo is None and down == 0 else None, w, up, down)
        if (yield from ok(s)):
            lo, up, down = s, up + 1, 0
        else:
            hi, hi_far, up, down = s, False, 0, down + 1
    if lo is None:
        return result(None, hi, max_rate_rps=0.0, max_rate_scale=0.0, bracket_rps=[0.0, base * hi],
                      note=f"SLO missed even at {base * hi:.3g} requests/s ({hi:g} x the trace's rate)")
    if hi / lo > w_end:
        if hi == burst:
            return result(lo, hi, note=f"search stopped after 16 replays without a miss: the limit is above "
                                       f"{base * lo:.4g} requests/s")
        return result(lo, hi, note=f"search stopped after {refining + bracketing} replays: the limit lies in the "
                                   f"bracket (x{hi / lo:.3g} wide)")
    return result(lo, hi)


def _count(probes: list[list]) -> dict:
    """The replays of a search by kind (tangram-sim's metrics.json, benchmarks/sim_speed.py)."""
    run = [p for p in probes if p[4] == "probe"]
    return {"probe": len(run), "met": sum(1 for p in run if p[2]), "missed": sum(1 for p in run if not p[2]),
            "stopped_early": sum(1 for p in run if p[3]), "burst": sum(1 for p in probes if p[4] == "burst"),
            "reused": sum(1 for p in probes if p[4] == "reused")}


def replicas_search(trace, run_replicas: Callable[[object, int], dict], slo: dict[str, float],
                    target_rps: float, start: int, *, max_replicas: int = 256, progress=None) -> dict:
    """Fewest replicas whose cluster (the spec's router included) meets the SLO with the trace scaled to
    ``target_rps``: simulated, not divided from one replica's capacity (routing, session affinity and migration
    make n replicas serve less than n times one). From ``start``, down while the SLO holds or up while not, in
    growing steps, then bisection (more replicas never serve a rate worse: the search assumes it).

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

    def bisect(miss: int, meet: int) -> int:
        """The fewest replicas meeting the SLO between a count that missed it and one that met it."""
        while meet - miss > 1:
            mid = (miss + meet) // 2
            miss, meet = (miss, mid) if ok(mid) else (mid, meet)
        return meet

    # From ``start`` down (it met) or up (it missed) in steps of 1, 2, 4, ... until the outcome flips, then
    # bisect: O(log) cluster replays whatever the start. A start far above the answer (a trace too small to
    # saturate gives only a lower bound of one replica's rate) stepped down one replica at a time, each replay
    # simulating that many replicas: hours for a start of 256.
    n = max(1, min(int(start), max_replicas))
    step = 1
    if ok(n):
        need = n
        while need > 1:
            m = max(1, need - step)
            if not ok(m):
                need = bisect(m, need)
                break
            need, step = m, step * 2
    else:
        need = None
        while n < max_replicas:
            m = min(max_replicas, n + step)
            if ok(m):
                need = bisect(n, m)
                break
            n, step = m, step * 2
    return {"replicas_needed": need, "target_rps": target_rps, "scale": scale,
            "probes": sorted(probes, key=lambda p: p[0]),
            **({} if need is not None else {"note": f"SLO missed at {target_rps:g} requests/s with "
                                                    f"{max_replicas} replicas"})}

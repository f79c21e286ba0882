"""One simulated deployment per mode, and the capacity search over arrival-rate scales."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tangram.budgets import BudgetProfile
from tangram.config import EngineConfig, GPUConfig, ModelConfig, kv_pool_bytes
from tangram.errors import ConfigError
from tangram.metrics import latency_summary, time_weighted_mean
from tangram.scheduler import Scheduler

from .cluster import Cluster, ClusterResult
from .costmodel import CostModel, CostParams

SLO_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99")
# rejections that do not depend on load (a single turn larger than the pool or the context window)
_LOAD_FREE = ("turn larger than the KV pool", "context ", "previous turn rejected")


def parse_slo(text: str) -> dict[str, float]:
    """``'ttft_p99=2s,tpot_p99=100ms'`` -> {'ttft_p99': 2.0, 'tpot_p99': 0.1}."""
    out: dict[str, float] = {}
    if not text or not text.strip():
        raise ConfigError("--slo: empty; expected e.g. 'ttft_p99=2s,tpot_p99=0.1s'")
    for part in text.split(","):
        key, sep, val = part.strip().partition("=")
        key, val = key.strip(), val.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo: cannot parse {part.strip()!r}; expected KEY=VALUE with KEY in "
                              f"{', '.join(SLO_KEYS)} and VALUE like 2s or 100ms")
        scale = 1e-3 if val.endswith("ms") else 1.0
        num = val[:-2] if val.endswith("ms") else val[:-1] if val.endswith("s") else val
        try:
            v = float(num) * scale
        except ValueError:
            raise ConfigError(f"--slo: {key}: {val!r} is not a duration like 2s or 100ms") from None
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"--slo: {key} must be a positive duration, got {val!r}")
        out[key] = v
    return out


def default_profile(model: ModelConfig, rho: float, alpha: float, seed: int = 0, method: str = "ada-snapkv",
                    scope: str = "per-layer") -> BudgetProfile:
    """The profile of a run that names none (:func:`tangram.profiles.registry.default_profile`: the shipped
    calibration when there is one, else synthetic)."""
    from tangram.profiles.registry import default_profile as resolve

    return resolve(model, rho, alpha, seed, method, scope)[0]


@dataclass
class SimSpec:
    """Everything a simulated deployment needs besides the trace and the mode."""

    model: ModelConfig
    gpu: GPUConfig
    engine: EngineConfig
    profile: BudgetProfile
    replicas: int = 1
    router: str = "session-affinity"
    seed: int = 0
    tables: object = "auto"
    params: CostParams = field(default_factory=CostParams)


def build_replica(spec: SimSpec, engine: EngineConfig, idx: int) -> tuple[Scheduler, CostModel]:
    pool = kv_pool_bytes(spec.model, spec.gpu, engine)
    sched = Scheduler(spec.model, engine, spec.profile, pool_bytes=pool)
    cm = CostModel(spec.model, spec.gpu, engine, sched.layout, sched.profile, tables=spec.tables,
                   params=spec.params, seed=spec.seed * 1009 + idx)
    return sched, cm


def simulate(trace, spec: SimSpec, mode: str | None = None, *, progress=None, record_kv: bool = True
             ) -> tuple[dict, ClusterResult]:
    """Run the trace through ``spec.replicas`` simulated replicas; returns (summary, raw result)."""
    engine = spec.engine if mode is None else spec.engine.with_(mode=mode)
    reps = [build_replica(spec, engine, i) for i in range(spec.replicas)]
    res = Cluster(trace, reps, spec.router, progress=progress, record_kv=record_kv).run()
    return summarize(res, engine, [c for _, c in reps]), res


def summarize(res: ClusterResult, engine: EngineConfig, costs: list[CostModel]) -> dict:
    s = latency_summary(res.records)
    scheds = res.schedulers
    lay = scheds[0].layout
    pb, hb = lay.page_bytes, lay.head_token_bytes
    pool_b = scheds[0].pool.num_pages * pb
    peak = max(sc.stats.peak_pages for sc in scheds) * pb
    util, res_tw, live_tw = [], 0.0, 0.0
    for tr, sc in zip(res.replicas, scheds):
        if tr.t:
            t = np.asarray(tr.t)
            r = np.asarray(tr.reserved, float) * pb
            lv = np.asarray(tr.live, float) * hb
            util.append(time_weighted_mean(t, r, res.end_s) / pool_b)
            res_tw += time_weighted_mean(t, r, res.end_s)
            live_tw += time_weighted_mean(t, lv, res.end_s)
    bd: dict[str, float] = {}
    for tr in res.replicas:
        for k, v in tr.breakdown.items():
            bd[k] = bd.get(k, 0.0) + v
    busy = sum(tr.busy_s for tr in res.replicas)
    pf_s = sum(tr.prefill_step_s for tr in res.replicas)
    st = [sc.stats for sc in scheds]
    s.update({
        "mode": engine.mode, "replicas": len(scheds),
        "peak_kv_bytes": peak, "kv_pool_bytes": pool_b, "page_bytes": pb, "n_tables": lay.n_tables,
        "heads_per_group": lay.heads_per_group,
        "kv_utilization": float(np.mean(util)) if util else 0.0,
        "fragmentation": 1.0 - live_tw / res_tw if res_tw > 0 else 0.0,
        "preemptions": sum(x.preemptions for x in st), "session_evictions": sum(x.session_evictions for x in st),
        "pages_reclaimed": sum(x.pages_reclaimed for x in st), "steps": res.steps,
        "busy_s": busy, "time_by_operator_s": dict(sorted(bd.items())),
        "share_of_busy": {k: v / busy for k, v in sorted(bd.items())} if busy > 0 else {},
        "prefill_step_s": pf_s,
        "reclaim_share_of_prefill": bd.get("reclaim", 0.0) / pf_s if pf_s > 0 else 0.0,
        "control_plane_s": bd.get("host", 0.0) + bd.get("reclaim", 0.0) + bd.get("runtime_plan", 0.0),
        "cost_model_source": costs[0].describe()["sources"],
        "cost_tables": costs[0].describe()["tables"],
        "n_cta": costs[0].n_cta,
        "engine": engine.to_dict(),
    })
    return s


# --------------------------------------------------------------------------- capacity


def meets_slo(summary: dict, slo: dict[str, float]) -> bool:
    """All SLO percentiles met, and no request lost to load (stalls); size rejections are load-free."""
    for k, v in slo.items():
        got = summary.get(f"{k}_s")
        if got is None or got > v:
            return False
    if any(not r.startswith(_LOAD_FREE) for r in summary.get("rejected_reasons", {})):
        return False
    return summary["completed"] > 0


def offered_rps(trace) -> float:
    """Requests per second the trace offers: all its turns over the span of its session arrivals."""
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    span = max(arr) - min(arr)
    if span <= 0:
        raise ConfigError("capacity search needs a trace whose sessions arrive over a time span > 0")
    return len(trace.turns) / span


def capacity_search(trace, spec: SimSpec, mode: str, slo: dict[str, float], *, iters: int = 7,
                    tol: float = 0.08, start: float = 1.0, progress=None) -> dict:
    """Highest arrival-rate scale meeting the SLO: bracket by doubling/halving from ``start``, then log-bisection.

    ``start`` is only a first guess (the CLI passes the saturation throughput over the offered load);
    the bracket search makes the result independent of it up to the bisection tolerance.
    """
    base = offered_rps(trace)
    probes: list[tuple[float, float | None, bool]] = []
    cache: dict[float, bool] = {}

    def ok(scale: float) -> bool:
        if scale in cache:
            return cache[scale]
        summ, _ = simulate(trace.scaled(scale), spec, mode, record_kv=False)
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

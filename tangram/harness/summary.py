"""One run's summary (``metrics.json`` per mode): latency, throughput, KV use and where the time went.

The same keys whether step durations were priced (simulator) or measured (engine); the executor says which
through its ``describe()``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tangram.config import EngineConfig
from tangram.metrics import latency_summary, time_weighted_mean
from tangram.plan import Executor

from .cluster import ClusterResult


def summarize(res: ClusterResult, engine: EngineConfig, executors: Sequence[Executor]) -> dict:
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
    about = executors[0].describe()
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
        "cost_model_source": about["sources"],
        "cost_tables": about["tables"],
        "n_cta": about["n_cta"],
        "engine": engine.to_dict(),
    })
    if sum(x.prefix_turns for x in st):  # shared prefixes (only when the trace declares any: keys unchanged else)
        s.update(prefix_metrics(st, res.records, pb))
    if res.stopped:  # an SLO monitor ended the replay: percentiles above cover only what finished by then
        ttft = [(r.first_token_s if r.first_token_s is not None else res.end_s) - r.arrival_s
                for r in res.records if r.arrival_s is not None]
        s["stopped_early"] = res.stopped
        s["stopped_at_s"] = res.end_s
        # TTFT p99 of every turn that had arrived, the waiting ones counted at their wait so far (a lower bound)
        s["ttft_p99_at_stop_s"] = float(np.percentile(ttft, 99)) if ttft else None
    return s


def prefix_metrics(stats, records, page_bytes: int) -> dict:
    """Prefix-cache keys of the run summary (tangram.prefix_cache), summed over replicas."""
    tot = {k: sum(getattr(x, k) for x in stats) for k in
           ("prefix_turns", "prefix_lookups", "prefix_hits", "prefix_hit_tokens", "prompt_tokens", "page_copies")}
    done = [r for r in records if r.status == "finished"]
    hit_req = sum(1 for r in done if r.cached_tokens > 0)
    shared = max(x.shared_pages_peak for x in stats)
    return {
        "prefix_turns": tot["prefix_turns"], "prefix_lookups": tot["prefix_lookups"],
        "prefix_hits": tot["prefix_hits"],
        # finished requests that reused a cached prefix / finished requests
        "prefix_hit_rate_requests": hit_req / len(done) if done else 0.0,
        # prompt tokens served from the cache / prompt tokens of every admission (vLLM's hits / queries)
        "prefix_hit_rate_tokens": tot["prefix_hit_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0,
        "prefix_tokens_saved": tot["prefix_hit_tokens"],
        "prefix_shared_pages_peak": shared, "prefix_shared_bytes_peak": shared * page_bytes,
        "prefix_saved_pages_peak": max(x.saved_pages_peak for x in stats),
        "prefix_cached_pages_peak": max(x.cached_pages_peak for x in stats),
        "prefix_page_copies": tot["page_copies"],
    }

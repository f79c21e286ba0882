"""The GPU executor reproduces shared prefixes: a turn that reuses another session's cached prefix pages gives the
logits and greedy tokens of the same turn prefilled from scratch (CPU, float64 reference kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_cases import reference_kernels, tiny_cfg, tiny_model  # noqa: F401 (reference_kernels: autouse fixture)
from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig
from tangram.engine.bench import leak_check
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.harness.cluster import Cluster
from tangram.traces.format import Trace, Turn


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(11)


CHAIN = (("sys", 21), ("doc", 26))  # 47 tokens; C = 16, P = 4


def trace(first_chain):
    """Session a (its chain ``first_chain``) long before session b (chain CHAIN); b is request 1 in every run."""
    return Trace([Turn("a:0", "a", 0, 0.0, 0.0, 60, 4, prefix=first_chain),
                  Turn("b:0", "b", 0, 1000.0, 0.0, 55, 5, prefix=CHAIN)])


def run(cfg, model, mode, first_chain, dynamic_keep="topk"):
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = EngineConfig(mode=mode, page_size=4, heads_per_group=2, rho=0.5, alpha=1.0, chunk_size=16,
                       max_batched_tokens=24, kv_pool_bytes=400_000)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    tr = trace(first_chain)
    exe = Executor(model, sched, TokenSource.from_trace(tr, cfg.vocab, seed=3),
                   ExecutorOptions(record_logits=True, dynamic_keep=dynamic_keep, cuda_graphs="off"))
    res = Cluster(tr, [(sched, exe)]).run()
    assert all(r.status == "finished" for r in res.records)
    leak = leak_check(sched)  # evicts the cached prefix units first: nobody holds them once every session ended
    assert leak["ok"]
    cached = leak["prefix_cache_pages"]
    logits = {pos: lg for rid, pos, lg in exe.logit_log if rid == 1}
    return sched, exe, res, logits, cached


@pytest.mark.parametrize("mode,keep", [("full", "topk"), ("uniform", "topk"), ("br", "topk"), ("br+rp", "topk"),
                                       ("tangram", "topk"), ("dynamic", "topk"), ("dynamic", "profile")])
def test_a_cache_hit_gives_the_logits_of_a_fresh_prefill(tiny, mode, keep):
    cfg, model = tiny
    # hit: a declared the same chain, so b reuses a's pages of it
    s1, e1, r1, hit, cached = run(cfg, model, mode, CHAIN, keep)
    # fresh: a's chain differs, so b computes everything itself (same token ids, same chunk cuts)
    s2, e2, r2, fresh, _ = run(cfg, model, mode, (("other", 47),), keep)
    want = 44 if mode == "full" else 47  # full: whole pages (floor(47 / 4) * 4); compressed: whole chunks
    assert r1.records[1].cached_tokens == want and r2.records[1].cached_tokens == 0
    assert cached > 0  # the chain's pages stayed cached after both sessions ended
    assert e1.streams["b"][:47] == e2.streams["b"][:47]
    # the chain's ids are a function of the chain: a's and b's streams agree on them in the hit run
    assert e1.streams["a"][:47] == e1.streams["b"][:47] and e2.streams["a"][:47] != e2.streams["b"][:47]
    if mode == "br":  # monolithic pages span heads of different budgets: partial pages are copied on a hit
        assert s1.stats.page_copies > 0
    assert sorted(hit) == sorted(fresh) and len(hit) == 5
    worst = max(float((hit[p] - fresh[p]).abs().max() / fresh[p].abs().max()) for p in hit)
    # float32 model, float64 reference attention: the hit run computes the same kept tokens from the same ids,
    # batched differently, so only fp32 roundoff separates the logits
    assert worst < 1e-4, worst
    assert e1.streams["b"] == e2.streams["b"]  # the same greedy tokens


def test_declared_ids_follow_the_chain_and_override_outputs():
    src = TokenSource(50, seed=1)
    src.declare(0, "a", (("sys", 5),))
    src.declare(1, "a", (("sys", 5), ("hist", 6)))  # a later turn: covers a's first answer too
    src.declare(2, "b", (("sys", 5), ("hist", 6)))
    a0 = src.turn_ids(0, 7)
    b0 = src.turn_ids(2, 12)
    np.testing.assert_array_equal(a0[:5], b0[:5])
    # a's output at position 7 and 8 lies in "hist": the stream records the declared ids, b's prompt has them
    assert src.output_id(0, 7, 999) == b0[7] and src.output_id(0, 8, 999) == b0[8]
    assert src.output_id(0, 11, 999) == 999  # past the chain: the sample
    np.testing.assert_array_equal(src.turn_ids(1, 3, start=9)[:2], b0[9:11])  # position 11: past the chain
    # a request without a chain keeps its seeded ids, whatever the start
    np.testing.assert_array_equal(src.turn_ids(7, 4), src.turn_ids(7, 4, start=100))


def test_page_copy_is_one_index_copy():
    from tangram.engine.kv_cache import KVCache
    from tangram.paging import KVLayout

    cfg = tiny_cfg()
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, seed=0)
    for mode in ("br", "tangram"):
        lay = KVLayout.build(cfg, EngineConfig(mode=mode, page_size=4, heads_per_group=2), prof.B)
        kv = KVCache(lay, 6, torch.float32, "cpu")
        kv.pool.copy_(torch.randn(kv.pool.shape))
        before = kv.pool.clone()
        kv.copy_pages(np.array([1, 4]), np.array([3, 0]))
        assert torch.equal(kv.pool[3], before[1]) and torch.equal(kv.pool[0], before[4])
        assert torch.equal(kv.pool[[1, 2, 4, 5]], before[[1, 2, 4, 5]])

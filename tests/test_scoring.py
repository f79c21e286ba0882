"""The scorer set (tangram.kernels.scoring) against float64 references and hand-computed cases, the budget-scope
selections, the observer path (tangram.profiles.scoring) and KVzip's reconstruction scoring."""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from tangram.budgets import METHODS, check_method_scope, layer_targets, pyramid_ratios
from tangram.config import get_model
from tangram.engine.model import AttnEvent, Session, TorchAttention, rope_inv_freq
from tangram.engine.weights import build_model, random_state_dict
from tangram.errors import ConfigError
from tangram.kernels import reference as R
from tangram.kernels.scoring import (ENGINE_METHODS, ScoreParams, chunk_scores, engine_chunk_scores,
                                     scope_keep_mask, scope_ranks)
from tangram.profiles import scoring as profile_scoring
from tangram.profiles.scoring import KVzipScorer, event_lse2, make_scorer, per_head_topk_mask

D = 16


def _seed() -> int:
    s = int.from_bytes(os.urandom(4), "little")
    print("seed", s)  # printed on failure: replay with torch.Generator().manual_seed(seed)
    return s


def _case(gen, c, Hq=4, H=2, n_cached=5, d=D):
    """Random chunk q/k/v and the base-2 LSE of each query over a random cached prefix plus the chunk (causal)."""
    q, k, v = (torch.randn(c, n, d, generator=gen) for n in (Hq, H, H))
    kc = torch.randn(n_cached, H, d, generator=gen)
    g, scale = Hq // H, 1 / math.sqrt(d)
    lse = torch.empty(Hq, c)
    for qh in range(Hq):
        for i in range(c):
            keys = torch.cat([kc[:, qh // g], k[: i + 1, qh // g]]).double()
            lse[qh, i] = float(torch.logsumexp(keys @ q[i, qh].double() * scale, 0)) / math.log(2)
    return q, k, v, lse


def _inv_freq(d=D, theta=10000.0):
    return rope_inv_freq(dataclasses.replace(get_model("llama-3.1-8b"), head_dim=d, rope_theta=theta, rope_scaling=None))


def assert_scores_close(got, ref, rtol=1e-5, atol=1e-9):
    got, ref = got.double(), ref.double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "always-kept (+inf) positions differ"
    fin = torch.isfinite(ref)
    assert torch.allclose(got[fin], ref[fin], rtol=rtol, atol=atol), (got - ref)[fin].abs().max()


# ------------------------------------------------------------------ float64 references


@pytest.mark.parametrize("c,window,kernel", [(23, 6, 3), (9, 32, 7), (2, 32, 7), (40, 8, 5)])
def test_snapkv_matches_float64_reference(c, window, kernel):
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, lse = _case(gen, c)
    got = chunk_scores("ada-snapkv", q, k, v, lse, pos0=5, params=ScoreParams(window=window, kernel=kernel))
    assert_scores_close(got, R.ref_snapkv_chunk(q, k, lse, window, kernel))
    # pyramidkv scores with SnapKV; only its layer schedule differs
    assert torch.equal(got, chunk_scores("pyramidkv", q, k, v, lse, pos0=5,
                                         params=ScoreParams(window=window, kernel=kernel)))


@pytest.mark.parametrize("c", [2, 17])
def test_tova_matches_float64_reference(c):
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, lse = _case(gen, c)
    assert_scores_close(chunk_scores("tova", q, k, v, lse, pos0=0), R.ref_tova_chunk(q, k, lse))


def test_keydiff_matches_float64_reference():
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, lse = _case(gen, 19)
    # fp32 cosines of unit vectors: absolute error up to a few fp32 ulps of 1 (values near 0 fail a relative bound)
    assert_scores_close(chunk_scores("keydiff", q, k, v, None, pos0=0), R.ref_keydiff_chunk(k), atol=1e-6)


@pytest.mark.parametrize("pos0,c", [(0, 13), (2, 13), (300, 9)])
def test_expected_attention_matches_float64_reference(pos0, c):
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, _ = _case(gen, c)
    inv = _inv_freq()
    p = ScoreParams(n_future=40, epsilon=0.01)
    got = chunk_scores("expected-attention", q, k, v, None, pos0=pos0, inv_freq=inv, params=p)
    ref = R.ref_expected_attention_chunk(q, k, v, pos0, inv, n_future=40, epsilon=0.01)
    assert_scores_close(got, ref, rtol=1e-5)


# ------------------------------------------------------------------ hand-computed cases


def test_streaming_llm_keeps_exactly_sinks_and_the_most_recent_tokens():
    c, H = 20, 3
    q, k, v = torch.zeros(c, H, D), torch.zeros(c, H, D), torch.zeros(c, H, D)
    s = chunk_scores("streaming-llm", q, k, v, None, pos0=0)
    keep = scope_keep_mask(s[None], 10 / 20, "uniform")[0]  # 10 per head: 4 sinks + the last 6
    want = torch.zeros(c, dtype=torch.bool)
    want[:4] = True
    want[-6:] = True
    assert all(torch.equal(keep[h], want) for h in range(H))
    # a later chunk has no sinks: its most recent tokens only
    later = chunk_scores("streaming-llm", q, k, v, None, pos0=100)
    assert torch.equal(scope_keep_mask(later[None], 0.25, "uniform")[0, 0], torch.arange(c) >= 15)


def test_keydiff_on_keys_with_a_known_mean_direction():
    # head 0: three keys along e0 and one along e1 -> mean unit key (3 e0 + e1) / 4; the e1 key is the outlier
    k = torch.zeros(4, 1, 4)
    k[0, 0, 0], k[1, 0, 0], k[2, 0, 0], k[3, 0, 1] = 1.0, 2.0, 5.0, 3.0
    s = chunk_scores("keydiff", torch.zeros(4, 1, 4), k, k, None, pos0=0)[0]
    a = torch.tensor([3.0, 1.0]) / math.sqrt(10)  # cos with e0 = 3/sqrt(10), with e1 = 1/sqrt(10)
    assert torch.allclose(s, torch.tensor([-a[0], -a[0], -a[0], -a[1]]), atol=1e-6)
    assert int(s.argmax()) == 3


def test_expected_attention_without_rotation_is_softmax_of_the_mean_query():
    # inv_freq = 0: RoPE is the identity; equal queries: covariance 0 -> logits = q.k / sqrt(d)
    c, d = 8, 4
    gen = torch.Generator().manual_seed(_seed())
    q = torch.randn(1, 1, d, generator=gen).expand(c, 1, d).contiguous()
    k, v = torch.randn(c, 1, d, generator=gen), torch.randn(c, 1, d, generator=gen)
    s = chunk_scores("expected-attention", q, k, v, None, pos0=10, inv_freq=torch.zeros(d // 2))[0]
    want = torch.softmax(k[:, 0] @ q[0, 0] / 2.0, 0) * v[:, 0].norm(dim=-1)
    assert torch.allclose(s, want, rtol=1e-5)
    # the first chunk's sink positions are kept and left out of the statistics and the softmax
    s0 = chunk_scores("expected-attention", q, k, v, None, pos0=0, inv_freq=torch.zeros(d // 2))[0]
    assert torch.isinf(s0[:4]).all()
    want = torch.softmax(k[4:, 0] @ q[0, 0] / 2.0, 0) * v[4:, 0].norm(dim=-1)
    assert torch.allclose(s0[4:], want, rtol=1e-5)


def test_snapkv_and_tova_keep_their_observation_queries():
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, lse = _case(gen, 30)
    s = chunk_scores("ada-snapkv", q, k, v, lse, pos0=0, params=ScoreParams(window=8))
    assert torch.isinf(s[:, -8:]).all() and torch.isfinite(s[:, :-8]).all()
    t = chunk_scores("tova", q, k, v, lse, pos0=0)
    assert torch.isinf(t[:, -1]).all() and torch.equal(t[0], t[1])  # head-uniform


# ------------------------------------------------------------------ the engine's dispatch


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_engine_dispatch_is_the_scorer_in_slot_order(method):
    """Under TRITON_INTERPRET=1 SnapKV/TOVA go through the Triton score kernel (the GPU path), the rest through
    torch; either way the engine's slot-order scores are the scorer's, permuted."""
    gen = torch.Generator().manual_seed(_seed())
    q, k, v, lse = _case(gen, 21, Hq=8, H=4)
    s2h = torch.randperm(4, generator=gen).to(torch.int32)
    p = ScoreParams(window=6, kernel=3, n_future=16)
    inv = _inv_freq()
    got = engine_chunk_scores(method, q, k, v, lse, s2h, pos0=7, inv_freq=inv, params=p)
    want = chunk_scores(method, q, k, v, lse, pos0=7, inv_freq=inv, params=p)[s2h.long()]
    assert_scores_close(got, want, rtol=1e-4, atol=1e-7)


def test_engine_rejects_kvzip():
    with pytest.raises(ConfigError, match="profiles only"):
        engine_chunk_scores("kvzip", *(torch.zeros(4, 2, D),) * 3, torch.zeros(2, 4), torch.arange(2), pos0=0)


# ------------------------------------------------------------------ budget scopes


def test_pyramid_schedule():
    for rho in (0.1, 0.25, 0.5, 0.75):
        r = pyramid_ratios(30, rho)
        assert r.mean() == pytest.approx(rho) and np.all(np.diff(r) < 0) and np.all((r > 0) & (r <= 1))
    r = pyramid_ratios(30, 0.25)
    assert r[-1] == pytest.approx(0.25 / 20) and r[0] == pytest.approx(0.5 - 0.25 / 20)
    r = pyramid_ratios(30, 0.75)  # 2 rho - rho/beta > 1: capped at 1, bottom at 2 rho - 1
    assert r[0] == pytest.approx(1.0) and r[-1] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="cross-layer"):
        check_method_scope("pyramidkv", "cross-layer")


def test_scope_masks():
    gen = torch.Generator().manual_seed(_seed())
    L, H, T, rho = 4, 3, 50, 0.3
    scale = torch.tensor([4.0, 1.0, 0.25, 2.0])[:, None, None]  # layers of very different score scale
    s = torch.rand(L, H, T, generator=gen) * scale
    per = scope_keep_mask(s, rho, "per-layer")
    assert per.sum(dim=(1, 2)).tolist() == [math.ceil(rho * H * T)] * L  # every layer keeps rho
    for l in range(L):  # one threshold within the layer
        assert s[l][per[l]].min() >= s[l][~per[l]].max()
    cross = scope_keep_mask(s, rho, "cross-layer")
    assert int(cross.sum()) == math.ceil(rho * L * H * T)  # the total keeps rho ...
    assert s[cross].min() >= s[~cross].max()  # ... with one threshold over everything ...
    means = cross.float().mean(dim=(1, 2))
    # ... so strong layers take the budget of weak ones (threshold ~1: layer 1's scores, uniform on [0, 1], may
    # reach it on some draws; layer 2's, at most 0.25, never: layers 0 and 3 alone hold > 180 scores above 0.25)
    assert means[0] > means[3] > rho > means[1] >= means[2] == 0.0
    uni = scope_keep_mask(s, rho, "uniform")
    assert (uni.sum(-1) == math.ceil(rho * T)).all()
    pyr = scope_keep_mask(s, rho, "per-layer", "pyramidkv")
    want = [math.ceil(x * H * T - 1e-9) for x in pyramid_ratios(L, rho)]
    assert pyr.sum(dim=(1, 2)).tolist() == want
    assert layer_targets("tova", "cross-layer", L, rho) is None


def test_memoised_ranks_give_each_shares_own_selection():
    """One ranks memo serves every share, scope and per-head budget of a scores tensor (the accuracy harness
    selects 30-odd modes a chunk from it): each mask keeps exactly its count of the highest scores, lower index
    first on ties, as a selection from scratch would."""
    gen = torch.Generator().manual_seed(_seed())
    L, H, T = 3, 2, 40
    s = torch.randint(0, 6, (L, H, T), generator=gen).float()  # many ties
    memo: dict = {}
    for rho in (0.75, 0.5, 0.25, 0.1):
        for scope, n in (("cross-layer", (L * H * T,)), ("per-layer", (L, H * T)), ("uniform", (L, H, T))):
            got = scope_keep_mask(s, rho, scope, ranks=memo)
            flat, gflat = s.reshape(n), got.reshape(n)
            k = math.ceil(rho * n[-1] - 1e-9)
            # the top k by (score desc, index asc), computed by sorting index-score pairs in Python
            want = torch.zeros_like(gflat)
            for row in np.ndindex(*n[:-1]):
                order = sorted(range(n[-1]), key=lambda i: (-float(flat[row][i]), i))[:k]
                want[row][order] = True
            assert torch.equal(gflat, want), (rho, scope)
    assert set(memo) == {"cross-layer", "per-layer", "uniform"}
    B = torch.rand(L, H, generator=gen).numpy()
    assert torch.equal(per_head_topk_mask(s, B, memo), per_head_topk_mask(s, B))
    assert scope_ranks(s, "uniform", memo) is memo["uniform"]


# ------------------------------------------------------------------ observers


def _tiny_model(seed):
    cfg = dataclasses.replace(get_model("llama-3.1-8b"), name="tiny", num_layers=2, hidden=64, intermediate=96,
                              vocab=211, head_dim=16, num_q_heads=8, num_kv_heads=4, rope_scaling=None)
    return cfg, build_model(cfg, random_state_dict(cfg, seed=seed))


def test_event_lse_is_the_attention_normaliser():
    gen = torch.Generator().manual_seed(_seed())
    T, N, Hq, H = 12, 30, 4, 2
    keep = torch.rand(1, H, N, generator=gen) < 0.7
    keep[..., N - T:] = True
    pos = torch.arange(N)
    ev = AttnEvent(0, torch.randn(1, Hq, T, D, generator=gen), torch.randn(1, H, N, D, generator=gen),
                   torch.randn(1, H, N, D, generator=gen), keep, pos, pos[N - T:], N - T, 1 / math.sqrt(D))
    lse = event_lse2(ev, 0, 5)
    assert torch.isinf(lse[:, :T - 5]).all()
    for qh in range(Hq):
        for i in range(T - 5, T):
            ok = keep[0, qh // 2] & (pos <= N - T + i)
            ref = torch.logsumexp((ev.k[0, qh // 2][ok].double() @ ev.q[0, qh, i].double()) / math.sqrt(D), 0)
            assert float(lse[qh, i]) == pytest.approx(float(ref) / math.log(2), rel=1e-5)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "kvzip"])
def test_scores_of_a_chunk_do_not_look_past_it(method):
    """A chunk's scores are the same whatever follows it (prefix reuse), and the second chunk is scored with the
    cache of the first."""
    cfg, model = _tiny_model(_seed())
    gen = torch.Generator().manual_seed(_seed())
    a, b1, b2 = (torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in (16, 16, 16))
    got = []
    for b in (b1, b2):
        sc = make_scorer(method, cfg.num_layers, 6)
        sess = Session(model, TorchAttention(cfg, observers=[sc]))
        sess.forward(a)
        first = sc.take()
        sess.forward(b)
        got.append((first, sc.take()))
    assert torch.equal(got[0][0], got[1][0])
    assert got[0][1].shape == (cfg.num_layers, 1, cfg.num_kv_heads, 16)


class _Tok:
    """A byte-level stand-in for the GGUF tokenizer (KVzip only needs encode and the chat template)."""

    def encode(self, text):
        return [b % 211 for b in text.encode()]

    def render_chat(self, messages, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user><assistant>"


@pytest.mark.parametrize("evict", [False, True])
@pytest.mark.parametrize("block", [None, 1, 2000])
def test_kvzip_reconstruction_scores_match_float64_reference(block, evict, monkeypatch):
    """``block``: KVzip's repeat-query blocks (elements), so one, several uneven and one-row blocks are checked.
    ``evict``: two sink tokens of one KV head are evicted before the second chunk (the repeat must not see them)."""
    if block is not None:
        monkeypatch.setattr(profile_scoring, "_SCORE_BLOCK", block)
    cfg, model = _tiny_model(_seed())
    gen = torch.Generator().manual_seed(_seed())
    tok = _Tok()
    chunks = [torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in (12, 10)]
    sc = make_scorer("kvzip", cfg.num_layers, tokenizer=tok)
    assert isinstance(sc, KVzipScorer) and sc.suffix == tok.encode("</user><assistant>")
    seen = []  # the repeat forward's queries and caches, recorded by a second observer
    rec = lambda ev: seen.append((ev.layer, ev.q.clone(), ev.k.clone(), ev.new_start))  # noqa: E731
    sess = Session(model, TorchAttention(cfg, observers=[sc, rec]))
    n0, out = 0, []
    gone = (1, 3)  # evicted from KV head 0 of every layer before the second chunk (evict=True)
    for i, ch in enumerate(chunks):
        if i == 1 and evict:
            for l in range(cfg.num_layers):
                km = torch.ones(1, cfg.num_kv_heads, n0, dtype=torch.bool)
                km[0, 0, list(gone)] = False
                sess.backend.evict(l, 0, km)
        sess.forward(ch)
        seen.clear()
        sc.after_chunk(sess, ch)
        assert sess.length == n0 + len(ch)  # the repeat's KV is dropped
        out.append(sc.take()[:, 0])
        prompt = sc.first_prompt if i == 0 else sc.next_prompt + chunks[0][-8:]
        R_ = len(prompt) + len(sc.suffix) + len(ch)
        g = cfg.num_q_heads // cfg.num_kv_heads
        for l, q, K, ns in seen:
            assert q.shape[2] == R_ and ns == n0 + len(ch)
            sink = min(4, n0)
            idx = list(range(sink)) + list(range(n0, n0 + len(ch))) + list(range(ns, ns + R_))
            ref = torch.zeros(cfg.num_kv_heads, len(ch), dtype=torch.float64)
            for qh in range(cfg.num_q_heads):
                out_ = gone if evict and i == 1 and qh // g == 0 else ()
                for r in range(R_):
                    cols = [c for c in idx[:sink + len(ch) + r + 1] if c not in out_]
                    s_kept = sum(1 for c in idx[:sink] if c not in out_)
                    keys = K[0, qh // g, cols].double()
                    p = torch.softmax(keys @ q[0, qh, r].double() / math.sqrt(cfg.head_dim), 0)
                    ref[qh // g] = torch.maximum(ref[qh // g], p[s_kept:s_kept + len(ch)])
            if n0 == 0:
                ref[:, :4] = math.inf  # sequence sinks
            assert_scores_close(out[-1][l], ref, rtol=1e-4, atol=1e-7)
        n0 += len(ch)


def test_make_scorer_errors():
    with pytest.raises(ConfigError, match="unknown scoring method"):
        make_scorer("h2o", 2)
    with pytest.raises(ConfigError, match="tokenizer"):
        make_scorer("kvzip", 2)
    assert make_scorer("ada-snapkv", 2, 9).params.window == 9

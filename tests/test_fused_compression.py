"""The one-launch SnapKV compression (score + kvpress finish + per-head top-k + copy) against float64 references
and against the engine's unfused launches; poisoned outputs; several token blocks per head (last-arriver)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_cases import batched_case
from tangram.kernels.compress import (prefill_attention_varlen, select_scatter, snapkv_compress,
                                      snapkv_scores_varlen)
from tangram.kernels.reference import is_topk_set, ref_prefill_attention, ref_scatter
from tangram.kernels.scoring import snapkv_finish_batched

P, D = 4, 16


def _case(seed, H=4, gq=2, Hp=2, cs=(30, 70, 12), cached=(0, 9, 30), dtype=torch.float32):
    return batched_case(torch.Generator().manual_seed(seed), P, D, H, gq, Hp, cs, cached, W=32, dtype=dtype)


def _finished_ref(probs, lens, s2h, window, gq, kernel):
    """kvpress's SnapKV finish in float64 [H, c] (slot order): mean window probability over the w * gq rows,
    average pooling (zero padded) over the tokens before the window, the window +inf."""
    rows = []
    for slot in range(len(s2h)):
        p = probs[int(s2h[slot])]
        n, c = int(lens[slot]), p.shape[1]
        w = min(window, c)
        s = p[:, c - w:, n:].sum(dim=(0, 1)) / (w * gq)
        s[c - w:] = 0.0
        s = F.avg_pool1d(s[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
        s[c - w:] = float("inf")
        rows.append(s)
    return torch.stack(rows)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_t,copy", [(16, "serial"), (64, "serial"), (16, "parallel"), (64, "parallel")])
def test_fused_compression_matches_float64_and_the_unfused_launches(seed, block_t, copy):
    cu, pool, tables, s2h, lens, q, k, v = _case(seed)
    kp, H = lens.shape
    gq, window, kernel = q.shape[1] // H, 8, 5
    h2s = torch.argsort(s2h.long()).to(torch.int32)
    cs = (cu[1:] - cu[:-1]).tolist()
    _, lse = prefill_attention_varlen(q, k, v, cu, max(cs), pool, tables, lens, h2s, page_size=P, heads_per_group=2)
    # every regime of a head: nothing, a few, all but one, all, more than the chunk
    counts = torch.tensor([[[0, 3, c - 1, c][s % 4] if i != 2 else [c + 5, 1, 0, 7][s] for s in range(H)]
                           for i, c in enumerate(cs)]).to(torch.int32)
    fused = pool.clone()
    kept = torch.full((kp, H), -7, dtype=torch.int32)
    snapkv_compress(q, k, v, lse, cu, max(cs), counts, fused, tables, lens, s2h, page_size=P, heads_per_group=2,
                    window=window, pool_kernel=kernel, kept=kept, block_t=block_t, block_c=block_t, copy=copy,
                    copy_block=block_t // 2)
    assert torch.equal(kept, torch.minimum(counts, torch.tensor(cs, dtype=torch.int32)[:, None]))
    # the engine's unfused launches give the same pages bit for bit
    raw = snapkv_scores_varlen(q, k, lse, cu, max(cs), h2s, window=window)
    fin = snapkv_finish_batched(raw, cu[1:] - cu[:-1], window, gq, kernel)
    unfused = pool.clone()
    select_scatter(fin, k, v, cu, max(cs), counts, unfused, tables, lens, s2h, page_size=P, heads_per_group=2,
                   pool_kernel=1)
    assert torch.equal(fused, unfused)
    # and the float64 truth: a top-k set of the finished scores, copied where the reference scatter puts it
    for i in range(kp):
        a, b = int(cu[i]), int(cu[i + 1])
        _, probs = ref_prefill_attention(q[a:b], k[a:b], v[a:b], pool, tables[i], lens[i], s2h, page_size=P,
                                         heads_per_group=2)
        s = _finished_ref(probs, lens[i], s2h, window, gq, kernel).numpy()
        keep = np.zeros((H, b - a), dtype=bool)
        for slot in range(H):
            n = int(kept[i, slot])
            keep[slot, np.sort(np.argsort(-s[slot], kind="stable")[:n])] = True
        assert is_topk_set(s, keep, kept[i].numpy())
        rp, _ = ref_scatter(pool, tables[i], lens[i], s2h, k[a:b], v[a:b], keep, page_size=P, heads_per_group=2)
        pages = tables[i].long().flatten()
        assert torch.equal(fused[pages], rp[pages])


@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_fused_compression_ties_and_counters_reset(copy):
    """Equal keys (q = 0: uniform probabilities) go to the earliest tokens across token blocks, and the arrival
    counters are back at zero after the launch, so a second launch selects the same."""
    from tangram.kernels import compress as cmp

    cu, pool, tables, s2h, lens, q, k, v = _case(3, cs=(50,), cached=(5,))
    q = torch.zeros_like(q)
    H = lens.shape[1]
    h2s = torch.argsort(s2h.long()).to(torch.int32)
    _, lse = prefill_attention_varlen(q, k, v, cu, 50, pool, tables, lens, h2s, page_size=P, heads_per_group=2)
    counts = torch.tensor([[45, 44, 20, 43]], dtype=torch.int32)
    outs = []
    for _ in range(2):
        p2 = pool.clone()
        snapkv_compress(q, k, v, lse, cu, 50, counts, p2, tables, lens, s2h, page_size=P, heads_per_group=2,
                        window=8, pool_kernel=1, block_t=16, block_c=32, copy=copy)
        outs.append(p2)
        assert int(cmp._counters(q.device, H).abs().sum()) == 0
    assert torch.equal(outs[0], outs[1])
    keep = np.zeros((H, 50), dtype=bool)
    keep[:, 42:] = True  # the window (+inf)
    for slot in range(H):
        keep[slot, :int(counts[0, slot]) - 8] = True  # then the earliest of the equal scores
    rp, _ = ref_scatter(pool, tables[0], lens[0], s2h, k, v, keep, page_size=P, heads_per_group=2)
    pages = tables[0].long().flatten()
    assert torch.equal(outs[0][pages], rp[pages])


def test_a_score_row_narrower_than_the_chunk_is_refused():
    """The selection's block holds a whole chunk's scores: a width below the longest chunk would read and write
    past it (an illegal address on the GPU), so both entry points refuse it."""
    cu, pool, tables, s2h, lens, q, k, v = _case(5, cs=(70,), cached=(0,))
    h2s = torch.argsort(s2h.long()).to(torch.int32)
    _, lse = prefill_attention_varlen(q, k, v, cu, 70, pool, tables, lens, h2s, page_size=P, heads_per_group=2)
    counts = torch.full((1, lens.shape[1]), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="narrower than the longest chunk"):
        snapkv_compress(q, k, v, lse, cu, 70, counts, pool.clone(), tables, lens, s2h, page_size=P,
                        heads_per_group=2, window=8, pool_kernel=1, width=64)
    with pytest.raises(ValueError, match="narrower than the longest chunk"):
        snapkv_scores_varlen(q, k, lse, cu, 70, h2s, window=8, width=64)


@pytest.mark.parametrize("shared_pool", [True, False])
def test_every_layer_in_one_launch_equals_the_layer_by_layer_launches(shared_pool):
    """snapkv_compress_layers (the engine's deferred compression of a step: every layer's chunks in one launch)
    writes the same pages and kept counts as one snapkv_compress per layer, bit for bit. Both layer layouts: the
    ragged one (one pool, per-layer tables; pool layer stride 0) and the uniform one (a pool per layer, one
    table for every layer; table layer stride 0)."""
    from tangram.kernels.compress import snapkv_compress_layers

    g = torch.Generator().manual_seed(11)
    L, H, gq, Hp, cs, cached = 3, 4, 2, 2, (30, 70, 12), (0, 9, 30)
    kp, N, G, W = len(cs), sum(cs), H // Hp, 32
    cu = torch.tensor(np.concatenate([[0], np.cumsum(cs)]), dtype=torch.int32)
    qkv = torch.randn(L, N, (H * gq + 2 * H) * D, generator=g)
    q = qkv[..., :H * gq * D].view(L, N, H * gq, D)
    k = qkv[..., H * gq * D:(H * gq + H) * D].view(L, N, H, D)
    v = qkv[..., (H * gq + H) * D:].view(L, N, H, D)
    s2h = torch.stack([torch.randperm(H, generator=g) for _ in range(L)]).to(torch.int32)
    lens = torch.tensor([[[max(0, c - 2 * s - l) for s in range(H)] for l in range(L)] for c in cached],
                        dtype=torch.int32)  # [kp, L, H]
    counts = torch.stack([torch.randint(0, c + 3, (L, H), generator=g) for c in cs]).to(torch.int32)
    if shared_pool:
        pool = torch.randn(kp * L * G * W + 4, 2, Hp, P, D, generator=g)
        tables = torch.randperm(pool.shape[0], generator=g)[:kp * L * G * W].view(kp, L, G, W).to(torch.int32)
        stacked = lambda p: p.expand(L, *p.shape)  # noqa: E731 (every layer's view is the one pool)
        layer_pool = lambda p, l: p  # noqa: E731
    else:
        pool = torch.randn(kp * G * W + 4, L, 2, Hp, P, D, generator=g)
        tables = torch.randperm(pool.shape[0], generator=g)[:kp * G * W].view(kp, 1, G, W).to(torch.int32)
        tables = tables.expand(kp, L, G, W)
        stacked = lambda p: p.permute(1, 0, 2, 3, 4, 5)  # noqa: E731
        layer_pool = lambda p, l: p[:, l]  # noqa: E731
    lse = torch.empty(L, H * gq, N)
    for l in range(L):
        _, lse[l] = prefill_attention_varlen(q[l], k[l], v[l], cu, max(cs), layer_pool(pool, l), tables[:, l],
                                             lens[:, l], torch.argsort(s2h[l].long()).to(torch.int32), page_size=P,
                                             heads_per_group=Hp)
    kw = dict(page_size=P, heads_per_group=Hp, window=8, pool_kernel=5, block_t=16, block_c=16, copy_block=8)
    one = pool.clone()
    kept1 = torch.full((kp, L, H), -7, dtype=torch.int32)
    snapkv_compress_layers(q, k, v, lse, cu, max(cs), counts, stacked(one), tables, lens, s2h, kept=kept1, **kw)
    each = pool.clone()
    kept2 = torch.full((kp, L, H), -7, dtype=torch.int32)
    for l in range(L):
        kl = torch.empty((kp, H), dtype=torch.int32)
        snapkv_compress(q[l], k[l], v[l], lse[l], cu, max(cs), counts[:, l].contiguous(), layer_pool(each, l),
                        tables[:, l], lens[:, l].contiguous(), s2h[l], kept=kl, **kw)
        kept2[:, l] = kl
    assert torch.equal(kept1, kept2)
    assert torch.equal(kept1, torch.minimum(counts, torch.tensor(cs, dtype=torch.int32)[:, None, None]))
    assert torch.equal(one, each)
    assert not torch.equal(one, pool)  # something was written

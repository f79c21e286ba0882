"""CPU tests of tangram.kernels under the Triton interpreter, against float64 references (tiny shapes)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.budgets import head_groups, synthetic_profile
from tangram.errors import ConfigError
from tangram.engine.split_table import AotSplitTable
from tangram.planner import pow2_bucket
from tangram.kernels import (
    DeviceLimits, KernelResources, decode_n_cta, keep_budget, monolithic_layer_view,
    occupancy_blocks_per_sm, paged_decode, prefill_compress, runtime_plan_decode, runtime_plan_schedules,
    static_split_decode,
)
from kernel_cases import batched_case
from tangram.kernels.reference import (
    is_topk_set, ref_paged_decode, ref_prefill_attention, ref_scatter, ref_snapkv_scores, ref_topk_keep,
)

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
P = 4  # page size
D = 16  # head dim (tl.dot needs >= 16)
EDGE_LENS = [0, 1, P - 1, P, P + 1]


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def _ragged(B, H, Hp, lens, dtype, gen):
    """A fresh random ragged pool whose pages are scattered at random over a larger pool."""
    G = H // Hp
    max_pages = max(1, -(-int(lens.max()) // P)) + 1
    npages = B * G * max_pages + 5
    pool = torch.randn(npages, 2, Hp, P, D, generator=gen).to(dtype)
    bt = torch.randperm(npages, generator=gen)[: B * G * max_pages].view(B, G, max_pages).to(torch.int32)
    return pool, bt


def _lens(B, H, gen, extra=()):
    vals = np.array(EDGE_LENS + list(extra))
    return torch.from_numpy(vals[torch.randint(len(vals), (B, H), generator=gen).numpy()].astype(np.int32))


def _all_variants(q, pool, bt, lens, s2h, Hp, split_row):
    """Outputs of the three decode variants, each into a NaN-poisoned buffer."""
    outs = {}
    o = torch.full_like(q, float("nan"))
    outs["aot"] = paged_decode(q, pool, bt, lens, s2h, split_row, page_size=P, heads_per_group=Hp, out=o)
    o = torch.full_like(q, float("nan"))
    outs["static"] = static_split_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp,
                                         max_len=int(lens.max()), num_sms=2, out=o)
    sched = runtime_plan_schedules(lens.numpy()[:, None, :], n_cta=6)[0]
    o = torch.full_like(q, float("nan"))
    outs["runtime"] = runtime_plan_decode(q, pool, bt, lens, s2h, sched, page_size=P, heads_per_group=Hp, out=o)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hp", [1, 2, 4])
def test_decode_ragged_matches_reference(dtype, Hp):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, H, gq = 2, 4, 2
    lens = _lens(B, H, gen, extra=[11, 23])
    lens[0, 0], lens[1, 1] = 0, P + 1  # an empty head and a page-crossing one, always
    pool, bt = _ragged(B, H, Hp, lens, dtype, gen)
    s2h = torch.randperm(H, generator=gen).to(torch.int32)
    q = torch.randn(B, H * gq, D, generator=gen).to(dtype)
    ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
    split_row = torch.randint(1, 4, (H // Hp,), generator=gen).numpy()
    for name, o in _all_variants(q, pool, bt, lens, s2h, Hp, split_row).items():
        assert torch.isfinite(o).all(), f"{name}: output not fully written"
        assert rel(o, ref) < TOL[dtype], f"{name}: rel err {rel(o, ref)}"
        # an empty head must give exactly zero, not NaN
        h0 = int(s2h[0])
        assert torch.all(o[0, h0 * gq:(h0 + 1) * gq] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_monolithic_layer_view(dtype):
    """One kernel serves the monolithic pool [pages, L, 2, H, P, d] through strides (G = 1, H_p = H)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, L, H, gq = 2, 3, 4, 3
    lens = _lens(B, H, gen, extra=[9, 14])
    max_pages = -(-int(lens.max()) // P) + 1
    npages = B * max_pages + 3
    pool6 = torch.randn(npages, L, 2, H, P, D, generator=gen).to(dtype)
    bt2 = torch.randperm(npages, generator=gen)[: B * max_pages].view(B, max_pages).to(torch.int32)
    ident = torch.arange(H, dtype=torch.int32)
    q = torch.randn(B, H * gq, D, generator=gen).to(dtype)
    for layer in (0, L - 1):
        pool, bt = monolithic_layer_view(pool6, bt2, layer)
        assert not pool.is_contiguous()
        ref = ref_paged_decode(q, pool, bt, lens, ident, page_size=P, heads_per_group=H)
        for name, o in _all_variants(q, pool, bt, lens, ident, H, np.array([2])).items():
            assert torch.isfinite(o).all(), name
            assert rel(o, ref) < TOL[dtype], f"{name} layer {layer}: {rel(o, ref)}"


def _split_case(B, Hp, seed, maxlen):
    """A float32 decode case of 4 KV heads x 2 query heads each, random lengths up to ``maxlen``, and its float64
    reference: (generator, H, q, pool, block table, lengths, slot_to_head, reference output)."""
    gen = torch.Generator().manual_seed(seed)
    H, gq = 4, 2
    lens = torch.randint(0, maxlen + 1, (B, H), generator=gen).to(torch.int32)
    pool, bt = _ragged(B, H, Hp, lens, torch.float32, gen)
    s2h = torch.randperm(H, generator=gen).to(torch.int32)
    q = torch.randn(B, H * gq, D, generator=gen)
    ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
    return gen, H, q, pool, bt, lens, s2h, ref


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 3), Hp=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1),
       splits=st.lists(st.integers(1, 5), min_size=4, max_size=4), maxlen=st.integers(0, 30))
def test_decode_any_split_map_is_exact(B, Hp, seed, splits, maxlen):
    """Any split map (and any runtime-plan N_CTA) computes the same function: splitting never changes the result."""
    gen, H, q, pool, bt, lens, s2h, ref = _split_case(B, Hp, seed, maxlen)
    o = torch.full_like(q, float("nan"))
    paged_decode(q, pool, bt, lens, s2h, np.array(splits[: H // Hp]), page_size=P, heads_per_group=Hp, out=o)
    assert torch.isfinite(o).all()
    assert float((o.double() - ref).abs().max()) < 1e-4
    sched = runtime_plan_schedules(lens.numpy()[:, None, :], n_cta=int(splits[0]) * 3)[0]
    o2 = torch.full_like(q, float("nan"))
    runtime_plan_decode(q, pool, bt, lens, s2h, sched, page_size=P, heads_per_group=Hp, out=o2)
    assert float((o2.double() - ref).abs().max()) < 1e-4


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), Hp=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1),
       splits=st.lists(st.integers(1, 4), min_size=4, max_size=4), maxlen=st.integers(0, 30))
def test_decode_longest_first_order_is_the_same_function(B, Hp, seed, splits, maxlen):
    """Items launched longest first in an item-major grid (LPT order) compute exactly what the request-major
    launch computes: every (request, slot, split) is still one program, with or without a merge."""
    from tangram.kernels.decode import launch_decode, schedule_from_split_map

    gen, H, q, pool, bt, lens, s2h, ref = _split_case(B, Hp, seed, maxlen)
    w = torch.rand(H, generator=gen).numpy()
    sched = schedule_from_split_map(np.array(splits[: H // Hp]), Hp, lpt_weights=w)
    assert sched.item_major
    items = sched.items.numpy()
    piece = w[items[:, 0]] / sched.nsplit.numpy()[items[:, 0]]
    assert np.all(np.diff(piece) <= 0), "items not longest first"
    o = torch.full_like(q, float("nan"))
    launch_decode(q, pool, bt, lens, s2h, sched, page_size=P, heads_per_group=Hp, out=o)
    assert torch.isfinite(o).all()
    assert float((o.double() - ref).abs().max()) < 1e-4
    with pytest.raises(ConfigError, match="slot weights"):
        schedule_from_split_map(np.array(splits[: H // Hp]), Hp, lpt_weights=w[:-1])


@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 3), Hp=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1),
       splits=st.lists(st.integers(1, 3), min_size=4, max_size=4), maxlen=st.integers(0, 30),
       sms=st.integers(1, 6), occ=st.integers(1, 12))
def test_decode_paired_order_is_the_same_function(B, Hp, seed, splits, maxlen, sms, occ):
    """The SM-balanced varlen list (every (slot, split, request) once: the first wave's heaviest num_sms pieces,
    then that wave's rest lightest first, then the later waves longest first) computes what the request-major
    launch computes, through the interpreted kernel, against the float64 reference."""
    from tangram.kernels.decode import launch_decode, paired_schedule

    gen, H, q, pool, bt, lens, s2h, ref = _split_case(B, Hp, seed, maxlen)
    w = torch.rand(H, generator=gen).numpy()
    row = np.array(splits[: H // Hp])
    sched = paired_schedule(row, Hp, B, w, sms, occ)
    items = sched.items.numpy()
    ns = np.repeat(row, Hp)
    assert not sched.per_request and len(items) == B * int(ns.sum())
    assert len({tuple(x) for x in items}) == len(items)  # every (slot, split, request) exactly once
    piece = (w / ns)[items[:, 0]]
    m, k = min(occ, len(items)), min(sms, occ, len(items))
    assert np.all(np.diff(piece[:k]) <= 0) and np.all(np.diff(piece[k:m]) >= 0) and np.all(np.diff(piece[m:]) <= 0)
    assert len(items) <= k or piece[:k].min() >= piece[k:].max()  # the heaviest pieces lead
    o = torch.full_like(q, float("nan"))
    launch_decode(q, pool, bt, lens, s2h, sched, page_size=P, heads_per_group=Hp, out=o)
    assert torch.isfinite(o).all()
    assert float((o.double() - ref).abs().max()) < 1e-4


def test_decode_many_splits_merge_in_blocks():
    """More splits than one merge block (16), most of them empty: the merge must still be exact."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, H, Hp = 2, 4, 2
    lens = torch.randint(0, 60, (B, H), generator=gen).to(torch.int32)
    lens[0, 0] = 0
    pool, bt = _ragged(B, H, Hp, lens, torch.float32, gen)
    s2h = torch.randperm(H, generator=gen).to(torch.int32)
    q = torch.randn(B, 3 * H, D, generator=gen)
    ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
    o = torch.full_like(q, float("nan"))
    paged_decode(q, pool, bt, lens, s2h, [37, 5], page_size=P, heads_per_group=Hp, out=o)
    assert torch.isfinite(o).all() and rel(o, ref) < 1e-3


def test_group_size_must_divide_heads():
    gen = torch.Generator().manual_seed(1)
    B, H = 1, 4
    lens = torch.full((B, H), 3, dtype=torch.int32)
    pool = torch.randn(8, 2, 3, P, D)
    bt = torch.zeros(B, 1, 2, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=gen)
    with pytest.raises(ConfigError, match="H_p=3 must divide"):
        paged_decode(q, pool, bt, lens, torch.arange(H, dtype=torch.int32), [1], page_size=P, heads_per_group=3)
    with pytest.raises(ConfigError, match="must divide"):
        AotSplitTable(np.full((2, H), 0.5), np.tile(np.arange(H), (2, 1)), 3, n_occ=100)
    with pytest.raises(ConfigError, match="must divide"):
        prefill_compress(torch.randn(4, H, D), torch.randn(4, H, D), torch.randn(4, H, D), pool,
                         torch.zeros(1, 2, dtype=torch.int32), torch.zeros(H, dtype=torch.int32),
                         torch.arange(H, dtype=torch.int32), page_size=P, heads_per_group=3, keep_counts=[1] * H)


def test_aot_table_is_a_lookup_and_balances():
    prof = synthetic_profile(4, 8, 0.25, seed=int.from_bytes(os.urandom(2), "little"))
    B = prof.B
    perm = head_groups(B, 2)
    table = AotSplitTable(B, perm, 2, n_occ=528, max_batch=64, min_split_tokens=256)
    assert table.batch_buckets == [1, 2, 4, 8, 16, 32, 64]
    assert table.ctx_buckets[0] == 1024 and table.ctx_buckets[-1] == 131072
    s1 = table.lookup(3, 5, 100000)
    assert s1 is table.lookup(3, 8, 131072)  # same buckets, same precomputed object: no work per step
    S = table.split_maps[(8, 131072)][3]
    assert s1.n_items == int(S.sum()) * 2 and s1.max_splits == int(S.max())
    # groups with more budget get at least as many splits (clustered groups are sorted by budget)
    phi = np.take_along_axis(B, perm, 1).reshape(4, 4, 2).sum(2)
    order = np.argsort(phi[3], kind="stable")
    for key, Sm in table.split_maps.items():
        assert np.all(np.diff(Sm[3][order]) >= 0), key
    # short contexts are not over-split: no split below min_split_tokens of the group's longest head
    gmax = np.take_along_axis(B, perm, 1).reshape(4, 4, 2).max(2)
    for (b, c), Sm in table.split_maps.items():
        assert np.all((Sm == 1) | (Sm <= np.ceil(gmax * c) / 256)), (b, c)
    assert table.lookup(0, 1, 1000).max_splits <= 4
    assert pow2_bucket(1) == 1 and pow2_bucket(5) == 8 and pow2_bucket(64) == 64


def test_aot_table_longest_first_order_keeps_the_maps():
    """order="lpt": the same split maps and items per layer, listed by a piece's budget (slot budget / splits),
    longest first, in item-major schedules; an unknown order is refused."""
    prof = synthetic_profile(4, 8, 0.25, seed=int.from_bytes(os.urandom(2), "little"))
    perm = head_groups(prof.B, 2)
    req = AotSplitTable(prof.B, perm, 2, n_occ=528, max_batch=64, min_split_tokens=256)
    lpt = AotSplitTable(prof.B, perm, 2, n_occ=528, max_batch=64, min_split_tokens=256, order="lpt")
    Bs = np.take_along_axis(prof.B, perm, 1)
    for key, S in req.split_maps.items():
        assert np.array_equal(lpt.split_maps[key], S)
    for b, c, l in ((1, 1024, 0), (8, 131072, 3), (64, 32768, 2)):
        a, z = req.lookup(l, b, c), lpt.lookup(l, b, c)
        assert not a.item_major and z.item_major
        ia, iz = a.items.numpy(), z.items.numpy()
        assert sorted(map(tuple, ia)) == sorted(map(tuple, iz))  # the same (slot, split) items
        piece = Bs[l][iz[:, 0]] / z.nsplit.numpy()[iz[:, 0]]
        assert np.all(np.diff(piece) <= 0)
    with pytest.raises(ConfigError, match="launch order"):
        AotSplitTable(prof.B, perm, 2, n_occ=528, max_batch=4, order="longest")
    # "paired": a launch of exactly a bucket's rows takes the SM-balanced varlen list, any other batch the lpt one
    pr = AotSplitTable(prof.B, perm, 2, n_occ=528, max_batch=64, min_split_tokens=256, order="paired", num_sms=132)
    full, part = pr.lookup(2, 64, 32768), pr.lookup(2, 40, 32768)
    assert not full.per_request and full.n_items == 64 * lpt.lookup(2, 64, 32768).n_items
    assert part.item_major and torch.equal(part.items, lpt.lookup(2, 40, 32768).items)
    assert pr.step(64, 32768)[2] is full and pr.step(40, 32768)[2] is part
    with pytest.raises(ConfigError, match="num_sms"):
        AotSplitTable(prof.B, perm, 2, n_occ=528, max_batch=4, order="paired")


def test_occupancy_formula():
    lim = DeviceLimits(num_sms=132)
    # 128 regs x 128 threads = 16K regs/CTA -> 4 CTAs by registers; 32 KiB smem -> 6; threads -> 16
    assert occupancy_blocks_per_sm(KernelResources(128, 32 * 1024, 4), lim) == 4
    # shared memory bound: 100 KiB -> 2
    assert occupancy_blocks_per_sm(KernelResources(64, 100 * 1024, 4), lim) == 2
    # register granularity: 65 regs round up to 72/thread per warp allocation (2304 -> 2304) -> 28 warps -> 3 CTAs of 8
    assert occupancy_blocks_per_sm(KernelResources(65, 0, 8), lim) == 3
    assert decode_n_cta(KernelResources(128, 32 * 1024, 4), lim) == 4 * 132


def test_decode_n_cta_from_calibration(tmp_path):
    meta = {"sm_count": 132, "decode_kernel": {"n_regs": 96, "shared_bytes": 49152, "num_warps": 4}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    n = decode_n_cta(calibration=str(tmp_path))
    assert n == occupancy_blocks_per_sm(KernelResources(96, 49152, 4), DeviceLimits(num_sms=132)) * 132


def _prefill_case(gen, dtype, Hp, cached, c, H=4, gq=2):
    G = H // Hp
    lens = torch.tensor(cached, dtype=torch.int32)
    max_pages = -(-(int(lens.max()) + c) // P) + 1
    npages = G * max_pages + 4
    pool = torch.randn(npages, 2, Hp, P, D, generator=gen).to(dtype)
    bt = torch.randperm(npages, generator=gen)[: G * max_pages].view(G, max_pages).to(torch.int32)
    s2h = torch.randperm(H, generator=gen).to(torch.int32)
    q = torch.randn(c, H * gq, D, generator=gen).to(dtype)
    kn = torch.randn(c, H, D, generator=gen).to(dtype)
    vn = torch.randn(c, H, D, generator=gen).to(dtype)
    return q, kn, vn, pool, bt, lens, s2h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["tangram", "uniform", "dynamic"])
def test_prefill_compress_matches_reference(dtype, mode):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    Hp, c, H = 2, 19, 4
    cached = [0, P - 1, P, P + 1]
    q, kn, vn, pool, bt, lens, s2h = _prefill_case(gen, dtype, Hp, cached, c)
    ratios = torch.rand(H, generator=gen).numpy() * 0.9 + 0.05
    counts, gkeep = keep_budget(mode, c, H, ratios=ratios, rho=0.3)
    ro, probs = ref_prefill_attention(q, kn, vn, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
    rs = ref_snapkv_scores(probs, lens, s2h, window=8)
    pool2, lens2 = pool.clone(), lens.clone()
    res = prefill_compress(q, kn, vn, pool2, bt, lens2, s2h, page_size=P, heads_per_group=Hp, keep_counts=counts,
                           global_keep=gkeep, window=8)
    assert torch.isfinite(res.out).all()
    assert rel(res.out, ro) < TOL[dtype]
    assert rel(res.scores, rs) < TOL[dtype]
    s = res.scores.double().numpy()
    keep = res.keep.numpy()
    # kept sets are exactly the reference top-k of the same scores
    assert np.array_equal(keep, ref_topk_keep(s, counts, gkeep))
    got = res.counts.numpy()
    if gkeep is None:
        assert np.array_equal(got, np.minimum(counts, c))
        assert is_topk_set(s, keep, got)
    else:
        assert got.sum() == gkeep
    # scatter: the pool gets exactly the kept K/V after each head's length; nothing else moves
    rpool, rlens = ref_scatter(pool, bt, lens, s2h, kn, vn, keep, page_size=P, heads_per_group=Hp)
    assert torch.equal(lens2, rlens)
    assert torch.equal(pool2, rpool)


def test_prefill_chunk_of_one_token_and_window_larger_than_chunk():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, kn, vn, pool, bt, lens, s2h = _prefill_case(gen, torch.float32, 1, [2, 0, 5, 1], 1)
    ro, probs = ref_prefill_attention(q, kn, vn, pool, bt, lens, s2h, page_size=P, heads_per_group=1)
    res = prefill_compress(q, kn, vn, pool, bt, lens, s2h, page_size=P, heads_per_group=1, keep_counts=[1, 0, 1, 1],
                           window=32)
    assert rel(res.out, ro) < 1e-3
    assert lens.tolist() == [3, 0, 6, 2]


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors take the float64 reference path (the engine's CPU mode)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, H, Hp = 2, 4, 2
    lens = _lens(B, H, gen)
    pool, bt = _ragged(B, H, Hp, lens, torch.float32, gen)
    s2h = torch.randperm(H, generator=gen).to(torch.int32)
    q = torch.randn(B, 2 * H, D, generator=gen)
    o = paged_decode(q, pool, bt, lens, s2h, [1, 2], page_size=P, heads_per_group=Hp)
    assert rel(o, ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)) < 1e-6
    q, kn, vn, pool, bt, lens, s2h = _prefill_case(gen, torch.float32, 2, [1, 0, 4, 6], 9)
    pool2, lens2 = pool.clone(), lens.clone()
    res = prefill_compress(q, kn, vn, pool2, bt, lens2, s2h, page_size=P, heads_per_group=2, keep_counts=[2, 3, 0, 9],
                           window=4)
    rpool, rlens = ref_scatter(pool, bt, lens, s2h, kn, vn, res.keep.numpy(), page_size=P, heads_per_group=2)
    assert torch.equal(pool2, rpool) and torch.equal(lens2, rlens)


# ----------------------------------------------------------------------------- fused layer-loop kernels


def _seed():
    return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_activation_and_rope_match_the_torch_code(dtype):
    """One launch each, the torch code's roundings: fp32 to rounding order, bf16 within one bf16 ulp (the
    interpreter truncates fp32 -> bf16 where the GPU rounds to nearest)."""
    from tangram.kernels.fused import _torch_rms_norm, _torch_rope, add_rms_norm, rms_norm, rope_qkv, silu_mul

    g = torch.Generator().manual_seed(_seed())
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    x, r = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    ref = _torch_rms_norm(x.double(), w.double(), 1e-5)
    assert rel(rms_norm(x, w, 1e-5), ref) < tol * 4
    s, y = add_rms_norm(x, r, w, 1e-5)
    assert rel(s, x.double() + r.double()) < tol * 4
    assert rel(y, _torch_rms_norm(s.double(), w.double(), 1e-5)) < tol * 4
    gu = torch.randn(3, 80, generator=g).to(dtype)
    assert rel(silu_mul(gu), torch.nn.functional.silu(gu[:, :40].double()) * gu[:, 40:].double()) < tol * 4
    N, Hq, H, d = 4, 4, 2, 16
    qkv = torch.randn(N, (Hq + 2 * H) * d, generator=g).to(dtype)
    f = torch.arange(N).double()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).double() / d))[None]
    cos, sin = torch.cat([f, f], -1).cos().to(dtype), torch.cat([f, f], -1).sin().to(dtype)
    ref = qkv.double().clone()
    q, k, v = rope_qkv(qkv, cos, sin, num_q_heads=Hq, num_kv_heads=H, head_dim=d)
    rq = _torch_rope(ref[:, :Hq * d].view(N, Hq, d), cos.double()[:, None], sin.double()[:, None])
    rk = _torch_rope(ref[:, Hq * d:(Hq + H) * d].view(N, H, d), cos.double()[:, None], sin.double()[:, None])
    assert rel(q, rq) < tol * 4 and rel(k, rk) < tol * 4
    assert torch.equal(v.double(), ref[:, (Hq + H) * d:].view(N, H, d))


@pytest.mark.parametrize("Hp", [1, 2, 4])
def test_rope_kv_write_puts_each_head_at_its_own_position(Hp):
    """Decode rows' K (rotated) and V land in slot head_to_slot[h] at head_lens - 1 through the row's table;
    prefill rows (past n_decode) write nothing; every other slot keeps its NaN poison."""
    from tangram.kernels.fused import _torch_kv_write, rope_qkv

    g = torch.Generator().manual_seed(_seed())
    B, Hq, H, d = 3, 8, 4, 16
    G = H // Hp
    pool = torch.full((B * G * 3 + 2, 2, Hp, P, d), float("nan"))
    tables = torch.randperm(pool.shape[0], generator=g)[:B * G * 3].view(B, G, 3).to(torch.int32)
    lens = torch.randint(1, 3 * P + 1, (B, H), generator=g).to(torch.int32)
    h2s = torch.randperm(H, generator=g).to(torch.int32)
    qkv = torch.randn(B + 2, (Hq + 2 * H) * d, generator=g)
    cos, sin = torch.randn(B + 2, d, generator=g), torch.randn(B + 2, d, generator=g)
    q, k, v = rope_qkv(qkv, cos, sin, num_q_heads=Hq, num_kv_heads=H, head_dim=d, kv_pool=pool, block_table=tables,
                       head_lens=lens, head_to_slot=h2s, page_size=P, heads_per_group=Hp, n_decode=B)
    ref = torch.full_like(pool, float("nan"))
    _torch_kv_write(ref, tables, lens, h2s, k[:B], v[:B], P, Hp)
    assert torch.equal(torch.isnan(pool), torch.isnan(ref))
    assert int((~torch.isnan(pool)).sum()) == B * H * 2 * d  # exactly one token per (row, head), K and V
    m = ~torch.isnan(ref)
    assert torch.equal(pool[m], ref[m])


def _batched_case(g, H=4, gq=2, Hp=2, cs=(5, 37, 20), cached=(0, 9, 30), dtype=torch.float32):
    return batched_case(g, P, D, H, gq, Hp, cs, cached, W=24, dtype=dtype)


@pytest.mark.parametrize("kind", ["per_head", "global", "full"])
def test_batched_compression_matches_the_float64_references(kind):
    """Every chunk of a step at once: chunk attention and SnapKV scores against the float64 references, the kept
    set a top-k of the scores with exactly the counts asked for, the pool equal to the reference scatter."""
    from tangram.kernels.compress import (global_keep_counts, pool_scores, prefill_attention_varlen, select_scatter,
                                          snapkv_scores_varlen)

    g = torch.Generator().manual_seed(_seed())
    cu, pool, tables, s2h, lens, q, k, v = _batched_case(g)
    H, kp = lens.shape[1], lens.shape[0]
    h2s = torch.argsort(s2h.long()).to(torch.int32)
    cs = (cu[1:] - cu[:-1]).tolist()
    out = torch.full(q.shape, float("nan"))
    out, lse = prefill_attention_varlen(q, k, v, cu, max(cs), pool, tables, lens, h2s, page_size=P,
                                        heads_per_group=2, out=out)
    raw = snapkv_scores_varlen(q, k, lse, cu, max(cs), h2s, window=8)
    pooled = pool_scores(raw)
    if kind == "per_head":
        want = torch.tensor([[min(c, 1 + 3 * s) for s in range(H)] for c in cs], dtype=torch.int32)
        p2 = pool.clone()
        kept = select_scatter(raw, k, v, cu, max(cs), want, p2, tables, lens, s2h, page_size=P, heads_per_group=2)
    elif kind == "global":
        gk = torch.tensor([7, 40, 1])
        want = global_keep_counts(pooled, cu, gk, 40)
        assert want.sum(1).tolist() == [7, 40, 1]
        p2 = pool.clone()
        kept = select_scatter(pooled, k, v, cu, max(cs), want, p2, tables, lens, s2h, page_size=P, heads_per_group=2,
                              pool_kernel=1)
    else:
        want = torch.tensor(cs)[:, None].expand(kp, H)
        p2 = pool.clone()
        kept = select_scatter(None, k, v, cu, max(cs), None, p2, tables, lens, s2h, page_size=P, heads_per_group=2)
    assert torch.equal(kept.long(), want.long())
    for i in range(kp):
        a, b = int(cu[i]), int(cu[i + 1])
        o_ref, probs = ref_prefill_attention(q[a:b], k[a:b], v[a:b], pool, tables[i], lens[i], s2h, page_size=P,
                                             heads_per_group=2)
        assert rel(out[a:b], o_ref) < 1e-5
        s_ref = ref_snapkv_scores(probs, lens[i], s2h, window=8)
        assert rel(pooled[i, :, :b - a], s_ref) < 1e-5
        s = pooled[i, :, :b - a].double().numpy()
        keep = np.zeros((H, b - a), dtype=bool)
        for slot in range(H):  # the kernel's rule: top-k, ties to the earliest tokens
            keep[slot, np.sort(np.argsort(-s[slot], kind="stable")[:int(want[i, slot])])] = True
        assert is_topk_set(s, keep, want[i].numpy())
        rp, _ = ref_scatter(pool, tables[i], lens[i], s2h, k[a:b], v[a:b], keep, page_size=P, heads_per_group=2)
        pages = tables[i].long().flatten()
        assert torch.equal(p2[pages], rp[pages])


def test_select_ties_go_to_the_earliest_tokens():
    """All scores equal: each head keeps its first ``count`` tokens, in order, after its current length."""
    from tangram.kernels.compress import select_scatter

    g = torch.Generator().manual_seed(_seed())
    cu, pool, tables, s2h, lens, q, k, v = _batched_case(g, cs=(30,), cached=(7,))
    H = lens.shape[1]
    scores = torch.ones(1, H, 32)
    counts = torch.tensor([[3, 0, 30, 11]], dtype=torch.int32)
    p2 = pool.clone()
    select_scatter(scores, k, v, cu, 30, counts, p2, tables, lens, s2h, page_size=P, heads_per_group=2,
                   pool_kernel=1)
    keep = np.zeros((H, 30), dtype=bool)
    for slot in range(H):
        keep[slot, :int(counts[0, slot])] = True
    rp, _ = ref_scatter(pool, tables[0], lens[0], s2h, k, v, keep, page_size=P, heads_per_group=2)
    assert torch.equal(p2, rp)

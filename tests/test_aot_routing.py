"""AOT regime routing: the split table can launch exactly the static split (or no split, one launch), keeps the
baseline unless the fitted model's error is beaten, and every routing choice computes the same attention."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tangram.budgets import head_groups, synthetic_profile
from tangram.engine.split_table import AotSplitTable
from tangram.errors import ConfigError
from tangram.kernels import decode as dec
from tangram.kernels.reference import ref_paged_decode
from tangram.planner import DecodeCosts, aot_bucket_split_map, flashdecoding_num_splits

P, D = 4, 16


def _case(seed, B=2, H=4, Hp=2, gq=2, maxlen=70, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, maxlen + 1, (B, H), generator=g).to(torch.int32)
    lens[0, 0] = maxlen  # one long head: the splits matter
    G = H // Hp
    mp = -(-maxlen // P) + 1
    npages = B * G * mp + 3
    pool = torch.randn(npages, 2, Hp, P, D, generator=g).to(dtype)
    bt = torch.randperm(npages, generator=g)[: B * G * mp].view(B, G, mp).to(torch.int32)
    q = torch.randn(B, H * gq, D, generator=g).to(dtype)
    s2h = torch.randperm(H, generator=g).to(torch.int32)
    return q, pool, bt, lens, s2h


@pytest.mark.parametrize("seed", [0, 1])
def test_every_routing_choice_gives_the_same_attention(seed):
    """No split (one launch), Algorithm 1's map, FlashDecoding's uniform split and a finer map: each into a
    NaN-poisoned output, each equal to the float64 reference."""
    q, pool, bt, lens, s2h = _case(seed)
    Hp, G = 2, 2
    ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
    maps = {"none": np.ones(G), "alg1": np.array([3, 1]), "static": np.full(G, 5), "fine": np.array([18, 7])}
    for name, row in maps.items():
        out = torch.full_like(q, float("nan"))
        dec.paged_decode(q, pool, bt, lens, s2h, row, page_size=P, heads_per_group=Hp, out=out)
        assert torch.isfinite(out).all(), name
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-5, (name, err)


def test_no_split_is_one_launch_without_the_merge_kernel(monkeypatch):
    """A map of ones writes the output from the split kernel directly: the merge kernel is never launched."""
    q, pool, bt, lens, s2h = _case(5)

    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError("merge kernel launched for a map without splits")
    monkeypatch.setattr(dec, "_decode_merge_kernel", Forbidden())
    out = torch.full_like(q, float("nan"))
    dec.paged_decode(q, pool, bt, lens, s2h, np.ones(2), page_size=P, heads_per_group=2, out=out)
    ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=2)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    with pytest.raises(AssertionError, match="merge kernel"):
        dec.paged_decode(q, pool, bt, lens, s2h, np.array([2, 1]), page_size=P, heads_per_group=2, out=out)


def test_kept_baseline_launches_exactly_the_static_split():
    """Uniform budgets: the table keeps FlashDecoding's split, and its items are the static schedule's items
    (the same CTAs, so the same kernel time); a step is one lookup returning every layer's schedule."""
    L, H, Hp, n_sms = 3, 8, 2, 132
    B = np.ones((L, H))
    perm = np.tile(np.arange(H), (L, 1))
    table = AotSplitTable(B, perm, Hp, n_occ=264, max_batch=16, costs=DecodeCosts(), gq=4, head_dim=128,
                          num_sms=n_sms)
    for batch, ctx in ((1, 8192), (4, 1024), (16, 32768)):
        ns = flashdecoding_num_splits(batch * H, n_sms, -(-ctx // 128))
        step = table.step(batch, ctx)
        assert len(step) == L and step is table.step(batch, ctx)
        static = dec.static_schedule(H, ns)
        for l in range(L):
            assert step[l] is table.lookup(l, batch, ctx)
            assert torch.equal(step[l].items, static.items) and torch.equal(step[l].nsplit, static.nsplit)
            assert step[l].max_splits == ns


def test_margin_comes_from_the_fit_and_gates_every_non_baseline_map(tmp_path):
    """decode_costs.json without a margin: the largest p90 error of its fit. A margin of ~1 keeps the baseline
    at every layer; a margin of 0 lets the cheapest predicted map win."""
    c = DecodeCosts(bw=2.9e12, cta_bw=2.8e10, cta_s=3e-6, launch_s=2.7e-6, merge_s=3e-6)
    c.to_json(tmp_path / DecodeCosts.FILENAME)
    v = json.loads((tmp_path / DecodeCosts.FILENAME).read_text())
    del v["margin"]
    v["fit"] = {"static_split": {"p90_abs_rel_err": 0.12}, "tangram_aot": {"p90_abs_rel_err": 0.15}}
    (tmp_path / DecodeCosts.FILENAME).write_text(json.dumps(v))
    assert DecodeCosts.load(tmp_path).margin == 0.15
    v["margin"] = 1.5
    (tmp_path / DecodeCosts.FILENAME).write_text(json.dumps(v))
    with pytest.raises(ConfigError, match="decode_costs.json: margin"):
        DecodeCosts.load(tmp_path)
    prof = synthetic_profile(4, 8, 0.25, seed=3)
    perm = head_groups(prof.B, 1)
    Bg = np.take_along_axis(prof.B, perm, axis=1)
    for batch, ctx in ((1, 32768), (4, 131072)):
        ns = flashdecoding_num_splits(batch * 8, 132, -(-int(np.ceil(Bg.max() * ctx)) // 128))
        kw = dict(context=ctx, gq=4, head_dim=128, num_sms=132)
        keep = aot_bucket_split_map(prof.B, perm, 1, 264, batch, costs=DecodeCosts(margin=0.999), **kw)
        assert (keep == ns).all()
        free = aot_bucket_split_map(prof.B, perm, 1, 264, batch, costs=DecodeCosts(margin=0.0), **kw)
        assert (free != ns).any()  # skewed long contexts: Algorithm 1's balance is predicted to pay


def test_ratio_margins_apply_by_batch_bucket_load_and_are_not_carried_to_another_gpu(tmp_path):
    c = DecodeCosts(margin=0.2, ratio_margins=((1, 0.3), (4, 0.06), (64, 0.04)))
    assert [c.margin_for(b) for b in (1, 2, 4, 16, 64, 256)] == [0.3, 0.3, 0.06, 0.06, 0.04, 0.04]
    assert DecodeCosts(margin=0.2, ratio_margins=((4, 0.06),)).margin_for(2) == 0.2  # below the smallest measured
    c.to_json(tmp_path / DecodeCosts.FILENAME)
    assert DecodeCosts.load(tmp_path).ratio_margins == c.ratio_margins  # JSON round trip
    assert c.scaled(bandwidth=1.1).ratio_margins == c.ratio_margins  # a probe of the same GPU keeps them
    assert c.transferred(1.4).ratio_margins == () and c.transferred(1.4).margin_for(16) == 0.2
    for bad in (((4, 0.1), (1, 0.2)), ((0, 0.1),), ((4, 1.5),)):
        with pytest.raises(ConfigError, match="ratio_margins"):
            DecodeCosts(ratio_margins=bad)
    v = json.loads((tmp_path / DecodeCosts.FILENAME).read_text())
    v["ratio_margins"] = [[4, 0.1], [1, 0.2]]
    (tmp_path / DecodeCosts.FILENAME).write_text(json.dumps(v))
    with pytest.raises(ConfigError, match="decode_costs.json: .*ratio_margins"):
        DecodeCosts.load(tmp_path)


def test_split_candidates_are_the_maps_the_routing_chooses_among():
    """Every candidate is a valid map of the layout; ``static`` is FlashDecoding's split; the balanced chunking of
    even lengths splits every head alike; the routing's map is, layer by layer, FlashDecoding's split or one of
    them (with no margin, the one predicted cheapest)."""
    from tangram.planner import SPLIT_CANDIDATE_EVEN, split_candidates

    L, H = 4, 8
    prof = synthetic_profile(L, H, 0.25, seed=int(np.random.default_rng().integers(99)))
    for hp in (1, 2):
        perm = head_groups(prof.B, hp)
        Bg = np.take_along_axis(prof.B, perm, axis=1)
        for batch, ctx in ((1, 8192), (16, 32768)):
            named = split_candidates(prof.B, perm, hp, 264, batch, context=ctx, num_sms=132)
            assert {"static", "alg1_w1", "balanced_x1", "balanced_x2"} <= set(named)
            assert {f"uniform_s{s}" for s in SPLIT_CANDIDATE_EVEN} <= set(named)
            for S in named.values():
                assert S.shape == (L, H // hp) and S.dtype == np.int32 and (S >= 1).all()
            ns = flashdecoding_num_splits(batch * H, 132, -(-int(np.ceil(Bg.max() * ctx)) // 128))
            assert (named["static"] == ns).all()
            S = aot_bucket_split_map(prof.B, perm, hp, 264, batch, context=ctx, costs=DecodeCosts(margin=0.0),
                                     gq=4, head_dim=128, num_sms=132)
            allowed = list(split_candidates(prof.B, perm, hp, 264, batch, context=ctx, num_sms=132,
                                            lens=np.maximum(1.0, np.ceil(Bg * 0.75 * ctx))).values())
            allowed += [aot_bucket_split_map(prof.B, perm, hp, 264, batch, context=ctx), np.ones_like(S)]
            assert all(any(np.array_equal(S[l], X[l]) for X in allowed) for l in range(L))
    even = split_candidates(np.ones((L, H)), np.tile(np.arange(H), (L, 1)), 1, 264, 4, context=8192, num_sms=132)
    assert all((S == S[0, 0]).all() for k, S in even.items() if k.startswith("balanced"))


def test_ratio_margins_fit_is_zero_on_the_models_own_timings_and_the_p90_of_a_known_error():
    """Rows timed exactly as the model predicts give a margin of 0 at every batch; multiplying one candidate's
    measured time by 1.1 at every point gives that log error where it lands in the p90."""
    from tangram.kernels.bench.cases import layer_lens
    from tangram.planner import decode_layer_times, split_candidates
    from tangram.config import get_model
    from tangram.sim.fit_decode import ratio_margins

    m = get_model("llama-3.1-8b")
    costs = DecodeCosts()
    rows = []
    for batch, ctx, rho in ((1, 8192, 0.25), (4, 32768, 0.5), (16, 8192, 0.25)):
        B = synthetic_profile(m.num_layers, m.num_kv_heads, rho, seed=0).B
        perm = head_groups(B, 1)
        lens = layer_lens(B, perm, ctx)
        named = split_candidates(B, perm, 1, 264, batch, context=ctx, num_sms=132, lens=lens)
        ms = {k: 1e3 * float(decode_layer_times(lens, S, 1, batch, 264, costs, gq=m.gqa_group, head_dim=m.head_dim)
                             .sum()) for k, S in named.items()}
        rows.append({"model": m.name, "profile_seed": 0, "num_sms": 132, "batch": batch, "context": ctx,
                     "rho": rho, "hp": 1, "n_occ": 264, "ms": ms})
    margins, stats = ratio_margins(rows, costs)
    assert [b for b, _ in margins] == [1, 4, 16] and all(x < 1e-9 for _, x in margins)
    n = len(rows[0]["ms"]) - 1
    for r in rows:  # every candidate 10% slower than predicted: each pair's error is log(1.1)
        r["ms"] = {k: v * (1.0 if k == "static" else 1.1) for k, v in r["ms"].items()}
    margins, stats = ratio_margins(rows, costs)
    assert all(abs(x - np.log(1.1)) < 1e-9 for _, x in margins) and stats["4"]["pairs"] == n
    with pytest.raises(ConfigError, match="row 0"):
        ratio_margins([{"model": m.name}], costs)

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

import math
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.budgets import head_groups, synthetic_profile
from tangram.errors import ConfigError
from tangram.planner import aot_split_map, flashdecoding_num_splits, runtime_plan

# Primer's worked example: budgets (tokens) per layer x head, H_p = 2, adjacent groups.
B = np.array([[3, 1, 2, 4], [5, 2, 1, 3]]) / 10
ADJ = head_groups(B, 2, clustered=False)


def test_algorithm1_ncta2():
    # round rule: layer 0 tau = 1/2, Phi = [.4, .6] -> 0.8, 1.2 -> [1, 1]; layer 1 tau = .55 -> 1.27, .73 -> [1, 1]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 2, "round"), [[1, 1], [1, 1]])
    # primer's ceil variant: [[1, 2], [2, 1]]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 2, "ceil"), [[1, 2], [2, 1]])


def test_algorithm1_ncta8():
    # layer 0: tau = 1.0/8 -> shares 3.2, 4.8 -> [3, 5]; layer 1: tau = 1.1/8 -> 5.09, 2.91 -> [5, 3]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 8, "round"), [[3, 5], [5, 3]])
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 8, "ceil"), [[4, 5], [6, 3]])


def test_algorithm1_round_half_up_and_zero_layer():
    b = np.array([[0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0]])
    # share of each group = 2 * 0.5 / ... : N_CTA = 3 -> shares 1.5, 1.5 -> both round up to 2
    np.testing.assert_array_equal(aot_split_map(b, head_groups(b, 2, False), 2, 3), [[2, 2], [1, 1]])
    with pytest.raises(ConfigError):
        aot_split_map(b, head_groups(b, 2, False), 2, 0)


def test_flashdecoding_heuristic():
    """FlashAttention-2's policy as flash_api.cpp calls it: twice the SMs (two 128-thread blocks an SM)."""
    assert flashdecoding_num_splits(212, 132, 512) == 1  # >= 0.8 x 2 x 132 pairs: the GPU is full
    assert flashdecoding_num_splits(128, 132, 64) == 2  # batch 16 x 8 KV heads at 8K: 256 of 264 slots
    s = flashdecoding_num_splits(8, 132, 2048)
    assert 1 < s <= 128
    # wave efficiency of the chosen split is within 85% of the best, the fewest such splits
    eff = [(8 * k / 264) / np.ceil(8 * k / 264) for k in range(1, 129)]
    assert eff[s - 1] >= 0.85 * max(eff) and all(e < 0.85 * max(eff) for e in eff[: s - 1])


def test_runtime_plan_fits_ncta_and_counts_host_work():
    rng = np.random.default_rng()
    lens = rng.integers(1, 5000, size=(4, 3, 8))
    plan = runtime_plan(lens, n_cta=264)
    assert len(plan.splits) == 3 and plan.host_items > 3 * 32
    for l in range(3):
        assert plan.splits[l].sum() <= 264 or plan.chunk_tokens[l] == lens[:, l].max()
        assert np.all(plan.splits[l] * plan.chunk_tokens[l] >= lens[:, l])


def _runtime_plan_per_layer(lengths, n_cta, min_chunk=16):
    """The planner as FlashInfer runs it, one layer's binary search after another (the reference)."""
    R, L, H = lengths.shape
    splits, chunks, items, iters = [], [], 0, 0
    for l in range(L):
        x = lengths[:, l, :]
        lo, hi = min_chunk, max(min_chunk, int(x.max()) if x.size else min_chunk)
        while lo < hi:
            mid = (lo + hi) // 2
            n = sum(max(1, -(-int(v) // mid)) for v in x.ravel())
            items, iters = items + x.size, iters + 1
            lo, hi = (lo, mid) if n <= n_cta else (mid + 1, hi)
        chunks.append(lo)
        splits.append(np.array([[max(1, -(-int(v) // lo)) for v in row] for row in x], dtype=np.int32).reshape(R, H))
        items += x.size
    return splits, chunks, items, iters


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_runtime_plan_searches_every_layer_as_on_its_own(data):
    """All layers' binary searches run at once; each layer's chunk size, splits, scanned items and iterations are
    those of its own search (a scalar reference), for empty batches, zero lengths and CTA counts below the work."""
    R, L, H = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 8))
    top = data.draw(st.sampled_from([1, 20, 700, 40000]))
    lens = np.array(data.draw(st.lists(st.integers(0, top), min_size=R * L * H, max_size=R * L * H)),
                    dtype=np.int64).reshape(R, L, H)
    n_cta = data.draw(st.integers(1, 600))
    min_chunk = data.draw(st.sampled_from([1, 16, 64]))
    plan = runtime_plan(lens, n_cta, min_chunk=min_chunk)
    splits, chunks, items, iters = _runtime_plan_per_layer(lens, n_cta, min_chunk)
    assert plan.chunk_tokens.tolist() == chunks and plan.host_items == items and plan.search_iters == iters
    assert len(plan.splits) == L
    for got, want in zip(plan.splits, splits):
        assert got.dtype == np.int32 and got.flags.c_contiguous and np.array_equal(got, want)


def test_algorithm1_rejects_hp_not_dividing_h():
    with pytest.raises(ConfigError, match="must divide"):
        aot_split_map(np.full((2, 8), 0.3), np.tile(np.arange(8), (2, 1)), 3, 16)


# ----------------------------------------------------------------------------- regime routing


@pytest.mark.parametrize("rate_model", ["capped", "saturating"])
def test_decode_layer_times_prices_every_cta_of_the_batch(rate_model):
    """decode_layer_times on a batch of identical requests equals every CTA materialised in launch order (request,
    slot, split) and priced one by one, plus one launch, and the merge with its partials where a head is split."""
    from tangram.planner import DecodeCosts, decode_layer_times

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    c = DecodeCosts(bw=2e12, cta_bw=4e10, cta_s=2e-6, launch_s=4e-6, merge_s=3e-6, rate_model=rate_model)
    for batch in (1, 3, 40, 300):
        L, H, hp, gq, d = 3, 8, 2, 4, 128
        lens = rng.integers(1, 20000, (L, H)).astype(float)
        S = rng.integers(1, 5, (L, H // hp))
        S[0] = 1  # one layer unsplit: no merge
        per_head = np.repeat(S, hp, axis=1)
        size = np.tile(lens / per_head * (2 * d * 2), (1, batch))
        reps = np.tile(per_head, (1, batch))
        want = _wave_time_per_cta(size, reps, 264, c.bw, c.cta_bw, c.cta_s, rate_model) + c.launch_s
        want += np.where(S.max(axis=1) > 1, c.merge_s + batch * per_head.sum(axis=1) * gq * (d + 2) * 4 * 2 / c.bw, 0)
        got = decode_layer_times(lens, S, hp, batch, 264, c, gq=gq, head_dim=d)
        np.testing.assert_allclose(got, want, rtol=1e-10)


def _wave_time_per_cta(size, reps, n_occ, bw, cta_bw, cta_s, rate_model="capped"):
    """Reference: every CTA materialised in launch order, one layer at a time, in float64."""
    out = []
    for sz, rp in zip(size, reps):
        cta = np.repeat(sz, rp)
        n = cta.size
        if n == 0:
            out.append(0.0)
            continue
        waves = -(-n // n_occ)
        tail = np.sort(cta[(waves - 1) * n_occ:])
        body = cta[:(waves - 1) * n_occ].sum() / bw
        t, prev = 0.0, 0.0
        for j, x in enumerate(tail):  # processor sharing among the CTAs still running
            active = tail.size - j
            if rate_model == "capped":
                t += (x - prev) * max(active / bw, 1.0 / cta_bw)
            else:  # together they stream bw (1 - exp(-active cta_bw / bw))
                t += (x - prev) * active / (bw * (1.0 - np.exp(-active * cta_bw / bw)))
            prev = x
        out.append(body + t + waves * cta_s)
    return np.array(out)


def test_wave_time_equals_the_per_cta_reference():
    """Only the last wave is materialised: equal to pricing every CTA, with empty layers, layers of fewer CTAs
    than one wave, and identical layers."""
    from tangram.planner import wave_time

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for _ in range(60):
        L, M, N = int(rng.integers(1, 5)), int(rng.integers(1, 30)), int(rng.integers(1, 50))
        size = rng.uniform(1.0, 1e4, (L, M))
        reps = rng.integers(0, 7, (L, M))
        if rng.random() < 0.3:  # identical layers
            size, reps = np.tile(size[:1], (L, 1)), np.tile(reps[:1], (L, 1))
        if rng.random() < 0.1:
            reps[0] = 0
        got = wave_time(size, reps, N, 2.0, 0.5, 0.01)
        np.testing.assert_allclose(got, _wave_time_per_cta(size, reps, N, 2.0, 0.5, 0.01), rtol=1e-10, atol=1e-12)


def test_a_kept_launch_prices_new_sizes_as_wave_time():
    """The simulator keeps a launch's integer structure (``wave_launch``) and prices it again on new sizes: each
    pricing equals the per-CTA reference and, bit for bit, ``wave_time`` of the same sizes and CTA counts."""
    from tangram.planner import launch_wave_time, wave_launch, wave_time

    rng = np.random.default_rng(20261124)
    kinds = set()
    for i in range(60):
        L, M, N = int(rng.integers(1, 6)), int(rng.integers(1, 40)), int(rng.integers(1, 60))
        reps = rng.integers(0, 6, (L, M)) if i % 3 else rng.integers(16, 65, (L, M))  # heads cut in many pieces
        if rng.random() < 0.2:
            reps[:] = 0  # no CTA at all
        launch = wave_launch(reps, N)
        kinds.add(launch.grouped)
        assert not launch.reps.flags.writeable and not launch.src.flags.writeable
        for _ in range(3):
            size = rng.uniform(1.0, 1e4, (L, M))
            got = launch_wave_time(size, launch, 2.0, 0.5, 0.01)
            np.testing.assert_array_equal(got, wave_time(size, reps, N, 2.0, 0.5, 0.01))
            np.testing.assert_allclose(got, _wave_time_per_cta(size, reps, N, 2.0, 0.5, 0.01), rtol=1e-10,
                                       atol=1e-12)
    assert kinds == {True, False}, "both tail readings (CTA by CTA, entry by entry) must be checked"


def test_regime_choice_keeps_the_baseline_split_without_a_clear_gain():
    """Uniform lengths: nothing beats FlashDecoding's split by the margin, so every layer runs exactly it (no
    split when it says one); long skewed contexts: Algorithm 1's balance is predicted to pay and is chosen."""
    from tangram.planner import (DecodeCosts, aot_bucket_split_map, decode_context_bucket, decode_layer_times,
                                 flashdecoding_num_splits)

    costs = DecodeCosts()
    L, H = 4, 8
    B1 = np.ones((L, H))
    ident = np.tile(np.arange(H), (L, 1))
    for batch, ctx in ((1, 4096), (4, 1024), (64, 8192), (256, 1024)):
        S = aot_bucket_split_map(B1, ident, 1, 264, batch, context=ctx, costs=costs, num_sms=132)
        ns = flashdecoding_num_splits(batch * H, 132, -(-ctx // 128))
        assert (S == ns).all(), (batch, ctx, S, ns)
    prof = synthetic_profile(L, H, 0.25, seed=3)
    perm = np.tile(np.arange(H), (L, 1))
    S = aot_bucket_split_map(prof.B, perm, 1, 264, 4, context=131072, costs=costs, num_sms=132)
    lens = np.ceil(prof.B * 0.75 * 131072)
    ns = flashdecoding_num_splits(4 * H, 132, -(-int(np.ceil(prof.B.max() * 131072)) // 128))
    t_aot = decode_layer_times(lens, S, 1, 4, 264, costs, gq=4, head_dim=128)
    t_static = decode_layer_times(lens, np.full_like(S, ns), 1, 4, 264, costs, gq=4, head_dim=128)
    assert (t_aot <= t_static * (1 + 1e-12)).all() and (S != ns).any()
    assert decode_context_bucket(5) == 1024 and decode_context_bucket(5000) == 8192
    assert decode_context_bucket(10**7) == 131072
    # without costs: Algorithm 1 capped per context, as before
    S0 = aot_bucket_split_map(prof.B, perm, 1, 264, 4, context=1024)
    assert (S0 <= np.maximum(1, np.ceil(prof.B.max(axis=1, keepdims=True) * 1024) // 256)).all()


def test_decode_costs_file_round_trip_and_errors(tmp_path):
    from tangram.errors import ConfigError
    from tangram.planner import DecodeCosts

    c = DecodeCosts(bw=2e12, cta_bw=3e10, cta_s=1e-6, launch_s=2e-6, merge_s=3e-6, source="test")
    c.to_json(tmp_path / DecodeCosts.FILENAME, {"note": 1})
    d = DecodeCosts.load(tmp_path)
    assert (d.bw, d.cta_bw, d.cta_s, d.launch_s, d.merge_s) == (2e12, 3e10, 1e-6, 2e-6, 3e-6)
    (tmp_path / DecodeCosts.FILENAME).write_text('{"bw": 1}')
    with pytest.raises(ConfigError, match="missing field"):
        DecodeCosts.load(tmp_path)
    (tmp_path / DecodeCosts.FILENAME).write_text('{"bw": ')
    with pytest.raises(ConfigError, match="invalid JSON"):
        DecodeCosts.load(tmp_path)
    empty = tmp_path / "none"
    empty.mkdir()
    assert DecodeCosts.load(empty).source.startswith("default")


def test_saturating_rate_model_against_its_formula_and_the_capped_one():
    """The tail's seconds per byte with ``a`` CTAs running: capped = max(a / bw, 1 / cta_bw); saturating = a / (bw
    (1 - exp(-a cta_bw / bw))), computed here in float64 by hand. Saturating is never faster than the copy
    bandwidth, tends to one CTA's rate when few run, and gives one-per-SM launches less than bw."""
    from tangram.planner import DecodeCosts

    bw, cta = 3.0e12, 5.0e10
    cap = DecodeCosts(bw=bw, cta_bw=cta).tail_seconds_per_byte(264)
    sat = DecodeCosts(bw=bw, cta_bw=cta, rate_model="saturating").tail_seconds_per_byte(264)
    for j in (0, 100, 136, 200, 263):
        a = 264 - j
        assert cap[j] == pytest.approx(max(a / bw, 1 / cta), rel=1e-12)
        assert sat[j] == pytest.approx(a / (bw * (1 - math.exp(-a * cta / bw))), rel=1e-12)
    assert np.all(sat >= cap * (1 - 1e-12))  # 1 - exp(-x) <= min(1, x)
    assert 1 / sat[-1] == pytest.approx(cta, rel=1e-2)  # one CTA left: about its own rate (cta / 2bw lower)
    a = 128  # one CTA per SM: the launch streams well below the copy bandwidth
    assert a / sat[264 - a] / bw == pytest.approx(1 - math.exp(-a * cta / bw))
    assert a / sat[264 - a] < 0.9 * bw
    with pytest.raises(Exception, match="rate_model"):
        DecodeCosts(rate_model="linear")


def test_decode_costs_by_model_entries_and_their_errors(tmp_path):
    """A decode_costs.json with per-model fits: a model with an entry reads it (its own rate model and margin), any
    other model the top-level fit; a malformed entry is an error naming the file and the field."""
    from tangram.errors import ConfigError
    from tangram.planner import DecodeCosts

    top = DecodeCosts(bw=2e12, cta_bw=3e10, cta_s=1e-6, launch_s=2e-6, merge_s=3e-6, margin=0.2)
    own = {"bw": 2.5e12, "cta_bw": 5e10, "cta_s": 4e-6, "launch_s": 3e-6, "merge_s": 3.5e-6, "margin": 0.1,
           "rate_model": "saturating", "source": "fitted on llama rows"}
    f = tmp_path / DecodeCosts.FILENAME
    top.to_json(f, {"by_model": {"llama-3.1-8b": own}})
    d = DecodeCosts.load(tmp_path, "llama-3.1-8b")
    assert (d.bw, d.cta_bw, d.cta_s, d.launch_s, d.merge_s, d.margin, d.rate_model) == \
        (2.5e12, 5e10, 4e-6, 3e-6, 3.5e-6, 0.1, "saturating")
    assert "by_model.llama-3.1-8b" in d.source
    for name in ("smollm2-135m", None):
        e = DecodeCosts.load(tmp_path, name)
        assert (e.bw, e.margin, e.rate_model) == (2e12, 0.2, "capped")
    for bad, match in (({**own, "cta_bw": "fast"}, "cta_bw must be a positive number"),
                       ({**own, "bw": -1.0}, "bw must be a positive number"),
                       ({**own, "rate_model": "linear"}, "rate_model must be one of"),
                       ({k: v for k, v in own.items() if k != "merge_s"}, r"missing field.*merge_s.*by_model")):
        top.to_json(f, {"by_model": {"llama-3.1-8b": bad}})
        with pytest.raises(ConfigError, match=match):
            DecodeCosts.load(tmp_path, "llama-3.1-8b")
    top.to_json(f, {"by_model": ["llama"]})
    with pytest.raises(ConfigError, match="by_model must be an object"):
        DecodeCosts.load(tmp_path, "llama-3.1-8b")


def _dispatch_reference(sizes, n_occ, bw, cta_bw):
    """Float64 time-stepped reference of dispatch_time (capped rates): every running CTA streams min(bw/a, cta_bw),
    a CTA starts the moment a slot frees, in launch order."""
    rem, queue, t = [], list(map(float, sizes)), 0.0
    while queue and len(rem) < n_occ:
        rem.append(queue.pop(0))
    while rem:
        r = min(bw / len(rem), cta_bw)
        dt = min(rem) / r
        t += dt
        rem = [x - r * dt for x in rem]
        rem = [x for x in rem if x > 1e-9 * max(sizes)]
        while queue and len(rem) < n_occ:
            rem.append(queue.pop(0))
    return t


@pytest.mark.parametrize("seed", range(6))
def test_dispatch_time_matches_a_step_by_step_reference(seed):
    from tangram.planner import dispatch_time

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, rng.integers(1, 40)).astype(float) * 1e6
    n_occ = int(rng.integers(1, 12))
    bw, cta_bw = 3e12, float(rng.choice([2e11, 5e11, 4e12]))
    got = dispatch_time(sizes, n_occ, bw, cta_bw, rate_model="capped")
    assert got == pytest.approx(_dispatch_reference(sizes, n_occ, bw, cta_bw), rel=1e-9)


def test_dispatch_time_order_and_edges():
    from tangram.planner import dispatch_time

    bw, cta = 1e12, 1e12  # one CTA alone streams at the full bandwidth: no tail penalty from the rate cap
    assert dispatch_time([], 4, bw, cta) == 0.0
    assert dispatch_time([5e9] * 4, 8, bw, cta, "capped") == pytest.approx(4 * 5e9 / bw)  # one wave, shared
    # two slots, a long CTA last: it runs alone at the end; first, it overlaps the short ones
    late = dispatch_time([1e9, 1e9, 1e9, 4e9], 2, bw, 1e11, "capped")
    early = dispatch_time([4e9, 1e9, 1e9, 1e9], 2, bw, 1e11, "capped")
    assert late > early
    with pytest.raises(ConfigError, match="n_occ"):
        dispatch_time([1.0], 0, bw, cta)

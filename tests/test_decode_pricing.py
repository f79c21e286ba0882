"""The simulator prices decode attention with the model the AOT routing chooses split maps by
(``tangram.planner.launch_layer_times`` with the fitted ``DecodeCosts``), for every partition, and those costs move
with the tables when they are transferred to another GPU or rescaled by a probe."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, ModelConfig, get_gpu, get_model
from tangram.paging import KVLayout
from tangram.planner import DecodeCosts, decode_layer_times, runtime_plan
from tangram.scheduler import Scheduler
from tangram.sim import costmodel
from tangram.sim.costmodel import CostModel, CostParams
from tangram.sim.tables import CostTables, resolve, tables_dir_for
from tangram.sim.transfer import rescale, write_tables

LLAMA = get_model("llama-3.1-8b")
H100, H200, A100 = get_gpu("h100-80gb"), get_gpu("h200"), get_gpu("a100-80gb")
TINY = ModelConfig("tiny-decode", num_layers=2, num_q_heads=6, num_kv_heads=3, head_dim=4, hidden=24,
                   intermediate=48, vocab=100)


def _shipped():
    d = tables_dir_for("h100-80gb")
    if not (d / DecodeCosts.FILENAME).exists():
        pytest.skip("no H100 decode costs installed")
    return d


def test_decode_price_by_hand_two_layers_three_heads(tmp_path):
    """2 layers x 3 KV heads (g = 2, d = 4: 16 bytes per token and head), one request, a GPU of 8 SMs and 4
    resident CTAs. FlashDecoding splits every head in 2 (3 heads < 0.8 x 8 SMs; 2 blocks of 256 tokens at most),
    so a layer launches 6 CTAs in (head, split) order: a full wave of 4, then a last wave of the 2 CTAs of head 2.
    Priced by hand below from the costs in the folder, not from any code under test."""
    bw, cta, cta_s, launch_s, merge_s = 1e9, 2e8, 1e-6, 3e-6, 2e-6
    d = tmp_path / "tab"
    d.mkdir()
    (d / DecodeCosts.FILENAME).write_text(json.dumps(dict(bw=bw, cta_bw=cta, cta_s=cta_s, launch_s=launch_s,
                                                          merge_s=merge_s, rate_model="saturating")))
    (d / "meta.json").write_text(json.dumps({"n_cta": 4}))
    gpu = dataclasses.replace(H100, name="tiny-gpu", num_sms=8)
    eng = EngineConfig(mode="full", page_size=16)
    cm = CostModel(TINY, gpu, eng, KVLayout.build(TINY, eng, None), None, tables=d)
    assert cm.partition == "static" and cm.n_occ == 4 and cm.price_costs is not None
    lens = np.array([[[100, 200, 300], [50, 50, 400]]])  # [request, layer, head]

    def two_running(x):  # seconds of x bytes streamed by the last 2 CTAs together: bw (1 - exp(-2 cta / bw))
        return x * 2 / (bw * (1 - math.exp(-2 * cta / bw)))

    merge = merge_s + 6 * 2 * (4 + 2) * 4 * 2 / bw  # 6 partials of g x (d + 2) fp32, written and read
    fixed = launch_s + 2 * cta_s + merge  # per layer: one launch, two waves, the merge
    # layer 0: CTAs of 50, 50, 100, 100, 150, 150 tokens; the last wave is the two of 150 tokens (2400 bytes)
    l0 = (50 + 50 + 100 + 100) * 16 / bw + two_running(150 * 16) + fixed
    # layer 1: CTAs of 25, 25, 25, 25, 200, 200 tokens
    l1 = (25 * 4) * 16 / bw + two_running(200 * 16) + fixed
    t, _ = cm._decode_attention(lens)
    assert t == pytest.approx(l0 + l1, rel=1e-12)
    assert cm._dec_fixed == pytest.approx(2 * fixed, rel=1e-12)  # what the rescale cache keeps fixed
    # the routing's model gives the same numbers for the same lengths and map
    want = decode_layer_times(lens[0], np.full((2, 3), 2), 1, 1, 4, cm.price_costs, gq=2, head_dim=4)
    np.testing.assert_allclose(want, [l0, l1], rtol=1e-12)
    # decode_model="capped" (the A/B of benchmarks/decode_pricing.py) prices as a folder without the file does
    from tangram.errors import ConfigError

    ab = CostModel(TINY, gpu, eng, KVLayout.build(TINY, eng, None), None, tables=d,
                   params=CostParams(decode_model="capped"))
    assert ab.price_costs is None and "decode_model='capped'" in ab.sources["decode_attention"]
    with pytest.raises(ConfigError, match="decode_model"):
        CostModel(TINY, gpu, eng, KVLayout.build(TINY, eng, None), None, tables=d, params=CostParams(decode_model="x"))
    t_ab = ab._decode_attention(lens)[0]
    # a folder without decode_costs.json keeps the fallback (capped model, fitted intercepts) and says so
    (d / DecodeCosts.FILENAME).unlink()
    fb = CostModel(TINY, gpu, eng, KVLayout.build(TINY, eng, None), None, tables=d)
    assert fb.price_costs is None and "fallback" in fb.sources["decode_attention"]
    assert fb._decode_attention(lens)[0] == t_ab and t_ab != pytest.approx(t, rel=1e-3)


@pytest.mark.parametrize("part", ["aot", "static", "runtime"])
def test_the_simulator_prices_a_launch_as_decode_layer_times(part):
    """Batches of identical requests, every partition, the shipped H100 decode costs: the simulator's price of a
    decode step equals decode_layer_times (the routing's model) summed over layers for the map it launches."""
    _shipped()
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for hp, scale in ((1, 1.5), (4, 1.0)):
        prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=int(rng.integers(1000)))
        eng = EngineConfig(mode="tangram", heads_per_group=hp, n_cta_scale=scale, decode_partition=part)
        sched = Scheduler(LLAMA, eng, prof, pool_bytes=2**30)
        cm = CostModel(LLAMA, H100, eng, sched.layout, sched.profile)
        assert cm.price_costs == DecodeCosts.load(tables_dir_for("h100-80gb"), LLAMA.name)
        B = sched.layout.to_slots(sched.profile.B)
        for batch in (1, 5, 64):
            ctx = int(rng.integers(600, 60000))
            one = np.maximum(1, np.ceil(B * ctx)).astype(np.int64)  # [L, H] slots
            lens = np.repeat(one[None], batch, axis=0)
            if part == "aot":
                S, g = cm.split_map(batch, ctx), hp
            elif part == "static":
                from tangram.planner import flashdecoding_num_splits

                s = flashdecoding_num_splits(batch * LLAMA.num_kv_heads, H100.num_sms, -(-int(one.max()) // 128))
                S, g = np.full(one.shape, s), 1
            else:
                S, g = np.stack([x[0] for x in runtime_plan(lens, cm.n_cta).splits]), 1
            want = decode_layer_times(one, S, g, batch, cm.n_occ, cm.price_costs, gq=LLAMA.gqa_group,
                                      head_dim=LLAMA.head_dim).sum()
            got, _ = cm._decode_attention(lens, ctx)
            assert got == pytest.approx(want, rel=1e-12), (part, hp, batch, ctx)


def test_transferred_decode_costs_scale_by_the_bandwidth_ratio():
    """A GPU priced from the H100 tables by datasheet: the decode costs' bandwidth x the transfer's bandwidth
    ratio, the latencies and the lone-CTA rate kept (the transfer's rules); the simulator prices and routes with
    them, and the engine's routing (DecodeCosts.for_gpu, no simulator import) reads the same costs."""
    d = _shipped()
    base = DecodeCosts.load(d, LLAMA.name)
    for gpu in (H200, A100):
        rb = gpu.mem_bandwidth / H100.mem_bandwidth
        t = resolve("auto", gpu)
        assert [p["kind"] for p in t.provenance] == ["transfer"]
        c = t.decode_costs(LLAMA.name)
        assert c.bw == pytest.approx(base.bw * rb, rel=1e-12)
        assert (c.cta_bw, c.cta_s, c.launch_s, c.merge_s, c.rate_model, c.margin) == \
            (base.cta_bw, base.cta_s, base.launch_s, base.merge_s, base.rate_model, base.margin)
        assert DecodeCosts.for_gpu(gpu.name, LLAMA.name) == c
        prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=1)
        eng = EngineConfig(mode="tangram")
        cm = CostModel(LLAMA, gpu, eng, KVLayout.build(LLAMA, eng, prof.B), prof)
        assert cm.decode_costs == c and cm.price_costs == c
        assert "transferred from h100" in cm.sources["decode_attention"]
    # a balanced, bandwidth-bound launch (64 requests x 8K tokens on every head) speeds up by about r_b on an H200
    lens = np.full((LLAMA.num_layers, LLAMA.num_kv_heads), 8192.0)
    S = np.ones((LLAMA.num_layers, LLAMA.num_kv_heads), dtype=int)
    t0 = decode_layer_times(lens, S, 1, 64, 264, base, gq=4, head_dim=128).sum()
    t1 = decode_layer_times(lens, S, 1, 64, 264, resolve("auto", H200).decode_costs(LLAMA.name), gq=4,
                            head_dim=128).sum()
    assert 0.9 < (t0 / t1) / (H200.mem_bandwidth / H100.mem_bandwidth) <= 1.0 + 1e-9
    assert DecodeCosts.for_gpu("h100-80gb", LLAMA.name) == base  # its own tables: unchanged


def _probe(t: CostTables, small: float, large: float) -> dict:
    """The reference probe of the shipped tables (or a copy point only) with the two decode points tangram-probe
    times, read from the table's own rows (tangram_aot, rho 1, H_p = H, 4 waves: B = 1 x 1K and B = 64 x 8K), the
    small one x ``small`` and the large one x ``large``."""
    from tangram.sim.probe import check_probe

    p = json.loads(json.dumps(t.reference_probe)) if t.reference_probe is not None else \
        {"kind": "tangram-probe", "version": 1, "device": {"name": "synthetic"},
         "copy": {"bytes": 4 * 2**30, "gbps": t.meta["copy_gbps"]}, "gemm": [], "prefill": []}
    df = t.decode
    p["decode"] = []
    for (b, c), f in (((1, 1024), small), ((64, 8192), large)):
        r = df[(df["kernel"] == "tangram_aot") & (df["model"] == LLAMA.name) & (df["batch"] == b)
               & (df["context"] == c) & (df["rho"] == 1.0) & (df["heads_per_group"] == 8) & (df["waves"] == 4.0)]
        p["decode"].append(dict(model=LLAMA.name, kernel="tangram_aot", batch=b, context=c, rho=1.0,
                                heads_per_group=8, waves=4.0, n_calls=1, bytes=int(r["bytes"].iloc[0]),
                                median_ms=float(np.median(r["median_ms"])) * f))
    return check_probe(p)


def test_a_probe_moves_decode_costs_as_it_moves_the_decode_rows(tmp_path):
    d = _shipped()
    t = CostTables.load(d)
    base = t.decode_costs(LLAMA.name)
    same = rescale(t, _probe(t, 1.0, 1.0))
    assert dataclasses.replace(same.decode_costs(LLAMA.name), source="") == dataclasses.replace(base, source="")
    # a machine 1.3x slower everywhere: every decode time x 1.3, whatever the launch
    slow = rescale(t, _probe(t, 1.3, 1.3)).decode_costs(LLAMA.name)
    rng = np.random.default_rng(5)
    lens = rng.integers(100, 30000, (LLAMA.num_layers, LLAMA.num_kv_heads)).astype(float)
    for batch, split in ((1, 8), (16, 2), (128, 1)):
        S = np.full(lens.shape, split)
        a = decode_layer_times(lens, S, 1, batch, 264, base, gq=4, head_dim=128)
        b = decode_layer_times(lens, S, 1, batch, 264, slow, gq=4, head_dim=128)
        np.testing.assert_allclose(b, 1.3 * a, rtol=1e-9)
    # launch floor 1.2x, streaming 0.9x: latencies x 1.2, lone-CTA rate / 1.2, bandwidth / 0.9
    mixed = rescale(t, _probe(t, 1.2, 0.9))
    c = mixed.decode_costs(LLAMA.name)
    assert c.launch_s == pytest.approx(1.2 * base.launch_s) and c.merge_s == pytest.approx(1.2 * base.merge_s)
    assert c.cta_s == pytest.approx(1.2 * base.cta_s) and c.cta_bw == pytest.approx(base.cta_bw / 1.2)
    assert c.bw == pytest.approx(base.bw / 0.9) and "probe of" in c.source
    # written out (transfer, then the probe) and read back: the same costs, not applied a second time
    x = rescale(resolve(str(d), A100), _probe(t, 1.2, 0.9))
    want = x.decode_costs(LLAMA.name)
    y = resolve(str(write_tables(x, tmp_path / "a100")), A100)
    got = y.decode_costs(LLAMA.name)
    for k in ("bw", "cta_bw", "cta_s", "launch_s", "merge_s"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-12), k
    assert got.rate_model == want.rate_model


def test_the_engine_routes_with_the_costs_the_simulator_prices_its_spec_with():
    """tangram-bench / tangram-validate's engine run: 'auto' tables -> DecodeCosts.for_gpu; tables resolved with a
    probe (tangram-validate --probe) -> those tables' carried costs, as the simulator side uses."""
    from tangram.engine.bench import routing_costs
    from tangram.spec import DeploymentSpec

    d = _shipped()
    prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=1)
    for gpu in (H100, H200):
        spec = DeploymentSpec(LLAMA, gpu, EngineConfig(mode="tangram"), prof)
        assert spec.tables == "auto" and routing_costs(spec) == resolve("auto", gpu).decode_costs(LLAMA.name)
        t = rescale(resolve("auto", gpu), _probe(CostTables.load(d), 1.1, 0.95))
        spec.tables = t
        c = routing_costs(spec)
        assert c == t.decode_costs(LLAMA.name) and c != DecodeCosts.for_gpu(gpu.name, LLAMA.name)
        eng = spec.engine
        cm = CostModel(LLAMA, gpu, eng, KVLayout.build(LLAMA, eng, prof.B), prof, tables=t)
        assert cm.decode_costs == c
        # a pinned folder (--tables DIR; here the H100's own): found by path, transferred as the simulator does
        spec.tables = str(d)
        assert routing_costs(spec) == resolve(str(d), gpu).decode_costs(LLAMA.name)


@pytest.mark.parametrize("mode,part", [("tangram", None), ("br+rp", "static"), ("full", None), ("uniform", None)])
@pytest.mark.parametrize("fitted", [True, False])
def test_prices_of_a_runs_steps_at_once_equal_each_step_alone(mode, part, fitted):
    """A run's decode steps are priced in one call (every head grown alike, contexts crossing a bucket and the
    static split's block count changing on the way): each point equals pricing that step alone, bit for bit, with
    the fitted decode costs and with the fallback, and leaves the same fixed part for the rescale cache."""
    eng = EngineConfig(mode=mode, decode_partition=part)
    prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, eng.rho, seed=3)
    lay = KVLayout.build(LLAMA, eng, prof.B)
    cm = CostModel(LLAMA, H100, eng, lay, prof, params=None if fitted else CostParams(decode_model="capped"))
    assert (cm.price_costs is not None) == (fitted and cm.tables.has_decode_costs)
    rng = np.random.default_rng(5)
    kd = 3
    ratio = {"full": np.ones_like(prof.B), "uniform": np.full_like(prof.B, eng.rho)}.get(mode, prof.B)
    lens0 = np.ceil(lay.to_slots(ratio)[None] * rng.integers(3800, 4000, size=(kd, 1, 1))).astype(np.int64)
    offs = np.array([1, 2, 40, 90, 130, 200, 260, 300])  # the longest context crosses 4096 on the way
    ctx = 4000 + offs
    t, fixed = cm._decode_prices(lens0, offs, ctx)
    for i, o in enumerate(offs.tolist()):
        alone = cm._decode_attention(lens0 + o, int(ctx[i]))[0]
        assert t[i] == alone and fixed[i] == cm._dec_fixed, (i, t[i], alone)


def test_kept_launch_shapes_stay_within_their_byte_budget(monkeypatch):
    """The launch shapes a cost model keeps are bounded by their arrays' bytes (``LAUNCH_CACHE_BYTES``), oldest
    dropped first, and the running count matches what is kept."""
    eng = EngineConfig(mode="tangram")
    sched = Scheduler(LLAMA, eng, synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=3),
                      pool_bytes=2**30)
    cm = CostModel(LLAMA, H100, eng, sched.layout, sched.profile)
    cm._launches.clear()
    cm._launch_bytes = 0
    one = costmodel._launch_bytes(cm._launch(None, np.full((2, 4), 2, dtype=np.int64), (2, 2, 2)))
    monkeypatch.setattr(costmodel, "LAUNCH_CACHE_BYTES", 3 * one)
    for i in range(10):
        cm._launch(("shape", i), np.full((2, 4), 2, dtype=np.int64), (2, 2, 2))
    assert list(cm._launches) == [("shape", 7), ("shape", 8), ("shape", 9)]
    assert cm._launch_bytes == sum(costmodel._launch_bytes(h) for h in cm._launches.values()) == 3 * one


@pytest.mark.parametrize("part", ["static", "aot"])
def test_a_pricing_of_several_launch_shapes_survives_the_kept_shapes_turning_over(part, monkeypatch):
    """One pricing whose points need several launch shapes, one of them kept but the oldest of a full set of kept
    shapes: building the shape it lacks pushes the kept one out before it is read. Crashed the capacity search
    (full mode, a run crossing a split-count boundary: `int() argument ... not 'NoneType'`); each point must still
    price exactly as alone."""
    _shipped()
    eng = EngineConfig(mode="full" if part == "static" else "tangram", decode_partition=part)
    prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=3)
    sched = Scheduler(LLAMA, eng, prof, pool_bytes=2**30)
    cm = CostModel(LLAMA, H100, eng, sched.layout, sched.profile)
    kd, H = 3, LLAMA.num_kv_heads
    lens0 = np.full((kd, LLAMA.num_layers, H), 1000, dtype=np.int64)
    if part == "static":  # offsets crossing block boundaries: split counts (launch shapes) change along the run
        offs = np.array([1, 20_000, 60_000, 120_000], dtype=np.int64)
        ctx = None
    else:  # contexts in different buckets: one split map each
        offs = np.array([1, 2, 3], dtype=np.int64)
        ctx = np.array([2_000, 40_000, 120_000], dtype=np.int64)
    alone = [cm._decode_prices(lens0, offs[i:i + 1], None if ctx is None else ctx[i:i + 1]) for i in range(offs.size)]
    assert len(cm._launches) >= 2
    want_t = np.array([t[0][0] for t in alone])
    keep = list(cm._launches)[-1]  # a shape the pricing needs: made the oldest kept, every other one dropped
    hit = cm._launches[keep]
    cm._launches.clear()
    cm._launches[keep] = hit
    cm._launch_bytes = costmodel._launch_bytes(hit)
    for i in range(63):  # fill the kept set with other shapes (each priced once), then hold it at its bytes
        cm._launch(("filler", i), np.full((1, 2), 1 + i % 3, dtype=np.int64), (2, 1, 1))
    monkeypatch.setattr(costmodel, "LAUNCH_CACHE_BYTES", cm._launch_bytes)
    assert len(cm._launches) == 64 and next(iter(cm._launches)) == keep
    t, _ = cm._decode_prices(lens0, offs, ctx)
    np.testing.assert_array_equal(t, want_t)

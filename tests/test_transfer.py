"""Cost tables on another machine: the probe's rescale and the datasheet transfer, checked on synthetic tables whose
ground truth is a known roofline (times written by hand from bytes and FLOPs), and on the shipped H100 tables."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_gpu, get_model
from tangram.errors import InputError
from tangram.paging import KVLayout
from tangram.sim.costmodel import CostModel
from tangram.sim.probe import check_probe, gemm_shapes, load_probe, run_probe
from tangram.sim.tables import CostTables, resolve, tables_dir_for
from tangram.sim.transfer import blocks_per_sm, ratio_curve, rescale, transfer, write_tables

LLAMA, SMOL = get_model("llama-3.1-8b"), get_model("smollm2-135m")
H100, H200, A100 = get_gpu("h100-80gb"), get_gpu("h200"), get_gpu("a100-80gb")
SEED = 20261124
# ground truth of the synthetic tables: each kernel = a latency floor + max(bytes / B0, FLOPs / P0)
B0, P0 = 0.7 * H100.mem_bandwidth, 0.8 * H100.bf16_flops
GEMM_FLOOR, DEC_A, DEC_BW, PF_FLOOR = 6e-6, 12e-6, 2.8e12, 0.19e-3
TOKENS = [2**i for i in range(14)]
DECODE_GRID = [(b, c) for b in (1, 4, 16, 64) for c in (1024, 4096, 8192)]
META = {"gpu_name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "copy_gbps": 3000.0, "copy_bytes": 4 * 2**30,
        "aot_waves": 4.0, "decode_kernel": {"block_n": 128, "num_warps": 8, "num_stages": 3, "n_regs": 111,
                                            "shared_bytes": 74240, "blocks_per_sm": 2, "n_cta": 264,
                                            "limits": {"num_sms": 132, "regs_per_sm": 65536, "smem_per_sm": 233472,
                                                       "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
                                                       "smem_reserved_per_block": 1024, "reg_alloc_unit": 256}}}


def _gemm_truth(n, k, m):
    return GEMM_FLOOR + max((n * k + m * k + m * n) * 2 / B0, 2 * m * n * k / P0)


def _elem_truth(tokens, hidden):
    return 8e-6 + tokens * hidden * 2 * 2 / B0


def _decode_bytes(batch, ctx):
    return batch * LLAMA.num_kv_heads * ctx * 2 * LLAMA.head_dim * 2 + 2 * batch * LLAMA.num_q_heads * LLAMA.head_dim * 2


def _prefill_work(chunk, cached):
    H, Hq, d = LLAMA.num_kv_heads, LLAMA.num_q_heads, LLAMA.head_dim
    ntok = cached * H
    return (ntok * 2 * d + chunk * (2 * Hq + 2 * H) * d) * 2, 4.0 * d * (Hq // H) * (chunk * ntok + H * chunk ** 2 / 2)


PREFILL_GRID = [(1, 0), (16, 32768), (32, 32768), (512, 8192), (2048, 0), (2048, 8192), (4096, 32768)]


def _prefill_truth(chunk, cached):
    b, f = _prefill_work(chunk, cached)
    return PF_FLOOR + max(b / B0, f / P0)


@pytest.fixture
def synth(tmp_path):
    """A tables folder written from the ground truth above (seeded noise on the p20/p80 columns only)."""
    rng = np.random.default_rng(SEED)
    d = tmp_path / "synth"
    d.mkdir()
    rows = [dict(model="tiny", op="noop", tokens=1, m=1, n=1, k=1, median_ms=1e3 * _gemm_truth(1, 1, 1))]
    for op, (n, k) in gemm_shapes(LLAMA).items():
        for m in TOKENS:
            rows.append(dict(model=LLAMA.name, op=op, tokens=m, m=m, n=n, k=k, median_ms=1e3 * _gemm_truth(n, k, m)))
    g = pd.DataFrame(rows)
    g["p20_ms"], g["p80_ms"] = g["median_ms"] * rng.uniform(0.95, 1, len(g)), g["median_ms"] * rng.uniform(1, 1.05, len(g))
    g.to_csv(d / "gemm.csv", index=False)
    pd.DataFrame([dict(model=LLAMA.name, op=op, tokens=t, hidden=h, median_ms=1e3 * _elem_truth(t, h),
                       gbps=t * h * 4 / _elem_truth(t, h) / 1e9)
                  for op, h in (("rmsnorm", 4096), ("silu_mul", 14336)) for t in (1, 16, 256, 4096, 8192)]
                 ).to_csv(d / "elementwise.csv", index=False)
    dec = []
    for b, c in DECODE_GRID:
        byts = _decode_bytes(b, c)
        dec.append(dict(kernel="tangram_aot", impl="triton", model=LLAMA.name, batch=b, num_q_heads=32, num_kv_heads=8,
                        head_dim=128, heads_per_group=8, rho=1.0, context=c, bytes=byts, waves=4.0, plan_ms=0.002,
                        median_ms=1e3 * (DEC_A + byts / DEC_BW)))
    pd.DataFrame(dec).to_csv(d / "decode_attention.csv", index=False)
    pf = []
    for c, cached in PREFILL_GRID:
        pf.append(dict(model=LLAMA.name, chunk=c, cached=cached, cached_tokens=cached * 8,
                       attention_ms=1e3 * _prefill_truth(c, cached), score_ms=0.2, select_ms=0.13, scatter_ms=0.05,
                       select_dynamic_ms=0.15))
    pd.DataFrame(pf).to_csv(d / "prefill_attention.csv", index=False)
    (d / "meta.json").write_text(json.dumps(META))
    return d


def _probe_of(tables: CostTables, *, gemm=1.0, copy=1.0, decode=1.0, prefill=1.0, prefill_floor_ms=None) -> dict:
    """A probe that reads the reference's own numbers at the probe points, times the given scales (gemm: a number
    or a function of tokens; copy: time factor, i.e. the copy bandwidth divided by it; prefill: above the floor)."""
    gemm_f = gemm if callable(gemm) else (lambda t: gemm)
    items = []
    for op, (n, k) in gemm_shapes(LLAMA).items():
        f = tables.gemm_interp(LLAMA, op, n, k)
        for t in (1, 16, 128, 512, 2048, 8192):
            items.append(dict(model=LLAMA.name, op=op, n=n, k=k, tokens=t, median_ms=float(f(t)) * 1e3 * gemm_f(t)))
    dec = []
    for b, c in ((1, 1024), (64, 8192)):
        r = tables.decode[(tables.decode["batch"] == b) & (tables.decode["context"] == c)
                          & (tables.decode["kernel"] == "tangram_aot") & (tables.decode["heads_per_group"] == 8)
                          & (tables.decode["rho"] == 1.0)]
        if "waves" in r.columns and (r["waves"] == 4.0).any():
            r = r[r["waves"] == 4.0]
        dec.append(dict(model=LLAMA.name, kernel="tangram_aot", batch=b, context=c, rho=1.0, heads_per_group=8,
                        waves=4.0, n_calls=1, bytes=int(r["bytes"].iloc[0]),
                        median_ms=float(np.median(r["median_ms"])) * decode))
    pf = tables.prefill[(tables.prefill["model"] == LLAMA.name)]
    floor = pf["attention_ms"].min() if prefill_floor_ms is None else prefill_floor_ms
    row = pf[(pf["chunk"] == 2048) & (pf["cached"] == 8192)]
    ref = float(np.median(row["attention_ms"]))
    return check_probe({"kind": "tangram-probe", "version": 1, "device": {"name": "synthetic"},
                        "copy": {"bytes": 4 * 2**30, "gbps": tables.meta["copy_gbps"] / copy},
                        "gemm": items, "decode": dec,
                        "prefill": [dict(model=LLAMA.name, chunk=2048, cached=8192, cached_tokens=int(8192 * 8),
                                         attention_ms=floor + (ref - floor) * prefill)]})


def _frames(t: CostTables):
    return {k: getattr(t, k) for k in ("gemm", "elementwise", "decode", "prefill") if getattr(t, k) is not None}


def _assert_same(a: CostTables, b: CostTables):
    for k, df in _frames(a).items():
        pd.testing.assert_frame_equal(df, getattr(b, k), check_exact=True)


# --------------------------------------------------------------------------- occupancy


def test_occupancy_formula_agrees_with_the_kernels_and_by_hand():
    from tangram.kernels.decode import DeviceLimits, KernelResources, occupancy_blocks_per_sm

    rng = np.random.default_rng(SEED)
    for _ in range(200):
        regs, smem, warps = int(rng.integers(16, 255)), int(rng.integers(0, 200_000)), int(rng.choice([1, 2, 4, 8, 16]))
        lim = DeviceLimits(num_sms=100, regs_per_sm=65536, smem_per_sm=int(rng.choice([167936, 233472])),
                           max_threads_per_sm=int(rng.choice([1536, 2048])), max_blocks_per_sm=32)
        want = occupancy_blocks_per_sm(KernelResources(regs, smem, warps), lim)
        assert blocks_per_sm(regs, smem, warps, regs_per_sm=lim.regs_per_sm, smem_per_sm=lim.smem_per_sm,
                             max_threads_per_sm=lim.max_threads_per_sm, max_blocks_per_sm=32) == want
    # the H100 decode kernel (111 registers, 74240 B shared, 8 warps) on an A100 (164 KiB shared per SM), by hand:
    # threads 2048 / 256 = 8; registers ceil(111 * 32 / 256) * 256 = 3584 per warp -> 65536 // 3584 = 18 warps -> 2;
    # shared 167936 // (74240 + 1024) = 2  => 2 per SM x 108 SMs
    assert blocks_per_sm(111, 74240, 8, regs_per_sm=65536, smem_per_sm=167936, max_threads_per_sm=2048,
                         max_blocks_per_sm=32) == 2


# --------------------------------------------------------------------------- datasheet transfer


def test_transfer_to_the_own_datasheet_is_the_identity(synth):
    t = CostTables.load(synth)
    same = transfer(t, H100, dataclasses.replace(H100, name="h100-copy"))
    _assert_same(same, t)
    assert same.meta["copy_gbps"] == t.meta["copy_gbps"] and same.n_cta(132) == t.n_cta(132)
    assert same.provenance[-1]["bandwidth_ratio"] == 1.0 and "transferred from h100 by datasheet" in same.label


def test_transfer_of_the_shipped_tables_to_their_own_datasheet_is_the_identity():
    d = tables_dir_for("h100-80gb")
    if not (d / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    t = CostTables.load(d)
    _assert_same(transfer(t, H100, dataclasses.replace(H100, name="h100-copy")), t)


def test_twice_the_bandwidth_halves_memory_bound_time_and_leaves_compute_bound(synth):
    t = CostTables.load(synth)
    fast = dataclasses.replace(H100, name="x2bw-test", mem_bandwidth=2 * H100.mem_bandwidth)
    x = transfer(t, H100, fast)
    floor = GEMM_FLOOR + _gemm_truth(1, 1, 1) - GEMM_FLOOR  # the file's fastest GEMM: the no-op row
    g = x.gemm[x.gemm["model"] == LLAMA.name]
    n_mem = n_comp = 0
    for (n, k, m), new in zip(g[["n", "k", "tokens"]].itertuples(index=False), g["median_ms"]):
        tb, tf = (n * k + m * k + m * n) * 2 / B0, 2 * m * n * k / P0
        # ground truth on the target: the floor plus the roofline at twice the bandwidth
        assert new * 1e-3 == pytest.approx(floor + max(tb / 2, tf), rel=1e-6), (n, k, m)
        if tb > 2 * tf:  # memory-bound even at twice the bandwidth: the time above the floor halves
            assert new * 1e-3 - floor == pytest.approx((_gemm_truth(n, k, m) - floor) / 2, rel=1e-6)
            n_mem += 1
        elif tf > tb:  # compute-bound: unchanged
            assert new * 1e-3 == pytest.approx(_gemm_truth(n, k, m), rel=1e-9)
            n_comp += 1
    assert n_mem >= 10 and n_comp >= 10
    e = x.elementwise
    for (tok, h), new in zip(e[["tokens", "hidden"]].itertuples(index=False), e["median_ms"]):
        # the rule by hand: the bytes' part at the op's rate at its largest size (8192 tokens), above its 1-token
        # floor, halves; that part is the whole time above the floor up to the floor's own 1 token of bytes
        f = _elem_truth(1, h)
        rate = 8192 * h * 4 / (_elem_truth(8192, h) - f)
        tb = min(tok * h * 4 / rate, _elem_truth(tok, h) - f)
        assert new * 1e-3 == pytest.approx(_elem_truth(tok, h) - tb / 2, rel=1e-12)
        assert new * 1e-3 - f == pytest.approx((_elem_truth(tok, h) - f) / 2, rel=2 / 16 if tok > 1 else 1e-12)
    a, bw, _ = x.decode_fit(LLAMA)
    a0, bw0, _ = t.decode_fit(LLAMA)
    assert a0 == pytest.approx(DEC_A, rel=1e-6) and bw0 == pytest.approx(DEC_BW, rel=1e-6)
    assert a == pytest.approx(DEC_A, rel=1e-6) and bw == pytest.approx(2 * DEC_BW, rel=1e-6)
    p = x.prefill
    pf_floor = _prefill_truth(1, 0)
    for (c, cached), new in zip(p[["chunk", "cached"]].itertuples(index=False), p["attention_ms"]):
        b, f = _prefill_work(c, cached)
        # the floor row stays; the others within the floor row's own work (its chunk's q/k/v/o bytes, 9 ns)
        want = pf_floor if (c, cached) == (1, 0) else PF_FLOOR + max(b / B0 / 2, f / P0)
        assert new * 1e-3 == pytest.approx(want, rel=1e-4), (c, cached)
    assert (p["score_ms"] == t.prefill["score_ms"]).all()  # latency floors stay
    assert x.meta["copy_gbps"] == pytest.approx(2 * t.meta["copy_gbps"])
    assert x.n_cta(132)[0] == 264


def test_transfer_to_the_a100_rederives_occupancy_and_scales_compute(synth):
    x = transfer(CostTables.load(synth), H100, A100)
    assert x.n_cta(A100.num_sms)[0] == 2 * 108  # by hand in the occupancy test
    assert x.meta["sm_count"] == 108 and x.gpu().name == "a100-80gb"
    big = x.gemm[(x.gemm["op"] == "gate_up") & (x.gemm["tokens"] == 8192)]["median_ms"].item() * 1e-3
    n, k = gemm_shapes(LLAMA)["gate_up"]
    assert big - GEMM_FLOOR == pytest.approx(2 * 8192 * n * k / (P0 * 312 / 989), rel=1e-5)


def test_a_gpu_without_tables_is_priced_by_transfer_and_says_so(tmp_path):
    if not (tables_dir_for("h100-80gb") / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25)
    eng = EngineConfig(mode="tangram")
    lay = KVLayout.build(LLAMA, eng, prof.B)
    h100 = CostModel(LLAMA, H100, eng, lay, prof)
    a100 = CostModel(LLAMA, A100, eng, lay, prof)
    assert "cost_tables" not in h100.sources
    assert a100.sources["cost_tables"].startswith("transferred from h100 by datasheet")
    assert "transferred from h100 by datasheet" in a100.sources["gemm_qkv"]
    assert "carried over unchanged from the h100-80gb fit" in a100.sources["engine_overhead"]
    assert a100.n_occ == 216 and h100.n_occ == 264
    # a prefill-sized dense step is compute-bound: on the A100 it takes about 989/312 as long
    g1, _ = h100._dense(8192, 0)
    g2, _ = a100._dense(8192, 0)
    assert 2.8 < g2 / g1 < 3.3
    # and the CLI reports it
    from tangram.sim.cli import main

    tr = tmp_path / "t.jsonl"
    tr.write_text('{"session_id": "a", "turn": 0, "arrival_s": 0.0, "new_tokens": 300, "output_tokens": 4}\n')
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main([str(tr), "--gpu", "a100-80gb", "--mode", "full", "--model", "smollm2-135m", "--hp", "1", "--out", str(out),
              "--no-plots"])
    assert e.value.code == 0
    m = json.loads((out / "metrics.json").read_text())["full"]
    assert m["cost_model_source"]["cost_tables"].startswith("transferred from h100 by datasheet")
    assert m["cost_tables"]["provenance"][0].startswith("transferred from h100 by datasheet")


def test_written_transfer_reads_back_without_a_second_transfer(synth, tmp_path):
    x = transfer(CostTables.load(synth), H100, A100)
    d = write_tables(x, tmp_path / "a100")
    y = resolve(str(d), A100)
    assert [p["label"] for p in y.provenance] == [p["label"] for p in x.provenance]
    for k, df in _frames(x).items():
        pd.testing.assert_frame_equal(getattr(y, k).reset_index(drop=True), df.reset_index(drop=True),
                                      check_exact=False, rtol=1e-12)


# --------------------------------------------------------------------------- probe rescale


def test_a_probe_reading_the_reference_changes_nothing(synth):
    t = CostTables.load(synth)
    r = rescale(t, _probe_of(t))
    _assert_same(r, t)
    assert r.meta["copy_gbps"] == t.meta["copy_gbps"]
    sc = r.provenance[-1]["scales"]
    assert sc["copy_bandwidth"]["ratio"] == 1.0
    assert all(x == 1.0 for v in sc["gemm"].values() for x in v["time_ratio"])


def test_a_probe_of_the_shipped_reference_changes_nothing():
    d = tables_dir_for("h100-80gb")
    if not (d / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    t = CostTables.load(d)
    # the machine the tables stand for: the fit machine's recorded probe when shipped, else the tables' own points
    _assert_same(rescale(t, t.reference_probe if t.reference_probe is not None else _probe_of(t)), t)


def test_rescale_recovers_injected_scales(synth):
    t = CostTables.load(synth)
    r = rescale(t, _probe_of(t, gemm=1.1, copy=1.25, decode=1.3, prefill=1.2))
    assert np.allclose(r.gemm["median_ms"] / t.gemm["median_ms"], 1.1, rtol=1e-12, atol=0)  # noop row: pooled
    e0, e1 = t.elementwise, r.elementwise
    for op in ("rmsnorm", "silu_mul"):
        a, b = e0[e0["op"] == op], e1[e1["op"] == op]
        ms, f = a["median_ms"].to_numpy(), a["median_ms"].min()
        byts = a["tokens"].to_numpy() * a["hidden"].to_numpy() * 4
        tb = np.minimum(byts * (ms[-1] - f) / byts[-1], ms - f)  # bytes at the largest size's rate (by hand)
        assert np.allclose(b["median_ms"].to_numpy(), ms + tb * 0.25, rtol=1e-12, atol=0)
    assert r.meta["copy_gbps"] == pytest.approx(t.meta["copy_gbps"] / 1.25, rel=1e-12)
    a, bw, _ = r.decode_fit(LLAMA)
    assert a == pytest.approx(1.3 * DEC_A, rel=1e-6) and bw == pytest.approx(DEC_BW / 1.3, rel=1e-6)
    f0 = t.prefill["attention_ms"].min()
    assert np.allclose(r.prefill["attention_ms"] - f0, (t.prefill["attention_ms"] - f0) * 1.2, rtol=1e-12, atol=1e-15)
    # the cost model prices the rescaled GEMMs: a step's GEMM seconds x 1.1
    prof = synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25)
    eng = EngineConfig(mode="full")
    lay = KVLayout.build(LLAMA, eng, prof.B)
    g0, _ = CostModel(LLAMA, H100, eng, lay, prof, tables=t)._dense(300, 3)
    g1, _ = CostModel(LLAMA, H100, eng, lay, prof, tables=r)._dense(300, 3)
    assert g1 / g0 == pytest.approx(1.1, rel=1e-9)


def test_gemm_ratio_is_interpolated_in_tokens_between_probe_points(synth):
    t = CostTables.load(synth)
    s = {1: 1.0, 16: 1.0, 128: 1.05, 512: 1.1, 2048: 1.2, 8192: 1.2}
    r = rescale(t, _probe_of(t, gemm=lambda tok: s[tok]))
    g0, g1 = t.gemm[t.gemm["model"] == LLAMA.name], r.gemm[r.gemm["model"] == LLAMA.name]
    ratio = (g1["median_ms"] / g0["median_ms"]).to_numpy()
    tok = g0["tokens"].to_numpy()
    for tk, want in s.items():
        assert np.allclose(ratio[tok == tk], want, rtol=1e-12)
    # between 512 and 2048 (log midpoint 1024): the geometric mean; beyond 8192 (none here) flat
    assert np.allclose(ratio[tok == 1024], np.sqrt(1.1 * 1.2), rtol=1e-12)
    assert np.allclose(ratio[tok == 4], 1.0) and np.allclose(ratio[tok == 4096], 1.2)


def test_rescale_against_a_recorded_reference_probe(synth):
    t0 = CostTables.load(synth)
    ref = _probe_of(t0, gemm=0.9, copy=0.95, decode=0.9, prefill=0.9)  # the calibration machine was faster
    (synth / "reference_probe.json").write_text(json.dumps(ref))
    t = CostTables.load(synth)
    assert t.reference_probe is not None
    _assert_same(rescale(t, ref), t)  # the probe of the reference machine itself: identity
    slower = _probe_of(t0, gemm=0.9 * 1.2, copy=0.95, decode=0.9, prefill=0.9)
    r = rescale(t, slower)
    assert np.allclose(r.gemm["median_ms"] / t.gemm["median_ms"], 1.2, rtol=1e-12)
    # a second rescale compares with the first probe: the same probe again changes nothing
    _assert_same(rescale(r, slower), r)


def test_probe_then_transfer_compose(synth):
    """A probe of an H100 applied to the tables transferred to a 2x-bandwidth GPU: the reference moves with them."""
    t = CostTables.load(synth)
    fast = dataclasses.replace(H100, name="x2bw-test", mem_bandwidth=2 * H100.mem_bandwidth)
    x = transfer(t, H100, fast)
    r = rescale(x, _probe_of(x, gemm=1.05))
    assert np.allclose(r.gemm["median_ms"] / x.gemm["median_ms"], 1.05, rtol=1e-12)
    assert [p["kind"] for p in r.provenance] == ["transfer", "probe"]
    assert "transferred from h100 by datasheet" in r.label and "rescaled by the probe of synthetic" in r.label


def test_ratio_curve_flat_beyond_and_exact_at_points():
    f = ratio_curve([16, 1, 256], [1.5, 1.0, 2.0])
    assert f(1) == 1.0 and f(16) == 1.5 and f(256) == 2.0 and f(0.5) == 1.0 and f(1e6) == 2.0
    assert f(4) == pytest.approx(np.sqrt(1.5))


# --------------------------------------------------------------------------- the probe and its JSON


class _Injected:
    facts = {"name": "injected"}

    def __init__(self, scale):
        self.scale, self.calls = scale, 0

    def warm(self):
        pass

    def gemm(self, n, k, tokens):
        self.calls += 1
        return 1e3 * self.scale * _gemm_truth(n, k, tokens)

    def copy(self, nbytes):
        return 1e3 * 2 * nbytes / 3e12 * self.scale

    def decode(self, model, batch, context, n_calls):
        b = _decode_bytes(batch, context)
        return 1e3 * self.scale * (DEC_A + b / DEC_BW), b

    def prefill(self, model, chunk, cached):
        return 1e3 * (PF_FLOOR + self.scale * (_prefill_truth(chunk, cached) - PF_FLOOR)), cached * 8


def test_probe_with_injected_timings_rescales_by_them(synth):
    timers = _Injected(1.15)
    p = run_probe([LLAMA], device="cpu", timers=timers, budget_s=60)
    check_probe(p)
    assert timers.calls == 5 * 6 and len(p["decode"]) == 2 and len(p["prefill"]) == 1 and not p["skipped"]
    t = CostTables.load(synth)
    r = rescale(t, p)
    assert np.allclose(r.gemm["median_ms"] / t.gemm["median_ms"], 1.15, rtol=1e-9)
    assert r.meta["copy_gbps"] == pytest.approx(3000 / 1.15, rel=1e-9)
    a, bw, _ = r.decode_fit(LLAMA)
    assert a == pytest.approx(1.15 * DEC_A, rel=1e-6) and bw == pytest.approx(DEC_BW / 1.15, rel=1e-6)


def test_probe_runs_on_the_cpu_with_tiny_shapes(tmp_path):
    p = run_probe([SMOL], device="cpu", budget_s=60)
    check_probe(p)
    assert p["tiny"] and p["copy"]["gbps"] > 0 and {g["tokens"] for g in p["gemm"]} == {1, 4}
    assert any("lm_head" in s for s in p["skipped"]) and any(s.startswith("decode") for s in p["skipped"])
    assert p["device"]["name"] == "cpu" and p["device"]["torch"] and p["date"] and "timer" in p


def _write(tmp_path, d, name="p.json"):
    f = tmp_path / name
    f.write_text(json.dumps(d) if not isinstance(d, str) else d)
    return f


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["gemm"][3].update(median_ms=-1.0), "gemm[3].median_ms"),
    (lambda d: d["gemm"][0].pop("n"), "gemm[0].n"),
    (lambda d: d["decode"][1].update(rho=1.5), "decode[1].rho"),
    (lambda d: d["copy"].update(gbps="fast"), "copy.gbps"),
    (lambda d: d.update(kind="something"), "kind"),
    (lambda d: d.update(version=9), "version"),
    (lambda d: d["prefill"][0].update(cached=2.5), "prefill[0].cached"),
])
def test_bad_probe_json_names_file_and_field(synth, tmp_path, mutate, field):
    d = _probe_of(CostTables.load(synth))
    mutate(d)
    f = _write(tmp_path, d)
    with pytest.raises(InputError) as e:
        load_probe(f)
    assert str(e.value).startswith(f"{f}: {field}: ")


def test_bad_probe_is_one_line_from_the_cli(tmp_path, capsys):
    from tangram.sim.cli import main

    f = _write(tmp_path, '{"kind": "tangram-probe", "version": 1,\n "device": 3}')
    with pytest.raises(SystemExit) as e:
        main(["--probe", str(f), "--mode", "full", "--out", str(tmp_path / "o"), "--no-plots"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {f}: device.name: missing: the probed device's name\n"
    g = _write(tmp_path, "{not json", "q.json")
    with pytest.raises(SystemExit) as e:
        main(["--probe", str(g), "--mode", "full", "--out", str(tmp_path / "o"), "--no-plots"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: {g}:1: invalid JSON")


def test_bench_records_the_probe_and_its_scales(tmp_path):
    """tangram-bench --probe FILE: the probe lands in out/probe.json and the scales it gives the tables that would
    price the run in the record (metrics.json's run.probe)."""
    import types

    from tangram.engine.bench import record_probe
    from tangram.spec import load

    if not (tables_dir_for("h100-80gb") / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    t = CostTables.load(tables_dir_for("h100-80gb"))
    if t.reference_probe is not None:  # a machine 1.2x slower in GEMMs and 1.1x in copies than the fit machine
        p = json.loads(json.dumps(t.reference_probe))
        p["device"]["name"] = "synthetic"
        for g in p["gemm"]:
            g["median_ms"] *= 1.2
        p["copy"].update(gbps=p["copy"]["gbps"] / 1.1, median_ms=p["copy"]["median_ms"] * 1.1)
    else:
        p = _probe_of(t, gemm=1.2, copy=1.1)
    f = _write(tmp_path, p)
    spec = load(None, {"modes": ["full"]})
    rec = record_probe(str(f), spec, types.SimpleNamespace(type="cpu"), tmp_path / "out")
    assert load_probe(tmp_path / "out" / "probe.json")["device"]["name"] == "synthetic"
    assert rec["label"].startswith("rescaled by the probe of synthetic")
    assert rec["scales"]["copy_bandwidth"]["ratio"] == pytest.approx(1 / 1.1)
    assert all(r == pytest.approx(1.2) for v in rec["scales"]["gemm"].values() for r in v["time_ratio"])


def test_the_engines_fused_elementwise_kernels_price_over_torch_rows(synth):
    """Rows of the engine's own fused kernels (impl "fused", kernels/bench's elementwise section) are what the cost
    model reads when a table has them; a table measured before them (torch rows only) still prices by those."""
    t = CostTables.load(synth)
    torch_only = float(t.elementwise_interp(LLAMA, "rmsnorm")(16))
    df = pd.read_csv(synth / "elementwise.csv").assign(impl="torch")
    fused = df[df["op"] == "rmsnorm"].assign(impl="fused", median_ms=lambda x: x["median_ms"] / 7.0)
    pd.concat([df, fused]).to_csv(synth / "elementwise.csv", index=False)
    both = CostTables.load(synth)
    assert float(both.elementwise_interp(LLAMA, "rmsnorm")(16)) == pytest.approx(torch_only / 7.0, rel=1e-9)
    assert float(both.elementwise_interp(LLAMA, "silu_mul")(16)) == pytest.approx(
        float(t.elementwise_interp(LLAMA, "silu_mul")(16)), rel=1e-9)  # no fused row of it: the torch rows

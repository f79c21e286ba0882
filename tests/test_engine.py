"""Engine executor on the CPU: every mode through the shared harness, full-mode logits vs the plain model,
the KV leak check, rejection of a turn larger than the pool, and the SmolLM2 GGUF in a multi-turn session."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tangram.budgets import synthetic_profile
from tangram.config import MODES, EngineConfig, get_gpu, get_model
from tangram.engine.bench import leak_check, run_mode
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.engine.model import Session
from tangram.engine.sampling import SamplingParams
from tangram.engine.weights import build_model, random_state_dict
from tangram.errors import ConfigError
from tangram.harness import Cluster
from tangram.spec import DeploymentSpec
from tangram.traces.format import Trace, Turn

CPU = torch.device("cpu")


def tiny_cfg():
    base = get_model("llama-3.1-8b")
    return dataclasses.replace(base, name="tiny", num_layers=2, hidden=64, intermediate=96, vocab=211, head_dim=16,
                               num_q_heads=8, num_kv_heads=4, rope_scaling=None, max_context=4096)


@pytest.fixture(autouse=True)
def reference_kernels(request):
    """Whole-model runs use the float64 torch references on the CPU: the Triton interpreter runs every kernel
    program in numpy (minutes per model forward). Tests marked ``interpret`` keep the interpreted Triton kernels,
    so the executor's launch plumbing (strides, tables, split maps) is exercised through Triton too."""
    from tangram.kernels import cpu_reference
    with cpu_reference(request.node.get_closest_marker("interpret") is None):
        yield


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_cfg()
    model = build_model(cfg, random_state_dict(cfg, seed=int(torch.randint(0, 10_000, ()))))
    return cfg, model


def engine(mode, **kw):
    d = dict(mode=mode, page_size=4, heads_per_group=2, rho=0.5, alpha=1.0, chunk_size=16, max_batched_tokens=24,
             kv_pool_bytes=120_000)
    d.update(kw)
    return EngineConfig(**d)


def small_trace(sessions=3, first=(29, 35, 41), later=9, out=5):
    turns = []
    for s in range(sessions):
        sid = f"s{s}"
        turns.append(Turn(f"{sid}:0", sid, 0, 0.001 * s, 0.0, first[s % len(first)], out))
        turns.append(Turn(f"{sid}:1", sid, 1, None, 0.01, later, out))
    return Trace(turns)


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.interpret) if m == "tangram" else m
                                  for m in MODES])
def test_every_mode_serves_the_trace_and_returns_every_page(tiny, mode):
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    spec = DeploymentSpec(cfg, get_gpu("h100"), engine(mode), prof)
    summ, res, leak = run_mode(small_trace(), spec, mode, model, device=CPU, warmup=False)
    assert summ["completed"] == 6 and summ["rejected"] == 0
    assert leak["ok"] and leak["pages_in_use"] == 0
    assert all(r.first_token_s is not None and r.finish_s >= r.first_token_s for r in res.records)
    if mode in ("dynamic", "uniform", "br", "br+rp", "tangram"):
        # compression really happened: fewer live head-tokens than the logical context at the end of turn 0
        assert res.schedulers[0].stats.pages_allocated > 0


@pytest.mark.interpret
def test_full_mode_logits_equal_the_plain_model(tiny):
    """Chunked, paged, batched full mode == one unpaged forward over the same token stream (fp32)."""
    cfg, model = tiny
    eng = engine("full", kv_pool_bytes=400_000)
    sched = TimedScheduler(cfg, eng, None, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=3), ExecutorOptions(record_logits=True))
    tr = small_trace(sessions=2, first=(37, 22), out=6)
    res = Cluster(tr, [(sched, exe)]).run()
    assert all(r.status == "finished" for r in res.records)
    assert leak_check(sched)["ok"]
    worst = 0.0
    checked = 0
    for sid, stream in exe.streams.items():
        toks = torch.tensor(stream)
        ref = Session(model).forward(toks)  # logits at every position, causal, no paging
        rids = {r.rid for r in res.records if r.session_id == sid}
        for rid, pos, logits in exe.logit_log:
            if rid in rids:
                err = (logits - ref[pos]).abs().max() / ref[pos].abs().max()
                worst = max(worst, float(err))
                checked += 1
    assert checked == sum(r.output_tokens for r in res.records)
    assert worst < 1e-4, worst


def test_turn_larger_than_the_pool_is_rejected_and_the_rest_completes(tiny):
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    spec = DeploymentSpec(cfg, get_gpu("h100"), engine("tangram", kv_pool_bytes=60_000), prof)
    turns = list(small_trace(sessions=2).turns) + [Turn("big:0", "big", 0, 0.0005, 0.0, 3000, 4),
                                                   Turn("big:1", "big", 1, None, 0.0, 5, 4)]
    summ, res, leak = run_mode(Trace(turns), spec, "tangram", model, device=CPU, warmup=False)
    rec = {r.request_id: r for r in res.records}
    assert rec["big:0"].status == "rejected" and "pool" in rec["big:0"].reason
    assert rec["big:1"].status == "rejected"
    assert summ["completed"] == 4
    assert leak["ok"]


def test_cpu_pool_is_capped_by_host_memory_in_its_own_element_size(monkeypatch):
    """The preset's pool (tens of GiB for an H100) is capped on the CPU at half the memory available, counted in
    the pool's element size: a float32 pool sized from the bf16 preset asked the CPU for 139 GB."""
    import os

    from tangram.engine.bench import pool_bytes_for

    model, gpu = get_model("smollm2-135m"), get_gpu("h100")
    eng = EngineConfig(mode="tangram", heads_per_group=3)
    page = 4096
    monkeypatch.setattr(os, "sysconf", lambda k: {"SC_AVPHYS_PAGES": 2 * 2**30 // page, "SC_PAGE_SIZE": page}[k])
    cpu = torch.device("cpu")
    assert pool_bytes_for(model, gpu, eng, cpu, elem_bytes=2) == 2**30  # half of 2 GiB, bf16 as the layout counts
    assert pool_bytes_for(model, gpu, eng, cpu, elem_bytes=4) == 2**29  # float32: the same bytes hold half
    given = eng.with_(kv_pool_bytes=3 * 2**30)
    assert pool_bytes_for(model, gpu, given, cpu, elem_bytes=4) == 3 * 2**30  # --kv-pool-gib is taken as given


def test_cpu_pool_is_capped_by_what_the_trace_can_hold(tiny, monkeypatch):
    """On the CPU the pool is never larger than the trace can fill (every session resident and uncompressed, twice
    over): the same run as with a far larger pool (every decision and count equal), without NaN-filling half the
    host's memory first. A pool well below the bound does change the run (so the comparison can tell)."""
    import os

    from tangram.engine.bench import pool_bytes_for, trace_kv_bound_bytes

    cfg, model = tiny
    page = 4096
    monkeypatch.setattr(os, "sysconf", lambda k: {"SC_AVPHYS_PAGES": 64 * 2**30 // page, "SC_PAGE_SIZE": page}[k])
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = engine("tangram", kv_pool_bytes=None)
    tr = small_trace(sessions=3, first=(120, 90, 150), later=40, out=12)
    bound = trace_kv_bound_bytes(tr, cfg, eng)
    assert pool_bytes_for(cfg, get_gpu("h100"), eng, CPU, elem_bytes=4, trace=tr) == bound < \
        pool_bytes_for(cfg, get_gpu("h100"), eng, CPU, elem_bytes=4)

    def run(e):
        summ, res, leak = run_mode(tr, DeploymentSpec(cfg, get_gpu("h100"), e, prof), "tangram", model, device=CPU,
                                   warmup=False)
        assert leak["ok"]
        return summ, [(r.rid, r.status, r.preemptions, r.prefill_tokens, r.cached_tokens) for r in res.records]

    capped, larger = run(eng), run(eng.with_(kv_pool_bytes=8 * bound))
    assert capped[0]["kv_pool_bytes"] == bound and larger[0]["kv_pool_bytes"] == 8 * bound
    # (step counts follow the measured step times, which advance the clock: they vary from run to run on the CPU)
    assert capped[1] == larger[1]
    assert capped[0]["session_evictions"] == capped[0]["preemptions"] == 0
    small = run(eng.with_(kv_pool_bytes=int(0.8 * capped[0]["peak_kv_bytes"])))  # below what the run held
    assert small[0]["session_evictions"] + small[0]["preemptions"] > 0


def test_sampling_temperature_top_p():
    from tangram.engine.sampling import Sampler, SamplingParams

    logits = torch.randn(64, 50)
    logits[:, 7] += 100.0  # one token holds almost all the mass
    s = Sampler(SamplingParams(temperature=0.7, top_p=0.5, seed=1))
    assert (s(logits) == 7).all()
    g = Sampler(SamplingParams())(logits)
    assert torch.equal(g, logits.argmax(-1))
    flat = Sampler(SamplingParams(temperature=1.0, seed=2))(torch.zeros(2000, 4))
    counts = np.bincount(flat.numpy(), minlength=4)
    assert counts.min() > 400  # uniform logits are sampled uniformly, not greedily


def test_smollm2_gguf_multiturn_session():
    """The real SmolLM2 GGUF, a 2-turn chat served through the executor in tangram mode, text prompts tokenized."""
    from tangram.tokenizer import load_tokenizer
    from tangram.engine.weights import load_model, smollm2_gguf_path

    model, info = load_model("smollm2-135m", "auto")
    cfg = model.cfg
    tok = load_tokenizer(smollm2_gguf_path())
    t0 = tok.render_chat([{"role": "user", "content": "Remember: my locker code is 4417. Say OK."}])
    t1 = "What is my locker code?"
    n0 = len(tok.encode(t0))
    trace = Trace([Turn("c:0", "c", 0, 0.0, 0.0, n0, 6, text=t0), Turn("c:1", "c", 1, None, 0.0, 8, 6, text=t1)])
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=2.0, seed=0, model=cfg.name)
    eng = EngineConfig(mode="tangram", heads_per_group=3, rho=0.5, chunk_size=32, kv_pool_bytes=8 * 2**20)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource.from_trace(trace, cfg.vocab, tokenizer=tok))
    res = Cluster(trace, [(sched, exe)]).run()
    assert [r.status for r in res.records] == ["finished", "finished"]
    stream = exe.streams["c"]
    assert stream[:n0] == tok.encode(t0)  # the prompt really is the tokenized text
    assert len(stream) == n0 + 6 + 8 + 6
    assert leak_check(sched)["ok"]


@pytest.mark.parametrize("mode,partition", [("tangram", "runtime"), ("uniform", "aot"), ("br+rp", "static")])
def test_decode_partitions(tiny, mode, partition):
    """Each decode partition path (AOT table, runtime host plan, static) runs end to end on both layouts and gives
    the token streams of the mode's default partition. On the CPU the kernels use their float64 reference, so this
    checks the executor's plumbing per partition; the split arithmetic itself is tested in tests/test_kernels.py."""
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    streams = []
    for part in (partition, None):
        eng = engine(mode, decode_partition=part)
        sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
        exe = Executor(model, sched, TokenSource(cfg.vocab, seed=5))
        res = Cluster(small_trace(sessions=2), [(sched, exe)]).run()
        assert all(r.status == "finished" for r in res.records) and leak_check(sched)["ok"]
        streams.append(exe.streams)
    assert streams[0] == streams[1]


@pytest.mark.interpret
def test_longest_first_decode_order_serves_the_same_tokens(tiny):
    """ExecutorOptions.decode_order "lpt" and "paired" reach the AOT table (item-major schedules, longest pieces
    first; the SM-paired varlen list for a bucket's exact batch) and, through the interpreted Triton decode kernel,
    give the request-order run's token streams and logits."""
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    runs = []
    for order in ("request", "lpt", "paired"):
        eng = engine("tangram", kv_pool_bytes=400_000)
        sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
        exe = Executor(model, sched, TokenSource(cfg.vocab, seed=5),
                       ExecutorOptions(record_logits=True, decode_order=order))
        assert exe.aot.lookup(0, 3, 64).item_major == (order != "request")
        assert exe.aot.lookup(0, 2, 64).per_request == (order != "paired")  # 2 rows = a bucket: the SM-paired list
        res = Cluster(small_trace(sessions=2, out=4), [(sched, exe)]).run()
        assert all(r.status == "finished" for r in res.records) and leak_check(sched)["ok"]
        runs.append(exe)
    for other in runs[1:]:
        assert runs[0].streams == other.streams
        for (r0, p0, a), (r1, p1, b) in zip(runs[0].logit_log, other.logit_log, strict=True):
            assert (r0, p0) == (r1, p1) and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_dynamic_keep_from_profile_reclaims(tiny):
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    spec = DeploymentSpec(cfg, get_gpu("h100"), engine("dynamic"), prof)
    summ, res, leak = run_mode(small_trace(), spec, "dynamic", model, device=CPU, warmup=False,
                               dynamic_keep="profile")
    assert summ["completed"] == 6 and leak["ok"]
    assert res.schedulers[0].stats.pages_reclaimed > 0


def test_dynamic_draws_match_the_cost_model(tiny):
    """Engine and simulator realise the same per-head counts for the same prefill chunk (common random numbers
    keyed by request and chunk start), so their dynamic-mode reclaim and preemptions can agree."""
    from tangram.sim.costmodel import CostModel

    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = engine("dynamic", kv_pool_bytes=400_000)
    seed = int(np.random.default_rng().integers(0, 1000))
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=3),
                   ExecutorOptions(dynamic_keep="profile", sampling=SamplingParams(seed=seed)))
    cm = CostModel(cfg, get_gpu("h100"), eng, sched.layout, sched.profile, tables=None, seed=seed)
    for rid, n in enumerate((29, 35, 7)):
        sched.add_request(rid, f"s{rid}", n, 3)
    seen = 0
    while sched.has_work():
        plan = sched.schedule()
        res = exe.execute(plan)
        if plan.num_prefill:
            np.testing.assert_array_equal(res.realized_keep, cm.execute(plan).realized_keep)
            seen += plan.num_prefill
        sched.update(plan, res)
    assert seen >= 4  # chunks of 16: 2 + 3 + 1 (+ none for decode)


def _served(model, cfg, prof, mode, cuda_graphs, trace, graph_layers=4, **eng_kw):
    eng = engine(mode, kv_pool_bytes=400_000, **eng_kw)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=3),
                   ExecutorOptions(record_logits=True, cuda_graphs=cuda_graphs, graph_layers=graph_layers))
    res = Cluster(trace, [(sched, exe)]).run()
    assert all(r.status == "finished" for r in res.records) and leak_check(sched)["ok"]
    return exe, res


@pytest.mark.parametrize("mode,graph_layers", [pytest.param("tangram", 1, marks=pytest.mark.interpret),
                                               ("full", 0), ("full", 1)])
def test_decode_graph_path_equals_eager(tiny, mode, graph_layers):
    """Pure-decode steps through the static graph buffers (padded to power-of-two buckets, padded rows in the
    scratch page, block tables regrown when a table outgrows them) give the eager path's tokens and logits, as
    one graph per step or one per layer (the carry between pieces). ``emulate`` runs the captured callables
    without CUDA; each key's callable is built once and replays read only the static buffers, as a CUDA graph
    does. tangram runs the interpreted Triton decode kernel."""
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    # three sessions decode together (batch 3 -> bucket 4, one padded row); the 90-token one outgrows the
    # 16-page tables the buffers start with (page size 4)
    tr = small_trace(sessions=3, first=(29, 90, 41), out=7)
    eager, r0 = _served(model, cfg, prof, mode, "off", tr)
    graph, r1 = _served(model, cfg, prof, mode, "emulate", tr, graph_layers=graph_layers, cuda_graph_max_bs=4)
    assert eager.graphs is None and graph.graphs is not None
    assert len(graph.graphs.pieces) == (cfg.num_layers if graph_layers == 1 else 1)
    st = graph.graphs.stats
    assert st.replays > 0 and (4, 1024) in st.keys  # aot: the canonical context bucket of the split maps
    if mode == "full":
        assert st.regrows >= 1
    assert graph.streams == eager.streams
    ref = {(r, p): l for r, p, l in eager.logit_log}
    got = {(r, p): l for r, p, l in graph.logit_log}
    assert got.keys() == ref.keys()
    err = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    assert err < 1e-5, err
    # graphed steps are labelled, so the overhead fit and the reports can tell them apart
    assert r1.replicas[0].breakdown["engine_graph"] > 0 and "engine_graph" not in r0.replicas[0].breakdown


def test_graph_bucket_rules():
    e = EngineConfig(mode="tangram", cuda_graph_max_bs=48, max_num_seqs=256)
    assert e.graph_max_batch == 64
    assert list(e.decode_graphed(np.array([0, 1, 3, 64, 65, 8]), np.array([0, 0, 0, 0, 0, 1]))) == \
        [False, True, True, True, False, False]
    assert EngineConfig(mode="full", cuda_graph_max_bs=0).graph_max_batch == 0
    assert EngineConfig(mode="tangram", decode_partition="runtime").graph_max_batch == 0  # host plan per step
    assert EngineConfig(mode="full", max_num_seqs=5).graph_max_batch == 8
    from tangram.engine.cuda_graphs import context_bucket
    assert [context_bucket(n) for n in (1, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]


def test_run_diagnostics_hooks_restore_and_record(tiny):
    """tangram-bench's in-run diagnostics: Triton compile hooks are installed only during the run and record
    what Triton passes them; GC pauses are counted; metrics carry both."""
    import gc

    from triton import knobs

    from tangram.engine.bench import GcPauses, TritonCompiles

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with TritonCompiles() as tc, GcPauses() as gp:
        assert knobs.runtime.jit_post_compile_hook is not None
        info = type("Fn", (), {"name": "_k"})()
        kw = dict(key=("k",), repr="_k[...](c: i32)", fn=info, compile={}, is_manual_warmup=False,
                  already_compiled=False)
        assert not knobs.runtime.jit_cache_hook(**kw)
        knobs.runtime.jit_post_compile_hook(**kw)
        gc.collect()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    s = tc.summary()
    assert s["count"] == 1 and s["first"][0]["kernel"] == "_k" and s["first"][0]["s"] >= 0
    # a compile in the run names the arguments whose class differs from the warm-up's compile of the kernel
    tc2 = TritonCompiles()
    tc2.running = False
    sig = {"X": "*bf16", "n": "i32", "m": "i32"}
    with tc2:
        for cfg, const in (({(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}, {}),
                           ({(0,): [["tt.divisibility", 16]]}, {(2,): 1})):
            if const:
                tc2.start()
            kw = dict(key=(str(cfg),), repr="", fn=info, compile={"signature": sig, "constants": const,
                                                                   "configs": [cfg]},
                      is_manual_warmup=False, already_compiled=False)
            knobs.runtime.jit_cache_hook(**kw)
            knobs.runtime.jit_post_compile_hook(**kw)
    s2 = tc2.summary()
    assert s2["count"] == 1 and s2["first"][0]["differs"] == {"n": "i32/16 -> i32", "m": "i32 -> i32=1"}
    assert gp.n >= 1 and gp.s >= 0
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    spec = DeploymentSpec(cfg, get_gpu("h100"), engine("tangram"), prof)
    summ, _, _ = run_mode(small_trace(sessions=2), spec, "tangram", model, device=CPU, warmup=False,
                          cuda_graphs="emulate")
    assert summ["triton_compiles_in_run"]["count"] == 0  # reference kernels: nothing compiles
    assert summ["gc_pauses"]["count"] >= 0
    g = summ["cuda_graphs"]
    assert g["emulated"] and g["captured_before_run"] > 0 and g["captured_in_run"] == 0 and g["replays"] > 0
    # two sessions never decode more than two rows together: buckets 1 and 2 only, not every bucket up to 64
    assert g["max_batch"] == 64 and sorted({b for b, _ in g["keys"]}) == [1, 2]


def test_prefill_keep_counts_uploaded_once_per_step(tiny, monkeypatch):
    """Per-head keep counts reach the selection as device tensors (views of the step's one pinned upload): a numpy
    array uploaded with a plain ``.to(device)`` inside the layer loop would synchronise the stream once per layer
    on the GPU. Every chunk keeps exactly its counts (clipped to the chunk), and the step's chunks of a layer go
    through one selection call."""
    import tangram.engine.executor as ex
    from tangram.kernels import select_scatter as real

    calls = []

    def spy(scores, k, v, cu, max_chunk, counts, *a, **kw):
        kept = real(scores, k, v, cu, max_chunk, counts, *a, **kw)
        calls.append((counts is None or isinstance(counts, torch.Tensor), cu.numel() - 1))
        if counts is not None:
            c = (cu[1:] - cu[:-1]).long()
            assert torch.equal(kept.long(), torch.minimum(counts.long(), c[:, None]))
        return kept

    monkeypatch.setattr(ex, "select_scatter", spy)
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    for mode in ("tangram", "uniform", "dynamic", "full"):
        spec = DeploymentSpec(cfg, get_gpu("h100"), engine(mode, max_batched_tokens=64, kv_pool_bytes=300_000), prof)
        summ, _, leak = run_mode(small_trace(sessions=2), spec, mode, model, device=CPU, warmup=False,
                                 dynamic_keep="profile" if mode == "dynamic" else "topk")
        assert summ["completed"] == 4 and leak["ok"]
    assert calls and all(ok for ok, _ in calls) and max(n for _, n in calls) >= 2  # chunks of a step batched


@pytest.mark.parametrize("mode", ["tangram", "dynamic", "full"])
def test_device_block_table_mirror_follows_the_scheduler(tiny, mode):
    """The executor keeps the block table on the device from the scheduler's write log: under evictions,
    preemptions, parking and the dynamic mode's reclaim, every step's rows read exactly the scheduler's pages."""
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = engine(mode, kv_pool_bytes=60_000)  # tight: sessions are evicted and re-prefilled
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=3), ExecutorOptions(cuda_graphs="emulate",
                                                                                  dynamic_keep="profile"))
    checked = [0]
    real = exe.execute

    def checked_execute(plan):
        res = real(plan)
        rows = np.concatenate([plan.decode_rows, plan.prefill_rows]).astype(np.int64)
        if rows.size:
            npg = sched.bt.npages[rows]
            dev = exe._bt_dev.numpy()[rows]
            for r in range(rows.size):
                for t in range(npg.shape[1]):
                    n = int(npg[r, t])
                    assert np.array_equal(dev[r, t, :n], sched.bt.pages[rows[r], t, :n]), (plan.step, r, t)
            checked[0] += 1
        return res

    exe.execute = checked_execute
    res = Cluster(small_trace(sessions=3, first=(29, 90, 41), out=7), [(sched, exe)]).run()
    assert all(r.status == "finished" for r in res.records) and leak_check(sched)["ok"]
    assert checked[0] > 10 and sched.stats.session_evictions + sched.stats.preemptions > 0


# ------------------------------------------------------------------ scorers and budget scopes in the engine


def _recording(monkeypatch):
    """Record (method, chunk start, slot_to_head, scores [H, c]) of every chunk and layer the executor scores, in
    step, layer, chunk order (the batched SnapKV path and the per-chunk dispatch alike)."""
    import tangram.engine.executor as ex
    real, seen = ex.Executor._chunk_scores, []
    # the one-launch SnapKV path never materialises the scores: record the unfused launches it equals bit for bit
    # (tests/test_fused_compression.py; test_fused_snapkv_path_equals_the_unfused_one below)
    monkeypatch.setattr(ex.Executor, "_fused_snapkv", lambda self, st: False)

    def rec(self, l, q, k, v, lse, cu, max_chunk, st):
        out = real(self, l, q, k, v, lse, cu, max_chunk, st)
        for i, (pos0, c) in enumerate(zip(st["pf_start"], st["pf_tokens"].tolist())):
            seen.append((self.engine.score_method, pos0, self.cache.slot_to_head[l].clone(), out[i, :, :c].clone()))
        return out

    monkeypatch.setattr(ex.Executor, "_chunk_scores", rec)
    return seen


def _one_session(cfg, model, eng, prof, n, opts=None):
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=11), opts or ExecutorOptions())
    sched.add_request(0, "s", n, 2)
    realized = []
    while sched.has_work():
        plan = sched.schedule()
        res = exe.execute(plan)
        if plan.num_prefill:
            realized.append((int(plan.prefill_tokens[0]), res.realized_keep))
        sched.update(plan, res)
    sched.end_session("s")
    assert leak_check(sched)["ok"]
    return exe, sched, realized


@pytest.mark.interpret
@pytest.mark.parametrize("method", ["pyramidkv"])
def test_fused_snapkv_path_equals_the_unfused_one(tiny, monkeypatch, method):
    """SnapKV/PyramidKV chunks longer than the window compress in one launch (interpreted Triton kernel here),
    every layer's at once after the last layer (deferred) or layer by layer when the step's stacked projections
    would pass DEFER_COMPRESS_MAX_BYTES: the same kept counts, pages and generated tokens as the unfused score +
    finish + select launches."""
    import tangram.engine.executor as ex
    from tangram.budgets import BudgetProfile

    cfg, model = tiny
    L, H = cfg.num_layers, cfg.num_kv_heads
    mu = 0.3 + 0.5 * np.random.default_rng(1).permutation(L * H).reshape(L, H) / (L * H)
    prof = BudgetProfile(mu, np.zeros_like(mu), 0.0, 0.97, method, cfg.name)
    calls = {"layer": 0, "step": 0}
    one, every = ex.snapkv_compress, ex.snapkv_compress_layers

    def count(key, real):
        def f(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)
        return f
    monkeypatch.setattr(ex, "snapkv_compress", count("layer", one))
    monkeypatch.setattr(ex, "snapkv_compress_layers", count("step", every))
    runs = []
    for fused, limit in ((True, ex.DEFER_COMPRESS_MAX_BYTES), (True, 0), (False, ex.DEFER_COMPRESS_MAX_BYTES)):
        calls.update(layer=0, step=0)
        monkeypatch.setattr(ex, "DEFER_COMPRESS_MAX_BYTES", limit)
        monkeypatch.setattr(ex.Executor, "_fused_snapkv", lambda self, st, f=fused: f and
                            int(st["pf_tokens"].min()) > self.score_params.window)
        eng = engine("tangram", score_method=method, kv_pool_bytes=400_000)
        exe, sched, realized = _one_session(cfg, model, eng, prof, 29, ExecutorOptions(score_window=4))
        runs.append((realized, list(exe.streams["s"])))
        # chunks of 16 + 13 tokens: two steps of every layer
        assert calls == ({"layer": 0, "step": 2} if fused and limit else
                         {"layer": 2 * L, "step": 0} if fused else {"layer": 0, "step": 0})
    for other in runs[1:]:
        assert [r[0] for r in runs[0][0]] == [r[0] for r in other[0]]
        for (c0, k0), (c1, k1) in zip(runs[0][0], other[0]):
            assert np.array_equal(np.asarray(k0), np.asarray(k1))
        assert runs[0][1] == other[1]


@pytest.mark.parametrize("method,window", [("ada-snapkv", 32), ("ada-snapkv", 4), ("pyramidkv", 32),
                                           ("pyramidkv", 4), ("keydiff", 32), ("tova", 32), ("streaming-llm", 32),
                                           ("expected-attention", 32)])
def test_engine_scores_every_chunk_like_the_profiles_observer(tiny, monkeypatch, method, window):
    """The executor scores each prefill chunk with EngineConfig.score_method, and its slot-order scores are the
    profiles observer's scores of the same tokens (so a profile is calibrated with what the engine selects by).
    Budgets just under 1 keep every token, so both see the same uncompressed cache on the second chunk; the
    distinct budgets give a non-trivial slot order. SnapKV with a window shorter than the chunks runs the batched
    path (one score launch for all chunks, kvpress's finish on the batch); a longer window the per-chunk one."""
    from tangram.budgets import BudgetProfile
    from tangram.engine.model import TorchAttention
    from tangram.profiles.scoring import make_scorer

    cfg, model = tiny
    seen = _recording(monkeypatch)
    L, H = cfg.num_layers, cfg.num_kv_heads
    mu = 0.95 + 0.04 * np.random.default_rng(0).permutation(L * H).reshape(L, H) / (L * H)
    prof = BudgetProfile(mu, np.zeros_like(mu), 0.0, 0.97, method, cfg.name)
    eng = engine("tangram", score_method=method, kv_pool_bytes=400_000)
    exe, sched, _ = _one_session(cfg, model, eng, prof, 29, ExecutorOptions(score_window=window))
    assert not np.all(sched.layout.perm == np.arange(H))
    assert [s[:2] for s in seen] == [(method, 0)] * L + [(method, 16)] * L  # chunks of 16 + 13, every layer
    sc = make_scorer(method, L, window)
    sess = Session(model, TorchAttention(cfg, observers=[sc]))
    stream = exe.streams["s"]
    for j, (a, b) in enumerate(((0, 16), (16, 29))):
        sess.forward(stream[a:b])
        ref = sc.take()[:, 0]  # [L, H, c] KV-head order
        for l in range(L):
            _, _, s2h, got = seen[j * L + l]
            want = ref[l][s2h.long()]
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            fin = torch.isfinite(want)
            assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6), (method, j, l)


@pytest.mark.parametrize("method", ["ada-snapkv", "keydiff", "expected-attention", "pyramidkv", "tova",
                                    "streaming-llm"])
@pytest.mark.parametrize("scope", ["per-layer", "cross-layer", "uniform"])
def test_dynamic_mode_keeps_what_the_scope_fixes(tiny, monkeypatch, method, scope):
    """Dynamic mode realises the scope's selection: per layer ceil(r_l H c) (Ada-KV), ceil(rho L H c) over all
    layers (one threshold, per-layer counts differ), or ceil(r_l c) per head; for scorers without ties the
    per-head counts are those of the profiles' selection of the same scores."""
    from tangram.budgets import layer_targets
    from tangram.kernels.scoring import scope_keep_mask

    if method == "pyramidkv" and scope == "cross-layer":
        pytest.skip("pyramidkv has no cross-layer scope (its schedule fixes per-layer budgets)")
    cfg, model = tiny
    seen = _recording(monkeypatch)
    L, H, rho = cfg.num_layers, cfg.num_kv_heads, 0.3
    prof = synthetic_profile(L, H, rho, alpha=1.0, seed=0, model=cfg.name)
    eng = engine("dynamic", score_method=method, budget_scope=scope, rho=rho, kv_pool_bytes=400_000)
    # window 4: the always-kept window (+inf, ties) stays inside every budget, so the kept sets are unique
    _, sched, realized = _one_session(cfg, model, eng, prof, 29, ExecutorOptions(score_window=4))
    r = layer_targets(method, scope, L, rho)
    assert [c for c, _ in realized] == [16, 13]
    for j, (c, keep) in enumerate(realized):
        keep = keep[0]  # [L, H], slot order (monolithic layout: head order)
        if scope == "per-layer":
            assert keep.sum(1).tolist() == [math.ceil(x * H * c - 1e-9) for x in r]
        elif scope == "uniform":
            assert (keep == np.ceil(r * c - 1e-9)[:, None]).all()
        else:
            assert keep.sum() == math.ceil(rho * L * H * c - 1e-9)
        # the same kept sets as the profiles' selection where scores have no ties at the cut (TOVA and
        # StreamingLLM score all heads alike; PyramidKV's top layer keeps fewer tokens than its +inf window)
        if method in ("ada-snapkv", "keydiff", "expected-attention"):
            scores = torch.stack([s[3] for s in seen[j * L:(j + 1) * L]])
            np.testing.assert_array_equal(keep, scope_keep_mask(scores, rho, scope, method).sum(-1).numpy())
    assert sched.stats.pages_reclaimed >= 0


@pytest.mark.parametrize("method", ["ada-snapkv", "pyramidkv", "keydiff", "tova", "streaming-llm",
                                    "expected-attention"])
def test_every_scorer_serves_the_trace_in_tangram_and_dynamic_modes(tiny, method):
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    for mode in ("tangram", "dynamic"):
        spec = DeploymentSpec(cfg, get_gpu("h100"), engine(mode, score_method=method), prof)
        summ, res, leak = run_mode(small_trace(), spec, mode, model, device=CPU, warmup=False)
        assert summ["completed"] == 6 and summ["rejected"] == 0 and leak["ok"] and leak["pages_in_use"] == 0


def test_engine_rejects_a_method_it_cannot_run(tiny):
    cfg, model = tiny
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = engine("tangram", score_method="kvzip")
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    with pytest.raises(ConfigError, match="reconstruction"):
        Executor(model, sched, TokenSource(cfg.vocab))
    with pytest.raises(ConfigError, match="cross-layer"):
        engine("dynamic", score_method="pyramidkv", budget_scope="cross-layer")
    with pytest.raises(ConfigError, match="unknown budget scope"):
        engine("dynamic", budget_scope="global")


def test_fused_compression_is_chosen_per_engine_by_its_chunk_size():
    """The fused compression for engines whose chunks are up to 4096 tokens (where it measured faster on the H100),
    the unfused launches for longer chunks; never for chunks inside the observation window or for other scorers."""
    from types import SimpleNamespace

    import tangram.engine.executor as ex
    from tangram.kernels.scoring import ScoreParams

    def choose(chunk_size, method="ada-snapkv", shortest=100):
        fake = SimpleNamespace(engine=SimpleNamespace(score_method=method, chunk_size=chunk_size),
                               score_params=ScoreParams(window=32))
        return ex.Executor._fused_snapkv(fake, {"pf_tokens": np.array([shortest, 500])})

    assert choose(512) and choose(ex.FUSED_COMPRESS_MAX_CHUNK)
    assert choose(4096) and not choose(ex.FUSED_COMPRESS_MAX_CHUNK + 1) and not choose(8192)
    assert not choose(512, shortest=32) and not choose(512, method="keydiff")

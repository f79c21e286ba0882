"""Fast-forward through runs of decode steps: the step-by-step path is the reference.

Three levels, each against the reference and never against itself:
* scheduler: ``plan_run`` + ``commit_run(j)`` leave the state ``j`` schedule/update pairs leave, and
  ``StepRun.plan(i)`` is the plan ``schedule`` emits at step ``i``;
* cost model: ``execute_run`` gives each step the duration and terms ``execute`` gives it one by one (rescale cache
  included), and ``commit_run(j)`` leaves the cache as ``j`` single steps do;
* harness: whole replays (default trace, a Mooncake import, 3 replicas under each router, a memory-starved pool
  with evictions and preemptions, the dynamic mode, the runtime partition) give identical counts and per-request
  times, per-step KV samples and operator times equal to 1e-9 (the brief asks for 0.1 %).
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_gpu, get_model
from tangram.scheduler import Scheduler
from tangram.sim.costmodel import CostModel
from tangram.sim.run import simulate
from tangram.spec import DeploymentSpec, default_profile
from tangram.traces import Trace, Turn, default_trace_path, generate, generate_mooncake, import_mooncake, \
    load_trace, write_mooncake

LLAMA, H100 = get_model("llama-3.1-8b"), get_gpu("h100-80gb")
REL = 1e-9


def _spec(mode="tangram", model=LLAMA, replicas=1, router="session-affinity", tables="auto", **eng) -> DeploymentSpec:
    e = EngineConfig(mode=mode, **eng)
    return DeploymentSpec(model, H100, e, default_profile(model, e.rho, e.alpha), replicas, router, 0, tables)


def _close(a, b, rel=REL) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def assert_same_replay(trace, spec, mode=None, *, min_runs=1):
    """Replay with and without fast-forward; everything the reference reports must agree."""
    a, ra = simulate(trace, spec, mode, fast_forward=True)
    b, rb = simulate(trace, spec, mode, fast_forward=False)
    assert sum(r.runs for r in ra.replicas) >= min_runs, "fast-forward never engaged: the test would prove nothing"
    assert sum(r.runs for r in rb.replicas) == 0
    for k in ("steps", "preemptions", "session_evictions", "pages_reclaimed", "completed", "rejected",
              "peak_kv_bytes", "rejected_reasons"):
        assert a[k] == b[k], k
    for sa, sb in zip(ra.schedulers, rb.schedulers):
        assert dataclasses.asdict(sa.stats) == dataclasses.asdict(sb.stats)
        assert (sa.pool.n_used, sa.pool.total_allocs, sa.pool.total_frees, sa.live_tokens) == \
            (sb.pool.n_used, sb.pool.total_allocs, sb.pool.total_frees, sb.live_tokens)
    for pa, pb in zip(ra.records, rb.records):
        assert (pa.status, pa.reason, pa.replica, pa.preemptions, pa.prefill_tokens) == \
            (pb.status, pb.reason, pb.replica, pb.preemptions, pb.prefill_tokens), pa.request_id
        for f in ("arrival_s", "admitted_s", "first_token_s", "finish_s"):
            assert _close(getattr(pa, f), getattr(pb, f)), (pa.request_id, f)
    for ta, tb in zip(ra.replicas, rb.replicas):
        assert ta.steps == tb.steps and ta.reserved == tb.reserved and ta.live == tb.live
        assert np.allclose(ta.t, tb.t, rtol=REL, atol=0)
        assert set(ta.breakdown) == set(tb.breakdown)
        assert all(_close(ta.breakdown[k], tb.breakdown[k]) for k in ta.breakdown)
        assert _close(ta.busy_s, tb.busy_s)
    for k in ("kv_utilization", "fragmentation", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "throughput_rps"):
        assert _close(a[k], b[k]), k
    return a, ra


# --------------------------------------------------------------------------- whole replays


def test_default_trace_identical():
    tr = load_trace(default_trace_path()).head(30)
    for mode in ("tangram", "full"):
        assert_same_replay(tr, _spec(), mode)


def test_mooncake_import_identical(tmp_path):
    """A Mooncake-format trace as imported (shared-prefix chains, branches, think times from timestamp gaps)."""
    syn = generate_mooncake(160, seed=3, duration_s=60.0)
    write_mooncake(syn.records, tmp_path / "mc.jsonl")
    tr = import_mooncake(tmp_path / "mc.jsonl")
    assert any(t.turn > 0 for t in tr.turns) and any(t.prefix for t in tr.turns)
    for mode in ("tangram", "full"):  # the prefix cache's units: whole chunks / whole pages
        a, _ = assert_same_replay(tr, _spec(kv_pool_bytes=12 * 2**30), mode)
        assert a["prefix_hits"] > 0


@pytest.mark.parametrize("seed,pool_gib", [(3, 3), (5, 4)])
def test_mooncake_import_dynamic_identical(tmp_path, seed, pool_gib):
    """The dynamic mode (chunks take their pages as they run) with the prefix cache in a small pool: runs go past
    a prefilling turn whose chunk waits for pages only while making room could free none (no idle unit, no copy
    source to drop: the queue head's failed admission leaves its hit's units idle for the next step's chunk to
    evict). Both pools fail without the prefix-cache condition of ``Scheduler._stalled``."""
    syn = generate_mooncake(160, seed=seed, duration_s=60.0)
    write_mooncake(syn.records, tmp_path / "mc.jsonl")
    a, _ = assert_same_replay(import_mooncake(tmp_path / "mc.jsonl"), _spec(kv_pool_bytes=pool_gib * 2**30),
                              "dynamic")
    assert a["prefix_hits"] > 0 and a["preemptions"] > 0


def test_unchecked_pool_replays_as_the_checked_one(tmp_path, monkeypatch):
    """The replay's hot path runs the page pool without its per-call checks (``PagePool.validate`` off, the
    default outside the tests): the same Mooncake import under memory pressure (prefix-cache evictions, dropped
    copy sources, evicted sessions) gives the same per-request results and counts as with every check on."""
    from tangram.paging import PagePool

    syn = generate_mooncake(160, seed=3, duration_s=60.0)
    write_mooncake(syn.records, tmp_path / "mc.jsonl")
    tr = import_mooncake(tmp_path / "mc.jsonl")
    for mode in ("tangram", "full"):
        spec = _spec(kv_pool_bytes=4 * 2**30)
        a, ra = simulate(tr, spec, mode, fast_forward=True)
        monkeypatch.setattr(PagePool, "validate", False)
        b, rb = simulate(tr, spec, mode, fast_forward=True)
        monkeypatch.setattr(PagePool, "validate", True)
        assert ra.schedulers[0].pool.check and not rb.schedulers[0].pool.check
        assert a["session_evictions"] > 0 and ra.schedulers[0].pc.evictions > 0, mode
        for k in ("steps", "preemptions", "session_evictions", "completed", "ttft_p99_s", "prefix_hits"):
            assert a[k] == b[k], (mode, k)
        assert dataclasses.asdict(ra.schedulers[0].stats) == dataclasses.asdict(rb.schedulers[0].stats)
        assert [(p.status, p.first_token_s, p.finish_s) for p in ra.records] == \
            [(p.status, p.first_token_s, p.finish_s) for p in rb.records]


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding", "session-affinity"])
def test_three_replicas_each_router_identical(router):
    """Turns routed to a replica in the middle of its run cut the run there; round-robin migrates sessions, so
    ending a session on a replica during its run cuts it too."""
    tr = generate(24, "short", seed=7, rate=6.0, turns="uniform:2:4", output_tokens="uniform:20:200",
                  think_time="exp:1.0")
    a, _ = assert_same_replay(tr, _spec(replicas=3, router=router, kv_pool_bytes=8 * 2**30), "tangram", min_runs=3)
    assert a["completed"] == len(tr.turns)


def test_memory_starved_pool_evicts_and_preempts_identically():
    """A 3 GiB pool for sessions of ~16K tokens: decode growth runs the pool dry, so idle sessions are evicted and
    running turns preempted; a run must stop before the step that could not get its pages."""
    tr = generate(12, "short", seed=11, rate=4.0, turns="uniform:2:3", output_tokens="uniform:300:900",
                  think_time="exp:0.5")
    for mode in ("dynamic", "full"):
        a, _ = assert_same_replay(tr, _spec(tables=None, chunk_size=1024, max_batched_tokens=2048,
                                            kv_pool_bytes=3 * 2**30), mode)
        assert a["preemptions"] > 0 and a["session_evictions"] > 0, (mode, a["preemptions"], a["session_evictions"])


def test_runtime_and_static_partitions_identical():
    tr = generate(10, "short", seed=5, rate=3.0, turns="uniform:1:3", output_tokens="uniform:30:120")
    for part in ("runtime", "static"):
        assert_same_replay(tr, _spec(decode_partition=part), "br+rp")


# --------------------------------------------------------------------------- scheduler


def _busy_scheduler(seed: int, mode: str = "tangram", pages: tuple[int, int] = (120, 400)) -> Scheduler:
    rng = np.random.default_rng(seed)
    L, H = 4, 4
    model = dataclasses.replace(LLAMA, name="tiny", num_layers=L, num_kv_heads=H, num_q_heads=2 * H, head_dim=8,
                                max_context=100_000)
    eng = EngineConfig(mode=mode, heads_per_group=2, page_size=4, chunk_size=64, max_batched_tokens=160)
    s = Scheduler(model, eng, synthetic_profile(L, H, 0.3, seed=seed), num_pages=int(rng.integers(*pages)))
    for i in range(int(rng.integers(3, 9))):
        s.add_request(i, f"s{i}", int(rng.integers(5, 150)), int(rng.integers(5, 80)))
    return s


def _step(s: Scheduler):
    plan = s.schedule()
    events = s.update(plan, _no_result(plan))
    return plan, events


def _no_result(plan):
    from tangram.plan import StepResult

    return StepResult(plan.step, 0.0, realized_keep=plan.prefill_keep if plan.retention == "global" else None)


@pytest.mark.parametrize("seed", range(8))
def test_commit_run_equals_single_steps(seed):
    """Each run found while a busy scheduler drains: committing j of its k steps (random j) leaves the state
    j schedule/update pairs leave, and plan(i) is exactly the plan schedule() emits."""
    s = _busy_scheduler(seed, mode=["tangram", "full", "dynamic", "br"][seed % 4])
    runs, chunks, _ = _runs_equal_single_steps(s, np.random.default_rng(seed))
    assert runs > 0
    if s.engine.reserve_exact:
        assert chunks > 0, "no run carried a prefill chunk"


@pytest.mark.parametrize("seed", range(4))
def test_commit_run_past_a_stalled_chunk_equals_single_steps(seed):
    """Without budget reservation (the dynamic mode) a prefilling turn takes its chunk's pages as it runs; in a
    pool too small for the batch, its chunk waits for pages while the others decode. Runs found with such a
    turn waiting (``Scheduler._stalled``) leave it waiting at each step, as the single steps do."""
    s = _busy_scheduler(seed, mode="dynamic", pages=(90, 140))
    for i in range(int(np.random.default_rng(seed).integers(3, 6))):  # a longer prompt and a longer queue
        s.add_request(100 + i, f"t{i}", 200, 40)
    runs, _, stalled = _runs_equal_single_steps(s, np.random.default_rng(seed + 100))
    assert stalled > 0, "no run was planned past a waiting chunk: the test would prove nothing"


@pytest.mark.parametrize("seed", range(16))
def test_commit_run_past_a_stalled_chunk_with_shared_prefixes_equals_single_steps(seed):
    """As above with turns over shared prefix chains, with and without the session cache: a stalled chunk's attempt
    would evict an idle prefix unit (one a finished turn or the queue head's failed admission let go of) or drop a
    copy source only the cache keeps, so no run may go past it then. Seeds 2, 5, 7, 12, 14 fail without the
    idle-unit condition of ``Scheduler._stalled``, seeds 7 and 13 without the copy-source one."""
    rng = np.random.default_rng(seed)
    L, H = 2, 4
    model = dataclasses.replace(LLAMA, name="tiny", num_layers=L, num_kv_heads=H, num_q_heads=2 * H, head_dim=8,
                                max_context=100_000)
    chains = [(("a", 40),), (("a", 40), ("b", 70)), (("c", 100),)]
    stalled = 0
    for session_cache in (False, True):
        eng = EngineConfig(mode="dynamic", heads_per_group=2, page_size=4, chunk_size=32, max_batched_tokens=80,
                           session_cache=session_cache)
        s = Scheduler(model, eng, synthetic_profile(L, H, 0.3, seed=seed), num_pages=int(rng.integers(60, 160)))
        for i in range(int(rng.integers(4, 10))):
            ch = chains[int(rng.integers(0, 3))]
            s.add_request(i, f"s{i}", sum(n for _, n in ch) + int(rng.integers(5, 120)), int(rng.integers(5, 60)),
                          prefix=ch)
        stalled += _runs_equal_single_steps(s, np.random.default_rng(seed))[2]
    assert stalled > 0, "no run was planned past a waiting chunk: the test would prove nothing"


def _runs_equal_single_steps(s: Scheduler, rng) -> tuple[int, int, int]:
    """Drain ``s``; at each run it finds, commit a random number of its steps and compare with a copy advanced step
    by step. Returns (runs, prefill chunks inside runs, runs planned while a turn was prefilling)."""
    runs = chunks = stalled = 0
    for _ in range(3000):
        if not s.has_work():
            break
        run = s.plan_run()
        if run is None:
            _step(s)
            continue
        runs += 1
        stalled += bool(s._partition()[3]) and run.chunk_ids.size == 0
        ref = copy.deepcopy(s)
        j = int(rng.integers(1, run.k + 1))
        for i in range(1, j + 1):
            plan, ev_ref = _step(ref)
            mine = run.plan(i)
            for f in ("step", "decode_ids", "decode_rows", "decode_ctx", "decode_head_lens", "prefill_ids",
                      "prefill_rows", "prefill_start", "prefill_tokens", "prefill_last", "prefill_head_lens",
                      "prefill_keep", "prefill_pages"):
                assert np.array_equal(getattr(plan, f), getattr(mine, f)), (f, i)
            assert plan.counters == mine.counters, (i, plan.counters, mine.counters)
            chunks += plan.num_prefill
        ev = s.commit_run(run, j)
        assert [(e.rid, e.kind) for e in ev] == [(e.rid, e.kind) for e in ev_ref]
        assert dataclasses.asdict(s.stats) == dataclasses.asdict(ref.stats)
        for f in ("head_lens", "ctx"):
            assert np.array_equal(getattr(s, f), getattr(ref, f))
        assert np.array_equal(s.bt.npages, ref.bt.npages) and np.array_equal(s.bt.lens, ref.bt.lens)
        assert (s.pool.n_free, s.pool.total_allocs, s.live_tokens, s.bt.rows_touched) == \
            (ref.pool.n_free, ref.pool.total_allocs, ref.live_tokens, ref.bt.rows_touched)
        assert [(r.rid, r.generated, r.status) for r in s.requests.values()] == \
            [(r.rid, r.generated, r.status) for r in ref.requests.values()]
        # the next step (whatever it is) agrees too
        if s.has_work():
            pa, _ = _step(s)
            pb, _ = _step(ref)
            assert np.array_equal(pa.decode_ids, pb.decode_ids) and np.array_equal(pa.prefill_ids, pb.prefill_ids)
            assert pa.counters == pb.counters
    assert not s.has_work(), "the scheduler did not drain"
    return runs, chunks, stalled


def test_plan_run_refuses_when_the_next_step_would_admit():
    """Nothing may be fast-forwarded while the queue's head could be admitted (or was never tried)."""
    s = _busy_scheduler(0)
    while s.plan_run() is None and s.has_work():
        _step(s)
    assert s.plan_run() is not None and s.declined is None
    s.add_request(99, "new", 4, 3)  # an arrival: only the next step can try to admit it
    if s.waiting[0].rid == 99:
        assert s.plan_run() is None and s.declined == "head not blocked"
    run = s.plan_run()
    if run is not None:  # a blocked head: the new turn queues behind it and changes nothing
        assert s.waiting[0].rid != 99


def test_plan_run_declines_runs_shorter_than_min_steps():
    """``min_steps`` (the harness asks for 2: a lone step is priced faster by ``execute``) declines exactly the runs
    shorter than it, leaving the scheduler as it was: the run planned without it is the same run."""
    s = _busy_scheduler(3)
    seen = set()
    for _ in range(3000):
        if not s.has_work():
            break
        ref = copy.deepcopy(s)
        run = ref.plan_run()
        if run is None:
            assert s.plan_run(min_steps=2) is None  # (declined as "too short" where a run of one is found short)
            _step(s)
            continue
        short = s.plan_run(min_steps=run.k + 1)
        assert short is None and s.declined == "too short"
        same = s.plan_run(min_steps=run.k)
        assert same is not None and same.k == run.k and np.array_equal(same.alloc, run.alloc)
        assert np.array_equal(same.chunk_ids, run.chunk_ids) and np.array_equal(same.decode_ids, run.decode_ids)
        seen.add(run.k == 1)
        s.commit_run(same, same.k)
    assert seen == {True, False}, "needs runs of one step and longer ones"


def test_commit_run_rejects_a_stale_run():
    s = _busy_scheduler(1)
    while s.plan_run() is None and s.has_work():
        _step(s)
    run = s.plan_run()
    s.commit_run(run, 1)
    with pytest.raises(ValueError):
        s.commit_run(run, 1)


# --------------------------------------------------------------------------- cost model


@pytest.mark.parametrize("mode,part", [("tangram", None), ("full", None), ("br+rp", "runtime"), ("dynamic", None)])
def test_execute_run_prices_each_step_as_execute(mode, part):
    spec = _spec(mode, decode_partition=part)
    eng = spec.engine
    from tangram.sim.run import build_replica

    sched, cm = build_replica(spec, eng, 0)
    rng = np.random.default_rng(2)
    for i in range(12):
        sched.add_request(i, f"s{i}", int(rng.integers(200, 6000)), int(rng.integers(300, 900)))
    run = None
    for _ in range(2000):
        run = sched.plan_run()
        if run is not None and run.k > 40:
            break
        plan = sched.schedule()
        sched.update(plan, cm.execute(plan))
    assert run is not None and run.k > 40
    ref = copy.deepcopy(cm)
    res = cm.execute_run(run)
    j = run.k // 2
    for i in range(1, run.k + 1):
        r = ref.execute(run.plan(i))
        assert res.durations[i - 1] == pytest.approx(r.duration_s, rel=1e-12, abs=0)
        for k, v in r.breakdown.items():
            assert res.breakdown[k][i - 1] == pytest.approx(v, rel=1e-12, abs=1e-18), k
        if i == j:
            cut = copy.deepcopy(ref)
    cm.commit_run(res, j)  # truncated after step j: the next step prices as after j single steps
    nxt = run.plan(j + 1)
    assert cm.execute(nxt).duration_s == pytest.approx(cut.execute(nxt).duration_s, rel=1e-12)

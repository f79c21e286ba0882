"""Allocator/scheduler invariants under random workloads (hypothesis)."""
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.errors import ConfigError
from tangram.paging import BlockTable, KVLayout, OutOfPages, PagePool
from tangram.plan import StepResult
from tangram.scheduler import Scheduler

BASE = get_model("llama-3.1-8b")


def tiny_model(L, H):
    return dataclasses.replace(BASE, name="tiny", num_layers=L, num_kv_heads=H, num_q_heads=H * 2, head_dim=8,
                               max_context=100_000)


def check_invariants(s: Scheduler):
    parked = sum(int(x.parked.npages.sum()) for x in s.sessions.values() if x.parked is not None)
    assert s.pool.n_used == s.bt.pages_in_use() + parked, "page leaked"
    # pages reserved without ids (private_ids=False) are exactly the rows' unnamed ones
    anon = int((s.bt.npages - s.bt.nids).sum()) + sum(x.parked.anon for x in s.sessions.values()
                                                        if x.parked is not None)
    assert anon == s.pool.n_anon
    assert s.pool.in_use.sum() + s.pool.n_anon == s.pool.n_used
    col = np.arange(s.bt.pages.shape[2])[None, None, :]
    below = col < s.bt.nids[:, :, None]
    assert (s.bt.pages[below] >= 0).all()  # ids in the first nids columns (beyond: -1 with ids, else never read)
    if s.bt.private_ids:
        assert (s.bt.pages[~below] == -1).all()
    # free stack holds distinct pages, none in use
    free = s.pool.free_ids()
    assert np.unique(free).size == free.size and not s.pool.in_use[free].any()
    # every table can hold what it holds
    rows = [r.row for r in s.running]
    if rows:
        tl = s.layout.table_lens(s.head_lens[rows])
        assert np.all(s.layout.pages_for(tl) <= s.bt.npages[rows])
    live = int(s.head_lens[rows].sum()) + sum(int(x.parked_head_lens.sum()) for x in s.sessions.values()
                                              if x.parked is not None)
    assert live == s.live_tokens


def drive(s: Scheduler, rng, ops, profile, reserve_check: bool, state: dict):
    turns_left, ready = state.setdefault("turns_left", {}), state.setdefault("ready", [])
    rid = state.get("rid", 0)
    for op in ops:
        kind = op[0]
        if kind == "new" and len(turns_left) < 12:
            sid = f"s{rid}"
            turns_left[sid] = op[3]
            ready.append((sid, op[1], op[2]))
        while ready:
            sid, n, o = ready.pop()
            ev = s.add_request(rid, sid, n, o)
            rid += 1
            state["rid"] = rid
            if ev:  # rejected: the session ends
                turns_left.pop(sid, None)
                s.sessions[sid].busy = False
                s.end_session(sid)
        for _ in range(op[0] == "step" and op[1] or 1):
            plan = s.schedule()
            rk = None
            if plan.retention == "global" and plan.num_prefill:
                r = s.layout.to_slots(profile.sample_retention(rng, plan.num_prefill))
                rk = np.minimum(plan.prefill_keep, np.ceil(r * plan.prefill_tokens[:, None, None]).astype(int))
            for ev in s.update(plan, StepResult(plan.step, 0.0, realized_keep=rk)):
                if ev.kind == "finished":
                    sid = s.requests[ev.rid].sid
                    turns_left[sid] -= 1
                    if turns_left[sid] > 0:
                        ready.append((sid, int(rng.integers(1, 300)), int(rng.integers(1, 20))))
                    else:
                        del turns_left[sid]
                        s.end_session(sid)
            check_invariants(s)
            if reserve_check:
                # Budget Reservation: a prefilled turn holds exactly the pages its tokens need, plus decode growth
                for r in s.running:
                    if r.decoding:
                        tl = s.layout.table_lens(s.head_lens[r.row])
                        assert np.array_equal(s.layout.pages_for(tl), s.bt.npages[r.row])


op_strategy = st.one_of(
    st.tuples(st.just("new"), st.integers(1, 3000), st.integers(1, 40), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 20)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["full", "uniform", "dynamic", "br", "br+rp", "tangram"]),
       L=st.integers(1, 4), H=st.sampled_from([1, 2, 4, 8]), hp_idx=st.integers(0, 3),
       page=st.sampled_from([1, 3, 16]), chunk=st.sampled_from([64, 256, 1000]), pool=st.integers(30, 400),
       seed=st.integers(0, 2**31), ops=st.lists(op_strategy, min_size=1, max_size=25), clustering=st.booleans(),
       private_ids=st.booleans())
# found by hypothesis: s0's resident history (its output kept uncompressed) plus its next turn outgrew the pool
# while a recompute fitted, and the turn waited forever behind its own parked pages
@example(mode="uniform", L=1, H=1, hp_idx=0, page=1, chunk=64, pool=111, seed=775,
         ops=[("new", 120, 14, 2), ("step", 2), ("step", 1), ("new", 1, 13, 1)], clustering=False, private_ids=True)
def test_random_workloads_no_leak(mode, L, H, hp_idx, page, chunk, pool, seed, ops, clustering, private_ids):
    divs = [d for d in range(1, H + 1) if H % d == 0]
    hp = divs[hp_idx % len(divs)]
    model = tiny_model(L, H)
    prof = synthetic_profile(L, H, 0.3, seed=seed % 1000)
    eng = EngineConfig(mode=mode, page_size=page, heads_per_group=hp, chunk_size=chunk, max_batched_tokens=chunk * 2,
                       max_num_seqs=8, clustering=clustering)
    s = Scheduler(model, eng, prof, num_pages=pool, private_ids=private_ids)
    rng = np.random.default_rng(seed)
    state = {}
    drive(s, rng, ops, prof, eng.reserve_exact, state)
    # drain: everything finishes, then all pages return
    for _ in range(20000):
        if not s.has_work():
            break
        drive(s, rng, [("step", 1)], prof, eng.reserve_exact, state)
    assert not s.has_work()
    for sid in list(s.sessions):
        if not s.sessions[sid].busy:
            s.end_session(sid)
    assert s.pool.n_free == s.pool.num_pages
    assert s.live_tokens == 0


def test_turn_larger_than_pool_is_rejected_with_reason():
    model = tiny_model(2, 4)
    s = Scheduler(model, EngineConfig(mode="full", page_size=16), None, num_pages=10)
    ev = s.add_request(0, "a", 5000, 10)
    assert ev and ev[0].kind == "rejected" and "pool holds 10" in ev[0].detail
    assert s.add_request(1, "b", 50, 10) == []


def test_reservation_exact_at_admission_tangram():
    model = tiny_model(2, 4)
    prof = synthetic_profile(2, 4, 0.25, seed=0)
    eng = EngineConfig(mode="tangram", page_size=4, heads_per_group=2, chunk_size=100, max_batched_tokens=100)
    s = Scheduler(model, eng, prof, num_pages=1000)
    s.add_request(0, "a", 350, 3)
    plan = s.schedule()
    # whole post-compression prefill reserved at admission: chunks 100,100,100,50
    keep = np.ceil(s.keep_ratio * 100 - 1e-9) * 3 + np.ceil(s.keep_ratio * 50 - 1e-9)
    expect = s.layout.pages_for(s.layout.table_lens(keep.astype(int)[None]))[0]
    np.testing.assert_array_equal(s.bt.npages[plan.prefill_rows[0]], expect)
    assert s.pool.n_used == expect.sum()
    # no allocation happens while prefilling the rest
    used = s.pool.n_used
    s.update(plan, StepResult(plan.step, 0.0))
    for _ in range(3):
        p = s.schedule()
        assert p.counters["pages_allocated"] == 0
        s.update(p, StepResult(p.step, 0.0))
    assert s.pool.n_used == used


def test_dynamic_reclaims_after_compression():
    model = tiny_model(2, 4)
    prof = synthetic_profile(2, 4, 0.25, seed=0)
    s = Scheduler(model, EngineConfig(mode="dynamic", page_size=4, chunk_size=64), prof, num_pages=500)
    s.add_request(0, "a", 64, 2)
    p = s.schedule()
    assert s.pool.n_used == 16  # whole chunk over-allocated: 64 tokens / 4
    kept = np.full((1, 2, 4), 5)
    s.update(p, StepResult(p.step, 0.0, realized_keep=kept))
    assert s.pool.n_used == 2 and s.stats.pages_reclaimed == 14


def test_lru_eviction_then_recompute():
    model = tiny_model(1, 2)
    s = Scheduler(model, EngineConfig(mode="full", page_size=10, chunk_size=100, max_batched_tokens=200), None,
                  num_pages=22)
    for i, sid in enumerate(["a", "b"]):
        s.add_request(i, sid, 95, 1)
        while s.has_work():
            p = s.schedule()
            s.update(p, StepResult(p.step, 0.0))
    assert s.pool.n_used == 20  # both sessions resident (10 pages each)
    s.add_request(2, "c", 95, 1)  # needs 10 pages: evicts LRU session "a"
    p = s.schedule()
    assert s.stats.session_evictions == 1 and s.sessions["a"].parked is None and s.sessions["b"].parked is not None
    s.update(p, StepResult(p.step, 0.0))
    s.add_request(3, "a", 10, 1)  # next turn of the evicted session recomputes history (96) + new (10)
    p = s.schedule()
    assert s.requests[3].prompt == 96 + 10 - 1 + 0 or s.requests[3].prompt == 96 + 10


def test_block_table_vectorised_alloc_truncate():
    model = tiny_model(2, 4)
    prof = synthetic_profile(2, 4, 0.25, seed=0)
    lay = KVLayout.build(model, EngineConfig(mode="tangram", heads_per_group=1, page_size=4), prof.B)
    pool = PagePool(100, lay.page_bytes)
    bt = BlockTable(lay, pool, rows=2, cap=1)
    rows = np.array([bt.acquire_row(), bt.acquire_row(), bt.acquire_row()])
    tl = np.arange(3 * 8).reshape(3, 8)
    n = bt.ensure(rows, tl)
    assert n == int(lay.pages_for(tl).sum()) and pool.n_used == n
    # the width is a kernel stride: it stays in Triton's "divisible by 16" class through growth
    assert bt.pages.shape[2] % 16 == 0 and bt.pages.shape[2] >= int(lay.pages_for(tl).max())
    ids = bt.pages[rows][bt.pages[rows] >= 0]
    assert np.unique(ids).size == ids.size
    freed = bt.truncate(rows, tl // 2)
    assert pool.n_used == n - freed == int(lay.pages_for(tl // 2).sum())
    with pytest.raises(OutOfPages):
        bt.ensure(rows, tl * 100)
    assert pool.n_used == n - freed  # all-or-nothing
    for r in rows:
        bt.release_row(int(r))
    assert pool.n_free == 100
    # growth past twice the width to a size outside the class (33 pages) still lands on a multiple of 16
    r0, w0 = bt.acquire_row(), bt.pages.shape[2]
    one = np.zeros((1, lay.n_tables), dtype=np.int64)
    one[0, 0] = (2 * w0 + 1) * lay.page_size
    bt.ensure(np.array([r0]), one)
    assert bt.npages[r0, 0] == 2 * w0 + 1 and bt.pages.shape[2] >= 2 * w0 + 1 and bt.pages.shape[2] % 16 == 0
    bt.release_row(r0)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(np.array([0]))  # every page is free again: nobody holds page 0


@pytest.mark.parametrize("n", [5, 3000])
def test_pool_free_catches_repeated_ids(n):
    """With its checks on, a release naming a page id twice is caught (the repeated page would drop to ref 0 once
    and reach the free list twice), and a clean release of the same size passes and returns every page."""
    pool = PagePool(4 * n, 64, check=True)
    ids = pool.alloc(2 * n)
    bad = ids[:n].copy()
    bad[-1] = bad[0]
    with pytest.raises(AssertionError, match="double free"):
        pool.release(bad)
    pool2 = PagePool(4 * n, 64, check=True)
    ids2 = pool2.alloc(2 * n)
    assert pool2.release(ids2[::2]) == n
    assert pool2.n_free == 3 * n and pool2.in_use.sum() == n and not pool2.in_use[ids2[::2]].any()
    assert pool2.free_ids().size == pool2.n_free


@pytest.mark.parametrize("check", [False, True])
def test_pool_catches_double_free_across_calls(check):
    """Checks on or off (the replay's hot path runs with them off), releasing or unpinning a page nobody holds any
    more fails loudly instead of putting it on the free list twice."""
    pool = PagePool(64, 64, check=check)
    ids = pool.alloc(10)
    assert pool.release(ids[:4]) == 4
    with pytest.raises(AssertionError, match="double free"):
        pool.release(ids[3:5])
    pool.pin(ids[6:8], distinct=True)
    assert pool.release(ids[6:8]) == 0 and pool.unpin(ids[6:8]) == 2
    with pytest.raises(AssertionError, match="not pinned"):
        pool.unpin(ids[6:7])
    assert pool.n_free == 64 - 10 + 6 and int(pool.in_use.sum()) == pool.n_used


def test_pool_checks_flag_default_and_repeats():
    """The test suite runs every pool with its checks on (tests/conftest.py); an explicit ``check=False`` pool
    still counts a repeated id of a non-distinct pin twice (a hit's copy sources named by two hits of one step)."""
    assert PagePool(4, 64).check and not PagePool(4, 64, check=False).check
    pool = PagePool(8, 64, check=False)
    ids = pool.alloc(2)
    pool.pin(np.array([ids[0], ids[0], ids[1]]))
    assert pool.pins[ids[0]] == 2 and pool.pins[ids[1]] == 1 and pool.n_pinned == 2
    assert pool.release(ids) == 0
    assert pool.unpin(np.array([ids[0], ids[1], ids[0]])) == 2 and pool.n_free == 8 and pool.n_pinned == 0


def test_ragged_needs_profile():
    with pytest.raises(ConfigError):
        Scheduler(tiny_model(2, 4), EngineConfig(mode="tangram"), None, num_pages=10)


def test_decode_reads_table_lengths_kept_in_step_and_checks_them():
    """Decode and fast-forward read a row's table lengths from ``bt.lens`` instead of recomputing them from its head
    lengths; with the pool validating (the tests) a row whose two disagree is caught at the next decode step."""
    model = get_model("llama-3.1-8b")
    eng = EngineConfig(mode="tangram", chunk_size=64, max_batched_tokens=256)
    prof = synthetic_profile(model.num_layers, model.num_kv_heads, 0.25, seed=0)
    s = Scheduler(model, eng, prof, num_pages=20_000)
    s.add_request(0, "a", 100, 20)
    for _ in range(4):  # prefill, then decode
        plan = s.schedule()
        s.update(plan, StepResult(plan.step, 0.0))
    req = s.requests[0]
    assert req.decoding
    np.testing.assert_array_equal(s.bt.lens[req.row], s.layout.table_lens(s.head_lens[req.row]))
    s.bt.lens[req.row, 0] += 1
    with pytest.raises(AssertionError, match="out of step"):
        s.schedule()


def test_output_counts_follow_a_turn_off_its_row():
    """A running turn's output count lives in the scheduler's per-row array (a step advances the whole batch in one
    add): it must leave the row with the turn when the turn is preempted (its recompute prefills what it had
    generated) and when it finishes, and never leak to the next turn on that row."""
    model = tiny_model(1, 2)
    s = Scheduler(model, EngineConfig(mode="full", page_size=4, chunk_size=64, max_batched_tokens=128,
                                      session_cache=False), None, num_pages=14)
    s.add_request(0, "a", 8, 40)
    s.add_request(1, "b", 8, 40)
    made = {0: 0, 1: 0}
    at_preemption = {}
    for _ in range(500):
        if not s.has_work():
            break
        p = s.schedule()
        for rid in p.decode_ids.tolist() + p.prefill_ids[p.prefill_last].tolist():
            made[rid] += 1
        for e in s.update(p, StepResult(p.step, 0.0)):
            if e.kind == "finished":
                assert s.requests[e.rid].generated == made[e.rid] == s.requests[e.rid].output_tokens
        for r in s.running:
            assert r.generated == made[r.rid] == s.gen[r.row]
        for r in s.waiting:
            if r.preemptions and r.rid not in at_preemption:
                at_preemption[r.rid] = r.generated
                assert r.generated == made[r.rid] > 0 and r._sched is None
    assert not s.has_work() and s.stats.preemptions >= 1
    rid, g = next(iter(at_preemption.items()))
    assert s.stats.finished == 2 and made == {0: 40, 1: 40}
    # its recompute prefilled the prompt and the tokens it had generated before it was preempted
    assert s.requests[rid].prompt == 8 + g

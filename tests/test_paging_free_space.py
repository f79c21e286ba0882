"""The page pool's free space (a bitmap with per-block counts for large requests, a stack for small ones) under
random allocations, releases and pins (hypothesis): every page handed out is free and distinct, the free pages are
exactly those no row holds and no unit pins, and a large request is served from few dense blocks."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tangram.paging as paging
from tangram.paging import OutOfPages, PagePool


@pytest.fixture(params=[(10, 512), (3, 5)], ids=["blocks_of_1024", "blocks_of_8"])
def geometry(request, monkeypatch):
    """The replay's block and small-request sizes, and tiny ones that make a small pool span many blocks."""
    shift, small = request.param
    monkeypatch.setattr(paging, "_BLOCK_SHIFT", shift)
    monkeypatch.setattr(paging, "_BLOCK", 1 << shift)
    monkeypatch.setattr(paging, "_SMALL", small)
    return shift, small


def _check(pool: PagePool, held: list[np.ndarray], pinned: list[np.ndarray]) -> None:
    ref = np.zeros(pool.num_pages, dtype=np.int64)
    pins = np.zeros(pool.num_pages, dtype=np.int64)
    for ids in held:
        np.add.at(ref, ids, 1)
    for ids in pinned:
        np.add.at(pins, ids, 1)
    np.testing.assert_array_equal(pool.ref, ref)
    np.testing.assert_array_equal(pool.pins, pins)
    free = pool.free_ids()
    # free exactly when nobody holds or pins the page: no leak, nothing freed in use, none listed twice
    np.testing.assert_array_equal(free, np.flatnonzero((ref == 0) & (pins == 0)))
    assert pool.n_free == free.size == pool.num_pages - pool.n_used
    # each block's count of free pages is its bitmap row's (the stack's pages are off the bitmap)
    np.testing.assert_array_equal(pool._bfree, pool._isfree_blocks.sum(axis=1))
    assert not pool._isfree[pool.num_pages:].any()
    assert not pool._isfree[pool._stack[:pool._n_stack]].any()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_pages=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc_large", "release", "release_part", "pin", "unpin"]),
                              st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=60))
def test_free_space_invariants(geometry, num_pages, seed, ops):
    rng = np.random.default_rng(seed)
    pool = PagePool(num_pages, 64, check=True)
    held: list[np.ndarray] = []  # rows' pages (each list entry one holder)
    pinned: list[np.ndarray] = []
    for kind, a, b in ops:
        if kind in ("alloc", "alloc_large"):
            small = paging._SMALL
            n = int(a * (small - 1)) if kind == "alloc" else small + int(a * num_pages)
            if n > pool.n_free:
                with pytest.raises(OutOfPages):
                    pool.alloc(n)
                continue
            before = pool.free_ids()
            ids = pool.alloc(n)
            assert ids.size == n and np.unique(ids).size == n and np.isin(ids, before).all()
            if n >= small and n <= pool._bfree.size * paging._BLOCK:  # a large request: few blocks
                blocks = np.unique(ids >> paging._BLOCK_SHIFT).size
                assert blocks <= np.unique(before >> paging._BLOCK_SHIFT).size
            held.append(ids)
        elif kind in ("release", "release_part") and held:
            i = int(a * len(held)) % len(held)
            ids = held.pop(i)
            if kind == "release_part" and ids.size > 1:  # part of a row's pages (the dynamic mode's truncate)
                k = int(b * ids.size)
                held.append(ids[k:])
                ids = ids[:k]
            freed = pool.release(rng.permutation(ids))
            assert freed == int(np.count_nonzero(~np.isin(ids, np.concatenate(held + pinned + [ids[:0]]))))
        elif kind == "pin" and held:
            ids = held[int(a * len(held)) % len(held)]
            sub = ids[: max(1, int(b * ids.size))]
            pool.pin(sub, distinct=True)
            pinned.append(sub)
        elif kind == "unpin" and pinned:
            pool.unpin(pinned.pop(int(a * len(pinned)) % len(pinned)), distinct=True)
        _check(pool, held, pinned)
    for ids in held:
        pool.release(ids)
    for ids in pinned:
        pool.unpin(ids, distinct=True)
    _check(pool, [], [])
    assert pool.n_free == num_pages and pool.n_refs == 0 and pool.n_pinned == 0
    # everything free again: one allocation of the whole pool hands out every page once
    np.testing.assert_array_equal(np.sort(pool.alloc(num_pages)), np.arange(num_pages))


def test_a_reservation_comes_from_the_emptiest_blocks():
    """A large request after churn takes whole free blocks before the holes of used ones, ascending within each
    block: the pages a row's release later walks through lie in few dense runs."""
    B = paging._BLOCK
    pool = PagePool(8 * B, 64, check=True)
    a = pool.alloc(4 * B)  # blocks 0-3 taken
    pool.release(a[::2].copy())  # holes: every other page of blocks 0-3 (a large release: back on the bitmap)
    ids = pool.alloc(2 * B)
    np.testing.assert_array_equal(ids, np.arange(4 * B, 6 * B))  # blocks 4 and 5, whole
    ids2 = pool.alloc(2 * B + B // 2)  # blocks 6, 7, then half the free pages of block 0
    np.testing.assert_array_equal(ids2[:2 * B], np.arange(6 * B, 8 * B))
    np.testing.assert_array_equal(ids2[2 * B:], np.arange(0, B, 2))


def test_a_copied_pool_keeps_its_bitmap_and_counts_in_step():
    """``copy.deepcopy`` (the fast-forward tests copy whole schedulers) and pickling copy a view as an array of its
    own: a copied pool whose block view or ref/pins columns had drifted from its bitmap and counts crashed on a
    large request after small ones (found by the fast-forward test of runs past an untried head)."""
    import copy
    import pickle

    B = paging._BLOCK
    for clone in (copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))):
        pool = PagePool(3 * B + B // 2, 64, check=True)
        small = [pool.alloc(7) for _ in range(40)]  # off the stack, refilled from whole blocks
        for ids in small[::2]:
            pool.release(ids)  # back on the stack
        held = small[1::2]
        c = clone(pool)
        big = c.alloc(c.n_free - 3)  # more than the bitmap holds: the stack goes back to it first
        _check(c, held + [big], [])
        c.pin(big[:5])
        _check(c, held + [big], [big[:5]])
        _check(pool, held, [])  # the original is untouched


def test_a_row_parked_in_two_parts_frees_its_private_pages_and_refuses_shared_ones():
    """A row parked with ``shared`` columns keeps the pages below them apart from its own; ``ids`` still lists every
    page table-major, unpark puts each back in its column, and the release frees the private part at once while a
    shared page below the columns stays with its other holder. A page another row holds (ref 2) or the cache pins
    is refused by ``release_private`` (checked against hand-made counts, not the pool's own bookkeeping)."""
    from tangram.config import EngineConfig
    from tangram.paging import BlockTable, KVLayout

    lay = KVLayout(1, 2, 4, 2, 4, 1, True, np.tile(np.arange(2), (1, 1)))  # 2 tables of 1 head, pages of 4 tokens
    pool = PagePool(64, lay.page_bytes, check=True)
    bt = BlockTable(lay, pool, rows=2, cap=16)
    r = bt.acquire_row()
    bt.ensure(np.array([r]), np.array([[20, 12]]))  # 5 and 3 pages
    table = bt.pages[r].copy()
    want = np.concatenate([table[0, :5], table[1, :3]]).astype(np.int64)
    pool.incref(table[0, :2])  # another row shares table 0's first two pages
    parked = bt.park(r, shared=np.array([2, 0]))
    np.testing.assert_array_equal(parked.ids, want)
    assert sorted(parked.own.tolist()) == sorted(table[0, 2:5].tolist() + table[1, :3].tolist())
    r2 = bt.unpark(parked)
    np.testing.assert_array_equal(bt.pages[r2, :, :5], table[:, :5])
    with pytest.raises(AssertionError, match="private release"):
        pool.release_private(table[0, :1])  # held twice
    pool.pin(table[1, :1], distinct=True)
    with pytest.raises(AssertionError, match="private release"):
        pool.release_private(table[1, :1])  # pinned by the cache
    pool.unpin(table[1, :1], distinct=True)
    parked = bt.park(r2, shared=np.array([2, 0]))
    assert bt.free_parked(parked) == 6  # 3 + 3 private; the two shared ones stay with the other row
    assert pool.n_free == 64 - 2 and pool.ref[table[0, :2]].tolist() == [1, 1]
    # nothing shared (no prefix unit; shared columns all 0, or beyond no page): every page is the row's own
    for shared in (np.array([0, 0]), None):
        r3 = bt.acquire_row()
        bt.ensure(np.array([r3]), np.array([[4, 16]]))  # 1 and 4 pages
        t3 = bt.pages[r3].copy()
        parked = bt.park(r3, shared=shared)
        mine = np.concatenate([t3[0, :1], t3[1, :4]])
        np.testing.assert_array_equal(parked.ids, mine)
        if shared is None:
            assert parked.own.size == 0 and bt.free_parked(parked) == 5
        else:
            assert parked.head.size == 0 and parked.own.tolist() == mine.tolist() and bt.free_parked(parked) == 5
    assert pool.n_free == 64 - 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), park=st.booleans())
def test_unnamed_pages_go_back_by_count_without_an_id(seed, park):
    """``private_ids=False``: a row's pages without an id (reserved by count; copy-on-write destinations are such)
    are its alone wherever they sit, below the ``shared`` bound of a park or release too: they go back by count,
    no id is taken for them (``alloc_reserved`` is never called), the named ones shared with another row stay
    with it, and once both rows let go every page is free again (the pool checks its invariants throughout)."""
    from tangram.paging import BlockTable, KVLayout

    rng = np.random.default_rng(seed)
    lay = KVLayout(2, 3, 4, 2, 4, 1, True, np.tile(np.arange(3), (2, 1)))  # 6 tables of 1 head, pages of 4 tokens
    pool = PagePool(2048, lay.page_bytes, check=True)
    bt = BlockTable(lay, pool, rows=2, cap=16, private_ids=False)
    r = bt.acquire_row()
    bt.ensure(np.array([r]), rng.integers(0, 4 * 60, size=(1, lay.n_tables)))
    named = rng.integers(0, bt.npages[r] + 1)  # the leading pages a prefix unit named (the rest only counted)
    ids = bt.row_ids(r, 0, named)
    pool.incref(ids)  # another row holds the named ones (a prefix hit)
    shared = np.minimum(bt.npages[r], named + rng.integers(0, 40, size=named.size))  # past the named columns
    taken, real = [], pool.alloc_reserved

    def spy(n):
        taken.append(n)
        return real(n)

    pool.alloc_reserved = spy
    held = int(bt.npages[r].sum())
    freed = bt.free_parked(bt.park(r, shared)) if park else bt.release_row(r, shared)
    assert taken == [] and freed == held - ids.size  # the shared ones stay with the other row
    assert pool.release(ids) == ids.size and pool.n_free == pool.num_pages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), private=st.booleans())
def test_a_grown_table_keeps_every_rows_ids(seed, private):
    """Growing the table (more rows, wider columns) keeps each row's page ids where they were, with ids given by
    ``row_ids`` (``private_ids=False``: only the columns below ``nids`` are copied, each table its own) and rows
    parked and released before the growth leaving nothing behind that a later row reads."""
    from tangram.paging import BlockTable, KVLayout

    rng = np.random.default_rng(seed)
    lay = KVLayout(2, 3, 4, 2, 4, 1, True, np.tile(np.arange(3), (2, 1)))  # 6 tables of 1 head, pages of 4 tokens
    pool = PagePool(4096, lay.page_bytes, check=True)
    bt = BlockTable(lay, pool, rows=2, cap=16, private_ids=private)
    want = {}
    for _ in range(int(rng.integers(3, 9))):
        r = bt.acquire_row()  # past the rows it has: grows the rows
        lens = rng.integers(0, 4 * int(rng.choice([4, 40, 120])), size=(1, lay.n_tables))  # wider: grows the columns
        bt.ensure(np.array([r]), lens)
        hi = bt.npages[r] if private else rng.integers(0, bt.npages[r] + 1)  # some pages named, some only counted
        want[r] = (hi.copy(), bt.row_ids(r, 0, hi))
        if rng.random() < 0.3:  # a row let go before the growth: its stale columns are never read again
            bt.release_row(r) if rng.random() < 0.5 else bt.free_parked(bt.park(r))
            del want[r]
    before = bt.pages.shape
    bt._grow(rows=2 * before[0], cap=2 * before[2])
    assert bt.pages.shape[0] == 2 * before[0] and bt.pages.shape[2] >= 2 * before[2]
    for r, (hi, ids) in want.items():
        np.testing.assert_array_equal(bt.row_ids(r, 0, hi), ids)
        assert (bt.nids[r] >= hi).all()
    fresh = bt.acquire_row()  # a row taken after the growth holds nothing and reads nothing stale
    assert bt.npages[fresh].sum() == 0 and bt.nids[fresh].sum() == 0 and bt.row_ids(fresh).size == 0


@pytest.mark.parametrize("heads,hp", [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3), (12, 6), (12, 4)])
def test_table_lens_is_each_tables_longest_head(heads, hp):
    """``table_lens`` (pairwise maxima for a power-of-two H_p, a loop over the group otherwise) against a plain
    Python maximum over each table's heads, for any leading shape (none, one row, several, two axes)."""
    import dataclasses

    from tangram.config import EngineConfig, get_model
    from tangram.paging import KVLayout

    m = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=3, num_kv_heads=heads, num_q_heads=heads)
    B = np.random.default_rng(heads * 10 + hp).uniform(0.1, 1.0, (3, heads))
    lay = KVLayout.build(m, EngineConfig(mode="tangram", heads_per_group=hp), B)
    rng = np.random.default_rng(hp)
    for lead in ((), (1,), (5,), (2, 3), (0,)):
        h = rng.integers(0, 10_000, lead + (3, heads))
        flat = h.reshape(-1, 3, heads)
        want = np.array([[max(int(x) for x in flat[i, l, g * hp:(g + 1) * hp]) for l in range(3)
                          for g in range(heads // hp)] for i in range(flat.shape[0])], dtype=np.int64)
        got = lay.table_lens(h)
        assert got.shape == lead + (3 * heads // hp,)
        np.testing.assert_array_equal(got.reshape(-1, 3 * heads // hp), want.reshape(-1, 3 * heads // hp))

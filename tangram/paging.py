"""Ragged paging: one pool of equal-size pages and a vectorised block table.

A *table* is the unit that owns a list of pages: under Ragged Paging one table
per (layer, head group) of a request, under the monolithic vLLM layout a single
table spanning all layers and heads. Both are this one allocator, so baseline
and Tangram memory is measured by the same code. All per-step work is a few
numpy operations over ``[rows, tables]`` arrays, never a Python loop over heads.

Heads are addressed in *slot order*: slot ``g*H_p + j`` of a layer is the head
``perm[l, g*H_p + j]`` (budget-aware clustering); lengths, budgets and keep
counts below are all in slot order.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from tangram.budgets import BudgetProfile, check_group_size, head_groups
from tangram.config import EngineConfig, ModelConfig
from tangram.errors import ConfigError
from tangram.host_memory import sparse_zeros
from tangram.placement import check_tp, slot_perm


class OutOfPages(Exception):
    """Raised internally when an allocation cannot be served; callers decide to evict or preempt."""


@dataclass(frozen=True, eq=False)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    heads_per_group: int  # H_p; the monolithic layout uses H (and one table for all layers)
    ragged: bool
    perm: np.ndarray  # [L, H] slot -> KV head
    tp: int = 1  # tensor-parallel ranks; slots are rank-major: rank r owns slots r*H/tp .. (r+1)*H/tp - 1

    @classmethod
    def build(cls, model: ModelConfig, engine: EngineConfig, budgets: np.ndarray | None = None) -> "KVLayout":
        L, H = model.num_layers, model.num_kv_heads
        tp = engine.tp
        if engine.ragged:
            check_group_size(H, engine.heads_per_group)
            if budgets is None:
                raise ConfigError("ragged paging needs a budget profile to group heads")
            if tp > 1:  # rank-major slots, each rank's heads grouped on their own (tangram.placement)
                perm = slot_perm(budgets, tp, engine.heads_per_group, engine.clustering, engine.placement)
            else:
                perm = head_groups(budgets, engine.heads_per_group, clustered=engine.clustering)
            hp = engine.heads_per_group
        else:
            check_tp(H, tp)
            hp = H
            if tp > 1 and budgets is not None:  # a page spans every head; the placement only picks the shards
                perm = slot_perm(budgets, tp, H // tp, False, engine.placement)
            else:
                perm = np.tile(np.arange(H), (L, 1))
        return cls(L, H, model.head_dim, model.dtype_bytes, engine.page_size, hp, engine.ragged, perm, tp)

    def rank_slots(self, rank: int) -> slice:
        """The slots (heads) rank ``rank`` of ``tp`` holds."""
        hr = self.num_kv_heads // self.tp
        return slice(rank * hr, (rank + 1) * hr)

    def rank_layout(self, rank: int) -> "KVLayout":
        """What one rank's pool looks like: its ``H/tp`` heads (slot order kept, ``perm`` into its own heads, which
        its weight shards hold in slot order); a monolithic page of a rank spans its heads only."""
        if self.tp == 1:
            return self
        hr = self.num_kv_heads // self.tp
        ident = np.tile(np.arange(hr), (self.num_layers, 1))
        hp = self.heads_per_group if self.ragged else hr
        return KVLayout(self.num_layers, hr, self.head_dim, self.dtype_bytes, self.page_size, hp, self.ragged, ident)

    @property
    def n_groups(self) -> int:
        return self.num_kv_heads // self.heads_per_group if self.ragged else 1

    @property
    def n_tables(self) -> int:
        return self.num_layers * self.n_groups if self.ragged else 1

    @property
    def page_bytes(self) -> int:
        heads = self.heads_per_group if self.ragged else self.num_layers * self.num_kv_heads
        return heads * 2 * self.page_size * self.head_dim * self.dtype_bytes

    @property
    def head_token_bytes(self) -> int:
        """Bytes of one token of one KV head (K and V)."""
        return 2 * self.head_dim * self.dtype_bytes

    def to_slots(self, x: np.ndarray) -> np.ndarray:
        """Reorder a [..., L, H] per-head array from KV-head order into slot order (one fancy index: the dynamic
        mode reorders every prefill step's draws, and ``take_along_axis`` builds its index anew each call)."""
        x = np.asarray(x)
        if x.shape[-2:] != self.perm.shape:
            raise ValueError(f"to_slots: expected [..., {self.perm.shape[0]}, {self.perm.shape[1]}], got {x.shape}")
        return x[..., _layer_rows(self.perm.shape[0]), self.perm]

    def table_lens(self, head_lens: np.ndarray) -> np.ndarray:
        """Tokens each table must hold [..., T]: the longest head it serves."""
        head_lens = np.asarray(head_lens)
        lead = head_lens.shape[:-2]
        if self.ragged:
            if self.heads_per_group == 1:  # one head per table: its own length (a view; callers only read it)
                return head_lens.reshape(lead + (self.n_tables,))
            hp, T = self.heads_per_group, self.n_tables
            # numpy reduces a tiny trailing axis ~30x slower than H_p elementwise maxima over whole arrays
            # (measured 648 us vs 21 us for 256 requests x 32 layers x 8 heads at H_p = 2); a power-of-two H_p
            # takes the maximum of each pair of neighbours log2(H_p) times (2 maxima at H_p = 4 instead of a copy and
            # 3; pairs, not halves: numpy runs an elementwise op over [.., T, 2] halves ~5x slower)
            if hp & (hp - 1) == 0:
                g = head_lens
                while hp > 1:
                    hp //= 2
                    g = g.reshape(lead + (T, hp, 2))
                    g = np.maximum(g[..., 0], g[..., 1])
                return g.reshape(lead + (T,))
            g = head_lens.reshape(lead + (self.num_layers, self.n_groups, self.heads_per_group))
            out = g[..., 0].copy()
            for j in range(1, self.heads_per_group):
                np.maximum(out, g[..., j], out=out)
            return out.reshape(lead + (self.n_tables,))
        return np.maximum.reduce(head_lens.reshape(lead + (-1,)), axis=-1, keepdims=True)  # .max without wrappers

    def table_min_lens(self, head_lens: np.ndarray) -> np.ndarray:
        """Tokens every head of each table holds [..., T]: the shortest head. Pages below ``min // P`` are full for
        every head, so nothing is ever written into them again (what the prefix cache may share)."""
        head_lens = np.asarray(head_lens)
        lead = head_lens.shape[:-2]
        if self.ragged:
            g = head_lens.reshape(lead + (self.n_tables, self.heads_per_group))
            return g.min(axis=-1)
        return head_lens.reshape(lead + (-1,)).min(axis=-1, keepdims=True)

    @property
    def page_head_tokens(self) -> int:
        """Head-tokens one page holds (heads it spans x P)."""
        return self.page_bytes // self.head_token_bytes

    def pages_for(self, table_lens: np.ndarray) -> np.ndarray:
        t = np.asarray(table_lens, dtype=np.int64)
        P = self.page_size
        if P & (P - 1) == 0:  # a shift instead of an int64 division: ~2x faster on the per-step [rows, T] arrays
            return (t + (P - 1)) >> (P.bit_length() - 1)
        return -(-t // P)


_BLOCK_SHIFT = 10
_BLOCK = 1 << _BLOCK_SHIFT  # pages per block of the free bitmap's summary
_SMALL = 512  # allocations and releases of fewer pages go through the stack of free ids


_RAMP = np.arange(1 << 16, dtype=np.intp)


def _ramp(n: int) -> np.ndarray:
    """``np.arange(n)`` (intp, read-only) from a shared array grown by doubling: the per-call index arithmetic of a
    reservation adds a ramp to ~14K repeated offsets, so it need not allocate and fill one each time."""
    global _RAMP
    if n > _RAMP.size:
        _RAMP = np.arange(max(n, 2 * _RAMP.size), dtype=np.intp)
        _RAMP.flags.writeable = False
    return _RAMP[:n]


_RAMP.flags.writeable = False


def _index(ids) -> np.ndarray:
    """Page ids as a flat intp array (no copy when they already are)."""
    return np.asarray(ids).ravel().astype(np.intp, copy=False)


class PagePool:
    """Equal-size physical pages: free space, reference counts and double-free detection.

    ``ref[p]`` counts the block-table rows (running or parked) whose tables hold page ``p``; ``pins[p]`` counts the
    prefix-cache entries that retain it (:mod:`tangram.prefix_cache`). A page returns to the free list only when
    both are zero, so a page shared by several requests, or cached for later ones, is never freed while in use:
    a page is allocated exactly when ``ref > 0 or pins > 0`` (no separate flag to keep in step).
    Without shared prefixes every page has ``ref == 1`` and no pin: :meth:`release` then frees every page.

    A replay moves a few hundred million page ids through here (a parked session under ragged paging holds ~20K),
    so the hot paths make as few passes over the ids as they can. Always checked: a count dropping below zero (a
    release or unpin of a page nobody holds: the double free of a page freed earlier). Checked only when
    ``check`` is on (``PagePool.validate``, or ``TANGRAM_CHECK_PAGES=1``; the test suite turns it on): a page id
    repeated within one call, an incref/pin/alloc of a page in the wrong state. Those cost a sort or extra
    gathers per call and the invariants of the callers already exclude them.
    """

    validate = os.environ.get("TANGRAM_CHECK_PAGES", "") not in ("", "0")  # default of ``check``

    def __init__(self, num_pages: int, page_bytes: int, *, check: bool | None = None):
        if num_pages <= 0:
            raise ConfigError(f"the KV pool holds no page (page of {page_bytes} bytes does not fit)")
        self.num_pages, self.page_bytes = int(num_pages), int(page_bytes)
        self.check = PagePool.validate if check is None else bool(check)
        # Free space: a bitmap of free pages with each block's count of free pages (blocks of _BLOCK ids), and a
        # small stack of free ids. An allocation or release of at least _SMALL pages (a reservation, a session's
        # pages) works on the bitmap, taking the pages of the emptiest blocks first; smaller ones (decode growth,
        # chunks, a unit's pages) pop and push the stack, refilled a whole block at a time. A row's reservation so
        # comes in a few dense runs of ids, and so do the ~23K pages its release walks through: read cold, their
        # counts cost ~50-120 us where a scattered release costs ~210 us (measured), and a stack of freed ids
        # scatters them over the whole pool within a few thousand sessions (each allocation splits the runs the
        # last release pushed). Page ids are handled as intp inside the pool: numpy converts any other index dtype
        # to intp before every gather or scatter (an int32 index costs ~1.7x an intp one on 23K ids)
        nb = -(-self.num_pages // _BLOCK)
        self._isfree = np.zeros(nb * _BLOCK, dtype=bool)  # padded to whole blocks; the padding is never free
        self._isfree[:num_pages] = True
        self._isfree_blocks = self._isfree.reshape(nb, _BLOCK)
        self._bfree = np.full(nb, _BLOCK, dtype=np.int64)  # free pages of each block on the bitmap
        self._bfree[-1] = num_pages - (nb - 1) * _BLOCK
        self._stack = np.empty(num_pages, dtype=np.intp)  # free ids off the bitmap; top = end
        self._n_stack = 0
        self._n_free = int(num_pages)  # ids on the free structures (the bitmap and the stack)
        # Pages rows hold without an id yet (:meth:`reserve`; a block table that materialises its private page ids
        # only when they are read, ``BlockTable(private_ids=False)``): counted as allocated and referenced once,
        # their ids still on the free structures, any of which :meth:`alloc_reserved` may hand out for them later
        self.n_anon = 0
        # ref and pins side by side in memory (strided views of one [num_pages, 2] array): a release reads both
        # counts of each page, in random order over a pool larger than the cache, so one cache miss serves both
        self._counts = np.zeros((num_pages, 2), dtype=np.int32)
        self.ref, self.pins = self._counts[:, 0], self._counts[:, 1]
        self.n_refs = 0  # sum of ref: table entries pointing at pages
        self.n_referenced = 0  # pages with ref >= 1
        self.n_shared = 0  # pages with ref >= 2 (held by two or more rows at once)
        self.n_pinned = 0  # pages retained by the prefix cache
        self.total_allocs = 0
        self.total_frees = 0
        self.lets_go = 0  # calls that lowered a ref or pin count (a page may have become the cache's alone)
        # pages that became held by nobody and pinned once (``ref == 0 and pins == 1``: retained by one cache entry
        # alone), logged among those with ``watch[p] > 0`` when a prefix cache sets ``watch`` (an array it owns);
        # it takes them with :meth:`take_lone`
        self.watch: np.ndarray | None = None
        self._lone: list[np.ndarray] = []
        self._n_lone = 0

    @property
    def n_free(self) -> int:
        return self._n_free - self.n_anon

    @property
    def n_used(self) -> int:
        return self.num_pages - self._n_free + self.n_anon

    @property
    def n_saved(self) -> int:
        """Pages that sharing saves right now: table entries beyond the first on each shared page."""
        return self.n_refs - self.n_referenced

    @property
    def in_use(self) -> np.ndarray:
        """bool [num_pages]: allocated ids (a row holds it or the cache pins it); ``n_anon`` reserved pages have none."""
        return (self.ref > 0) | (self.pins > 0)

    def take_lone(self) -> np.ndarray:
        """Watched pages logged as held by nobody and pinned once since the last call (some may have changed since,
        some may repeat)."""
        out = np.concatenate(self._lone) if self._lone else np.zeros(0, dtype=np.int64)
        self._lone, self._n_lone = [], 0
        return out

    def _log_lone(self, ids: np.ndarray) -> None:
        ids = ids[self.watch[ids] > 0]
        if ids.size:
            self._lone.append(ids)
            self._n_lone += ids.size
            if self._n_lone > self.num_pages:  # nobody took them for long: keep those still lone, once each
                x = np.unique(self.take_lone())
                x = x[(self.ref[x] == 0) & (self.pins[x] == 1)]
                self._lone, self._n_lone = [x], x.size

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the views (``_isfree_blocks``, ``ref``, ``pins``): ``copy.deepcopy`` copies a
        view as an array of its own, so a copied pool's bitmap and block view would drift apart."""
        st = self.__dict__.copy()
        for k in ("_isfree_blocks", "ref", "pins"):
            st.pop(k, None)
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._isfree_blocks = self._isfree.reshape(-1, _BLOCK)
        self.ref, self.pins = self._counts[:, 0], self._counts[:, 1]

    def _distinct(self, ids: np.ndarray, what: str) -> None:
        srt = np.sort(ids)
        if (srt[1:] == srt[:-1]).any():
            raise AssertionError(f"double {what}: a page id repeats in one call")

    def alloc(self, n: int) -> np.ndarray:
        """``n`` fresh pages, each held once (``ref = 1``) by the caller's row."""
        if n > self.n_free:
            raise OutOfPages(f"need {n} pages, {self.n_free} free")
        ids = self._take(n)
        if self.check and (self.ref[ids].any() or self.pins[ids].any()):
            raise AssertionError("free list holds a page in use")
        self._n_free -= n
        self.ref[ids] = 1
        self.n_refs += n
        self.n_referenced += n
        self.total_allocs += n
        return ids

    def reserve(self, n: int) -> None:
        """``n`` pages for the caller's row without ids yet (counted as :meth:`alloc` counts them): a row's private
        pages that nobody reads by id until :meth:`alloc_reserved` gives them one (``BlockTable(private_ids=False)``)."""
        if n > self.n_free:
            raise OutOfPages(f"need {n} pages, {self.n_free} free")
        self.n_anon += n
        self.n_refs += n
        self.n_referenced += n
        self.total_allocs += n

    def alloc_reserved(self, n: int) -> np.ndarray:
        """Ids for ``n`` pages already reserved (:meth:`reserve`; each held once, ``ref = 1``); counts stay as they are."""
        if n > self.n_anon:
            raise AssertionError(f"ids for {n} reserved pages, {self.n_anon} reserved")
        if n == 0:
            return np.zeros(0, dtype=np.intp)
        ids = self._take(n)
        if self.check and (self.ref[ids].any() or self.pins[ids].any()):
            raise AssertionError("free list holds a page in use")
        self._n_free -= n
        self.n_anon -= n
        self.ref[ids] = 1
        return ids

    def unreserve(self, n: int) -> int:
        """A row lets go of ``n`` reserved pages that never got an id (all freed); returns ``n``."""
        if n > self.n_anon or n < 0:
            raise AssertionError(f"release of {n} reserved pages, {self.n_anon} reserved (double free)")
        self.n_anon -= n
        self.n_refs -= n
        self.n_referenced -= n
        self.total_frees += n
        return int(n)

    def incref(self, ids: np.ndarray) -> None:
        """Another row holds these (distinct, allocated) pages: a prefix-cache hit."""
        ids = _index(ids)
        if ids.size == 0:
            return
        r = self.ref[ids]
        if self.check:
            self._distinct(ids, "reference")
            if not ((r > 0) | (self.pins[ids] > 0)).all():
                raise AssertionError("reference to a page that is not allocated")
        self.n_referenced += int(np.count_nonzero(r == 0))
        self.n_shared += int(np.count_nonzero(r == 1))
        r += 1
        self.ref[ids] = r
        self.n_refs += ids.size

    def release(self, ids: np.ndarray) -> int:
        """A row lets go of these (distinct) pages; those no row holds and no cache entry pins are freed.
        Returns the number freed."""
        ids = _index(ids)
        if ids.size == 0:
            return 0
        r = self.ref[ids]
        r -= 1
        if r.min() < 0:
            raise AssertionError("release of a page no row holds (double free)")
        if self.check:
            self._distinct(ids, "free")
        self.lets_go += 1
        self.ref[ids] = r
        self.n_refs -= ids.size
        zero = r == 0
        nz = int(np.count_nonzero(zero))
        self.n_referenced -= nz
        self.n_shared -= int(np.count_nonzero(r == 1))
        if self.n_pinned:
            p = self.pins[ids]
            if self.watch is not None:
                lone = zero & (p == 1)
                if lone.any():
                    self._log_lone(ids[lone])
            dead = ids[zero & (p == 0)]
        else:
            dead = ids if nz == ids.size else ids[zero]
        self._push(dead)
        return int(dead.size)

    def release_private(self, ids: np.ndarray) -> int:
        """A row lets go of (distinct) pages it alone holds: pages it allocated that no other row and no cache entry
        ever took (``ref == 1``, no pin). All are freed: the counts are checked, not read per page as
        :meth:`release` does (a parked session's release is ~95% such pages). Returns the number freed."""
        ids = _index(ids)
        if ids.size == 0:
            return 0
        if (self.ref[ids] != 1).any():
            raise AssertionError("private release of a page no row or another row holds (double free or shared)")
        if self.check:
            self._distinct(ids, "free")
            if self.pins[ids].any():
                raise AssertionError("private release of a page the prefix cache pins")
        self.lets_go += 1
        self.ref[ids] = 0
        self.n_refs -= ids.size
        self.n_referenced -= ids.size
        self._push(ids)
        return int(ids.size)

    def pin(self, ids: np.ndarray, distinct: bool = False) -> None:
        """The prefix cache retains these (allocated) pages beyond their rows' lifetime; a repeated id pins twice
        (``distinct``: the caller knows no id repeats, which saves a sort)."""
        ids, n = self._counted(ids, distinct, "pin")
        if ids.size == 0:
            return
        p = self.pins[ids]
        if self.check and not ((p > 0) | (self.ref[ids] > 0)).all():
            raise AssertionError("pin of a page that is not allocated")
        self.n_pinned += int(np.count_nonzero(p == 0))
        p += n
        self.pins[ids] = p

    def unpin(self, ids: np.ndarray, distinct: bool = False) -> int:
        """A cache entry lets go of these pages; those nobody holds any more are freed. Returns the number freed."""
        ids, n = self._counted(ids, distinct, "unpin")
        if ids.size == 0:
            return 0
        p = self.pins[ids]
        p -= n
        if p.min() < 0:
            raise AssertionError("unpin of a page that is not pinned")
        self.lets_go += 1
        self.pins[ids] = p
        self.n_pinned -= int(np.count_nonzero(p == 0))
        r0 = self.ref[ids] == 0
        if self.watch is not None:
            lone = r0 & (p == 1)
            if lone.any():
                self._log_lone(ids[lone])
        dead = ids[(p == 0) & r0]
        self._push(dead)
        return int(dead.size)

    def _counted(self, ids, distinct: bool, what: str) -> tuple[np.ndarray, np.ndarray | int]:
        ids = _index(ids)
        if not distinct:
            if ids.size > 1:
                return np.unique(ids, return_counts=True)
            return ids, 1
        if self.check and ids.size > 1:
            self._distinct(ids, what)
        return ids, 1

    def _push(self, ids: np.ndarray) -> None:
        """Return pages nobody holds or pins (``release`` / ``unpin`` found them) to the free list."""
        if ids.size == 0:
            return
        if self.check:
            if self.ref[ids].any() or self.pins[ids].any():
                raise AssertionError("free of a page that a row holds or the prefix cache pins")
            self._distinct(ids, "free")
            if self._isfree[ids].any() or np.isin(ids, self._stack[:self._n_stack]).any():
                raise AssertionError("free of a page already free (double free)")
        m = ids.size
        if m < _SMALL:
            self._stack[self._n_stack:self._n_stack + m] = ids
            self._n_stack += m
        else:
            self._isfree[ids] = True
            self._bfree += np.bincount(ids >> _BLOCK_SHIFT, minlength=self._bfree.size)
        self._n_free += m
        self.total_frees += m

    def _take(self, n: int) -> np.ndarray:
        """``n <= n_free`` free page ids: small requests off the stack, large ones off the bitmap (``__init__``)."""
        if n < _SMALL:
            if self._n_stack < n:
                self._refill(n)
            if self._n_stack >= n:
                self._n_stack -= n
                return self._stack[self._n_stack:self._n_stack + n][::-1].copy()
        if int(self._bfree.sum()) < n:  # the bitmap alone cannot serve it: the stack's ids go back first
            self._unstack()
        return self._take_blocks(n)

    def _refill(self, n: int) -> None:
        """Move the free pages of whole blocks, the emptiest first (few blocks to read), onto the stack until it
        holds ``n`` and a block's worth more (or the bitmap is empty): decode pages fill a block of their own."""
        bf = self._bfree
        need = max(n - self._n_stack, _BLOCK)
        b = int(bf.argmax())
        if bf[b] >= need or bf[b] == 0:
            blocks = np.array([b]) if bf[b] else np.zeros(0, dtype=np.intp)
        else:
            order = self._emptiest()
            blocks = order[:int(np.searchsorted(np.cumsum(bf[order]), need)) + 1]
        if blocks.size == 0:
            return
        ids = self._block_ids(blocks)
        bf[blocks] = 0
        self._isfree_blocks[blocks] = False
        self._stack[self._n_stack:self._n_stack + ids.size] = ids[::-1]  # the lowest id on top
        self._n_stack += ids.size

    def _unstack(self) -> None:
        ids = self._stack[:self._n_stack]
        self._isfree[ids] = True
        self._bfree += np.bincount(ids >> _BLOCK_SHIFT, minlength=self._bfree.size)
        self._n_stack = 0

    def _emptiest(self) -> np.ndarray:
        """The blocks with a free page on the bitmap, the most free pages first (ties: lowest block first; a
        counting sort on 16 bits)."""
        nzb = np.flatnonzero(self._bfree)
        return nzb[np.argsort((_BLOCK - self._bfree[nzb]).astype(np.int16), kind="stable")]

    def _block_ids(self, blocks: np.ndarray) -> np.ndarray:
        """The free ids of ``blocks`` on the bitmap, block by block, ascending within each (``blocks`` in the order
        of :meth:`_emptiest`: the wholly free ones, first, are ranges; only the others are read off the bitmap)."""
        bf = self._bfree[blocks]
        whole = int(np.count_nonzero(bf == _BLOCK))
        part = blocks[whole:]
        nw = whole * _BLOCK
        pos = np.flatnonzero(self._isfree_blocks[part]) if part.size else np.zeros(0, dtype=np.intp)
        ids = np.empty(nw + pos.size, dtype=np.intp)
        if whole:  # ranges
            np.add((blocks[:whole] * _BLOCK)[:, None], _ramp(_BLOCK), out=ids[:nw].reshape(whole, _BLOCK))
        if part.size:  # a position in the gathered blocks -> its id: each block's offset, repeated per free page
            np.add(pos, np.repeat((part - _ramp(part.size)) * _BLOCK, bf[whole:]), out=ids[nw:])
        return ids

    def _take_blocks(self, n: int) -> np.ndarray:
        """The ``n`` free ids of the bitmap's emptiest blocks (ascending within a block); ``n`` <= its free pages."""
        bf = self._bfree
        order = self._emptiest()
        cs = np.cumsum(bf[order])
        j = int(np.searchsorted(cs, n))
        blocks = order[:j + 1]
        ids = self._block_ids(blocks)[:n]
        bf[order[:j]] = 0
        self._isfree_blocks[order[:j]] = False  # whole blocks taken
        last = n - (int(cs[j - 1]) if j else 0)  # of the last block
        bf[order[j]] -= last
        self._isfree[ids[n - last:]] = False
        return ids

    def free_ids(self) -> np.ndarray:
        """The free page ids, ascending (tests, debugging)."""
        return np.sort(np.concatenate([np.flatnonzero(self._isfree), self._stack[:self._n_stack]]))


class ParkedTables:
    """A row's pages and lengths while its session is idle (compact: exactly its page ids).

    ``shared`` (optional, [T]): the columns below which a table's pages may be shared with other rows or pinned
    by the prefix cache; the pages at or beyond them are the row's alone. Those two parts are then kept apart
    (``head``: the first, ``own``: the second, each table-major), so a release walks the counts of the first part
    only (:meth:`PagePool.release_private`); ``ids`` gives them all, table-major. Without it every page may be
    shared and ``head`` holds them all."""

    __slots__ = ("npages", "lens", "head", "own", "shared", "nids")

    def __init__(self, npages: np.ndarray, lens: np.ndarray, ids: np.ndarray, shared: np.ndarray | None = None,
                 own: np.ndarray | None = None, nids: np.ndarray | None = None):
        self.npages, self.lens, self.head, self.shared = npages, lens, ids, shared
        self.own = own if own is not None else ids[:0]
        # [T] the leading pages of each table that have ids (``BlockTable(private_ids=False)``; None: all of them);
        # the rest, ``npages - nids``, are reserved pages without one
        self.nids = nids

    @property
    def anon(self) -> int:
        """Pages held without an id (:meth:`PagePool.reserve`)."""
        return 0 if self.nids is None else int((self.npages - self.nids).sum())

    @property
    def ids(self) -> np.ndarray:
        """Every page id, table-major (tests, debugging)."""
        if self.shared is None:
            return self.head
        n, s = self.npages if self.nids is None else self.nids, self.shared
        w = int(n.max(initial=0))
        col = np.arange(w)[None, :]
        tab = np.full((n.size, w), -1, dtype=np.int64)
        tab[col < s[:, None]] = self.head
        tab[(col >= s[:, None]) & (col < n[:, None])] = self.own
        return tab[col < n[:, None]]


@functools.lru_cache(maxsize=8)
def _layer_rows(L: int) -> np.ndarray:
    """[L, 1] layer index (read-only), to pair with a [L, H] per-layer permutation in one fancy index."""
    a = np.arange(L)[:, None]
    a.flags.writeable = False
    return a


CAP_ALIGN = 16  # Triton's integer-specialisation divisor


def _runs(starts: np.ndarray, cnt: np.ndarray, total: int) -> np.ndarray:
    """Flat indices of runs of ``cnt[i]`` consecutive positions from ``starts[i]``, run after run (``total`` =
    ``cnt.sum()``): runs of a table's columns as one fancy index."""
    flat = np.repeat(starts - (np.cumsum(cnt) - cnt), cnt)
    flat += _ramp(total)
    return flat


def _aligned(cap: int) -> int:
    """A table width: a kernel stride, so kept at a multiple of 16. Triton specialises integer arguments on
    "divisible by 16"; a width outside that class compiles the prefill/scatter/decode kernels again inside a timed
    step (the 0.2-3.4 s of in-run compiles tangram-validate recorded on the H100 before widths were aligned)."""
    return -(-max(int(cap), 1) // CAP_ALIGN) * CAP_ALIGN


class BlockTable:
    """Dense ``[rows, T, cap]`` page-id table for running requests, grown by doubling.

    ``lens[row, t]`` is the number of tokens table ``t`` holds; ``npages[row, t]``
    the pages it owns (capacity ``npages * P`` may exceed ``lens`` when pages were
    reserved ahead, as Budget Reservation does at admission).

    ``private_ids=False`` (an executor that never reads page ids: the simulator's cost model) reserves pages by count
    (:meth:`PagePool.reserve`) and gives a table's pages ids only when something reads them by id (:meth:`row_ids`:
    the prefix cache registering or copying a row's pages), so ``pages[row, t]`` holds ids in its first
    ``nids[row, t]`` columns only; the other ``npages - nids`` are counted, not named, and the columns beyond
    ``nids`` are never read (what they hold is undefined: a wide table grown for one long shared chain is not
    written, so not paged in, where no row has ids). Every count
    (pages used, allocated, freed, shared, tables touched) is the same as with ids (``True``, the GPU engine's: every
    page has its id from the moment it is taken).
    """

    def __init__(self, layout: KVLayout, pool: PagePool, rows: int = 16, cap: int = 16, *, private_ids: bool = True):
        self.layout, self.pool = layout, pool
        T = layout.n_tables
        cap = _aligned(cap)
        self.pages = np.full((rows, T, cap), -1, dtype=np.int32)
        self.npages = np.zeros((rows, T), dtype=np.int64)
        self.lens = np.zeros((rows, T), dtype=np.int64)
        self.private_ids = bool(private_ids)
        self.nids = self.npages if self.private_ids else np.zeros((rows, T), dtype=np.int64)  # pages with ids
        self._free_rows = list(range(rows - 1, -1, -1))
        self.rows_touched = 0  # table rows updated, for pricing host work
        self._writes: list[np.ndarray] | None = None  # page ids written, when an executor mirrors the table

    # -- write log (a device mirror updates itself from it instead of re-uploading the table every step)
    def track_writes(self) -> None:
        """Start logging every page id written (``ensure``, ``unpark``): :meth:`take_writes` hands them over.
        Entries cleared by ``release_row``/``park``/``truncate`` are not logged: a row never reads past its
        pages, and a page written there later is logged then."""
        self._writes = []

    def take_writes(self) -> np.ndarray | None:
        """``[n, 4]`` int64 (row, table, column, page id) written since the last call; None when not tracking."""
        if self._writes is None:
            return None
        w = np.concatenate(self._writes) if self._writes else np.zeros((0, 4), dtype=np.int64)
        self._writes = []
        return w

    def _log(self, rows, tables, cols, ids) -> None:
        if self._writes is not None:
            self._writes.append(np.stack([np.asarray(rows, np.int64), np.asarray(tables, np.int64),
                                          np.asarray(cols, np.int64), np.asarray(ids, np.int64)], axis=1))

    # -- rows
    def acquire_row(self) -> int:
        if not self._free_rows:
            old = self.pages.shape[0]
            self._grow(rows=old * 2)
            self._free_rows = list(range(old * 2 - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int | None = None, cap: int | None = None) -> None:
        r0, T, c0 = self.pages.shape
        rows, cap = rows or r0, cap or c0
        cap = _aligned(cap)
        if self.private_ids:
            pages = np.empty((rows, T, cap), dtype=np.int32)  # each byte written once (a pool's table is ~100s of MB)
            pages[:r0, :, :c0] = self.pages
            pages[:r0, :, c0:] = -1
            pages[r0:] = -1
        else:  # only the columns below nids are ever read: the rest stays unwritten (never paged in), not -1
            # Each (row, table)'s own ids, not every table up to the widest: one long shared chain made the
            # rectangle up to it ~600x the ids (a 12,000-request Mooncake replay spent 1.4 s in 9 grows); and in
            # 4 KiB pages (sparse_zeros): with numpy's huge pages each first write zeroed 2 MiB of the rectangle
            pages = sparse_zeros((rows, T, cap), np.int32)
            n = self.nids.reshape(-1)
            k = np.flatnonzero(n)
            if k.size:
                cnt, total = n[k], int(n.sum())
                pages.reshape(-1)[_runs(k * cap, cnt, total)] = self.pages.reshape(-1)[_runs(k * c0, cnt, total)]
        npages = np.zeros((rows, T), dtype=np.int64)
        npages[:r0] = self.npages
        lens = np.zeros((rows, T), dtype=np.int64)
        lens[:r0] = self.lens
        self.pages, self.npages, self.lens = pages, npages, lens
        if self.private_ids:
            self.nids = npages
        else:
            nids = np.zeros((rows, T), dtype=np.int64)
            nids[:r0] = self.nids
            self.nids = nids

    def row_ids(self, row: int, lo: np.ndarray | int = 0, hi: np.ndarray | None = None) -> np.ndarray:
        """Page ids of the row's tables in columns ``[lo[t], hi[t])`` (default: all it holds), table-major (pages
        without an id get theirs now: :meth:`materialise`)."""
        T = self.layout.n_tables
        hi = self.npages[row] if hi is None else np.broadcast_to(np.asarray(hi, dtype=np.int64), (T,))
        if not self.private_ids:
            self.materialise(row, hi)
        lo = np.broadcast_to(np.asarray(lo, dtype=np.int64), (T,))
        return self._gather(row, lo, hi).astype(np.int64)

    def row_id_parts(self, row: int, lo: np.ndarray, mid: np.ndarray, hi: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``row_ids(row, lo, mid)`` and ``row_ids(row, mid, hi)`` (``lo <= mid <= hi``, arrays [T]), with the ids
        of the pages that have none given once (a prefix unit reads its pages and its partial pages' copy sources
        together)."""
        if not self.private_ids:
            self.materialise(row, hi)
        return self._gather(row, lo, mid).astype(np.int64), self._gather(row, mid, hi).astype(np.int64)

    def _gather(self, row: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``pages[row, t, lo[t]:hi[t]]`` of every table, table-major (the table's dtype): runs of consecutive
        columns gathered by flat index, O(ids) rather than a mask over every table's columns up to the widest (a
        long shared chain makes a few tables thousands of pages wide)."""
        flat = self._flat(row, lo, hi)
        return self.pages.reshape(-1)[flat] if flat.size else np.zeros(0, dtype=self.pages.dtype)

    def _flat(self, row: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Flat indices into ``pages`` of ``[row, t, lo[t]:hi[t]]`` for every table, table-major."""
        cnt = hi - lo
        t = np.flatnonzero(cnt > 0)
        if t.size == 0:
            return np.zeros(0, dtype=np.intp)
        cnt = cnt[t]
        cap = self.pages.shape[2]
        return _runs((row * self.layout.n_tables + t) * cap + lo[t], cnt, int(cnt.sum()))

    def materialise(self, row: int, hi: np.ndarray) -> int:
        """Give ids to the row's pages in columns below ``hi`` [T] (<= ``npages``) that have none yet (reserved by
        count, ``private_ids=False``); returns how many got one. Pages keep their counts: only ids are taken."""
        nids = self.nids[row]
        k = np.maximum(np.asarray(hi, dtype=np.int64) - nids, 0)
        total = int(k.sum())
        if total == 0:
            return 0
        if (nids + k > self.npages[row]).any():
            raise AssertionError("ids for pages the row does not hold")
        cap = int((nids + k).max())
        if cap > self.pages.shape[2]:
            self._grow(cap=max(cap, 2 * self.pages.shape[2]))
            nids = self.nids[row]
        ids = self.pool.alloc_reserved(total)
        cap = self.pages.shape[2]
        t = np.flatnonzero(k)
        cnt = k[t]
        base = (row * self.layout.n_tables + t) * cap + nids[t]
        self.pages.reshape(-1)[_runs(base, cnt, total)] = ids
        nids += k
        return total

    def _split(self, row: int, n: np.ndarray, w: int, shared: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The row's page ids in columns below ``shared`` (all of them when None) and at or beyond, table-major."""
        zero = np.zeros(n.shape, dtype=np.int64)
        if shared is None:
            return self._gather(row, zero, n), np.zeros(0, dtype=self.pages.dtype)
        s = np.minimum(shared, n)
        if not s.any():  # no prefix unit: every page is the row's own
            return np.zeros(0, dtype=self.pages.dtype), self._gather(row, zero, n)
        return self._gather(row, zero, s), self._gather(row, s, n)

    def release_row(self, row: int, shared: np.ndarray | None = None) -> int:
        """Let go of every page of the row (shared ones stay with their other holders); returns pages freed.
        ``shared`` [T]: the columns below which pages may be shared or pinned (:class:`ParkedTables`); the pages
        beyond are the row's alone (default: every page may be shared)."""
        n, anon = self._id_cols(row)
        w = int(n.max(initial=0))  # columns at or beyond a table's npages hold -1 already: leave them
        ids, own = self._split(row, n, w, shared)
        freed = self.pool.release(ids) + self.pool.release_private(own)
        if anon:
            freed += self.pool.unreserve(anon)
        if not self.private_ids:
            self.nids[row] = 0  # columns beyond nids are never read: their ids stay (no -1 to write)
        else:
            self.pages[row, :, :w] = -1
        self.npages[row] = 0
        self.lens[row] = 0
        self._free_rows.append(row)
        self.rows_touched += self.layout.n_tables
        return freed

    def park(self, row: int, shared: np.ndarray | None = None) -> ParkedTables:
        """The row's pages, kept compact while its session is idle (``shared`` as in :meth:`release_row`)."""
        n, _ = self._id_cols(row)
        n = n.copy()
        w = int(n.max(initial=0))  # columns at or beyond a table's npages hold -1 already: leave them
        ids, own = self._split(row, n, w, shared)
        parked = ParkedTables(self.npages[row].copy(), self.lens[row].copy(), ids,
                              None if shared is None else np.minimum(shared, n), own,
                              None if self.private_ids else n)
        if not self.private_ids:
            self.nids[row] = 0  # columns beyond nids are never read: their ids stay (no -1 to write)
        else:
            self.pages[row, :, :w] = -1
        self.npages[row] = 0
        self.lens[row] = 0
        self._free_rows.append(row)
        return parked

    def _id_cols(self, row: int) -> tuple[np.ndarray, int]:
        """The row's columns with ids per table [T] and its pages without one. A page without an id is the row's
        alone, wherever it sits: a prefix unit, a pin or another row's reference all name a page first
        (``materialise``), so a release or park takes the unnamed ones back by count, below a ``shared`` bound too
        (naming them there first, only to free them, was ~3.9M ids of a Mooncake replay)."""
        if self.private_ids:
            return self.npages[row], 0
        n = self.nids[row]
        return n, int((self.npages[row] - n).sum())

    def unpark(self, parked: ParkedTables) -> int:
        """A fresh row holding exactly the parked pages (also how a prefix-cache hit adopts shared pages)."""
        row = self.acquire_row()
        n = parked.npages if parked.nids is None else parked.nids  # the columns with ids
        if parked.nids is not None and self.private_ids:
            raise ValueError("a table of ids cannot hold pages reserved without one")
        need_cap = int(n.max(initial=0))
        if need_cap > self.pages.shape[2]:
            self._grow(cap=max(need_cap, 2 * self.pages.shape[2]))
        if need_cap:
            zero = np.zeros(n.shape, dtype=np.int64)
            if parked.shared is None:
                parts = [(zero, n, parked.head)]
            else:  # its two parts (ParkedTables)
                parts = [(zero, parked.shared, parked.head), (parked.shared, n, parked.own)]
            cap, T = self.pages.shape[2], self.layout.n_tables
            for lo, hi, ids in parts:
                flat = self._flat(row, lo, hi)
                self.pages.reshape(-1)[flat] = ids  # table-major, as park took them
                if self._writes is not None:
                    rt, col = np.divmod(flat, cap)
                    self._log(rt // T, rt % T, col, ids)
        self.npages[row] = parked.npages
        if not self.private_ids:
            self.nids[row] = n
        self.lens[row] = parked.lens
        return row

    def free_parked(self, parked: ParkedTables) -> int:
        """Let go of a parked session's pages; returns pages freed (shared ones stay with their other holders)."""
        freed = self.pool.release(parked.head) + self.pool.release_private(parked.own)
        anon = parked.anon
        return freed + self.pool.unreserve(anon) if anon else freed

    # -- capacity
    def pages_needed(self, rows: np.ndarray, table_lens: np.ndarray) -> np.ndarray:
        """Extra pages [k, T] the rows need so each table can hold ``table_lens`` tokens."""
        return np.maximum(0, self.layout.pages_for(table_lens) - self.npages[rows])

    def ensure(self, rows: np.ndarray, table_lens: np.ndarray, need: np.ndarray | None = None) -> int:
        """Allocate pages so tables can hold ``table_lens`` tokens; all-or-nothing. Returns pages allocated.

        ``need`` may pass ``pages_needed(rows, table_lens)`` when the caller already has it.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if need is None:
            need = self.pages_needed(rows, table_lens)
        total = int(need.sum())
        if total == 0:
            return 0
        if total > self.pool.n_free:
            raise OutOfPages(f"need {total} pages, {self.pool.n_free} free")
        if not self.private_ids:  # counted now, named when read (materialise)
            self.pool.reserve(total)
            self.npages[rows] += need
            self.rows_touched += int(np.count_nonzero(need))
            return total
        # Work only on the (row, table) entries that grow: in decode a few of the rows x T tables cross a page
        # boundary per step, so this is O(grown tables), not O(rows x T) (rows are distinct requests).
        T = self.layout.n_tables
        flat = np.ascontiguousarray(need).ravel()
        nz = np.flatnonzero(flat)
        cnt = flat[nz]
        r_of, t_of = rows[nz // T], nz % T
        old = self.npages[r_of, t_of]
        cap = int((old + cnt).max())
        if cap > self.pages.shape[2]:
            self._grow(cap=max(cap, 2 * self.pages.shape[2]))
        ids = self.pool.alloc(total)
        cap = self.pages.shape[2]
        base = (r_of * T + t_of) * cap + old  # flat index of each growing table's first new page
        if total == nz.size:  # one page per growing table (every decode step)
            flat = base
        else:  # runs of ``cnt`` consecutive columns, table-major as ``ids``
            flat = _runs(base, cnt, total)
        self.pages.reshape(-1)[flat] = ids
        if self._writes is not None:
            rt, col = np.divmod(flat, cap)
            self._log(rt // T, rt % T, col, ids)
        self.npages[r_of, t_of] = old + cnt
        self.rows_touched += int(nz.size)
        return total

    def truncate(self, rows: np.ndarray, table_lens: np.ndarray) -> int:
        """Return pages beyond what ``table_lens`` tokens need (the dynamic mode's reclaim)."""
        rows = np.asarray(rows, dtype=np.int64)
        keep = np.minimum(self.layout.pages_for(table_lens), self.npages[rows])
        extra = self.npages[rows] - keep
        total = int(extra.sum())
        self.lens[rows] = np.minimum(self.lens[rows], table_lens)
        if total == 0:
            return 0
        T = self.layout.n_tables
        self.rows_touched += int(np.count_nonzero(extra))
        self.npages[rows] = keep  # (nids, an alias of npages with private ids, read before below otherwise)
        if not self.private_ids:  # pages beyond the ids: by count; the ids beyond ``keep``: as below
            nids = self.nids[rows]
            anon = int((keep + extra - np.maximum(keep, nids)).sum())
            if anon:
                self.pool.unreserve(anon)
            lo = np.minimum(keep, nids)
            extra, keep = nids - lo, lo
            self.nids[rows] = lo
        flat = extra.ravel()
        n_ids = int(flat.sum())
        if n_ids:
            rr = np.repeat(np.repeat(rows, T), flat)
            tt = np.repeat(np.tile(np.arange(T), rows.size), flat)
            off = np.arange(n_ids) - np.repeat(np.cumsum(flat) - flat, flat)
            col = keep.ravel().repeat(flat) + off
            ids = self.pages[rr, tt, col]
            self.pool.release(ids)
            self.pages[rr, tt, col] = -1
        return total

    def pages_in_use(self) -> int:
        return int(self.npages.sum())


def memory_report(layout: KVLayout, head_lens: np.ndarray, useful_lens: np.ndarray | None = None) -> dict:
    """Bytes reserved, bytes live and fragmentation for a set of requests.

    ``head_lens`` [n, L, H] (slot order) are the tokens each head holds;
    ``useful_lens`` (default ``head_lens``) the tokens its own budget asks for.
    Reserved = whole pages of every table; fragmentation = 1 - live / reserved.
    """
    head_lens = np.asarray(head_lens)
    useful = head_lens if useful_lens is None else np.asarray(useful_lens)
    pages = int(layout.pages_for(layout.table_lens(head_lens)).sum())
    reserved = pages * layout.page_bytes
    live = int(useful.sum()) * layout.head_token_bytes
    return {"pages": pages, "bytes_reserved": reserved, "bytes_live": live,
            "fragmentation": 0.0 if reserved == 0 else 1.0 - live / reserved}

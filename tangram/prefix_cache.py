"""Shared prefixes across sessions: a reference-counted cache of KV pages, keyed by the trace's prefix chains.

vLLM's automatic prefix caching is the reference behaviour, written for our tables (one per (layer, head group)
under ragged paging, one monolithic table otherwise):

* a turn's ``prefix`` chain ``((segment_id, tokens), ...)`` names the content of its first ``sum(tokens)`` context
  tokens; segment ``j``'s identity is the chain up to it (``chain[:j+1]``). We intern each chain prefix as a node,
  so content identity is a dict lookup, like vLLM's chained block hashes;
* the cache is split at *boundaries*, each a :class:`Unit` keyed ``(node covering the boundary, boundary)``: the
  key names the whole content before the boundary, a unit holds only the pages its boundary adds over its parent,
  and a lookup walks a turn's keys from the first until one is missing (the longest cached prefix);
* pages are reference counted in :class:`tangram.paging.PagePool` (``ref``: rows holding the page; ``pins``: units
  retaining it). A unit nobody holds stays cached (``idle``, LRU) until memory is needed, then it is evicted and
  its pages return to the pool; a page is never freed while a row holds it or a unit pins it.

What a unit holds depends on the mode (``page_units``):

* ``full`` (every head keeps every token): units are whole pages. Boundaries are every segment end and every
  ``C`` tokens inside a segment, floored to the page size ``P``. The KV of a token depends only on the tokens
  before it, so any row whose complete pages ``[0, b/P)`` lie inside its chain can register or reuse them,
  whatever its chunking, including a resident session's history (decoded tokens included).
* compressed modes (``uniform``, ``br``, ``br+rp``, ``tangram``, ``dynamic``): a head keeps ``ceil(ratio * c)``
  of each prefill chunk and a chunk's scoring does not look past the chunk, so the compressed KV up to a chunk's
  end is a function of the tokens before that end *and of where earlier chunks were cut*. A prefill that starts at
  position 0 of a turn with a chain is therefore cut at every segment end and every ``C`` tokens inside a
  segment (:meth:`PrefixCache.chain`): the chunks inside the chain are then a function of the chain alone, and
  each chunk end is a boundary. Per table a unit shares, by reference, the pages every head of the table has
  filled (``min`` over the table's heads of the kept tokens, in whole pages; no one writes into them again), and
  lists the partial pages after them as copy sources: a hit copies them (copy-on-write, ``StepPlan.copy_src`` ->
  ``copy_dst``) and the hitting turn appends its own tokens after the shared ones. Copy sources are kept at
  segment ends and the boundary before each (where hits end), and dropped under memory pressure before idle
  sessions are evicted (a hit then passes through such a unit but cannot end there). A turn that continues a
  resident session prefills from the session's end with its last output kept uncompressed, so its chunks are
  never the fresh ones: it neither registers nor hits (even when the history is a multiple of ``C``).

Both also cap a hit at ``prompt - 1`` tokens (the last prompt token is always computed for the first output's
logits, as in vLLM).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tangram.host_memory import sparse_zeros
from tangram.paging import KVLayout, PagePool


def chain_hashes(prefix) -> list[int]:
    """A content id per segment of a chain, a function of ``chain[:j+1]`` only (stable across processes; Python's
    ``hash`` of a str is salted). Values lie in [2**62, 2**63): apart from any request id, so the dynamic mode's
    retention draws keyed by them never collide with the per-request draws."""
    out, h = [], b""
    for sid, n in prefix:
        h = hashlib.blake2b(h + repr((str(sid), int(n))).encode(), digest_size=8).digest()
        out.append((int.from_bytes(h, "little") >> 2) | (1 << 62))
    return out


def check_prefix(prefix, context: int) -> tuple[tuple[str, int], ...]:
    """Validate a chain against the turn's context (history + new tokens): a clear error, never a wrong share."""
    out = []
    for i, item in enumerate(prefix):
        try:
            sid, n = item
        except (TypeError, ValueError):
            raise ValueError(f"prefix item {i}: expected a (segment_id, tokens) pair, got {item!r}") from None
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"prefix item {i}: segment id must be a non-empty string, got {sid!r}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"prefix item {i}: tokens must be an integer >= 1, got {n!r}")
        out.append((sid, int(n)))
    total = sum(n for _, n in out)
    if total > context:
        raise ValueError(f"prefix covers {total} tokens but the turn's context is {context}")
    return tuple(out)


@dataclass
class ChainPlan:
    """What the cache needs of one turn's chain, computed once when the turn is added."""

    ends: np.ndarray  # int64 [k] context position where each segment ends (cumulative tokens)
    bounds: np.ndarray  # int64 [u] unit boundaries, increasing
    keys: list  # [u] cache keys (node, boundary)
    draw: np.ndarray  # int64 [u] content id of the segment holding each boundary (dynamic mode's draw key)
    # bool [u] the unit keeps its copy sources (a hit may end there): segment ends, where hits usually end, and the
    # boundary before each (where a prompt that is exactly the chain stops: the last token is always computed)
    keep_tail: np.ndarray


@dataclass(eq=False)
class Unit:
    """The pages one boundary adds to the cached prefix before it."""

    key: tuple
    end: int  # context tokens covered, ancestors included
    parent: "Unit | None"
    lens: np.ndarray  # int64 [L, H] slot order: tokens each head holds at ``end`` (a fresh prefill's)
    stable: np.ndarray  # int64 [T] full pages per table at ``end`` (shared by reference), ancestors included
    cnt: np.ndarray  # int64 [T] of which this unit adds (stable - parent's stable)
    ids: np.ndarray  # int64 those pages, table-major
    tail_ids: np.ndarray  # int64 partial pages after the stable ones, table-major (copied on a hit), pinned
    tail_cnt: np.ndarray  # int64 [T]
    endable: bool = True  # a hit may end here: no partial page, or its copy sources are kept
    holders: int = 1  # rows (running or parked) holding it; the registering row first
    evicted: bool = False
    serial: int = 0  # registration order (``PrefixCache.tailed`` order)


class PrefixCache:
    """Units by key, the idle ones in LRU order; all page accounting goes through the pool's refs and pins."""

    def __init__(self, layout: KVLayout, pool: PagePool, chunk_size: int, page_units: bool):
        self.layout, self.pool = layout, pool
        self.C, self.P = int(chunk_size), layout.page_size
        self.page_units = page_units
        self._nodes: dict[tuple, int] = {}
        self.units: dict[tuple, Unit] = {}
        self.idle: OrderedDict[tuple, Unit] = OrderedDict()  # holders == 0, least recently used first
        self.tailed: OrderedDict[tuple, Unit] = OrderedDict()  # units whose copy sources are pinned, oldest first
        self.registered = 0
        self.evictions = 0
        self.tails_dropped = 0
        # Which tailed unit may drop its copy sources (``evict_one``) is kept up to date from the pool's log of pages
        # that became the cache's alone (``ref == 0``, one pin): a page pinned once is listed by one unit at most,
        # found by ``owner``. ``listed[p]``: tailed units listing page p (consecutive units of one row may list the
        # same partial page); ``owner[p]``: 1 + the serial of the last unit that listed it, 0 when none does, -1 when
        # that one let go while another still lists it (then one scan of every unit's copy sources finds the
        # candidates). Zero means "none" so both arrays are left to the OS's zeroed pages until a page is listed: a
        # pool of many pages (65.8M at TP 8 with H_p 1) took 1.5 s to fill with -1 at every replica's start
        self.listed = sparse_zeros(pool.num_pages, np.int16)  # (written at a few pages: 4 KiB pages, not huge ones)
        self.owner = sparse_zeros(pool.num_pages, np.int64)
        pool.watch = self.listed
        self._serial = 0
        self._by_serial: dict[int, Unit] = {}  # tailed units by serial
        self._cand: set[int] = set()  # serials of tailed units that may hold a copy source only the cache keeps
        self._rescan = False

    # ------------------------------------------------------------------ chains
    def chain(self, prefix) -> ChainPlan:
        """Intern the chain's nodes, then its boundaries (module docstring) and their keys."""
        ends, nodes, parent, end = [], [], 0, 0
        for sid, n in prefix:
            k = (parent, sid, n)
            node = self._nodes.get(k)
            if node is None:
                node = self._nodes[k] = len(self._nodes) + 1
            end += n
            ends.append(end)
            nodes.append(node)
            parent = node
        hashes = chain_hashes(prefix)
        bounds, start = [], 0
        for e in ends:  # every C tokens inside a segment, and the segment's end
            bounds.extend(range(start + self.C, e, self.C))
            bounds.append(e)
            start = e
        if self.page_units:  # whole pages: floor each boundary to a page
            bounds = sorted({b // self.P * self.P for b in bounds} - {0})
        e = np.asarray(ends, dtype=np.int64)
        b = np.asarray(bounds, dtype=np.int64)
        seg = np.searchsorted(e, b, side="left")  # the segment holding each boundary's last token
        keys = [(nodes[j], int(x)) for j, x in zip(seg.tolist(), bounds)]
        # a boundary is a segment end exactly when it is its segment's end (ends increase strictly; every boundary
        # is at most its segment's end): np.isin's set machinery cost ~2% of a full-mode replay
        ends_here = e[seg] == b
        keep = ends_here.copy()  # | the next boundary's (np.append's copy and checks: ~5 us a chain)
        keep[:-1] |= ends_here[1:]
        return ChainPlan(e, b, keys, np.asarray([hashes[j] for j in seg.tolist()], dtype=np.int64), keep)

    # ------------------------------------------------------------------ lookup
    def lookup(self, chain: ChainPlan, cap: int) -> list[Unit]:
        """The longest run of cached units from the chain's first boundary, ending at most at ``cap`` tokens, at a
        unit a hit may end at (its partial pages can be copied)."""
        out: list[Unit] = []
        parent = None
        for key, b in zip(chain.keys, chain.bounds.tolist()):
            if b > cap:
                break
            u = self.units.get(key)
            if u is None or u.parent is not parent:  # missing, or cached above an evicted ancestor
                break
            out.append(u)
            parent = u
        while out and not out[-1].endable:
            out.pop()
        return out

    def adopt(self, units: list[Unit]) -> tuple[np.ndarray, np.ndarray]:
        """Pages a row hitting ``units`` holds by reference: (count per table [T], ids table-major)."""
        T = self.layout.n_tables
        ids = np.concatenate([u.ids for u in units])
        tab = np.concatenate([np.repeat(np.arange(T), u.cnt) for u in units])
        return units[-1].stable.copy(), ids[np.argsort(tab, kind="stable")]

    def hold(self, units: list[Unit]) -> None:
        for u in units:
            if u.holders == 0:
                del self.idle[u.key]
            u.holders += 1

    def release(self, units: list[Unit]) -> None:
        """Rows let go of units; one nobody holds becomes idle (deepest first, so it is evicted first)."""
        for u in reversed(units):
            u.holders -= 1
            if u.holders < 0:
                raise AssertionError("prefix unit released more often than held")
            if u.holders == 0:
                self.idle[u.key] = u

    # ------------------------------------------------------------------ register
    def register(self, key: tuple, end: int, parent: Unit | None, lens: np.ndarray, bt, row: int,
                 keep_tail: bool = True) -> Unit | None:
        """Cache the row's pages up to ``end`` (the row holds ``parent``'s lineage). Returns the unit, held once by
        the row, or None when the key is already cached (a duplicate computation: the row's pages stay private).
        ``keep_tail``: pin its partial pages as copy sources (else a hit may pass through it but not end at it)."""
        old = self.units.get(key)
        if old is not None:
            if old.parent is parent or old.holders:
                return None
            self._evict(old)  # cached above an evicted ancestor, never reachable again: replace it
        lay = self.layout
        stable = lay.table_min_lens(lens) // self.P
        n = lay.pages_for(lay.table_lens(lens))
        prev = parent.stable if parent is not None else np.zeros_like(stable)
        ids, tail = bt.row_id_parts(row, prev, stable, n)
        endable = keep_tail or tail.size == 0
        if not endable:
            tail = tail[:0]
        self.pool.pin(ids, distinct=True)
        self.pool.pin(tail, distinct=True)
        self._serial += 1
        u = Unit(key, int(end), parent, np.array(lens, dtype=np.int64), stable, stable - prev, ids, tail,
                 n - stable if endable else np.zeros_like(n), endable, serial=self._serial)
        self.units[key] = u
        if tail.size:
            self.tailed[key] = u
            self._by_serial[u.serial] = u
            self.listed[tail] += 1
            self.owner[tail] = u.serial + 1
        self.registered += 1
        return u

    # ------------------------------------------------------------------ eviction
    def _evict(self, u: Unit) -> int:
        if u.holders:
            raise AssertionError("eviction of a prefix unit a row holds")
        self.idle.pop(u.key, None)
        if self.units.get(u.key) is u:
            del self.units[u.key]
        self._untail(u)
        u.evicted = True
        self.evictions += 1
        return self.pool.unpin(u.ids, distinct=True) + self.pool.unpin(u.tail_ids, distinct=True)

    def _untail(self, u: Unit) -> None:
        """``u`` no longer lists its copy sources (before they are unpinned)."""
        if self.tailed.get(u.key) is not u:
            return
        del self.tailed[u.key]
        del self._by_serial[u.serial]
        self._cand.discard(u.serial)
        t = u.tail_ids
        left = self.listed[t] - 1
        self.listed[t] = left
        mine = self.owner[t] == u.serial + 1
        self.owner[t[mine & (left == 0)]] = 0
        other = mine & (left > 0)
        if other.any():  # another unit still lists them: which one is not kept
            self.owner[t[other]] = -1

    def _drop_tail(self, u: Unit) -> int:
        """Forget a unit's copy sources: hits may still pass through it, not end at it."""
        self._untail(u)
        freed = self.pool.unpin(u.tail_ids, distinct=True)
        u.tail_ids, u.tail_cnt, u.endable = u.tail_ids[:0], np.zeros_like(u.tail_cnt), False
        self.tails_dropped += 1
        return freed

    def evict_one(self) -> bool:
        """Free memory: the least recently used idle unit; else the copy sources of a unit a row holds, oldest
        first, when only the cache keeps them (a lone turn is never starved by the cache's copies). False when
        neither frees anything."""
        if self.idle:
            self._evict(next(iter(self.idle.values())))
            return True
        u = self.droppable()
        if u is None:
            return False
        self._drop_tail(u)
        return True

    def droppable(self) -> Unit | None:
        """The oldest tailed unit with a copy source only the cache keeps (held by no row, pinned by it alone), or
        None; what :meth:`evict_one` drops when no unit is idle. Incremental: candidates come from the pool's log
        of pages that became the cache's alone, each checked before it is returned."""
        pool = self.pool
        d = pool.take_lone()  # copy sources that became the cache's alone since the last call
        if d.size:
            d = d[(pool.ref[d] == 0) & (pool.pins[d] == 1) & (self.listed[d] > 0)]
            o = self.owner[d] - 1  # the serial; -1: none, -2: ambiguous
            if (o == -2).any():
                self._rescan = True
            self._cand.update(o[o >= 0].tolist())
        if self._rescan:  # one vectorised test over every unit's copy sources
            self._rescan = False
            units = list(self.tailed.values())
            if units:
                ids = np.concatenate([u.tail_ids for u in units])
                own = np.repeat(np.arange(len(units)), [u.tail_ids.size for u in units])
                hit = own[(pool.ref[ids] == 0) & (pool.pins[ids] == 1)]
                self._cand.update(units[i].serial for i in np.unique(hit).tolist())
        for s in sorted(self._cand):  # oldest first; a candidate is checked before it is returned
            u = self._by_serial[s]
            t = u.tail_ids
            if ((pool.ref[t] == 0) & (pool.pins[t] == 1)).any():
                return u
            self._cand.discard(s)
        return None

    def clear(self) -> int:
        """Evict every idle unit (end of a run); returns pages freed."""
        freed = 0
        while self.idle:
            freed += self._evict(next(iter(self.idle.values())))
        return freed

"""Iteration-level continuous batching with chunked prefill and Budget Reservation.

One scheduler serves every mode of the design brief; the mode only changes
three things, all resolved in ``__init__``:

* **what a head keeps of a chunk of C tokens** (``_keep``): all of it (full),
  ``ceil(rho*C)`` (uniform), ``ceil(B[l,h]*C)`` (static budgets), or an
  input-dependent count only known after the forward pass (dynamic, global
  top-k: pages are over-allocated for the whole chunk and reclaimed in
  :meth:`update` from ``StepResult.realized_keep``);
* **when pages are taken**: at admission for the turn's whole post-compression
  prefill footprint (Budget Reservation), or chunk by chunk (vLLM style);
* **the page layout** (monolithic or ragged, :mod:`tangram.paging`).

Sessions keep their compressed KV resident between turns; idle sessions are
evicted LRU when memory runs short (their next turn recomputes the history),
then running requests are preempted by recompute, latest admitted first.

Turns that declare a shared-prefix chain (the trace's ``prefix``) reuse a
cached prefix's pages by reference (:mod:`tangram.prefix_cache`): a hit skips
prefilling those tokens, reserves only the pages it does not share, and copies
the partial pages after the shared ones (``StepPlan.copy_src/copy_dst``).
Cached pages nobody holds are evicted first when memory runs short.

The scheduler knows nothing of time, torch or simpy: drivers call
``add_request`` when a turn is ready, then ``schedule`` / ``update`` per step.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from tangram.budgets import BudgetProfile
from tangram.config import EngineConfig, ModelConfig
from tangram.errors import ConfigError
from tangram.paging import BlockTable, KVLayout, OutOfPages, PagePool, ParkedTables
from tangram.plan import Event, StepPlan, StepResult, StepRun
from tangram.prefix_cache import ChainPlan, PrefixCache, check_prefix

_EMPTY = np.zeros(0, dtype=np.int64)


def _inserted(a: np.ndarray, i: int, x: int) -> np.ndarray:
    """A read-only copy of the 1-d ``a`` with ``x`` at index ``i`` (np.insert's result, without its ~10 us of
    argument handling)."""
    out = np.empty(a.size + 1, dtype=a.dtype)
    out[:i], out[i], out[i + 1:] = a[:i], x, a[i:]
    out.flags.writeable = False
    return out


def _position(turns: list, req) -> int:
    """Index of ``req`` in ``turns`` (by identity: a Request compares as itself), -1 when absent."""
    try:
        return turns.index(req)
    except ValueError:
        return -1


def _deleted(a: np.ndarray, i: int) -> np.ndarray:
    """A read-only copy of the 1-d ``a`` without index ``i``."""
    out = np.empty(a.size - 1, dtype=a.dtype)
    out[:i], out[i:] = a[:i], a[i + 1:]
    out.flags.writeable = False
    return out


@dataclass(eq=False)
class Request:
    """One turn of a session being served (compared by identity: request ids are unique, and ``running.remove``
    would otherwise compare every field of every turn before it)."""

    rid: int
    sid: str
    new_tokens: int
    output_tokens: int
    status: str = "waiting"  # waiting | running | finished | rejected
    prompt: int = 0  # tokens to prefill in the current attempt
    prefilled: int = 0
    _generated: int = 0  # output tokens produced; while it holds a row, its scheduler's ``gen[row]`` (``generated``)
    row: int = -1
    seq: int = -1  # admission order (preemption picks the latest)
    preemptions: int = 0
    chain: ChainPlan | None = None  # its shared-prefix chain (None: no prefix, or the cache is off)
    cuts: np.ndarray | None = None  # this attempt's chunks are also cut here (a compressed fresh prefill of a chain)
    units: list = field(default_factory=list)  # prefix-cache units its row holds, in chain order
    reg: int = -1  # index of the next chain boundary this attempt may register in the cache (-1: none)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, summed over attempts
    pending_copy: tuple | None = None  # (src, dst) page ids copied before its first chunk runs
    _sched: "Scheduler | None" = None  # set while it holds a row: its token count lives in the scheduler's arrays
    _sizes: tuple | None = None  # _admit's last sizing (a blocked head is tried again every step: sized once)

    @property
    def generated(self) -> int:
        """Output tokens produced so far. While the turn holds a row the count is the scheduler's ``gen[row]``,
        so a step advances every decoding turn in one vectorised add instead of a Python loop over the batch."""
        s = self._sched
        return int(s.gen[self.row]) if s is not None else self._generated

    @generated.setter
    def generated(self, value: int) -> None:
        s = self._sched
        if s is not None:
            s.gen[self.row] = value
        else:
            self._generated = int(value)

    @property
    def decoding(self) -> bool:
        return self.status == "running" and self.prefilled >= self.prompt


@dataclass
class Session:
    sid: str
    history: int = 0  # logical tokens of finished turns (prompts + outputs)
    parked: ParkedTables | None = None  # resident, idle
    parked_head_lens: np.ndarray | None = None
    parked_ctx: int = 0
    parked_units: list = field(default_factory=list)  # prefix-cache units the parked row holds
    busy: bool = False  # a turn of it is admitted


@dataclass
class SchedulerStats:
    steps: int = 0
    admitted: int = 0
    preemptions: int = 0
    session_evictions: int = 0
    rejected: int = 0
    finished: int = 0
    pages_allocated: int = 0
    pages_freed: int = 0
    pages_reclaimed: int = 0  # dynamic mode's compress-and-reclaim
    peak_pages: int = 0
    # shared prefixes (tangram.prefix_cache)
    prefix_turns: int = 0  # turns added with a prefix chain
    prefix_lookups: int = 0  # admissions that looked a chain up (fresh prefills of a chain)
    prefix_hits: int = 0  # of which found at least one cached unit
    prefix_hit_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    prompt_tokens: int = 0  # prompt tokens of every admission, before hits
    page_copies: int = 0  # partial pages copied on hits (copy-on-write)
    shared_pages_peak: int = 0  # pages held by two or more rows at once
    saved_pages_peak: int = 0  # table entries beyond the first on shared pages (pages sharing saved)
    cached_pages_peak: int = 0  # pages the prefix cache retained
    extra: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, model: ModelConfig, engine: EngineConfig, profile: BudgetProfile | None = None,
                 *, pool_bytes: int | None = None, num_pages: int | None = None, prefix_cache: bool = True,
                 private_ids: bool = True):
        """``private_ids=False``: a row's private pages are reserved by count and named only when something reads
        them by id (:class:`tangram.paging.BlockTable`), for an executor that never reads the block table (the
        simulator's cost model); every decision and count is the same."""
        self.model, self.engine = model, engine
        L, H = model.num_layers, model.num_kv_heads
        self.retention = engine.retention
        if profile is not None:
            profile.check_model(L, H, model.name)
            profile = profile.with_alpha(engine.alpha)
        if self.retention in ("static", "global") and profile is None:
            raise ConfigError(f"mode {engine.mode!r} needs a budget profile")
        self.profile = profile
        if self.retention == "full":
            ratio = np.ones((L, H))
        elif self.retention == "uniform":
            ratio = np.full((L, H), engine.rho)
        elif self.retention == "static":
            ratio = profile.B
        else:  # global: allocation upper bound is the whole chunk
            ratio = np.ones((L, H))
        grouping = profile.B if profile is not None else ratio
        self.layout = KVLayout.build(model, engine, grouping)
        self.keep_ratio = self.layout.to_slots(ratio)  # [L, H] slot order
        self._est_ratio = self.layout.to_slots(profile.B) if profile is not None else self.keep_ratio
        if num_pages is None:
            if pool_bytes is None:
                raise ConfigError("give the scheduler pool_bytes or num_pages")
            num_pages = int(pool_bytes // self.layout.page_bytes)
        self.pool = PagePool(num_pages, self.layout.page_bytes)
        self.bt = BlockTable(self.layout, self.pool, rows=min(engine.max_num_seqs, 64), private_ids=private_ids)
        self.head_lens = np.zeros((self.bt.pages.shape[0], L, H), dtype=np.int64)
        self.ctx = np.zeros(self.bt.pages.shape[0], dtype=np.int64)
        self.gen = np.zeros(self.bt.pages.shape[0], dtype=np.int64)  # output tokens of the turn on each row
        self.out_tok = np.zeros(self.bt.pages.shape[0], dtype=np.int64)  # and the tokens it will produce
        self._batch: tuple | None = None  # _partition's answer; None when ``running`` or a turn's phase changed
        self.requests: dict[int, Request] = {}
        self.sessions: dict[str, Session] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.idle: OrderedDict[str, None] = OrderedDict()  # resident idle sessions, LRU first
        self.stats = SchedulerStats()
        self._keep_of: dict[int, np.ndarray] = {}  # _keep_one
        self._head_tokens = 0  # head-tokens held, summed over rows (sum of head_lens over resident KV)
        # shared prefixes: whole pages in full mode, whole chunks of a fresh prefill in compressed modes
        self.pc = PrefixCache(self.layout, self.pool, engine.chunk_size, page_units=self.retention == "full") \
            if prefix_cache else None
        self._copies: list[tuple] = []
        self._seq = 0
        self._step = 0
        self.declined: str | None = None  # why the last plan_run ran nothing ahead (None: it planned a run)
        self._in_step: set[int] = set()
        self._events: list[Event] = []
        self._counters: dict = {}
        # fast-forward (decode_run): (request, free pages) of this step's failed admission of the queue's head
        self._blocked: tuple[Request, int] | None = None
        self._run: tuple | None = None

    @property
    def live_tokens(self) -> int:
        """Head-tokens held in pages, each physical page counted once: a page several rows share is full for
        every head it spans (only such pages are shared), so the rows' sum overcounts it by its extra holders."""
        return self._head_tokens - self.pool.n_saved * self.layout.page_head_tokens

    # ------------------------------------------------------------------ sizes
    def _keep(self, c: np.ndarray) -> np.ndarray:
        """Tokens each head keeps of chunks of ``c`` tokens: [k, L, H] (upper bound for global)."""
        c = np.asarray(c, dtype=np.int64)
        return np.ceil(self.keep_ratio[None] * c[:, None, None] - 1e-9).astype(np.int64)

    def _keep_one(self, c: int) -> np.ndarray:
        """``_keep`` of one chunk length, [L, H] (read-only, kept per length: a replay asks for the same few
        chunk lengths ~10^5 times)."""
        k = self._keep_of.get(c)
        if k is None:
            k = self._keep(np.array([c]))[0]
            k.flags.writeable = False
            self._keep_of[c] = k
        return k

    def _prefill_keep_total(self, prompt: int, start: int = 0, cuts: np.ndarray | None = None) -> np.ndarray:
        """Post-compression tokens per head after prefilling ``prompt`` tokens from ``start`` in chunks of C (also
        cut at ``cuts``, chunks of C restarting after each cut)."""
        C = self.engine.chunk_size
        if cuts is None:
            pieces = [int(prompt)]
        else:
            end = start + int(prompt)  # the cuts strictly inside (start, end): cuts are increasing (chain ends)
            pts = [start, *cuts[bisect_right(cuts, start):bisect_left(cuts, end)].tolist(), end]
            pieces = [b - a for a, b in zip(pts, pts[1:])]
        n_full, rems = 0, []
        for x in pieces:
            f, r = divmod(int(x), C)
            n_full += f
            rems.append(r)
        out = n_full * self._keep_one(C)
        for r in rems:
            out += self._keep_one(r)
        return out

    def _chunk_len(self, remaining: int, pos: int, cuts: np.ndarray | None) -> int:
        """Tokens of the next chunk at context position ``pos``."""
        c = min(self.engine.chunk_size, remaining)
        if cuts is not None:
            i = bisect_right(cuts, pos)  # np.searchsorted's, without its ~3 us per call on a few cuts
            if i < cuts.size:
                c = min(c, int(cuts[i]) - pos)
        return c

    def footprint_pages(self, prompt: int, output: int, head_lens: np.ndarray | None = None,
                        cuts: np.ndarray | None = None) -> int:
        """Pages a turn occupies once prefilled and decoded (from ``head_lens``, default empty)."""
        base = np.zeros(self.keep_ratio.shape, dtype=np.int64) if head_lens is None else head_lens
        if self.retention == "global":  # expected compressed size plus one uncompressed chunk in flight
            est = np.ceil(self._est_ratio * prompt).astype(np.int64)
            final = base + est + min(prompt, self.engine.chunk_size) + output
        else:
            final = base + self._prefill_keep_total(prompt, 0, cuts) + output
        return int(self.layout.pages_for(self.layout.table_lens(final)).sum())

    # ------------------------------------------------------------------ intake
    def add_request(self, rid: int, sid: str, new_tokens: int, output_tokens: int, prefix=()) -> list[Event]:
        """A turn became ready (arrived, or its think time passed). Returns rejection events, if any.

        ``prefix``: the turn's shared-prefix chain ``((segment_id, tokens), ...)``, covering the first
        ``sum(tokens)`` tokens of its context (the session's history here, then ``new_tokens``; docs/traces.md)."""
        if rid in self.requests:
            raise ValueError(f"request id {rid} added twice")
        req = Request(rid, sid, int(new_tokens), int(output_tokens))
        hist = self.sessions[sid].history if sid in self.sessions else 0
        prefix = check_prefix(prefix, hist + req.new_tokens) if prefix else ()
        self.requests[rid] = req
        sess = self.sessions.setdefault(sid, Session(sid))
        if sess.busy:
            raise ValueError(f"session {sid} already has a turn in flight")
        cuts = None
        if prefix:
            self.stats.prefix_turns += 1
            if self.pc is not None:
                req.chain = self.pc.chain(prefix)
                cuts = None if self.pc.page_units else req.chain.ends
        total = sess.history + req.new_tokens + req.output_tokens
        reason = None
        if total > self.model.max_context:
            reason = f"context {total} tokens exceeds the model's {self.model.max_context}"
        else:
            need = self.footprint_pages(sess.history + req.new_tokens, req.output_tokens, cuts=cuts)
            if need > self.pool.num_pages:
                reason = (f"turn needs {need} KV pages ({need * self.layout.page_bytes / 2**30:.2f} GiB) "
                          f"but the whole pool holds {self.pool.num_pages}")
        if reason:
            req.status = "rejected"
            self.stats.rejected += 1
            return [Event(rid, "rejected", reason)]
        sess.busy = True
        self.waiting.append(req)
        return []

    def end_session(self, sid: str) -> None:
        """The session has no further turns: free its resident KV now."""
        sess = self.sessions.pop(sid, None)
        if sess is None:
            return
        if sess.busy:
            raise ValueError(f"session {sid} ended with a turn in flight")
        if sess.parked is not None:
            self._drop_parked(sess)

    # ------------------------------------------------------------------ memory pressure
    def _drop_parked(self, sess: Session) -> None:
        self.stats.pages_freed += self.bt.free_parked(sess.parked)
        self._head_tokens -= int(sess.parked_head_lens.sum())
        if sess.parked_units:
            self.pc.release(sess.parked_units)
            sess.parked_units = []
        sess.parked = sess.parked_head_lens = None
        sess.parked_ctx = 0
        self.idle.pop(sess.sid, None)

    def _evict_one(self, keep: str | None = None) -> bool:
        """Free memory: a cached prefix unit nobody holds (LRU), else the least recently used idle session."""
        if self.pc is not None and self.pc.evict_one():
            return True
        for sid in self.idle:
            if sid != keep:
                self._drop_parked(self.sessions[sid])
                self.stats.session_evictions += 1
                self._counters["evicted"] += 1
                return True
        return False

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop all of the session's KV, requeue the turn at the front."""
        self._leave_row(req)
        self._release_row(req)
        self.running.remove(req)
        self._batch = None
        req.status, req.prompt, req.prefilled, req.row = "waiting", 0, 0, -1
        req.preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        self._counters["preempted"] += 1
        self._events.append(Event(req.rid, "preempted"))

    def _shared_cols(self, units: list) -> np.ndarray:
        """Per table, the columns below which a row holding ``units`` may share pages with other rows or the
        prefix cache: a unit's pages and its copy sources (the row's own when it registered the unit). Every page
        beyond is one the row allocated and nobody else ever took (pins and increfs only reach units' pages)."""
        if not units:
            return np.zeros(self.layout.n_tables, dtype=np.int64)
        out = units[0].stable + units[0].tail_cnt
        for u in units[1:]:
            out = np.maximum(out, u.stable + u.tail_cnt)
        return out

    def _release_row(self, req: Request) -> None:
        self._head_tokens -= int(self.head_lens[req.row].sum())
        self.stats.pages_freed += self.bt.release_row(req.row, self._shared_cols(req.units))
        self.head_lens[req.row] = 0
        self.ctx[req.row] = 0
        if req.units:
            self.pc.release(req.units)
            req.units = []
        if req.pending_copy is not None:
            self.stats.pages_freed += self.pool.unpin(req.pending_copy[0], distinct=True)
            req.pending_copy = None

    def _make_room(self, pages: int, *, keep_sid: str | None = None, preempt_after: int | None = None) -> bool:
        """Free pages: cached prefix units nobody holds, then idle sessions, LRU first, then (if allowed) running
        turns admitted after ``preempt_after``."""
        while self.pool.n_free < pages:
            if self._evict_one(keep=keep_sid):
                continue
            if preempt_after is None:
                return False
            victims = [r for r in self.running if r.seq > preempt_after and r.rid not in self._in_step]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.seq))
        return True

    # ------------------------------------------------------------------ step
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self._step += 1
        self._events: list[Event] = []
        self._counters = {"admitted": 0, "preempted": 0, "evicted": 0, "pages_allocated": 0}
        self._copies = []
        self._blocked = None
        rows0, alloc0 = self.bt.rows_touched, self.pool.total_allocs
        frees0 = self.pool.total_frees
        budget = self.engine.max_batched_tokens

        # 1. decode: every running request past its prefill writes one token.
        self._in_step: set[int] = set()
        while True:
            dec, rows, d_ids, _ = self._partition()
            if not dec:
                break
            new_lens = self.head_lens[rows] + 1
            tl = self._decode_table_lens(rows) + 1  # every head grows by one: so does every table's longest
            need_t = self.bt.pages_needed(rows, tl)
            need = int(need_t.sum())
            if need <= self.pool.n_free:
                self.bt.ensure(rows, tl, need_t)
                break
            if not self._evict_one():
                self._preempt(max(self.running, key=lambda r: r.seq))
        if dec:
            self.head_lens[rows] = new_lens
            self.bt.lens[rows] = tl
            self.ctx[rows] += 1
            self._head_tokens += rows.size * new_lens[0].size
            budget -= len(dec)
            self._in_step = set(d_ids.tolist())  # empty until now (read by preemption, in the loop above)
            d_rows, d_ctx, d_lens = rows, self.ctx[rows].copy(), new_lens
        else:
            d_ids = d_rows = d_ctx = _EMPTY
            d_lens = np.zeros((0,) + self.keep_ratio.shape, dtype=np.int64)

        # 2. prefill chunks of admitted requests, then 3. admit waiting turns FCFS.
        pf: list[tuple] = []
        for req in list(self._partition()[3]):  # (a chunk's room may preempt a later one: status is checked)
            if req.status == "running" and req.prefilled < req.prompt and (budget > 0 or not pf):
                budget -= self._schedule_chunk(req, budget, pf)
        # As vLLM v1: a step that had to preempt admits nothing new (admitting would only feed the thrash).
        # A turn is admitted only if its first chunk also fits this step's token budget: admitted turns that get
        # no chunk would hold memory without progress and be the first preempted.
        while (self.waiting and not self._counters["preempted"] and len(self.running) < self.engine.max_num_seqs
               and (min(self.engine.chunk_size, self._prompt_of(self.waiting[0])) <= budget or not pf)):
            if not self._admit(self.waiting[0]):
                break
            budget -= self._schedule_chunk(self.running[-1], budget, pf)

        if pf:
            p_ids, p_rows, p_start, p_tok, p_last, p_before, p_keep, p_pages, p_key = map(np.array, zip(*pf))
        else:
            p_ids = p_rows = p_start = p_tok = p_key = _EMPTY
            p_last = np.zeros(0, dtype=bool)
            p_before = p_keep = np.zeros((0,) + self.keep_ratio.shape, dtype=np.int64)
            p_pages = np.zeros((0, self.layout.n_tables), dtype=np.int64)
        c_src = c_dst = _EMPTY
        if self._copies:  # copy-on-write of hits whose first chunk runs now
            c_src = np.concatenate([c[0] for c in self._copies]).astype(np.int64)
            c_dst = np.concatenate([c[1] for c in self._copies]).astype(np.int64)
            self._counters["page_copies"] = int(c_src.size)
            self.stats.page_copies += int(c_src.size)
        self._counters.update(
            pages_allocated=self.pool.total_allocs - alloc0, pages_freed=self.pool.total_frees - frees0,
            rows_touched=self.bt.rows_touched - rows0, tables=self.layout.n_tables,
            decode_rows=int(d_ids.size), prefill_rows=len(pf))
        self.stats.pages_allocated += self._counters["pages_allocated"]
        self.stats.steps += 1
        self.stats.peak_pages = max(self.stats.peak_pages, self.pool.n_used)
        if self.pc is not None:
            self._prefix_peaks()
        return StepPlan(self._step, d_ids, d_rows, d_ctx, d_lens, p_ids, p_rows, p_start, p_tok, p_last,
                        p_before, p_keep, p_pages, dict(self._counters), self.retention,
                        prefill_key=p_key, copy_src=c_src, copy_dst=c_dst,
                        copy_src_distinct=len(self._copies) == 1)

    def _prefix_peaks(self) -> None:
        st, pool = self.stats, self.pool
        st.shared_pages_peak = max(st.shared_pages_peak, pool.n_shared)
        st.saved_pages_peak = max(st.saved_pages_peak, pool.n_saved)
        st.cached_pages_peak = max(st.cached_pages_peak, pool.n_pinned)

    def _prompt_of(self, req: Request) -> int:
        """Tokens the turn must prefill if admitted now: its new tokens, plus the history if not resident."""
        sess = self.sessions[req.sid]
        if sess.parked is not None:
            return req.new_tokens + req.generated
        return sess.history + req.new_tokens + req.generated

    def _admit(self, req: Request) -> bool:
        sess = self.sessions[req.sid]
        resident = sess.parked is not None
        prompt = self._prompt_of(req)
        base = sess.parked_head_lens if resident else None
        held = int(sess.parked.npages.sum()) if resident else 0
        chain, cuts, units = req.chain, None, []
        if chain is not None and not resident:  # a fresh prefill of a chain: look the chain up
            if not self.pc.page_units:
                cuts = chain.ends
            units = self.pc.lookup(chain, prompt - 1)  # the last prompt token is always computed (its logits)
        base0 = base
        while True:
            hit, shared, base = 0, 0, base0
            if units:
                hit, base, shared = units[-1].end, units[-1].lens, int(units[-1].stable.sum())
            tl_final, pages = self._final_sizes(req, prompt, hit, base, cuts)
            need = max(0, pages - held - shared)
            # The turn's pages and every page the units it hits keep resident (held by it, they cannot be evicted:
            # their shared pages, the last one's copy sources, and an earlier one's copy sources too) must fit
            # together; if they never can, reuse a shorter prefix (found by the hypothesis test: a turn waited
            # forever behind the units it hit, first for the last unit's copy sources, then for an earlier one's)
            if not units or need + held + self._resident(units) <= self.pool.num_pages:
                break
            units.pop()
            while units and not units[-1].endable:
                units.pop()
        if resident and need + held > self.pool.num_pages:
            # The resident history plus this turn can never fit, though a recompute does (add_request checked):
            # the resident cache keeps the last turn's output uncompressed, a recompute compresses it. Waiting
            # would deadlock (its own parked pages are never evicted for it), so drop them and recompute.
            self._drop_parked(sess)
            self.stats.session_evictions += 1
            self._counters["evicted"] += 1
            return self._admit(req)
        watermark = int(0.01 * self.pool.num_pages) if self.running else 0
        if not self.engine.reserve_exact:
            watermark += self._inflight_chunk_pages()
        if units:  # before making room: the units it hits are not evicted, nor the copy sources it needs dropped
            self.pc.hold(units)
            self.pool.pin(units[-1].tail_ids, distinct=True)
        if not self._make_room(need + watermark, keep_sid=req.sid):
            if units:
                self.pc.release(units)
                self.pool.unpin(units[-1].tail_ids, distinct=True)
            self._blocked = (req, self.pool.n_free)  # what decode_run needs to know the next step admits nothing
            return False
        self.waiting.popleft()
        if resident:
            self.idle.pop(req.sid, None)
            row = self.bt.unpark(sess.parked)
            self._fit_rows()
            self.head_lens[row] = sess.parked_head_lens
            self.ctx[row] = sess.parked_ctx
            sess.parked = sess.parked_head_lens = None
            req.units, sess.parked_units = sess.parked_units, []
        elif units:
            last = units[-1]
            tl0 = self.layout.table_lens(last.lens)
            npg, ids = self.pc.adopt(units)
            row = self.bt.unpark(ParkedTables(npg, tl0, ids))  # the shared pages, by reference
            self.pool.incref(ids)
            self._fit_rows()
            self.head_lens[row] = last.lens
            self.ctx[row] = hit
            self._head_tokens += int(last.lens.sum())
            if last.tail_ids.size:  # copy-on-write: its own copy of the partial pages after the shared ones (their
                self.bt.ensure(np.array([row]), tl0[None])  # pin, taken above, lasts until the copy step has run)
                # the copies' own pages by id where the executor copies (the simulator prices them by count: -1)
                dst = self.bt.row_ids(row, last.stable, last.stable + last.tail_cnt) if self.bt.private_ids else \
                    np.full(int(last.tail_cnt.sum()), -1, dtype=np.int64)
                req.pending_copy = (last.tail_ids, dst)
            req.units = list(units)
        else:
            row = self.bt.acquire_row()
            self._fit_rows()
            self.head_lens[row] = 0
            self.ctx[row] = 0
        if self.engine.reserve_exact:
            self.bt.ensure(np.array([row]), tl_final[None])
        req.status, req.prompt, req.prefilled = "running", prompt - hit, 0
        self._take_row(req, row)
        req.seq, self._seq = self._seq, self._seq + 1
        req.cuts = cuts
        req.reg = -1
        if chain is not None and (not resident or self.pc.page_units):
            # it may cache its own pages of the chain while it holds the chain's units before them (one lineage)
            if [u.key for u in req.units] == chain.keys[:len(req.units)]:
                req.reg = len(req.units)
                if resident:  # full mode: the resident history's complete pages inside the chain
                    self._register(req)
        self.running.append(req)
        b = self._batch
        if b is not None:  # it prefills first: the decoding side is unchanged
            self._batch = (b[0], b[1], b[2], b[3] + [req])
        self.stats.admitted += 1
        self.stats.prompt_tokens += prompt
        if chain is not None and not resident:
            self.stats.prefix_lookups += 1
            if hit:
                self.stats.prefix_hits += 1
                self.stats.prefix_hit_tokens += hit
                req.cached_tokens += hit
        self._counters["admitted"] += 1
        self._events.append(Event(req.rid, "admitted", "resident" if resident else "recompute"))
        return True

    @staticmethod
    def _resident(units: list) -> int:
        """Distinct pages the prefix units ``units`` (one lineage) keep resident while a turn holds them: their pages
        and copy sources (a partial page may be listed by consecutive units, and become a later unit's page)."""
        n = sum(u.ids.size + u.tail_ids.size for u in units)
        if n == 0 or all(u.tail_ids.size == 0 for u in units[:-1]):  # no earlier copy source: nothing repeats
            return n
        return int(np.unique(np.concatenate([a for u in units for a in (u.ids, u.tail_ids)])).size)

    def _final_sizes(self, req: Request, prompt: int, hit: int, base: np.ndarray | None, cuts: np.ndarray | None
                     ) -> tuple[np.ndarray, int]:
        """Table lengths [T] and pages the turn holds once its prompt is prefilled from ``hit`` on top of ``base``
        head lengths (None: nothing), or its first chunk's without exact reservation. Kept on the request for the
        same inputs (the same arrays, which nothing writes): a blocked queue head is sized again at every step."""
        m = req._sizes
        if m is not None and m[0] == prompt and m[1] == hit and m[2] is base and m[3] is cuts:
            return m[4], m[5]
        b = np.zeros(self.keep_ratio.shape, dtype=np.int64) if base is None else base
        if self.engine.reserve_exact:
            final = b + self._prefill_keep_total(prompt - hit, hit, cuts)
        else:  # pages come chunk by chunk; admission only checks the first chunk fits
            final = b + self._keep_one(self._chunk_len(prompt - hit, hit, cuts))
        tl = self.layout.table_lens(final)
        tl.flags.writeable = False
        pages = int(self.layout.pages_for(tl).sum())
        req._sizes = (prompt, hit, base, cuts, tl, pages)
        return tl, pages

    def _register(self, req: Request) -> None:
        """Cache the row's pages of the chain's boundaries it has computed (in order, one lineage)."""
        ch, row = req.chain, req.row
        pos = int(self.ctx[row])
        while 0 <= req.reg < ch.bounds.size and ch.bounds[req.reg] <= pos:
            b = int(ch.bounds[req.reg])
            if self.pc.page_units:  # full: every head holds every token; pages [0, b/P) are complete
                lens = np.full(self.keep_ratio.shape, b, dtype=np.int64)
            elif b == pos:  # compressed: the chunk that just ended at b
                lens = self.head_lens[row]
            else:  # a boundary passed without a chunk ending there: not this chain's fresh layout
                req.reg = -1
                return
            u = self.pc.register(ch.keys[req.reg], b, req.units[-1] if req.units else None, lens, self.bt, row,
                                 keep_tail=bool(ch.keep_tail[req.reg]))
            if u is None:  # already cached from another row's pages: ours stay private from here on
                req.reg = -1
                return
            req.units.append(u)
            req.reg += 1

    def _inflight_chunk_pages(self) -> int:
        """Pages the next chunk of every admitted, still-prefilling turn will take (chunk-by-chunk modes).

        Admitting only beyond this headroom keeps a new turn from being preempted by an older turn's next chunk
        (with whole uncompressed chunks allocated in ``dynamic`` mode, that churn otherwise dominates).
        """
        pre = self._partition()[3]  # (the running turns still prefilling: kept, not a pass over the batch)
        if not pre:
            return 0
        rows = np.fromiter((r.row for r in pre), dtype=np.int64, count=len(pre))
        ctx = self.ctx[rows].tolist()
        c = np.fromiter((self._chunk_len(r.prompt - r.prefilled, x, r.cuts) for r, x in zip(pre, ctx)),
                        dtype=np.int64, count=len(pre))
        tl = self.layout.table_lens(self.head_lens[rows] + self._keep(c))
        return int(self.bt.pages_needed(rows, tl).sum())

    def _decode_table_lens(self, rows: np.ndarray) -> np.ndarray:
        """``table_lens(head_lens[rows])`` of decoding rows, read from ``bt.lens``: every path that sets a row's head
        lengths sets its tables' lengths to their maximum alongside (decode, chunks, admission, ``commit_run``; the
        dynamic mode's upper bound is truncated back in ``update`` before the row decodes). Checked when the pool
        validates (the tests)."""
        tl = self.bt.lens[rows]
        if self.pool.check and not np.array_equal(tl, self.layout.table_lens(self.head_lens[rows])):
            raise AssertionError("table lengths out of step with head lengths")
        return tl

    def _fit_rows(self) -> None:
        n = self.bt.pages.shape[0]
        if self.head_lens.shape[0] < n:
            hl = np.zeros((n,) + self.head_lens.shape[1:], dtype=np.int64)
            hl[: self.head_lens.shape[0]] = self.head_lens
            ctx = np.zeros(n, dtype=np.int64)
            ctx[: self.ctx.size] = self.ctx
            self.head_lens, self.ctx = hl, ctx
            gen, out = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
            gen[: self.gen.size], out[: self.out_tok.size] = self.gen, self.out_tok
            self.gen, self.out_tok = gen, out

    def _partition(self) -> tuple[list, np.ndarray, np.ndarray, list]:
        """The running turns split by phase, in admission order: (decoding turns, their rows, their request ids,
        prefilling turns). Kept, and changed in place of a rebuild when a turn is admitted, completes its prompt or
        finishes (``_batch_decodes``, ``_batch_drop``; a preemption rebuilds it): a replay asks ~5 x 10^4 times. The
        arrays are read-only (plans carry them); with ``pool.check`` every call rebuilds it and compares."""
        b = self._batch
        if b is None or self.pool.check:
            dec, pre = [], []
            for r in self.running:  # (every turn in running is "running")
                (dec if r.prefilled >= r.prompt else pre).append(r)
            rows = np.fromiter((r.row for r in dec), dtype=np.int64, count=len(dec))
            ids = np.fromiter((r.rid for r in dec), dtype=np.int64, count=len(dec))
            rows.flags.writeable = ids.flags.writeable = False
            if b is not None and (b[0] != dec or b[3] != pre or not np.array_equal(b[1], rows)
                                  or not np.array_equal(b[2], ids)):
                raise AssertionError("the running batch's partition changed without being invalidated")
            b = self._batch = (dec, rows, ids, pre)
        return b

    def _batch_decodes(self, req: Request) -> None:
        """Move a turn whose prompt completed from the kept partition's prefilling side to its decoding side, at its
        place in admission order (``running`` is in ``seq`` order: a turn is appended when admitted): a replay
        changes the batch ~36K times, and rebuilding it each time walked the whole running list."""
        b = self._batch
        if b is None:
            return
        dec, rows, ids, pre = b
        j = _position(pre, req)
        if j < 0:
            self._batch = None
            return
        i = bisect_left([r.seq for r in dec], req.seq)
        rows, ids = _inserted(rows, i, req.row), _inserted(ids, i, req.rid)
        self._batch = (dec[:i] + [req] + dec[i:], rows, ids, pre[:j] + pre[j + 1:])

    def _batch_drop(self, req: Request) -> None:
        """Take a turn that left ``running`` out of the kept partition (the rows keep their order)."""
        b = self._batch
        if b is None:
            return
        dec, rows, ids, pre = b
        i = _position(dec, req)
        if i >= 0:
            self._batch = (dec[:i] + dec[i + 1:], _deleted(rows, i), _deleted(ids, i), pre)
        elif (j := _position(pre, req)) >= 0:
            self._batch = (dec, rows, ids, pre[:j] + pre[j + 1:])
        else:
            self._batch = None

    def _take_row(self, req: Request, row: int) -> None:
        """The turn holds ``row`` from now: its output count moves to ``gen[row]`` (``Request.generated``)."""
        req.row = row
        self.gen[row], self.out_tok[row] = req._generated, req.output_tokens
        req._sched = self

    def _leave_row(self, req: Request) -> None:
        req._generated = int(self.gen[req.row])
        req._sched = None

    def _schedule_chunk(self, req: Request, budget: int, pf: list) -> int:
        """Put the request's next chunk in the step; returns tokens used (0 if it must wait)."""
        row = req.row
        start = int(self.ctx[row])
        c = self._chunk_len(req.prompt - req.prefilled, start, req.cuts)
        if c > budget and pf:  # the first chunk of a step may overrun the budget so prefill never starves
            return 0
        before = self.head_lens[row].copy()
        keep = self._keep_one(c)
        upper = before + keep  # global: keep == c, the over-allocation
        tl = self.layout.table_lens(upper)[None]
        if not self.engine.reserve_exact:
            rows = np.array([row])
            need_t = self.bt.pages_needed(rows, tl)
            need = int(need_t.sum())
            if need > self.pool.n_free and not self._make_room(need, keep_sid=req.sid, preempt_after=req.seq):
                return 0
            self.bt.ensure(rows, tl, need_t)  # (making room frees others' pages, never this row's)
        self.bt.lens[row] = tl[0]
        if self.retention != "global":
            self.head_lens[row] = upper
            self._head_tokens += int(keep.sum())
        self.ctx[row] += c
        req.prefilled += c
        if req.prefilled >= req.prompt:
            self._batch_decodes(req)  # it decodes from the next step
        self._in_step.add(req.rid)
        key = req.rid  # the dynamic mode's retention draw: per request, or per chain for a chunk of the chain
        if req.cuts is not None and start + c <= int(req.chain.ends[-1]):
            key = int(req.chain.draw[bisect_left(req.chain.bounds, start + c)])
        if req.pending_copy is not None:
            self._copies.append(req.pending_copy)
            req.pending_copy = None
        pf.append((req.rid, row, start, c, req.prefilled >= req.prompt, before, keep, self.bt.npages[row].copy(),
                   key))
        return c

    def update(self, plan: StepPlan, result: StepResult) -> list[Event]:
        events = self._events
        self._events = []
        if plan.retention == "global" and plan.num_prefill:
            if result.realized_keep is None:
                raise ValueError("dynamic mode: the executor must report realized_keep for prefill rows")
            kept = np.clip(np.asarray(result.realized_keep, dtype=np.int64), 0, plan.prefill_keep)
            new = plan.prefill_head_lens + kept
            self.head_lens[plan.prefill_rows] = new
            self._head_tokens += int(kept.sum())
            reclaimed = self.bt.truncate(plan.prefill_rows, self.layout.table_lens(new))
            self.stats.pages_reclaimed += reclaimed
            self.stats.pages_freed += reclaimed
        if plan.copy_src.size:  # the step copied them
            self.stats.pages_freed += self.pool.unpin(plan.copy_src, distinct=plan.copy_src_distinct)
            self._blocked = None  # unpinned copy sources may be the cache's alone now: the next admission can drop them
        if self.pc is not None and plan.num_prefill:  # the chunks ran: cache the chain's pages they completed
            for rid in plan.prefill_ids.tolist():
                req = self.requests[rid]
                if req.reg >= 0:
                    self._register(req)
            self._prefix_peaks()
        reqs = self.requests
        if plan.num_prefill:
            for rid in plan.prefill_ids[plan.prefill_last].tolist():
                self._emit_token(reqs[rid], events)
        if plan.num_decode:  # one token each, vectorised; _emit_token for the turns that start or finish
            rows = plan.decode_rows
            g = self.gen[rows] + 1
            self.gen[rows] = g
            for i in np.flatnonzero((g == 1) | (g >= self.out_tok[rows])).tolist():
                req = reqs[int(plan.decode_ids[i])]
                self.gen[req.row] -= 1
                self._emit_token(req, events)
        return events

    def _emit_token(self, req: Request, events: list[Event]) -> None:
        req.generated += 1
        if req.generated == 1:
            events.append(Event(req.rid, "first_token"))
        if req.generated >= req.output_tokens:
            self._finish(req)
            events.append(Event(req.rid, "finished"))

    def _finish(self, req: Request) -> None:
        sess = self.sessions[req.sid]
        self._leave_row(req)
        self.running.remove(req)
        self._batch_drop(req)
        req.status = "finished"
        sess.history += req.new_tokens + req.output_tokens
        sess.busy = False
        if self.engine.session_cache:
            sess.parked_head_lens = self.head_lens[req.row].copy()
            sess.parked_ctx = int(self.ctx[req.row])
            sess.parked = self.bt.park(req.row, self._shared_cols(req.units))
            sess.parked_units, req.units = req.units, []
            self.head_lens[req.row] = 0
            self.ctx[req.row] = 0
            self.idle[req.sid] = None
        else:
            self._release_row(req)
        req.row = -1
        self.stats.finished += 1

    def clear_prefix_cache(self) -> int:
        """Evict every cached prefix unit no row holds (end of a run, before a leak check); returns pages freed."""
        return self.pc.clear() if self.pc is not None else 0
    # ------------------------------------------------------------------ fast-forward
    def plan_run(self, max_steps: int | None = None, min_steps: int = 1) -> StepRun | None:
        """The longest run of coming steps that only advance the running set, or None.

        Call between ``update`` (or ``commit_run``) and the next ``schedule``. The steps ``schedule`` would plan
        next are described at once while each one would only decode every decoding turn and give the prefilling
        ones their chunks (the token budget's order): no turn finishes or completes its prompt before the run's
        last step, the pages decode takes fit the free pool without evicting, chunks take no page (their pages
        were reserved at admission: prefilling turns are only run ahead under exact reservation, and not in the
        dynamic mode, whose keep the executor decides; without reservation only a turn whose chunk waits for pages
        at every step, :meth:`_stalled`, which the run leaves waiting), and no turn is admitted. The last holds when
        nothing waits, the batch is at ``max_num_seqs``, or this scheduler's last step already failed to admit the
        queue's head and nothing has freed pages or parked a session since: the next attempts fail the same way,
        without side effects (a failed admission has evicted every idle session but the head's own, and memory only
        shrinks during the run). Decode pages are counted per step, vectorised: a table with ``c`` free token slots
        takes a page at steps ``c+1, c+1+P, ...``; the run stops before the step the pool could not serve. Only time can
        interrupt such a run (an arrival, another replica's doing): the driver then commits the steps up to the one
        in progress. A run shorter than ``min_steps`` is declined ("too short").
        """
        run = self.running
        if not run:
            return self._decline("nothing running")
        # (checked before the pass over the batch: most calls of a saturated replay end here)
        blocked = None
        if self.waiting and len(run) < self.engine.max_num_seqs:
            b = self._blocked
            if b is None:
                return self._decline("head not blocked")  # not tried yet, or no token budget to try it
            if b[0] is not self.waiting[0]:
                return self._decline("head changed")
            if self.pool.n_free > b[1]:
                return self._decline("freed since")  # pages freed since its failed try: the next may pass
            sid = b[0].sid
            if any(s != sid for s in self.idle):
                return self._decline("idle sessions")  # a session parked since: the next try evicts it
            blocked = b[0]
        dec, rows, ids, pre = self._partition()
        if pre and (not self.engine.reserve_exact or self.retention == "global"):
            if not (dec and self._stalled(pre)):
                return self._decline("chunks not reserved")
            pre = []  # its chunk waits for pages at every step of the run: decode steps alone
        if any(r.pending_copy is not None for r in pre):  # a hit's copy-on-write runs with its first chunk
            return self._decline("copy-on-write")
        # A chain's chunks are cut at its segment ends (``_chunk_len``), and a chunk that reaches the next chain
        # boundary a turn may cache ends the run (``commit_run`` registers it as ``update`` would). A blocked
        # head's failed admission is a fixed point with the prefix cache too: it evicted every idle unit and
        # copy source but those of the head's own hit, which it holds again at every attempt.
        k_max = int((self.out_tok[rows] - self.gen[rows]).min()) if dec else 1 << 30  # first decode finish
        if max_steps is not None:
            k_max = min(k_max, int(max_steps))
        chunks: list[tuple] = []  # (step, request, tokens, last)
        attempted_last = True
        if pre:  # the budget's chunks, step by step, until one completes its prompt (it decodes from the next)
            C, head = self.engine.chunk_size, blocked
            head_first = min(C, self._prompt_of(head)) if head is not None else 0
            rem = [r.prompt - r.prefilled for r in pre]
            pos = [int(self.ctx[r.row]) for r in pre]
            reg_at = [int(r.chain.bounds[r.reg]) if 0 <= r.reg < r.chain.bounds.size else -1 for r in pre]
            done = False
            for j in range(1, k_max + 1):
                budget, got = self.engine.max_batched_tokens - len(dec), False
                for i, r in enumerate(pre):
                    if rem[i] and (budget > 0 or not got):
                        c = self._chunk_len(rem[i], pos[i], r.cuts)
                        if c > budget and got:
                            continue
                        rem[i] -= c
                        pos[i] += c
                        budget -= c
                        got = True
                        chunks.append((j, r, c, rem[i] == 0))
                        done = done or rem[i] == 0 or 0 <= reg_at[i] <= pos[i]
                attempted_last = head_first <= budget or not got
                if done:
                    k_max = j
                    break
        if k_max < 1:
            return self._decline("no step")
        if k_max < min_steps:  # (memory only shortens it further: no need to count the pages)
            return self._decline("too short")
        lens0 = self.head_lens[rows]
        if dec:
            tl0 = self._decode_table_lens(rows)
            P = self.layout.page_size
            # first step at which each table needs a page, then one every P steps (strided cumulative count)
            first = (self.bt.npages[rows] * P - tl0).ravel() + 1
            first = first[first <= k_max]
            per = np.bincount(first, minlength=k_max + 1)[1:]
            if first.size and k_max > P:
                m = -(-k_max // P) * P
                per = np.cumsum(np.pad(per, (0, m - k_max)).reshape(-1, P), axis=0).ravel()[:k_max]
            k = int(np.searchsorted(np.cumsum(per), self.pool.n_free, side="right"))
        else:
            per, k = np.zeros(k_max, dtype=np.int64), k_max
        if k < 1:
            return self._decline("no free page")
        if k < min_steps:
            return self._decline("too short")
        if k < k_max:  # cut by memory: the steps after k neither complete a prompt nor happen
            chunks = [ch for ch in chunks if ch[0] <= k]
            if pre:
                attempted_last = self._attempted_at(k, chunks, blocked, len(dec))
        out = StepRun(self._step + 1, ids, rows,
                      self.ctx[rows].copy(), lens0, per[:k].astype(np.int64), self.layout.n_tables, self.retention,
                      self.pool.n_used, self.live_tokens, **self._chunk_arrays(chunks))
        self._run = (out, dec, blocked, self.pool.n_free, attempted_last if pre else True, tl0 if dec else None)
        self.declined = None
        return out

    def _stalled(self, pre: list) -> bool:
        """Whether the one prefilling turn's next chunk waits for pages at every coming step that only decodes
        (chunks take their pages as they run: ``budget_reservation`` off, the dynamic mode's default): its pages do
        not fit the free pool, which the run only shrinks, and making room cannot free any: no idle session or
        cached unit to evict, no copy source to drop, and no running turn to preempt (only a prefilling turn not
        in the step can be; a second one would be, so one alone qualifies). Such a step is a fixed point, as a
        blocked queue head is: the attempt changes nothing, and nothing frees pages until a turn finishes."""
        if len(pre) != 1 or self.idle:
            return False
        pc = self.pc
        if pc is not None and (pc.idle or pc.droppable() is not None):
            return False
        r = pre[0]
        c = self._chunk_len(r.prompt - r.prefilled, int(self.ctx[r.row]), r.cuts)
        tl = self.layout.table_lens(self.head_lens[r.row] + self._keep_one(c))[None]
        return int(self.bt.pages_needed(np.array([r.row]), tl).sum()) > self.pool.n_free

    def _decline(self, why: str) -> None:
        """:meth:`plan_run` runs nothing ahead; ``declined`` says why (read by benchmarks/sim_step_causes.py)."""
        self.declined = why
        return None

    def run_admits_nothing(self) -> bool:
        """Whether the pending run (:meth:`plan_run`) admits no turn at any of its steps whatever joins the queue
        behind its head while it runs, so a turn added then (``add_request``) leaves every step as planned: the
        queue's head was blocked (its admission fails the same way at each step, and admission is FCFS), or the
        batch is at ``max_num_seqs`` (no turn finishes before the run's last step, whose admissions come first)."""
        r = self._run
        return r is not None and (r[2] is not None or len(self.running) >= self.engine.max_num_seqs)

    def _attempted_at(self, j: int, chunks: list, head, kd: int) -> bool:
        """Whether step ``j``'s admission loop would try the queue's head (its token budget left allows it)."""
        mine = [c for (s, _, c, _) in chunks if s == j]
        budget = self.engine.max_batched_tokens - kd - sum(mine)
        return head is None or min(self.engine.chunk_size, self._prompt_of(head)) <= budget or not mine

    def _chunk_arrays(self, chunks: list) -> dict:
        if not chunks:
            return {}
        keep_of: dict[int, np.ndarray] = {}
        before, keep, start, pages = [], [], [], []
        grown: dict[int, np.ndarray] = {}
        ctx: dict[int, int] = {}
        for _, r, c, _ in chunks:
            kc = keep_of.get(c)
            if kc is None:
                kc = keep_of[c] = self._keep_one(c)
            b = grown.get(r.rid)
            if b is None:
                b, ctx[r.rid] = self.head_lens[r.row], int(self.ctx[r.row])
            before.append(b)
            keep.append(kc)
            grown[r.rid] = b + kc
            start.append(ctx[r.rid])
            ctx[r.rid] += c
            pages.append(self.bt.npages[r.row])
        n = len(chunks)
        return {"chunk_step": np.fromiter((ch[0] for ch in chunks), dtype=np.int64, count=n),
                "chunk_ids": np.fromiter((ch[1].rid for ch in chunks), dtype=np.int64, count=n),
                "chunk_rows": np.fromiter((ch[1].row for ch in chunks), dtype=np.int64, count=n),
                "chunk_start": np.array(start, dtype=np.int64),
                "chunk_tokens": np.fromiter((ch[2] for ch in chunks), dtype=np.int64, count=n),
                "chunk_last": np.fromiter((ch[3] for ch in chunks), dtype=bool, count=n),
                "chunk_before": np.stack(before), "chunk_keep": np.stack(keep), "chunk_pages": np.stack(pages)}

    def commit_run(self, run: StepRun, j: int) -> list[Event]:
        """Apply the first ``j`` steps of ``run`` (planned and updated), as ``j`` schedule/update pairs would;
        returns the events of its last step (``finished`` turns, and ``first_token`` of prompts completed at step
        ``k``). Counts are identical to the step-by-step path; page ids may differ (a table's decode pages of the
        run are taken in one allocation)."""
        if self._run is None or self._run[0] is not run:
            raise ValueError("commit_run: not the scheduler's pending run (call plan_run, then commit it once)")
        _, dec, blocked, free0, attempted_last, tl0 = self._run
        self._run = None
        if not 1 <= j <= run.k:
            raise ValueError(f"commit_run: {j} steps of a {run.k}-step run")
        alloc = int(run.alloc[:j].sum())
        if dec:
            rows = run.decode_rows
            new_lens = run.head_lens0 + j
            tl = tl0 + j  # table_lens(head_lens0 + j): every head grew by j
            touched = self.bt.rows_touched
            got = self.bt.ensure(rows, tl)
            assert got == alloc, (got, alloc)
            self.bt.rows_touched = touched + alloc  # one page per growing table per step, as j single steps count
            self.head_lens[rows] = new_lens
            self.bt.lens[rows] = tl
            self.ctx[rows] += j
            self._head_tokens += j * new_lens[0].size * rows.size
        n = int(run._bounds[j])  # chunks of steps 1..j
        last_prefill = []
        if n:
            # each request's last chunk among the first n (it sets the row) and its tokens; a run has a few chunks,
            # so dicts over them (np.unique and np.bincount cost ~40 us a commit)
            ids = run.chunk_ids[:n].tolist()
            last_of, tok_of = {}, {}
            for k, (rid, c) in enumerate(zip(ids, run.chunk_tokens[:n].tolist())):
                last_of[rid] = k
                tok_of[rid] = tok_of.get(rid, 0) + c
            uniq = sorted(last_of)
            last = np.array([last_of[r] for r in uniq], dtype=np.intp)
            rows = run.chunk_rows[last]
            upper = run.chunk_before[last] + run.chunk_keep[last]
            self.head_lens[rows] = upper
            self.bt.lens[rows] = self.layout.table_lens(upper)
            self.ctx[rows] += np.array([tok_of[r] for r in uniq], dtype=np.int64)
            for rid in uniq:
                self.requests[rid].prefilled += tok_of[rid]
            last_prefill = [self.requests[r] for r, done in zip(ids, run.chunk_last[:n].tolist()) if done]
            for r in last_prefill:  # they decode from the next step
                self._batch_decodes(r)
            self._head_tokens += int(run.chunk_keep[:n].sum())
        self._step += j
        st = self.stats
        st.steps += j
        st.pages_allocated += alloc
        st.peak_pages = max(st.peak_pages, run.pages_used0 + alloc)
        self._counters = run.counters(j)
        at_j = attempted_last if j == run.k else self._attempted_at(j, list(zip(
            run.chunk_step.tolist(), [None] * len(run.chunk_step), run.chunk_tokens.tolist(),
            [None] * len(run.chunk_step))), blocked, len(dec))
        self._blocked = (blocked, free0 - alloc) if blocked is not None and at_j else None
        if self.pc is not None and n:  # a chunk of the last step reached a chain boundary (plan_run ends there)
            for rid in uniq:
                req = self.requests[rid]
                if req.reg >= 0:
                    self._register(req)
            self._prefix_peaks()
        events: list[Event] = []
        for r in last_prefill:
            self._emit_token(r, events)
        if dec:  # j tokens each, vectorised; the j-th through _emit_token for the turns that start or finish
            rows = run.decode_rows
            g = self.gen[rows] + j
            self.gen[rows] = g
            for i in np.flatnonzero((g == 1) | (g >= self.out_tok[rows])).tolist():
                r = dec[i]
                self.gen[r.row] -= 1
                self._emit_token(r, events)
        self._events = []
        return events

    # ------------------------------------------------------------------ reporting
    def kv_usage(self) -> dict:
        reserved = self.pool.n_used * self.layout.page_bytes
        live = self.live_tokens * self.layout.head_token_bytes
        return {"pages_used": self.pool.n_used, "pages_total": self.pool.num_pages, "bytes_reserved": reserved,
                "bytes_live": live, "fragmentation": 0.0 if reserved == 0 else 1.0 - live / reserved}

"""The seam between the shared control plane and an executor.

``Scheduler.schedule()`` emits a :class:`StepPlan`; an executor (the GPU engine,
or the simulator's cost model) runs it and returns a :class:`StepResult`;
``Scheduler.update()`` consumes that and reports :class:`Event` s. Nothing
else crosses the seam, so the engine and the simulator share everything but
``execute``.

Arrays are struct-of-arrays over the rows of the step; per-head arrays are
``[rows, L, H]`` in *slot order* (see :mod:`tangram.paging`).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class StepPlan:
    step: int
    # decode rows: one new token each
    decode_ids: np.ndarray  # int64 request ids
    decode_rows: np.ndarray  # int64 block-table rows
    decode_ctx: np.ndarray  # int64 logical (uncompressed) context incl. the token written this step
    decode_head_lens: np.ndarray  # int64 [kd, L, H] tokens each head holds after this step's write
    # prefill rows: one chunk of new prompt tokens each
    prefill_ids: np.ndarray
    prefill_rows: np.ndarray
    prefill_start: np.ndarray  # logical position of the chunk's first token
    prefill_tokens: np.ndarray  # chunk length c
    prefill_last: np.ndarray  # bool: the chunk completes the prompt (emits the first output token)
    prefill_head_lens: np.ndarray  # int64 [kp, L, H] tokens each head holds before the chunk
    prefill_keep: np.ndarray  # int64 [kp, L, H] tokens each head keeps of the chunk (dynamic: c, an upper bound)
    prefill_pages: np.ndarray  # int64 [kp, T] pages each table holds while the chunk runs
    # host control-plane work of this step (priced by the cost model, measured by the engine)
    counters: dict = field(default_factory=dict)
    retention: str = "static"  # full | uniform | global | static
    # int64 [kp] key of each chunk's realised-retention draw (dynamic mode): its request id, or for a chunk of a
    # shared-prefix chain the chain's content id, so equal prefixes realise equal keeps (None: prefill_ids)
    prefill_key: np.ndarray | None = None
    # shared prefixes, copy-on-write: before this step's forward the executor copies page copy_src[i] (every layer
    # and head it spans) onto copy_dst[i], one index copy (int64 page ids; empty when nothing is copied; copy_dst is
    # -1 where the block table names pages only where read, BlockTable(private_ids=False): the simulator's executor
    # prices copies by count and reads no id)
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # no id repeats in copy_src (one turn's copy sources): the scheduler unpins them after the step without a sort
    copy_src_distinct: bool = False

    @property
    def num_decode(self) -> int:
        return int(self.decode_ids.size)

    @property
    def num_prefill(self) -> int:
        return int(self.prefill_ids.size)

    @property
    def num_tokens(self) -> int:
        return int(self.decode_ids.size + self.prefill_tokens.sum())

    @property
    def empty(self) -> bool:
        return self.decode_ids.size == 0 and self.prefill_ids.size == 0

    @property
    def draw_keys(self) -> np.ndarray:
        return self.prefill_ids if self.prefill_key is None else self.prefill_key


@dataclass
class StepResult:
    step: int
    duration_s: float
    breakdown: dict = field(default_factory=dict)  # seconds per operator/term
    # dynamic (global top-k) mode: tokens each head actually kept of its chunk [kp, L, H]
    realized_keep: np.ndarray | None = None
    # engine only: sampled token per decode row and per last-chunk prefill row
    sampled: dict | None = None


@dataclass
class StepRun:
    """``k`` consecutive steps of one unchanged running set (``Scheduler.plan_run``), described at once.

    Every step decodes the same rows (one token per head: ``decode_head_lens = head_lens0 + j`` at step ``j``,
    1-based) and gives the prefilling turns the chunks the token budget gives them (``chunk_*`` arrays, one entry
    per chunk, ordered by step then by the order ``schedule`` lists them). No turn is admitted, evicted, preempted
    or finished before step ``k``; ``alloc[j-1]`` pages are allocated at step ``j`` (decode tables crossing a page
    boundary; a chunk's pages were reserved at admission). :meth:`plan` ``(j)`` is the :class:`StepPlan` of step
    ``j``. A fast executor prices the run in one call (``execute_run``); the driver commits ``j <= k`` of its steps
    (``Scheduler.commit_run``), fewer when something external (an arrival, a session ended) happens during step
    ``j``. A run with no chunk is a run of pure decode steps.
    """

    step0: int  # step number of the run's first step
    decode_ids: np.ndarray  # int64 [kd], the order a step's plan lists them
    decode_rows: np.ndarray
    ctx0: np.ndarray  # int64 [kd] logical context before the run
    head_lens0: np.ndarray  # int64 [kd, L, H] tokens each head holds before the run
    alloc: np.ndarray  # int64 [k] pages allocated by each step (= table rows touched)
    n_tables: int
    retention: str
    pages_used0: int  # pool pages in use before the run
    live0: int  # head-tokens held before the run
    # prefill chunks of the run, [n] (per head: [n, L, H]); empty for a run of pure decode steps
    chunk_step: np.ndarray = None  # int64 step (1-based) of each chunk, nondecreasing
    chunk_ids: np.ndarray = None
    chunk_rows: np.ndarray = None
    chunk_start: np.ndarray = None
    chunk_tokens: np.ndarray = None
    chunk_last: np.ndarray = None  # bool: completes its prompt (only at step k)
    chunk_before: np.ndarray = None  # tokens each head holds before the chunk
    chunk_keep: np.ndarray = None  # tokens each head keeps of the chunk
    chunk_pages: np.ndarray = None  # [n, T] pages the row's tables hold (reserved at admission)

    def __post_init__(self):
        if self.chunk_step is None:
            e = np.zeros(0, dtype=np.int64)
            ph = np.zeros((0,) + self.head_lens0.shape[1:], dtype=np.int64)
            self.chunk_step = self.chunk_ids = self.chunk_rows = self.chunk_start = self.chunk_tokens = e
            self.chunk_last = np.zeros(0, dtype=bool)
            self.chunk_before = self.chunk_keep = ph
            self.chunk_pages = np.zeros((0, self.n_tables), dtype=np.int64)
        k = self.k
        self._bounds = np.searchsorted(self.chunk_step, np.arange(1, k + 2))  # chunks of step j: [b[j-1], b[j])
        self._num_prefill = np.diff(self._bounds)
        self._num_prefill.flags.writeable = False
        self._n_heads = math.prod(self.head_lens0.shape[1:])  # (np.prod of a shape: ~5 us a run)

    @property
    def k(self) -> int:
        return int(self.alloc.size)

    @property
    def _heads(self) -> int:
        return self._n_heads

    @property
    def num_decode(self) -> int:
        return int(self.decode_ids.size)

    @property
    def num_prefill(self) -> np.ndarray:
        """Chunks of each step [k] (read-only)."""
        return self._num_prefill

    def chunks_of(self, j: int) -> slice:
        return slice(int(self._bounds[j - 1]), int(self._bounds[j]))

    @property
    def totals(self) -> np.ndarray:
        """Head-tokens the decode rows hold after each step [k] (what decode attention streams)."""
        per_step = self._heads * self.num_decode
        return int(self.head_lens0.sum()) + per_step * np.arange(1, self.k + 1, dtype=np.int64)

    def counters(self, j=None) -> dict:
        """Host work of step ``j`` (1-based), or of every step as arrays [k] when ``j`` is None."""
        a = self.alloc if j is None else int(self.alloc[j - 1])
        kp = self.num_prefill if j is None else int(self.num_prefill[j - 1])
        return {"admitted": 0, "preempted": 0, "evicted": 0, "pages_allocated": a, "pages_freed": 0,
                "rows_touched": a, "tables": self.n_tables, "decode_rows": self.num_decode, "prefill_rows": kp}

    def reserved(self) -> np.ndarray:
        """Pool pages in use after each step [k] (nothing is freed inside a run)."""
        return self.pages_used0 + np.cumsum(self.alloc)

    def live(self) -> np.ndarray:
        """Head-tokens held after each step [k]."""
        per_step = self._heads * self.num_decode
        kept = np.bincount(self.chunk_step, weights=self.chunk_keep.sum(axis=(1, 2)),
                           minlength=self.k + 1)[1:].astype(np.int64)
        return self.live0 + per_step * np.arange(1, self.k + 1, dtype=np.int64) + np.cumsum(kept)

    def plan(self, j: int) -> StepPlan:
        """The step-by-step plan of step ``j`` (1-based)."""
        if not 1 <= j <= self.k:
            raise ValueError(f"step {j} outside the run's 1..{self.k}")
        c = self.chunks_of(j)
        if self.num_decode:
            d_ctx, d_lens = self.ctx0 + j, self.head_lens0 + j
        else:
            d_ctx, d_lens = self.ctx0, self.head_lens0
        return StepPlan(self.step0 + j - 1, self.decode_ids, self.decode_rows, d_ctx, d_lens,
                        self.chunk_ids[c], self.chunk_rows[c], self.chunk_start[c], self.chunk_tokens[c],
                        self.chunk_last[c], self.chunk_before[c], self.chunk_keep[c], self.chunk_pages[c],
                        self.counters(j), self.retention)


@dataclass
class RunResult:
    """A priced :class:`StepRun`: each step's duration and per-term seconds, arrays [k]. ``state`` is the
    executor's own (what it must look like after each possible last step), passed back to ``commit_run``."""

    durations: np.ndarray
    breakdown: dict = field(default_factory=dict)
    state: object = None


@dataclass(frozen=True)
class Event:
    rid: int
    kind: str  # admitted | first_token | finished | preempted | rejected
    detail: str = ""


class Executor(Protocol):
    """What the harness drives: runs (or prices) one step. ``describe()`` says where step durations come from,
    for the run's summary: ``sources`` (per operator or term), ``tables`` (provenance of cost tables, or None)
    and ``n_cta`` (the decode CTAs a plan aims at)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def describe(self) -> dict: ...


class RunExecutor(Executor, Protocol):
    """An executor that can also price a run of steps at once (the simulator's cost model): the harness
    fast-forwards through such runs. ``execute_run`` must not change the executor's state; ``commit_run(result,
    j)`` then leaves it as if steps 1..j had gone through ``execute`` one by one."""

    def execute_run(self, run: StepRun) -> RunResult: ...

    def commit_run(self, result: RunResult, j: int) -> None: ...

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
class DecodeRun:
    """``k`` consecutive pure-decode steps of one unchanged batch (``Scheduler.decode_run``), described at once.

    Step ``j`` (1-based) is the :class:`StepPlan` :meth:`plan` ``(j)`` builds: every row writes one token per
    head (``decode_head_lens = head_lens0 + j``), no prefill, admission, eviction or preemption, and
    ``alloc[j-1]`` pages allocated (each one a table crossing a page boundary). A fast executor prices the run in
    one call (``execute_run``); the driver commits ``j <= k`` of its steps (``Scheduler.commit_run``), fewer when
    something external (an arrival, a session ended) happens during step ``j``.
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

    @property
    def k(self) -> int:
        return int(self.alloc.size)

    @property
    def num_decode(self) -> int:
        return int(self.decode_ids.size)

    @property
    def totals(self) -> np.ndarray:
        """Head-tokens the batch holds after each step [k] (what decode attention streams)."""
        per_step = self.head_lens0[0].size * self.num_decode
        return int(self.head_lens0.sum()) + per_step * np.arange(1, self.k + 1, dtype=np.int64)

    def counters(self, j=None) -> dict:
        """Host work of step ``j`` (1-based), or of every step as arrays [k] when ``j`` is None."""
        a = self.alloc if j is None else int(self.alloc[j - 1])
        return {"admitted": 0, "preempted": 0, "evicted": 0, "pages_allocated": a, "pages_freed": 0,
                "rows_touched": a, "tables": self.n_tables, "decode_rows": self.num_decode, "prefill_rows": 0}

    def reserved(self) -> np.ndarray:
        """Pool pages in use after each step [k] (nothing is freed inside a run)."""
        return self.pages_used0 + np.cumsum(self.alloc)

    def live(self) -> np.ndarray:
        """Head-tokens held after each step [k]."""
        per_step = self.head_lens0[0].size * self.num_decode
        return self.live0 + per_step * np.arange(1, self.k + 1, dtype=np.int64)

    def plan(self, j: int) -> StepPlan:
        """The step-by-step plan of step ``j`` (1-based)."""
        if not 1 <= j <= self.k:
            raise ValueError(f"step {j} outside the run's 1..{self.k}")
        e = np.zeros(0, dtype=np.int64)
        pe = np.zeros((0,) + self.head_lens0.shape[1:], dtype=np.int64)
        return StepPlan(self.step0 + j - 1, self.decode_ids, self.decode_rows, self.ctx0 + j, self.head_lens0 + j,
                        e, e, e, e, np.zeros(0, dtype=bool), pe, pe, np.zeros((0, self.n_tables), dtype=np.int64),
                        self.counters(j), self.retention)


@dataclass
class RunResult:
    """A priced :class:`DecodeRun`: each step's duration and per-term seconds, arrays [k]. ``state`` is the
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
    """An executor that can also price a run of decode steps at once (the simulator's cost model): the harness
    fast-forwards through such runs. ``execute_run`` must not change the executor's state; ``commit_run(result,
    j)`` then leaves it as if steps 1..j had gone through ``execute`` one by one."""

    def execute_run(self, run: DecodeRun) -> RunResult: ...

    def commit_run(self, result: RunResult, j: int) -> None: ...

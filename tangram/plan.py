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
    # int64 [kp] key of each chunk's realised-retention draw (dynamic mode): its request id, or for a chunk of a
    # shared-prefix chain the chain's content id, so equal prefixes realise equal keeps (None: prefill_ids)
    prefill_key: np.ndarray | None = None
    # shared prefixes, copy-on-write: before this step's forward the executor copies page copy_src[i] (every layer
    # and head it spans) onto copy_dst[i], one index copy (int64 page ids; empty when nothing is copied)
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

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

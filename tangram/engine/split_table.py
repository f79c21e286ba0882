"""The AOT split table: every (batch bucket, context bucket, layer)'s split map and decode work items, built once.

The maps come from :func:`tangram.planner.aot_bucket_split_map`, the one function the simulator's cost model
also calls: Algorithm 1 capped per context bucket, or, with :class:`tangram.planner.DecodeCosts`, the cheapest
of no split, Algorithm 1's split and the finer splits the cost tables favour (regime routing, decided here ahead
of time). The work items of every distinct layer map are uploaded once; a step does dictionary lookups, no
planning. Both keys are known on the host without touching the device.
"""
from __future__ import annotations

import numpy as np

from tangram.budgets import check_group_size
from tangram.errors import ConfigError
from tangram.kernels.decode import LayerSchedule, paired_schedule, schedule_from_split_map
from tangram.planner import (AOT_MAX_CONTEXT, AOT_MAX_SPLITS, AOT_MIN_SPLIT_TOKENS, DECODE_ORDERS, MIN_CONTEXT_BUCKET,
                             DecodeCosts, aot_bucket_split_map, decode_context_bucket, pow2_bucket)


class AotSplitTable:
    """Split maps and work items for every (layer, batch bucket, context bucket), computed once ahead of time."""

    def __init__(self, B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_occ: int, *, max_batch: int = 256,
                 waves: float = 1.0, rounding: str = "round", min_split_tokens: int = AOT_MIN_SPLIT_TOKENS,
                 max_splits: int = AOT_MAX_SPLITS, min_context: int = MIN_CONTEXT_BUCKET,
                 max_context: int = AOT_MAX_CONTEXT, costs: DecodeCosts | None = None, gq: int = 4,
                 head_dim: int = 128, dtype_bytes: int = 2, num_sms: int | None = None, device="cpu",
                 order: str = "request"):
        B = np.asarray(B, dtype=np.float64)
        if order not in DECODE_ORDERS:
            raise ConfigError(f"decode launch order {order!r}: expected one of {', '.join(DECODE_ORDERS)}")
        if order == "paired" and num_sms is None:
            raise ConfigError("decode launch order 'paired' needs num_sms (the GPU's SMs)")
        # "lpt": items longest first (a slot's budget over its splits) in an item-major grid (schedule_from_split_map);
        # "paired": that, and a launch of exactly a batch bucket's rows (a graphed step) also balances the first
        # wave's bytes per SM (kernels.decode.paired_schedule)
        self.order = order
        weights = np.take_along_axis(B, np.asarray(perm), axis=1) if order != "request" else None
        check_group_size(B.shape[1], heads_per_group)  # aot_split_map itself does not check
        self.heads_per_group, self.n_occ, self.waves, self.costs = heads_per_group, n_occ, waves, costs
        self.min_split_tokens = min_split_tokens
        self.split_maps: dict[tuple[int, int], np.ndarray] = {}
        self._sched: dict[tuple[int, int, int], LayerSchedule] = {}
        self._canon: dict[tuple[int, int], int] = {}
        self._steps: dict[tuple[int, int], tuple[LayerSchedule, ...]] = {}
        shared: dict[bytes, LayerSchedule] = {}
        shared_paired: dict[tuple[int, bytes], LayerSchedule] = {}
        self._paired_steps: dict[tuple[int, int], tuple[LayerSchedule, ...]] = {}
        self.batch_buckets = [1 << i for i in range(pow2_bucket(max(1, max_batch)).bit_length())]
        lo = decode_context_bucket(min_context)
        self.ctx_buckets = [lo << i for i in range(max(0, (pow2_bucket(max_context) // lo).bit_length()))]
        for b in self.batch_buckets:
            seen: dict[bytes, int] = {}
            for c in self.ctx_buckets:
                S = aot_bucket_split_map(B, perm, heads_per_group, n_occ, b, waves=waves, rounding=rounding, context=c,
                                         min_split_tokens=min_split_tokens, max_splits=max_splits, costs=costs, gq=gq,
                                         head_dim=head_dim, dtype_bytes=dtype_bytes, num_sms=num_sms)
                self.split_maps[(b, c)] = S
                self._canon[(b, c)] = seen.setdefault(S.tobytes(), c)
                for l in range(S.shape[0]):
                    key = S[l].tobytes() + (b"" if weights is None else weights[l].tobytes())
                    if key not in shared:
                        shared[key] = schedule_from_split_map(S[l], heads_per_group, device,
                                                              lpt_weights=None if weights is None else weights[l])
                    self._sched[(b, c, l)] = shared[key]
                self._steps[(b, c)] = tuple(self._sched[(b, c, l)] for l in range(S.shape[0]))
                if order == "paired":
                    keys = [(b, S[l].tobytes() + weights[l].tobytes()) for l in range(S.shape[0])]
                    for l, key in enumerate(keys):
                        if key not in shared_paired:
                            shared_paired[key] = paired_schedule(S[l], heads_per_group, b, weights[l], num_sms,
                                                                 n_occ, device)
                    self._paired_steps[(b, c)] = tuple(shared_paired[k] for k in keys)

    def _keys(self, batch: int, max_context: int | None) -> tuple[int, int]:
        b = min(pow2_bucket(batch), self.batch_buckets[-1])
        c = self.ctx_buckets[-1] if max_context is None else \
            min(max(decode_context_bucket(max_context), self.ctx_buckets[0]), self.ctx_buckets[-1])
        return b, c

    def lookup(self, layer: int, batch: int, max_context: int | None = None) -> LayerSchedule:
        """Schedule of ``layer`` for a batch of ``batch`` requests whose longest context is ``max_context``
        tokens (before compression; None = the largest bucket)."""
        b, c = self._keys(batch, max_context)
        if batch == b and self._paired_steps:  # exactly the bucket's rows: the SM-balanced list
            return self._paired_steps[(b, c)][layer]
        return self._sched[(b, c, layer)]

    def step(self, batch: int, max_context: int | None = None) -> tuple[LayerSchedule, ...]:
        """Every layer's schedule for a step (one lookup per step, as a static split computes its num_splits once
        per step for all layers): the per-layer host work is an index into this tuple."""
        key = self._keys(batch, max_context)
        if batch == key[0] and self._paired_steps:  # exactly the bucket's rows (a graphed step): SM-balanced
            return self._paired_steps[key]
        return self._steps[key]

    def canonical_context(self, batch: int, max_context: int | None = None) -> int:
        """The smallest context bucket whose maps equal this one's for the batch: decode graphs are captured
        per (batch bucket, canonical context), so buckets that launch the same CTAs share one graph."""
        return self._canon[self._keys(batch, max_context)]

    def split_map(self, batch: int, max_context: int | None = None) -> np.ndarray:
        return self.split_maps[self._keys(batch, max_context)]


__all__ = ["AotSplitTable"]

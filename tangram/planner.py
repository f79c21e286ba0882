"""Decode work partitioning: the AOT split map (Algorithm 1) and the two baselines.

* :func:`aot_split_map` runs once, offline, from budget ratios. The decode
  kernel reads ``S[l, g]`` and does no planning at run time.
* :func:`flashdecoding_num_splits` is FlashDecoding's static heuristic: one
  ``num_splits`` for every head, chosen from the batch shape alone.
* :func:`runtime_plan` is the FlashInfer-style per-layer plan a system must
  recompute every step when lengths differ across layers; it reports how much
  host work it did so that work can be priced.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tangram.budgets import check_group_size, group_sums
from tangram.errors import ConfigError


def aot_split_map(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_cta: int,
                  rounding: str = "round") -> np.ndarray:
    """Algorithm 1: S[l, i] = max(1, R(Phi[l, i] / tau_l)), tau_l = Omega_l / N_CTA.

    ``rounding="round"`` is the paper's rule, implemented as round-half-up
    (``floor(x + 0.5)``, not numpy's round-half-to-even) so a share of exactly
    k + 1/2 CTAs always gets k + 1. ``rounding="ceil"`` is the primer's variant,
    which never gives a group fewer CTAs than its share (more CTAs in total).
    Layers whose budget sums to zero keep S = 1 (line 4).
    """
    if n_cta < 1:
        raise ConfigError(f"N_CTA must be >= 1, got {n_cta}")
    B = np.asarray(B, dtype=np.float64)
    check_group_size(B.shape[1], heads_per_group)
    phi = group_sums(B, perm, heads_per_group)  # [L, G]
    omega = B.sum(axis=1, keepdims=True)  # [L, 1]
    safe = np.where(omega > 0, omega, 1.0)
    share = phi / (safe / n_cta)
    if rounding == "round":
        s = np.floor(share + 0.5)
    elif rounding == "ceil":
        s = np.ceil(share - 1e-12)
    else:
        raise ConfigError(f"rounding must be 'round' or 'ceil', got {rounding!r}")
    s = np.where(omega > 0, s, 1.0)
    return np.maximum(1, s).astype(np.int32)


def pow2_bucket(n: int) -> int:
    """The power-of-two bucket of a size >= 1 (batch or context): 1, 2, 4, ... The AOT split table, the decode
    CUDA graphs and the cost model all key on it, so a step's bucket is the same everywhere."""
    return 1 << max(0, int(n) - 1).bit_length()


AOT_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more (empty CTAs, a longer merge) than it balances
AOT_MAX_SPLITS = 128
AOT_MAX_CONTEXT = 131072  # the largest context bucket of the split table (the bucket a lookup without one uses)


def aot_n_cta(n_occ: int, bucket: int, heads_per_group: int, waves: float = 1.0) -> int:
    """N_CTA handed to Algorithm 1 for one batch bucket.

    Algorithm 1 distributes N_CTA over the groups of a layer; the decode kernel launches
    ``S[l, g]`` CTAs for *each head* of group g and each request, i.e. about
    ``bucket * H_p * N_CTA`` CTAs. To fill the device's ``n_occ`` concurrent CTAs
    ``waves`` times, N_CTA = waves * n_occ / (bucket * H_p).
    """
    return max(1, int(round(waves * n_occ / (bucket * heads_per_group))))


def aot_bucket_split_map(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_occ: int, bucket: int, *,
                         waves: float = 1.0, rounding: str = "round", context: int = AOT_MAX_CONTEXT,
                         min_split_tokens: int = AOT_MIN_SPLIT_TOKENS,
                         max_splits: int = AOT_MAX_SPLITS) -> np.ndarray:
    """The split map the engine launches for a batch bucket and context bucket: Algorithm 1 at
    :func:`aot_n_cta`, each group capped at its longest head's retained tokens at ``context`` over
    ``min_split_tokens`` (and ``max_splits``). The engine's split table and the simulator's cost model
    both call this, so they price and launch the same CTAs."""
    S = aot_split_map(B, perm, heads_per_group, aot_n_cta(n_occ, bucket, heads_per_group, waves), rounding)
    Bg = np.take_along_axis(np.asarray(B, dtype=np.float64), np.asarray(perm), axis=1)
    gmax = Bg.reshape(Bg.shape[0], -1, heads_per_group).max(axis=2)  # [L, G] longest head of each group
    cap = np.clip(np.floor(np.ceil(gmax * context) / min_split_tokens), 1, max_splits).astype(np.int32)
    return np.minimum(S, cap)


def flashdecoding_num_splits(batch_nheads: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's ``num_splits_heuristic`` (flash_api.cpp), applied to every head alike.

    ``batch_nheads`` counts (request, KV head) pairs of the launch, ``num_n_blocks``
    the KV blocks of the longest sequence. Picks the fewest splits whose wave
    efficiency is within 85% of the best.
    """
    if batch_nheads >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, max(1, num_n_blocks))

    def eligible(s: int) -> bool:
        return s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))

    eff = np.zeros(max_splits + 1)
    best = 0.0
    for s in range(1, max_splits + 1):
        if not eligible(s):
            continue
        waves = batch_nheads * s / num_sms
        eff[s] = waves / np.ceil(waves)
        best = max(best, eff[s])
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s] >= 0.85 * best:
            return s
    return 1


@dataclass
class RuntimePlan:
    """Per-layer split counts for every (request, head) and the host work spent finding them."""

    splits: list[np.ndarray]  # per layer: [R, H] chunks per (request, head)
    chunk_tokens: np.ndarray  # [L] the chunk size chosen for each layer
    host_items: int  # (request, head) work items scanned, summed over layers and search iterations
    search_iters: int


def runtime_plan(lengths: np.ndarray, n_cta: int, min_chunk: int = 16) -> RuntimePlan:
    """FlashInfer-style balanced split-KV plan, recomputed for each layer.

    For each layer, binary-search the largest chunk size whose chunk count fits
    ``n_cta`` CTAs, then split every (request, head) into chunks of that size.
    ``lengths`` is [R, L, H] retained tokens. The loop over layers is the point:
    non-uniform lengths differ per layer, so one plan cannot be reused across
    layers the way FlashInfer reuses it for uniform caches.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 3:
        raise ConfigError(f"lengths must be [R, L, H], got {lengths.shape}")
    R, L, H = lengths.shape
    splits, chunks, items, iters = [], np.zeros(L, dtype=np.int64), 0, 0
    for l in range(L):
        x = lengths[:, l, :]
        lo, hi = min_chunk, max(min_chunk, int(x.max()) if x.size else min_chunk)
        while lo < hi:  # smallest chunk whose chunk count fits n_cta
            mid = (lo + hi) // 2
            n = int(np.maximum(1, -(-x // mid)).sum())
            items += x.size
            iters += 1
            if n <= n_cta:
                hi = mid
            else:
                lo = mid + 1
        chunks[l] = lo
        splits.append(np.maximum(1, -(-x // lo)).astype(np.int32))
        items += x.size
    return RuntimePlan(splits, chunks, items, iters)

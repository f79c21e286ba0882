"""Paged split-KV decode attention for ragged (per head-group) and monolithic KV pools.

One Triton kernel serves every decode variant. A launch is a list of *work
items* ``(request, slot, split)``; each item streams one contiguous token range
of one KV head through the block table and writes a partial softmax state
(max, sum, acc in fp32); a second kernel merges the splits of each head. The
variants only differ in how the item list and the range of an item are made:

* ``tangram_aot``  — split counts per head group come from the AOT split map
  ``S[l, g]`` (Algorithm 1, or no split, as the regime choice says); items are
  precomputed once per (layer, batch bucket, context bucket) by the engine's
  :class:`tangram.engine.split_table.AotSplitTable`, so a step does a table
  lookup, no planning.
* ``static_split`` — FlashDecoding's static ``num_splits`` for every head alike
  (baseline a).
* ``runtime_plan`` — (request, head) varlen work with a per-layer plan
  recomputed on the host every step (baseline b, FlashInfer-style).

Layouts (strides, so one kernel serves both):

* ragged: pool ``[num_pages, 2, H_p, P, d]``, block table ``[B, G, max_pages]``;
* monolithic: ``pool[:, l]`` of ``[num_pages, L, 2, H, P, d]`` is a strided
  ``[num_pages, 2, H, P, d]`` view with ``G = 1``, ``H_p = H``; its block table
  ``[B, max_pages]`` is viewed as ``[B, 1, max_pages]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tangram.budgets import check_group_size
from tangram.errors import ConfigError
from tangram.planner import aot_n_cta  # noqa: F401 - re-exported for the benchmarks
from tangram.kernels._triton import attend_block, runs_triton, tl, triton

# ----------------------------------------------------------------------------- kernels


# Integer arguments stay specialised (Triton's default: "== 1" / "divisible by 16"). Marking the step-varying ones
# do_not_specialize removed the occasional recompile (0.5-1.8 s steps) but cost 27% of engine throughput on the
# H100 (tangram mode 0.378 vs 0.517 req/s; reports/engine/README.md, "Earlier results"). Instead the partial buffers are
# padded (launch_decode) so their strides keep one divisibility class, and the warm-up covers the chunk lengths.
@triton.jit(do_not_specialize_on_alignment=["LENS", "SLOT2HEAD"])  # views at any offset (compress.py)
def _decode_split_kernel(
    Q, KV, BT, LENS, SLOT2HEAD, NSPLIT, ITEMS, PM, PL, PACC, OUT,
    qk_scale, chunk_tokens,
    stride_qb, stride_qh,
    stride_kvp, stride_kvkv, stride_kvh, stride_kvt,
    stride_btb, stride_btg,
    stride_lb, stride_nb,
    stride_pb, stride_ph, stride_ps,
    stride_ob, stride_oh,
    HP: tl.constexpr, GQ: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_MODE: tl.constexpr, ITEM_HAS_B: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    ITEM_MAJOR: tl.constexpr = False,
):
    """Stage 1: one program = one (request, slot, split) item. ``ITEM_MAJOR``: the grid is (requests, items), so
    the GPU dispatches every request's copy of item 0 first, then item 1, ... (items listed longest first: LPT)."""
    if ITEM_MAJOR:
        item = tl.program_id(1)
        b = tl.program_id(0)
    else:
        item = tl.program_id(0)
        if ITEM_HAS_B:
            b = tl.load(ITEMS + item * 3 + 2)
        else:
            b = tl.program_id(1)
    slot = tl.load(ITEMS + item * 3)
    split = tl.load(ITEMS + item * 3 + 1)
    g = slot // HP
    j = slot % HP
    head = tl.load(SLOT2HEAD + slot)
    n = tl.load(LENS + b * stride_lb + slot)
    ns = tl.load(NSPLIT + b * stride_nb + slot)
    if SPLIT_MODE == 0:  # page-aligned: ns ranges of ceil(pages / ns) pages each
        pps = tl.cdiv(tl.cdiv(n, P), ns)
        start = split * pps * P
        end = tl.minimum(n, start + pps * P)
    else:  # fixed chunk of tokens (runtime plan)
        start = split * chunk_tokens
        end = tl.minimum(n, start + chunk_tokens)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < GQ
    q = tl.load(Q + b * stride_qb + (head * GQ + offs_m)[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb + g * stride_btg
    k_base = KV + j * stride_kvh
    v_base = k_base + stride_kvkv
    for t in range(start, end, BLOCK_N):
        offs_n = t + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // P, mask=mask_n, other=0).to(tl.int64)
        off = page * stride_kvp + (offs_n % P) * stride_kvt
        k = tl.load(k_base + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_base + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, IEEE)

    if DIRECT:  # a single split per head: normalise and write the output here
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * stride_ob + (head * GQ + offs_m)[:, None] * stride_oh + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=mask_m[:, None])
    else:
        pbase = b.to(tl.int64) * stride_pb + slot * stride_ph + split * stride_ps
        tl.store(PM + pbase + offs_m, m_i, mask=mask_m)
        tl.store(PL + pbase + offs_m, l_i, mask=mask_m)
        tl.store(PACC + pbase * D + offs_m[:, None] * D + offs_d[None, :], acc, mask=mask_m[:, None])


@triton.jit
def _decode_merge_kernel(
    PM, PL, PACC, NSPLIT, SLOT2HEAD, OUT,
    stride_nb, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    GQ: tl.constexpr, GQ_P2: tl.constexpr, D: tl.constexpr, S_BLOCK: tl.constexpr,
):
    """Stage 2: merge the partial states of the splits of one (request, slot), S_BLOCK splits at a time
    (independent loads, so a head with many splits is not a chain of dependent round trips)."""
    b = tl.program_id(0)
    slot = tl.program_id(1)
    head = tl.load(SLOT2HEAD + slot)
    ns = tl.load(NSPLIT + b * stride_nb + slot)
    offs_m = tl.arange(0, GQ_P2)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, S_BLOCK)
    mask_m = offs_m < GQ
    m_i = tl.full([GQ_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GQ_P2], tl.float32)
    acc = tl.zeros([GQ_P2, D], tl.float32)
    base = b.to(tl.int64) * stride_pb + slot * stride_ph
    for s0 in range(0, ns, S_BLOCK):
        offs_s = s0 + offs_b
        msk = (offs_s < ns)[:, None] & mask_m[None, :]
        pb = base + offs_s[:, None] * stride_ps + offs_m[None, :]  # [S, M] element offsets of (m, l)
        m_s = tl.load(PM + pb, mask=msk, other=float("-inf"))
        l_s = tl.load(PL + pb, mask=msk, other=0.0)
        a_s = tl.load(PACC + pb[:, :, None] * D + offs_d[None, None, :], mask=msk[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        c_old = tl.exp2(m_i - m_safe)
        w = tl.exp2(m_s - m_safe[None, :])
        l_i = l_i * c_old + tl.sum(l_s * w, 0)
        acc = acc * c_old[:, None] + tl.sum(a_s * w[:, :, None], 0)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + b * stride_ob + (head * GQ + offs_m)[:, None] * stride_oh + offs_d[None, :],
             o.to(OUT.dtype.element_ty), mask=mask_m[:, None])


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the split kernel; chosen on the GPU by ``tangram.kernels.bench``."""

    block_n: int = 64  # tokens per iteration (several pages gathered through the block table)
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = DecodeConfig(block_n=128, num_warps=8, num_stages=3)  # chosen on the H100 (sim/tables/h100/meta.json)
_COMPILED: dict = {}  # DecodeConfig -> compiled stage-1 kernel (for the occupancy query)


@dataclass
class LayerSchedule:
    """Work items of one layer's decode launch.

    ``items`` is int32 ``[n, 3]`` (slot, split, request); with ``per_request``
    the same ``(slot, split)`` list is launched for every request (grid
    ``(n, B)``), else each item names its request (varlen, runtime plan).
    ``nsplit`` is ``[H]`` (same for all requests) or ``[B, H]``.
    """

    items: torch.Tensor
    nsplit: torch.Tensor
    max_splits: int
    per_request: bool
    split_mode: int = 0  # 0 page-aligned ranges of the head's own length, 1 fixed chunk_tokens
    chunk_tokens: int = 0
    item_major: bool = False  # per_request only: grid (B, n) instead of (n, B), items in dispatch order

    @property
    def n_items(self) -> int:
        return int(self.items.shape[0])


def _slot_items(nsplit_slot: np.ndarray) -> np.ndarray:
    ns = np.asarray(nsplit_slot, dtype=np.int64)
    slots = np.repeat(np.arange(ns.size), ns)
    starts = np.repeat(np.cumsum(ns) - ns, ns)
    split = np.arange(slots.size) - starts
    return np.stack([slots, split, np.zeros_like(slots)], axis=1).astype(np.int32)


def _split_row(split_map) -> np.ndarray:
    """A layer's split map row ``S[l]`` ([G] ints, a tensor or anything numpy reads) as int64, checked >= 1."""
    s = np.asarray(split_map.cpu() if isinstance(split_map, torch.Tensor) else split_map, dtype=np.int64).reshape(-1)
    if s.size == 0 or np.any(s < 1):
        raise ConfigError(f"split map row must be >= 1 for every group, got {s.tolist()}")
    return s


def schedule_from_split_map(split_map, heads_per_group: int, device="cpu", *, lpt_weights=None) -> LayerSchedule:
    """Items for one layer from its split map row ``S[l]`` ([G]): every head of group g gets S[l, g] splits.

    ``lpt_weights`` ([H], a slot's expected length, e.g. its budget): launch longest first (LPT list scheduling):
    items sorted by weight / splits, descending, in an item-major grid, so every request's longest pieces are
    dispatched before any shorter one and the last wave holds the shortest."""
    s = _split_row(split_map)
    ns = np.repeat(s, heads_per_group)
    items = _slot_items(ns)
    if lpt_weights is not None:
        w = np.asarray(lpt_weights, dtype=np.float64).reshape(-1)
        if w.shape != ns.shape:
            raise ConfigError(f"lpt_weights: expected {ns.size} slot weights, got {w.size}")
        piece = (w / ns)[items[:, 0]]
        items = items[np.argsort(-piece, kind="stable")]
    return LayerSchedule(torch.from_numpy(items).to(device), torch.from_numpy(ns.astype(np.int32)).to(device),
                         int(s.max()), per_request=True, item_major=lpt_weights is not None)


def paired_schedule(split_map, heads_per_group: int, batch: int, weights, num_sms: int, n_occ: int,
                    device="cpu") -> LayerSchedule:
    """Items of a launch of exactly ``batch`` requests (every ``(slot, split, request)`` listed: varlen), ordered so
    that the first wave balances bytes per SM: pieces sorted heaviest first (weight / splits), the first wave's
    ``n_occ`` heaviest laid out as the ``num_sms`` heaviest then the rest of the wave lightest first (the GPU
    hands block i of a wave to SM i mod ``num_sms``: SM k runs the k-th heaviest with one of the wave's lightest),
    the later waves longest first. A one-wave launch is limited by its most loaded SM, not only by its longest CTA
    (reports/engine/roofline/README.md, H200 2026-11-29). Only for launches of exactly ``batch`` rows: a smaller
    batch would read rows it does not have (the split table uses it for graphed steps, padded to their bucket)."""
    s = _split_row(split_map)
    ns = np.repeat(s, heads_per_group)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != ns.shape:
        raise ConfigError(f"paired_schedule: expected {ns.size} slot weights, got {w.size}")
    one = _slot_items(ns)
    items = np.tile(one, (batch, 1))
    items[:, 2] = np.repeat(np.arange(batch), len(one))
    idx = np.argsort(-(w / ns)[items[:, 0]], kind="stable")
    m = min(int(n_occ), idx.size)
    k = min(int(num_sms), m)
    idx = np.concatenate([idx[:k], idx[k:m][::-1], idx[m:]])
    return LayerSchedule(torch.from_numpy(items[idx].astype(np.int32)).to(device),
                         torch.from_numpy(ns.astype(np.int32)).to(device), int(s.max()), per_request=False)


def static_schedule(num_heads: int, num_splits: int, device="cpu") -> LayerSchedule:
    return schedule_from_split_map(np.full(num_heads, num_splits), 1, device)


# ----------------------------------------------------------------------------- launch


def _check(q, kv_pool, block_table, head_lens, slot_to_head, page_size, heads_per_group):
    if q.dim() != 3 or kv_pool.dim() != 5 or block_table.dim() != 3 or head_lens.dim() != 2:
        raise ConfigError("paged_decode: expected q[B,Hq,d], kv_pool[pages,2,H_p,P,d], block_table[B,G,max_pages], "
                          f"head_lens[B,H]; got {tuple(q.shape)}, {tuple(kv_pool.shape)}, {tuple(block_table.shape)}, "
                          f"{tuple(head_lens.shape)}")
    B, Hq, d = q.shape
    H = head_lens.shape[1]
    check_group_size(H, heads_per_group)
    if Hq % H:
        raise ConfigError(f"paged_decode: {Hq} query heads is not a multiple of {H} KV heads")
    if kv_pool.shape[1] != 2 or kv_pool.shape[2] != heads_per_group or kv_pool.shape[3] != page_size or kv_pool.shape[4] != d:
        raise ConfigError(f"paged_decode: kv_pool shape {tuple(kv_pool.shape)} != [pages, 2, H_p={heads_per_group}, "
                          f"P={page_size}, d={d}]")
    if block_table.shape[1] != H // heads_per_group or block_table.shape[0] != B or head_lens.shape[0] != B:
        raise ConfigError(f"paged_decode: block_table {tuple(block_table.shape)} / head_lens {tuple(head_lens.shape)} "
                          f"do not match B={B}, G={H // heads_per_group}")
    if slot_to_head.numel() != H:
        raise ConfigError(f"paged_decode: slot_to_head has {slot_to_head.numel()} entries, expected H={H}")
    if kv_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ConfigError("paged_decode: the head dimension of q and kv_pool must be contiguous")
    if d & (d - 1) or d < 16:
        raise ConfigError(f"paged_decode: head_dim must be a power of two >= 16, got {d}")
    if block_table.dtype != torch.int32 or head_lens.dtype != torch.int32:
        raise ConfigError("paged_decode: block_table and head_lens must be int32")
    return B, Hq, H, d


def launch_decode(q, kv_pool, block_table, head_lens, slot_to_head, sched: LayerSchedule, *, page_size: int,
                  heads_per_group: int, sm_scale: float | None = None, out: torch.Tensor | None = None,
                  config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Run one layer's decode with a prepared schedule (all variants end here)."""
    B, Hq, H, d = _check(q, kv_pool, block_table, head_lens, slot_to_head, page_size, heads_per_group)
    gq = Hq // H
    if out is None:
        out = torch.empty_like(q)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if B == 0:
        return out
    if not runs_triton(q):  # CPU without the interpreter: the float64 reference
        from tangram.kernels.reference import ref_paged_decode

        out.copy_(ref_paged_decode(q, kv_pool, block_table, head_lens, slot_to_head, page_size=page_size,
                                   heads_per_group=heads_per_group, sm_scale=sm_scale))
        return out
    direct = sched.max_splits == 1
    nsplit = sched.nsplit
    stride_nb = nsplit.stride(0) if nsplit.dim() == 2 else 0
    S = sched.max_splits
    if direct:
        pm = pl = pacc = out  # unused
        spb = sph = sps = 0
    else:
        # Pad the split axis so the partial buffers' strides (S*gq, H*S*gq) are always multiples of 16: a stride
        # flipping between "divisible by 16" and not as S changes from step to step would recompile both kernels.
        m = 16 // math.gcd(16, gq)
        S = -(-S // m) * m
        pm = torch.empty((B, H, S, gq), device=q.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty((B, H, S, gq, d), device=q.device, dtype=torch.float32)
        spb, sph, sps = pm.stride(0), pm.stride(1), pm.stride(2)
    item_major = sched.per_request and sched.item_major
    grid = ((B, sched.n_items) if item_major else (sched.n_items, B)) if sched.per_request else (sched.n_items, 1)
    if sched.n_items == 0:
        out.zero_()
        return out
    block_m = max(16, triton.next_power_of_2(gq))
    k = _decode_split_kernel[grid](
        q, kv_pool, block_table, head_lens, slot_to_head, nsplit, sched.items, pm, pl, pacc, out,
        sm_scale * 1.4426950408889634, sched.chunk_tokens,
        q.stride(0), q.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        block_table.stride(0), block_table.stride(1),
        head_lens.stride(0), stride_nb,
        spb, sph, sps,
        out.stride(0), out.stride(1),
        HP=heads_per_group, GQ=gq, P=page_size, D=d, BLOCK_M=block_m, BLOCK_N=config.block_n,
        SPLIT_MODE=sched.split_mode, ITEM_HAS_B=not sched.per_request, DIRECT=direct,
        IEEE=q.dtype == torch.float32, ITEM_MAJOR=item_major,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config not in _COMPILED and k is not None:
        _COMPILED[config] = k
    if not direct:
        _decode_merge_kernel[(B, H)](
            pm, pl, pacc, nsplit, slot_to_head, out,
            stride_nb, spb, sph, sps, out.stride(0), out.stride(1),
            GQ=gq, GQ_P2=triton.next_power_of_2(gq), D=d,
            S_BLOCK=max(1, min(16, 8192 // (triton.next_power_of_2(gq) * d))),  # <= 8K fp32 partials per step
            num_warps=4,
        )
    return out


def paged_decode(q, kv_pool, block_table, head_lens, slot_to_head, split_map, *, page_size: int, heads_per_group: int,
                 sm_scale: float | None = None, out: torch.Tensor | None = None,
                 config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Tangram decode for one layer with the AOT split map.

    ``split_map`` is a :class:`LayerSchedule` from the engine's split table (``AotSplitTable.lookup``)
    (zero planning) or the layer's row ``S[l]`` ([G] ints; items are then
    built on the host, convenient for tests, not for the serving loop).
    """
    sched = split_map if isinstance(split_map, LayerSchedule) else \
        schedule_from_split_map(split_map, heads_per_group, q.device)
    return launch_decode(q, kv_pool, block_table, head_lens, slot_to_head, sched, page_size=page_size,
                         heads_per_group=heads_per_group, sm_scale=sm_scale, out=out, config=config)


def static_split_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int, head_dim: int = 128) -> int:
    """FlashDecoding's num_splits for the launch (flash-attn's block_n: 256 for d<=64, 128 for d<=128, else 64)."""
    from tangram.planner import flashdecoding_num_splits, split_kv_block

    return flashdecoding_num_splits(batch * num_kv_heads, num_sms, max(1, -(-int(max_len) // split_kv_block(head_dim))))


_STATIC_CACHE: dict = {}


def static_split_decode(q, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int, heads_per_group: int,
                        max_len: int, num_sms: int, sm_scale: float | None = None, out=None,
                        config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Baseline (a): the same num_splits for every head, from the batch shape and the longest length."""
    H = head_lens.shape[1]
    ns = static_split_num_splits(q.shape[0], H, max_len, num_sms, q.shape[2])
    key = (H, ns, q.device)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = static_schedule(H, ns, q.device)
    return launch_decode(q, kv_pool, block_table, head_lens, slot_to_head, _STATIC_CACHE[key], page_size=page_size,
                         heads_per_group=heads_per_group, sm_scale=sm_scale, out=out, config=config)


def runtime_plan_schedules(lengths: np.ndarray, n_cta: int, device="cpu", min_chunk: int = 16) -> list[LayerSchedule]:
    """Baseline (b)'s host work for one step: tangram.planner.runtime_plan for every layer, then varlen items.

    ``lengths`` is [B, L, H] (slot order). Everything here is on the critical
    path of each step: the plan, the item lists and one host-to-device copy
    of all layers' items (as FlashInfer copies its plan info once per plan).
    """
    from tangram.planner import runtime_plan

    plan = runtime_plan(lengths, n_cta, min_chunk=min_chunk)
    parts, meta = [], []
    off = 0
    for l, sp in enumerate(plan.splits):
        B, H = sp.shape
        flat = sp.reshape(-1).astype(np.int64)
        pairs = np.repeat(np.arange(flat.size), flat)
        starts = np.repeat(np.cumsum(flat) - flat, flat)
        items = np.stack([pairs % H, np.arange(pairs.size) - starts, pairs // H], axis=1).astype(np.int32).reshape(-1)
        parts += [items, sp.reshape(-1).astype(np.int32)]
        meta.append((off, items.size, B, H, int(sp.max()) if sp.size else 1, int(plan.chunk_tokens[l])))
        off += items.size + sp.size
    buf = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int32)).to(device, non_blocking=True)
    out = []
    for off, ni, B, H, mx, ch in meta:
        out.append(LayerSchedule(buf[off:off + ni].view(-1, 3), buf[off + ni:off + ni + B * H].view(B, H), mx,
                                 per_request=False, split_mode=1, chunk_tokens=ch))
    return out


def runtime_plan_decode(q, kv_pool, block_table, head_lens, slot_to_head, sched: LayerSchedule, *, page_size: int,
                        heads_per_group: int, sm_scale: float | None = None, out=None,
                        config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Baseline (b): varlen (request, head) chunks from a per-layer runtime plan."""
    return launch_decode(q, kv_pool, block_table, head_lens, slot_to_head, sched, page_size=page_size,
                         heads_per_group=heads_per_group, sm_scale=sm_scale, out=out, config=config)


def monolithic_layer_view(pool: torch.Tensor, block_table: torch.Tensor, layer: int):
    """(kv_pool, block_table) of one layer of a monolithic pool [pages, L, 2, H, P, d] / table [B, max_pages]."""
    if pool.dim() != 6 or block_table.dim() != 2:
        raise ConfigError(f"monolithic pool must be [pages, L, 2, H, P, d] and table [B, max_pages], got "
                          f"{tuple(pool.shape)} and {tuple(block_table.shape)}")
    return pool[:, layer], block_table[:, None, :]


# ----------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class KernelResources:
    n_regs: int
    shared_bytes: int
    num_warps: int


@dataclass(frozen=True)
class DeviceLimits:
    num_sms: int
    regs_per_sm: int = 65536
    smem_per_sm: int = 233472  # H100: 228 KiB usable by blocks
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1024
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256


def device_limits(device=None) -> DeviceLimits:
    p = torch.cuda.get_device_properties(device)
    return DeviceLimits(num_sms=p.multi_processor_count,
                        regs_per_sm=getattr(p, "regs_per_multiprocessor", 65536),
                        smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", 233472),
                        max_threads_per_sm=getattr(p, "max_threads_per_multi_processor", 2048))


def kernel_resources(config: DecodeConfig = DEFAULT_CONFIG) -> KernelResources | None:
    """Registers / shared memory of the compiled stage-1 kernel (None until it was launched on a GPU)."""
    k = _COMPILED.get(config)
    if k is None or not hasattr(k, "n_regs"):
        return None
    return KernelResources(int(k.n_regs), int(k.metadata.shared), int(k.metadata.num_warps))


def occupancy_blocks_per_sm(res: KernelResources, lim: DeviceLimits) -> int:
    """Resident CTAs per SM: the min over the thread, register, shared-memory and block limits."""
    threads = 32 * res.num_warps
    by_threads = lim.max_threads_per_sm // threads
    regs_per_warp = -(-max(res.n_regs, 1) * 32 // lim.reg_alloc_unit) * lim.reg_alloc_unit
    by_regs = (lim.regs_per_sm // regs_per_warp) // res.num_warps
    by_smem = lim.smem_per_sm // (res.shared_bytes + lim.smem_reserved_per_block)
    return max(1, min(by_threads, by_regs, by_smem, lim.max_blocks_per_sm))


def decode_n_cta(resources: KernelResources | None = None, limits: DeviceLimits | None = None, *,
                 num_sms: int | None = None, calibration: str | None = None) -> int:
    """N_CTA = resident CTAs per SM x SMs for the decode kernel.

    On a GPU, resources come from the compiled kernel and limits from the device;
    on a CPU-only machine pass them, or name a calibration folder
    (``sim/tables/h100``) whose ``meta.json`` recorded them on the GPU.
    """
    if calibration is not None and (resources is None or limits is None):
        import json
        from pathlib import Path

        meta = json.loads((Path(calibration) / "meta.json").read_text())
        r = meta["decode_kernel"]
        resources = resources or KernelResources(r["n_regs"], r["shared_bytes"], r["num_warps"])
        limits = limits or DeviceLimits(num_sms=meta["sm_count"])
    if resources is None:
        resources = kernel_resources()
    if limits is None:
        if torch.cuda.is_available():
            limits = device_limits()
        elif num_sms is not None:
            limits = DeviceLimits(num_sms=num_sms)
    if resources is None or limits is None:
        raise ConfigError("decode_n_cta: no compiled kernel/device here; pass resources and limits or calibration=")
    if num_sms is not None:
        limits = DeviceLimits(num_sms=num_sms, regs_per_sm=limits.regs_per_sm, smem_per_sm=limits.smem_per_sm,
                              max_threads_per_sm=limits.max_threads_per_sm)
    return occupancy_blocks_per_sm(resources, limits) * limits.num_sms

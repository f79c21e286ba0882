"""Chunked prefill with fused compression, for one chunk of one request and one layer.

Stages (each a public function so the benchmark can time them apart):

1. :func:`prefill_attention` (Triton): the chunk's queries attend to the head's
   cached, already compressed KV in pages and causally to the chunk's own new
   K/V; it also writes each query row's log-sum-exp (base 2).
2. :func:`snapkv_scores`: importance of each NEW token per KV head, SnapKV
   style, from the last ``w = min(window, c)`` queries' softmax probabilities
   (rebuilt from the stored LSE, so no second pass over the cache), summed
   over the head's query heads and 1-D average pooled (kernel 7).
3. :func:`select_keep`: per-head top-k_h (tangram / uniform) or the global
   top-k of the layer's flattened scores (dynamic); no host sync.
4. :func:`scatter_kept` (Triton): the kept K/V of every head go into its
   group's pages right after its current length; ``head_lens`` grows.

Only the chunk's new tokens are selected among; cached tokens stay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tangram.budgets import check_group_size
from tangram.errors import ConfigError
from tangram.kernels._triton import attend_block, runs_triton, tl, triton

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attn_kernel(
    Q, KN, VN, KV, BT, LENS, HEAD2SLOT, OUT, LSE,
    c, qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kvp, stride_kvkv, stride_kvh, stride_kvt, stride_btg,
    stride_ot, stride_oh, stride_lh,
    HP: tl.constexpr, GQ: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    qh = tl.program_id(1)
    h = qh // GQ
    slot = tl.load(HEAD2SLOT + h)
    g = slot // HP
    j = slot % HP
    n = tl.load(LENS + slot)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < c
    q = tl.load(Q + offs_m[:, None] * stride_qt + qh * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = BT + g * stride_btg
    k_base = KV + j * stride_kvh
    # cached (compressed) KV of this head: visible to every query of the chunk
    for t in range(0, n, BLOCK_N):
        offs_n = t + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        page = tl.load(bt_row + offs_n // P, mask=mask_n, other=0).to(tl.int64)
        off = page * stride_kvp + (offs_n % P) * stride_kvt
        k = tl.load(k_base + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(k_base + stride_kvkv + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, IEEE)
    # the chunk itself, causal
    hi = tl.minimum(c, (mb + 1) * BLOCK_M)
    for t in range(0, hi, BLOCK_N):
        offs_n = t + tl.arange(0, BLOCK_N)
        mask_n = offs_n < c
        k = tl.load(KN + offs_n[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(VN + offs_n[:, None] * stride_vnt + h * stride_vnh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        ok = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        m_i, l_i, acc = attend_block(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE)
    o = acc / l_i[:, None]
    tl.store(OUT + offs_m[:, None] * stride_ot + qh * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(LSE + qh * stride_lh + offs_m, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit
def _snapkv_score_kernel(
    Q, KN, LSE, HEAD2SLOT, OUT,
    c, w, qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_lh, stride_oh,
    GQ: tl.constexpr, D: tl.constexpr, W_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Raw SnapKV score of a block of new keys of one KV head: sum over the last w queries of its
    query heads of exp2(q.k * scale - lse), causal. Written to the head's slot row (pooling follows)."""
    h = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(HEAD2SLOT + h)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_w = tl.arange(0, W_BLOCK)
    rows = c - w + offs_w
    mask_w = offs_w < w
    mask_n = offs_n < c
    k = tl.load(KN + offs_n[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    ok = mask_w[:, None] & mask_n[None, :] & (offs_n[None, :] <= rows[:, None])
    for i in tl.static_range(GQ):
        qh = h * GQ + i
        q = tl.load(Q + rows[:, None] * stride_qt + qh * stride_qh + offs_d[None, :], mask=mask_w[:, None], other=0.0)
        lse = tl.load(LSE + qh * stride_lh + rows, mask=mask_w, other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        p = tl.exp2(sc * qk_scale - lse[:, None])
        acc += tl.sum(tl.where(ok, p, 0.0), 0)
    tl.store(OUT + slot * stride_oh + offs_n, acc, mask=mask_n)


@triton.jit
def _scatter_kernel(
    KN, VN, KEEP, LENS, SLOT2HEAD, BT, KV,
    c, max_pages,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kh, stride_btg,
    stride_kvp, stride_kvkv, stride_kvh, stride_kvt,
    HP: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Append the kept tokens of a block of one head after its length; the rank of a kept token is
    the number of kept tokens before it (prefix over earlier blocks + cumsum inside the block)."""
    slot = tl.program_id(0)
    tb = tl.program_id(1)
    h = tl.load(SLOT2HEAD + slot)
    g = slot // HP
    j = slot % HP
    offs_b = tl.arange(0, BLOCK_T)
    before = tl.zeros([BLOCK_T], tl.int32)
    for t in range(0, tb * BLOCK_T, BLOCK_T):
        before += tl.load(KEEP + slot * stride_kh + t + offs_b).to(tl.int32)
    offs_t = tb * BLOCK_T + offs_b
    offs_d = tl.arange(0, D)
    kb = tl.load(KEEP + slot * stride_kh + offs_t, mask=offs_t < c, other=0).to(tl.int32)
    rank = tl.sum(before, 0) + tl.cumsum(kb, 0) - 1
    pos = tl.load(LENS + slot) + rank
    pidx = pos // P
    keep = (kb > 0) & (pidx < max_pages)
    page = tl.load(BT + g * stride_btg + pidx, mask=keep, other=-1)
    ok = keep & (page >= 0)
    dst = page.to(tl.int64) * stride_kvp + j * stride_kvh + (pos % P) * stride_kvt
    k = tl.load(KN + offs_t[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(VN + offs_t[:, None] * stride_vnt + h * stride_vnh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(KV + dst[:, None] + offs_d[None, :], k.to(KV.dtype.element_ty), mask=ok[:, None])
    tl.store(KV + stride_kvkv + dst[:, None] + offs_d[None, :], v.to(KV.dtype.element_ty), mask=ok[:, None])


# ----------------------------------------------------------------------------- host side


class _RankCache:
    """arange(k) per device, so selection does not rebuild it every call."""

    def __init__(self):
        self.d = {}

    def get(self, k, device):
        key = (str(device), k)
        if key not in self.d:
            self.d[key] = torch.arange(k, device=device, dtype=torch.int32)[None, :]
        return self.d[key]


_RANKS = _RankCache()


@dataclass
class PrefillResult:
    out: torch.Tensor  # [c, Hq, d] attention output, original head order
    scores: torch.Tensor  # [H, c] fp32 importance of each new token, slot order
    keep: torch.Tensor  # [H, c] bool, slot order
    counts: torch.Tensor  # [H] int32 tokens appended per slot


def _check_prefill(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head, page_size, heads_per_group):
    if q.dim() != 3 or k_new.dim() != 3 or v_new.shape != k_new.shape:
        raise ConfigError(f"prefill: expected q[c,Hq,d], k_new/v_new[c,H,d]; got {tuple(q.shape)}, "
                          f"{tuple(k_new.shape)}, {tuple(v_new.shape)}")
    c, Hq, d = q.shape
    H = k_new.shape[1]
    check_group_size(H, heads_per_group)
    if Hq % H or k_new.shape[0] != c or k_new.shape[2] != d:
        raise ConfigError(f"prefill: q {tuple(q.shape)} does not match k_new {tuple(k_new.shape)}")
    if kv_pool.dim() != 5 or kv_pool.shape[1:] != (2, heads_per_group, page_size, d):
        raise ConfigError(f"prefill: kv_pool {tuple(kv_pool.shape)} != [pages, 2, {heads_per_group}, {page_size}, {d}]")
    if block_table.dim() != 2 or block_table.shape[0] != H // heads_per_group:
        raise ConfigError(f"prefill: block_table must be [G={H // heads_per_group}, max_pages], got {tuple(block_table.shape)}")
    if head_lens.shape != (H,) or slot_to_head.numel() != H:
        raise ConfigError(f"prefill: head_lens and slot_to_head must have H={H} entries")
    if head_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ConfigError("prefill: block_table and head_lens must be int32")
    if d & (d - 1) or d < 16:
        raise ConfigError(f"prefill: head_dim must be a power of two >= 16, got {d}")
    return c, Hq, H, d


def prefill_attention(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int,
                      heads_per_group: int, sm_scale: float | None = None, block_m: int = 64, block_n: int = 64,
                      num_warps: int = 4, num_stages: int = 2, head_to_slot: torch.Tensor | None = None):
    """Attention output [c, Hq, d] and base-2 LSE [Hq, c] (fp32) of one chunk (``head_to_slot``: the inverse
    of ``slot_to_head`` as int32, if the caller keeps it; else computed here)."""
    c, Hq, H, d = _check_prefill(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head, page_size,
                                 heads_per_group)
    gq = Hq // H
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if not runs_triton(q):
        from tangram.kernels.reference import ref_prefill_attention

        o, _, lse = ref_prefill_attention(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head,
                                          page_size=page_size, heads_per_group=heads_per_group, sm_scale=sm_scale,
                                          with_lse=True)
        return o.to(q.dtype), lse
    if head_to_slot is None:
        head_to_slot = torch.argsort(slot_to_head.long()).to(torch.int32)
    out = torch.empty_like(q)
    lse = torch.empty((Hq, c), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(c, block_m), Hq)
    _prefill_attn_kernel[grid](
        q, k_new, v_new, kv_pool, block_table, head_lens, head_to_slot, out, lse,
        c, scale * LOG2E,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        HP=heads_per_group, GQ=gq, P=page_size, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


def snapkv_scores(q, k_new, lse, slot_to_head, *, sm_scale: float | None = None, window: int = 32,
                  pool_kernel: int = 7, head_to_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Importance [H, c] (fp32, slot order) of each new token from the last w queries' probabilities."""
    c, Hq, d = q.shape
    H = k_new.shape[1]
    gq = Hq // H
    w = min(window, c)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if runs_triton(q):
        raw = torch.empty((H, c), device=q.device, dtype=torch.float32)
        if head_to_slot is None:
            head_to_slot = torch.argsort(slot_to_head.long()).to(torch.int32)
        block_n = 64
        _snapkv_score_kernel[(H, triton.cdiv(c, block_n))](
            q, k_new, lse, head_to_slot, raw, c, w, scale * LOG2E,
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), lse.stride(0), raw.stride(0),
            GQ=gq, D=d, W_BLOCK=max(16, triton.next_power_of_2(w)), BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, num_warps=4,
        )
        return F.avg_pool1d(raw[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    qw = q[c - w:].float().view(w, H, gq, d)
    logits = torch.einsum("whgd,chd->hgwc", qw, k_new.float()) * (scale * LOG2E)  # [H, gq, w, c]
    rows = torch.arange(c - w, c, device=q.device)
    causal = torch.arange(c, device=q.device)[None, :] <= rows[:, None]  # [w, c]
    p = torch.exp2(logits - lse[:, c - w:].view(H, gq, w, 1)).masked_fill(~causal, 0.0)
    s = p.sum(dim=(1, 2))  # [H, c]
    s = F.avg_pool1d(s[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    return s[slot_to_head.long()]


def select_keep(scores: torch.Tensor, keep_counts=None, global_keep: int | None = None,
                counts: torch.Tensor | None = None):
    """Keep mask [H, c] and counts [H] (int32): per-head top-k_h, or global top-k (dynamic mode).

    ``counts``: ``keep_counts`` (already clipped to c) as an int32 tensor on the scores' device. The engine
    uploads a whole step's counts once through pinned memory and passes each row here, because uploading a
    numpy array with a plain ``.to(device)`` synchronises the stream, once per layer and chunk otherwise."""
    H, c = scores.shape
    keep = torch.zeros((H, c), dtype=torch.bool, device=scores.device)
    if global_keep is not None:
        k = min(int(global_keep), H * c)
        if k > 0:
            idx = scores.reshape(-1).topk(k).indices
            keep.view(-1)[idx] = True
        return keep, keep.sum(1, dtype=torch.int32)
    if keep_counts is None:
        raise ConfigError("select_keep: give keep_counts (per head) or global_keep")
    k = np.minimum(np.asarray(keep_counts.cpu() if isinstance(keep_counts, torch.Tensor) else keep_counts,
                              dtype=np.int64).reshape(-1), c)
    if k.size != H or np.any(k < 0):
        raise ConfigError(f"select_keep: keep_counts must be {H} non-negative ints, got {k.tolist()}")
    kmax = int(k.max()) if k.size else 0
    if counts is None:
        counts = torch.from_numpy(k.astype(np.int32)).to(scores.device)
    if kmax > 0:
        idx = scores.topk(kmax, dim=1).indices
        if np.all(k == kmax):
            keep.scatter_(1, idx, True)
        else:
            keep.scatter_(1, idx, _RANKS.get(kmax, scores.device) < counts[:, None])
    return keep, counts


def scatter_kept(k_new, v_new, keep, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int,
                 heads_per_group: int, counts: torch.Tensor | None = None, block_t: int = 64) -> None:
    """Append each head's kept new K/V after its current length and grow ``head_lens`` in place.

    Positions past the head's block table, or on entries < 0 (unallocated), are dropped:
    the allocator reserves ``ceil(B * c)`` tokens per head before the chunk runs.
    """
    H, c = keep.shape
    d = k_new.shape[2]
    if counts is None:
        counts = keep.sum(1, dtype=torch.int32)
    if runs_triton(k_new):
        grid = (H, triton.cdiv(c, block_t))
        keep8 = keep.view(torch.uint8) if keep.is_contiguous() else keep.to(torch.uint8)
        _scatter_kernel[grid](
            k_new, v_new, keep8, head_lens, slot_to_head, block_table, kv_pool,
            c, block_table.shape[1],
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), keep8.stride(0), block_table.stride(0),
            kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
            HP=heads_per_group, P=page_size, D=d, BLOCK_T=block_t, num_warps=4,
        )
    else:
        rank = keep.cumsum(1) - 1
        s2h = slot_to_head.long()
        slots, toks = torch.nonzero(keep, as_tuple=True)
        pos = head_lens.long()[slots] + rank.long()[slots, toks]
        pidx = pos // page_size
        ok = pidx < block_table.shape[1]
        slots, toks, pos, pidx = slots[ok], toks[ok], pos[ok], pidx[ok]
        page = block_table[slots // heads_per_group, pidx].long()
        ok = page >= 0
        slots, toks, pos, page = slots[ok], toks[ok], pos[ok], page[ok]
        jj = slots % heads_per_group
        kv_pool[page, 0, jj, pos % page_size] = k_new[toks, s2h[slots]].to(kv_pool.dtype)
        kv_pool[page, 1, jj, pos % page_size] = v_new[toks, s2h[slots]].to(kv_pool.dtype)
    head_lens += counts.to(head_lens.dtype)


def keep_budget(mode: str, chunk: int, num_kv_heads: int, *, ratios=None, rho: float | None = None):
    """What a chunk of ``chunk`` tokens keeps per mode: (keep_counts, global_keep).

    tangram / br / br+rp: ceil(B * c) per head (``ratios`` in slot order);
    uniform: ceil(rho * c) for every head; full: c; dynamic: global top-ceil(rho * H * c).
    """
    if mode in ("tangram", "br", "br+rp"):
        if ratios is None:
            raise ConfigError(f"keep_budget: mode {mode} needs per-head budget ratios")
        return np.ceil(np.asarray(ratios, dtype=np.float64) * chunk - 1e-9).astype(np.int64), None
    if mode == "uniform":
        return np.full(num_kv_heads, math.ceil(rho * chunk - 1e-9), dtype=np.int64), None
    if mode == "full":
        return np.full(num_kv_heads, chunk, dtype=np.int64), None
    if mode == "dynamic":
        return None, int(math.ceil(rho * num_kv_heads * chunk - 1e-9))
    raise ConfigError(f"keep_budget: unknown mode {mode!r}")


def prefill_compress(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int,
                     heads_per_group: int, keep_counts=None, global_keep: int | None = None,
                     sm_scale: float | None = None, window: int = 32, pool_kernel: int = 7) -> PrefillResult:
    """One chunk of one request for one layer: attention, SnapKV scores, top-k, scatter (head_lens updated).

    ``q`` [c, Hq, d], ``k_new``/``v_new`` [c, H, d] in the model's head order;
    ``kv_pool`` [pages, 2, H_p, P, d] (a monolithic layer view works with H_p = H);
    ``block_table`` [G, max_pages] int32 of this request and layer; ``head_lens``
    [H] int32 in slot order; ``keep_counts`` [H] in slot order or ``global_keep``.
    """
    out, lse = prefill_attention(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head,
                                 page_size=page_size, heads_per_group=heads_per_group, sm_scale=sm_scale)
    scores = snapkv_scores(q, k_new, lse, slot_to_head, sm_scale=sm_scale, window=window, pool_kernel=pool_kernel)
    keep, counts = select_keep(scores, keep_counts, global_keep)
    scatter_kept(k_new, v_new, keep, kv_pool, block_table, head_lens, slot_to_head, page_size=page_size,
                 heads_per_group=heads_per_group, counts=counts)
    return PrefillResult(out, scores, keep, counts)

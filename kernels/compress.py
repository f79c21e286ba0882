"""Batched chunked prefill with fused compression: every prefill chunk of a step, one layer, three launches.

The per-chunk path (:mod:`tangram.kernels.prefill`) issues, per chunk and layer, the attention kernel, the score
kernel, an average pool, a top-k, a scatter of the keep mask, a cumulative sum and the copy kernel: at 512-token
chunks that costs 2-4x the chunk's attention (reports/kernels). Here a step's chunks go together (``cu``: their
token offsets, as flash-attn's varlen ``cu_seqlens``):

1. :func:`prefill_attention_varlen`: each chunk's queries attend to their head's cached (compressed) pages and
   causally to the chunk; writes the base-2 log-sum-exp of every query row;
2. :func:`snapkv_scores_varlen`: SnapKV's raw importance of every new token per KV head (the last ``window``
   queries' probabilities, rebuilt from the LSE, summed over the head's query heads), ``[kp, H, CS]`` fp32;
3. :func:`select_scatter`: per (chunk, head, block of tokens) one program pools the scores (average over
   ``pool_kernel`` neighbours, zero padded, as SnapKV), finds the head's top-``k`` threshold by a binary search
   on the scores' order-preserving integer keys (ties go to the earliest tokens), and copies its block's kept
   K/V into the head's pages after its current length. No mask, no sort, no per-head host loop; ``k >= c``
   (``full``) copies everything without scoring.

Other scoring methods plug in at step 3: any ``[kp, H, CS]`` score array (``pooled=True`` when already pooled).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tangram.kernels._triton import attend_block, runs_triton, tl, triton

LOG2E = 1.4426950408889634


# Metadata pointers (views at any offset) and step-sized ints are not specialised: their classes flipped inside
# timed runs (tangram-validate's in-run compile report, H100 2026-11-24); they are read once per program.
@triton.jit(do_not_specialize=["stride_lh"], do_not_specialize_on_alignment=["LENS", "HEAD2SLOT", "CU"])
def _prefill_varlen_kernel(
    Q, KN, VN, KV, BT, LENS, HEAD2SLOT, CU, OUT, LSE,
    qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kvp, stride_kvkv, stride_kvh, stride_kvt, stride_btb, stride_btg, stride_lb,
    stride_ot, stride_oh, stride_lh,
    HP: tl.constexpr, GQ: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    qh = tl.program_id(1)
    i = tl.program_id(2)
    row0 = tl.load(CU + i)
    c = tl.load(CU + i + 1) - row0
    if mb * BLOCK_M >= c:
        return
    h = qh // GQ
    slot = tl.load(HEAD2SLOT + h)
    g = slot // HP
    j = slot % HP
    n = tl.load(LENS + i * stride_lb + slot)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < c
    rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + qh * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = BT + i.to(tl.int64) * stride_btb + g * stride_btg
    k_base = KV + j * stride_kvh
    for t in range(0, n, BLOCK_N):  # the head's cached (compressed) KV: visible to every query of the chunk
        offs_n = t + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        page = tl.load(bt_row + offs_n // P, mask=mask_n, other=0).to(tl.int64)
        off = page * stride_kvp + (offs_n % P) * stride_kvt
        k = tl.load(k_base + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(k_base + stride_kvkv + off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, IEEE)
    hi = tl.minimum(c, (mb + 1) * BLOCK_M)
    for t in range(0, hi, BLOCK_N):  # the chunk itself, causal
        offs_n = t + tl.arange(0, BLOCK_N)
        mask_n = offs_n < c
        kr = (row0 + offs_n).to(tl.int64)
        k = tl.load(KN + kr[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(VN + kr[:, None] * stride_vnt + h * stride_vnh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        ok = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        m_i, l_i, acc = attend_block(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE)
    o = acc / l_i[:, None]
    tl.store(OUT + rows[:, None] * stride_ot + qh * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(LSE + qh * stride_lh + rows, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit
def _window_prob_sums(Q, KN, LSE, row0, c, h, offs_n, window, qk_scale, stride_qt, stride_qh, stride_knt, stride_knh,
                      stride_lh, GQ: tl.constexpr, GQ_P2: tl.constexpr, D: tl.constexpr, W_BLOCK: tl.constexpr,
                      IEEE: tl.constexpr):
    """SnapKV's raw score of the keys ``offs_n`` of one chunk (rows from ``row0``, ``c`` long) of KV head ``h``:
    the attention probabilities (from the prefill's LSE) of the last ``window`` queries of its ``GQ`` query heads,
    summed, their rows stacked into one ``[GQ * W, D]`` operand for one dot. Keys past the chunk get 0."""
    w = tl.minimum(window, c)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, GQ_P2 * W_BLOCK)
    gi = offs_r // W_BLOCK
    rows = c - w + offs_r % W_BLOCK
    mask_r = (offs_r % W_BLOCK < w) & (gi < GQ)
    qh = h * GQ + gi
    mask_n = offs_n < c
    kr = (row0 + offs_n).to(tl.int64)
    qr = (row0 + rows).to(tl.int64)
    k = tl.load(KN + kr[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    q = tl.load(Q + qr[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :], mask=mask_r[:, None],
                other=0.0)
    lse = tl.load(LSE + qh * stride_lh + qr, mask=mask_r, other=0.0)
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    p = tl.exp2(sc * qk_scale - lse[:, None])
    ok = mask_r[:, None] & mask_n[None, :] & (offs_n[None, :] <= rows[:, None])
    return tl.sum(tl.where(ok, p, 0.0), 0)


@triton.jit(do_not_specialize=["window", "stride_lh"], do_not_specialize_on_alignment=["HEAD2SLOT", "CU"])
def _snapkv_varlen_kernel(
    Q, KN, LSE, HEAD2SLOT, CU, OUT,
    window, qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_lh, stride_oi, stride_oh,
    GQ: tl.constexpr, GQ_P2: tl.constexpr, D: tl.constexpr, W_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Raw SnapKV score of a block of one chunk's new keys of one KV head (0 past the chunk's end): the head's
    ``GQ`` query heads' window rows stacked into one ``[GQ * W, D]`` operand, one dot."""
    h = tl.program_id(0)
    nb = tl.program_id(1)
    i = tl.program_id(2)
    row0 = tl.load(CU + i)
    c = tl.load(CU + i + 1) - row0
    slot = tl.load(HEAD2SLOT + h)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptr = OUT + i.to(tl.int64) * stride_oi + slot * stride_oh + offs_n
    if nb * BLOCK_N >= c:
        tl.store(out_ptr, tl.zeros([BLOCK_N], tl.float32))
        return
    acc = _window_prob_sums(Q, KN, LSE, row0, c, h, offs_n, window, qk_scale, stride_qt, stride_qh, stride_knt,
                            stride_knh, stride_lh, GQ, GQ_P2, D, W_BLOCK, IEEE)
    tl.store(out_ptr, tl.where(offs_n < c, acc, 0.0))


@triton.jit
def _pooled(S, offs, c, POOL: tl.constexpr):
    """Average of the ``POOL`` scores centred on each offset, zero padded outside [0, c) (avg_pool1d)."""
    R: tl.constexpr = POOL // 2
    acc = tl.zeros(offs.shape, tl.float32)
    for j in tl.static_range(POOL):
        o = offs + (j - R)
        acc += tl.load(S + o, mask=(o >= 0) & (o < c), other=0.0)
    if POOL > 1:
        acc = acc / POOL
    return acc


@triton.jit
def _order_key(s):
    """An int32 that orders like the float32 ``s`` (negative floats: flip the magnitude bits)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _copy_kv_rows(KN, VN, KV, rows, h, dst, load_ok, store_ok, stride_knt, stride_knh, stride_vnt, stride_vnh,
                  stride_kvkv, D: tl.constexpr):
    """K/V rows ``rows`` of KV head ``h`` (new tokens) to pool offsets ``dst`` (K there, V ``stride_kvkv`` on)."""
    offs_d = tl.arange(0, D)
    k = tl.load(KN + rows[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask=load_ok[:, None], other=0.0)
    v = tl.load(VN + rows[:, None] * stride_vnt + h * stride_vnh + offs_d[None, :], mask=load_ok[:, None], other=0.0)
    tl.store(KV + dst[:, None] + offs_d[None, :], k.to(KV.dtype.element_ty), mask=store_ok[:, None])
    tl.store(KV + stride_kvkv + dst[:, None] + offs_d[None, :], v.to(KV.dtype.element_ty), mask=store_ok[:, None])


@triton.jit
def _compress_block(CU, COUNTS, stride_ci, stride_cl, n_chunks, BLOCK_T: tl.constexpr):
    """A (slot, token block, layer x chunk) program's coordinates: the layer, the chunk, their flat index, the
    chunk's first row and length, the block's first token and the slot's keep count (capped at the chunk; read
    even past the chunk's end: a valid address)."""
    slot = tl.program_id(0)
    tb = tl.program_id(1)
    li = tl.program_id(2)
    lyr = li // n_chunks
    i = li % n_chunks
    row0 = tl.load(CU + i)
    c = tl.load(CU + i + 1) - row0
    cnt = tl.minimum(tl.load(COUNTS + lyr * stride_cl + i * stride_ci + slot), c)
    return slot, tb, lyr, i, li, row0, c, tb * BLOCK_T, cnt


# max_pages (the step's widest table) takes any value: a specialisation per class would compile inside a run
@triton.jit(do_not_specialize=["max_pages"],
            do_not_specialize_on_alignment=["CU", "COUNTS", "LENS", "SLOT2HEAD", "KEPT"])
def _select_scatter_kernel(
    SC, KN, VN, CU, COUNTS, LENS, SLOT2HEAD, BT, KV, KEPT,
    max_pages,
    stride_si, stride_sh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ci, stride_lb, stride_btb,
    stride_btg, stride_kvp, stride_kvkv, stride_kvh, stride_kvt, stride_ki,
    HP: tl.constexpr, P: tl.constexpr, D: tl.constexpr, C_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    POOL: tl.constexpr, SELECT: tl.constexpr,
):
    slot = tl.program_id(0)
    tb = tl.program_id(1)
    i = tl.program_id(2)
    row0 = tl.load(CU + i)
    c = tl.load(CU + i + 1) - row0
    start = tb * BLOCK_T
    if start >= c:
        return
    if SELECT:
        cnt = tl.minimum(tl.load(COUNTS + i * stride_ci + slot), c)
    else:
        cnt = c
    if tb == 0:
        tl.store(KEPT + i * stride_ki + slot, cnt)
    if cnt <= 0:
        return
    offs_t = start + tl.arange(0, BLOCK_T)
    valid_t = offs_t < c
    keep = valid_t
    rank = offs_t
    if SELECT:
        if cnt < c:
            srow = SC + i.to(tl.int64) * stride_si + slot * stride_sh
            offs = tl.arange(0, C_BLOCK)
            valid = offs < c
            key = _order_key(_pooled(srow, offs, c, POOL))
            lo = tl.full([], -2147483648, tl.int64)
            hi = tl.full([], 2147483647, tl.int64)
            for _ in range(32):  # largest T with #(key >= T) >= cnt: the cnt-th largest key
                mid = lo + (hi - lo + 1) // 2
                n_ge = tl.sum((valid & (key >= mid.to(tl.int32))).to(tl.int32), 0)
                lo = tl.where(n_ge >= cnt, mid, lo)
                hi = tl.where(n_ge >= cnt, hi, mid - 1)
            thr = lo.to(tl.int32)
            n_gt = tl.sum((valid & (key > thr)).to(tl.int32), 0)
            need_ties = cnt - n_gt  # ties at the threshold: the earliest tokens win
            before = valid & (offs < start)
            gt_before = tl.sum((before & (key > thr)).to(tl.int32), 0)
            ties_before = tl.sum((before & (key == thr)).to(tl.int32), 0)
            key_t = _order_key(_pooled(srow, offs_t, c, POOL))
            tie = valid_t & (key_t == thr)
            tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), 0) - 1
            keep = valid_t & ((key_t > thr) | (tie & (tie_rank < need_ties)))
            rank = gt_before + tl.minimum(ties_before, need_ties) + tl.cumsum(keep.to(tl.int32), 0) - 1
    h = tl.load(SLOT2HEAD + slot)
    g = slot // HP
    jj = slot % HP
    pos = tl.load(LENS + i * stride_lb + slot) + rank
    pidx = pos // P
    ok = keep & (pidx < max_pages)
    page = tl.load(BT + i.to(tl.int64) * stride_btb + g * stride_btg + pidx, mask=ok, other=-1)
    ok = ok & (page >= 0)
    dst = page.to(tl.int64) * stride_kvp + jj * stride_kvh + (pos % P) * stride_kvt
    _copy_kv_rows(KN, VN, KV, (row0 + offs_t).to(tl.int64), h, dst, ok, ok, stride_knt, stride_knh, stride_vnt,
                  stride_vnh, stride_kvkv, D)


@triton.jit
def _finished_key(SROW, offs, c, w, POOL: tl.constexpr):
    """Order key of kvpress's finished SnapKV score at ``offs``: the tokens before the window average-pooled (zero
    padded, ``POOL`` wide) over the scaled raw scores in ``SROW`` (read past L1: other programs wrote them), the
    window +inf, nothing past ``c`` (callers mask)."""
    R: tl.constexpr = POOL // 2
    nb = c - w
    acc = tl.zeros(offs.shape, tl.float32)
    for j in tl.static_range(POOL):
        o = offs + (j - R)
        acc += tl.load(SROW + o, mask=(o >= 0) & (o < nb), other=0.0, cache_modifier=".cg")
    if POOL > 1:
        acc = acc / POOL
    s = tl.where(offs < nb, acc, float("inf"))
    return _order_key(s)


# the chunk count and the layer strides of the int32/fp32 inputs vary between steps: no specialisation per value.
# The strides that rebase the bf16 tensors (q/k/v, the pool) and the block tables keep Triton's divisibility
# specialisation: without it the compiler cannot prove a rebased pointer aligned and loads element by element
# (measured on the H100: the score phase of a 4096-token Llama-3.1-8B chunk 14.0 -> 22.9 us). They are 0 for one
# layer and multiples of 16 in the engine's stacked launch (a row of qkv, a layer of the pool, a layer's tables).
_LAYER_ARGS = ["n_chunks", "stride_ll", "stride_cl", "stride_lbl", "stride_kl", "stride_s2hl"]


@triton.jit(do_not_specialize=["window", "stride_lh", "max_pages"] + _LAYER_ARGS,
            do_not_specialize_on_alignment=["CU", "COUNTS", "LENS", "SLOT2HEAD", "KEPT", "CNT"])
def _snapkv_compress_kernel(
    Q, KN, VN, LSE, CU, COUNTS, LENS, SLOT2HEAD, BT, KV, KEPT, SC, DST, CNT,
    window, qk_scale, inv_wg, max_pages,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_lh, stride_ci, stride_lb,
    stride_btb, stride_btg, stride_kvp, stride_kvkv, stride_kvh, stride_kvt, stride_ki, stride_si, stride_sh,
    stride_cnt,
    n_chunks, stride_ql, stride_knl, stride_vnl, stride_ll, stride_cl, stride_lbl, stride_btl, stride_kvl, stride_kl,
    stride_s2hl,
    HP: tl.constexpr, GQ: tl.constexpr, GQ_P2: tl.constexpr, W_BLOCK: tl.constexpr, D: tl.constexpr,
    P: tl.constexpr, C_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, POOL: tl.constexpr,
    IEEE: tl.constexpr, PHASES: tl.constexpr = 3,
):
    """SnapKV scoring + kvpress's finish + per-head top-count + the copy of the kept K/V, in one launch.
    (``PHASES`` < 3 stops after the scores (1) or the selection (2): benchmarks/compress_phases.py times each.)

    Program (slot, token block, chunk): scores its block's keys against the window's queries of the head's GQ
    query heads (raw probability sums / (w * GQ), as snapkv_finish_batched) into the scratch row ``SC``, then
    counts itself in ``CNT[chunk, slot]``; the last block of a head to arrive (acq_rel atomic) resets the counter,
    finds the ``cnt``-th largest finished key by a 4-round radix select (8-bit digits, histograms), computes every
    kept token's destination (ties to the earliest, in token order after the head's current length) into ``DST``
    and copies the head's kept K/V, ``BLOCK_C`` tokens at a time. Heads that keep every
    token copy their block at once, without scores. The third grid axis runs over layers x chunks: every
    per-layer input is its layer-0 pointer plus ``layer * stride_*l`` (all 0 for one layer), so the chunks of
    every layer of a step compress in one launch."""
    slot, tb, lyr, i, li, row0, c, start, cnt = _compress_block(CU, COUNTS, stride_ci, stride_cl, n_chunks, BLOCK_T)
    if start >= c:
        return
    lyr64 = lyr.to(tl.int64)
    Q += lyr64 * stride_ql
    KN += lyr64 * stride_knl
    VN += lyr64 * stride_vnl
    LSE += lyr64 * stride_ll
    LENS += lyr64 * stride_lbl
    SLOT2HEAD += lyr64 * stride_s2hl
    BT += lyr64 * stride_btl
    KV += lyr64 * stride_kvl
    KEPT += lyr64 * stride_kl
    if tb == 0:
        tl.store(KEPT + i * stride_ki + slot, tl.maximum(cnt, 0))
    if cnt <= 0:
        return
    h = tl.load(SLOT2HEAD + slot)
    g = slot // HP
    jj = slot % HP
    lens0 = tl.load(LENS + i * stride_lb + slot)
    bt_row = BT + i.to(tl.int64) * stride_btb + g * stride_btg
    offs_b = tl.arange(0, BLOCK_T)
    if cnt >= c:  # keeps everything: this block's tokens go to positions lens + t
        offs_t = start + offs_b
        pos = lens0 + offs_t
        pidx = pos // P
        ok = (offs_t < c) & (pidx < max_pages)
        page = tl.load(bt_row + pidx, mask=ok, other=-1)
        ok = ok & (page >= 0)
        dst = page.to(tl.int64) * stride_kvp + jj * stride_kvh + (pos % P) * stride_kvt
        _copy_kv_rows(KN, VN, KV, (row0 + offs_t).to(tl.int64), h, dst, ok, ok, stride_knt, stride_knh, stride_vnt,
                      stride_vnh, stride_kvkv, D)
        return
    # 1. this block's raw SnapKV scores (the window's queries of the head's GQ query heads, one dot)
    offs_t = start + offs_b
    mask_t = offs_t < c
    raw = _window_prob_sums(Q, KN, LSE, row0, c, h, offs_t, window, qk_scale, stride_qt, stride_qh, stride_knt,
                            stride_knh, stride_lh, GQ, GQ_P2, D, W_BLOCK, IEEE) * inv_wg
    srow = SC + li.to(tl.int64) * stride_si + slot * stride_sh
    tl.store(srow + offs_t, raw, mask=mask_t)
    # 2. the last of the head's blocks to finish selects and copies (the others are done)
    tl.debug_barrier()  # every thread's scores are written before the release below
    ntb = tl.cdiv(c, BLOCK_T)
    cptr = CNT + li * stride_cnt + slot
    arrived = tl.atomic_add(cptr, 1, sem="acq_rel", scope="gpu")
    if arrived != ntb - 1:
        return
    tl.atomic_xchg(cptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if PHASES < 2:
        return
    offs = tl.arange(0, C_BLOCK)
    valid = offs < c
    ukey = _finished_key(srow, offs, c, tl.minimum(window, c), POOL).to(tl.int64) + 2147483648  # order-preserving, in [0, 2^32)
    need = cnt  # keys still to take at or below the prefix found so far
    prefix = tl.zeros([], tl.int64)
    bins = tl.arange(0, 256)
    for r in tl.static_range(4):
        shift = 24 - 8 * r
        digit = ((ukey >> shift) & 255).to(tl.int32)
        if r == 0:
            match = valid
        else:
            match = valid & ((ukey >> (shift + 8)) == prefix)
        hist = tl.histogram(digit, 256, mask=match)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching keys with a digit >= each bin
        dsel = tl.sum((suffix >= need).to(tl.int32), 0) - 1  # the largest digit with enough keys at or above it
        need = need - tl.sum(tl.where(bins > dsel, hist, 0), 0)
        prefix = prefix * 256 + dsel
    thr = prefix  # the cnt-th largest key; ``need`` keys equal to it are kept (the earliest)
    # 3. every token's destination at once (one page-table gather), then the copy: no dependent round trips
    # between token blocks (the K/V loads do not wait for the selection), so the serial tail stays short
    tie = valid & (ukey == thr)
    keep = valid & ((ukey > thr) | (tie & (tl.cumsum(tie.to(tl.int32), 0) - 1 < need)))
    pos = lens0 + tl.cumsum(keep.to(tl.int32), 0) - 1
    pidx = pos // P
    ok = keep & (pidx < max_pages)
    page = tl.load(bt_row + pidx, mask=ok, other=-1)
    ok = ok & (page >= 0)
    drow = DST + li.to(tl.int64) * stride_si + slot * stride_sh
    tl.store(drow + offs, tl.where(ok, page.to(tl.int64) * stride_kvp + jj * stride_kvh + (pos % P) * stride_kvt,
                                   -1), mask=valid)
    tl.debug_barrier()  # the destinations are visible to every thread of the program
    if PHASES < 3:
        return
    offs_c = tl.arange(0, BLOCK_C)
    for t0 in range(0, c, BLOCK_C):  # names of its own: a name bound before a loop is loop-carried (one shape)
        offs_u = t0 + offs_c
        vt = offs_u < c
        dst_u = tl.load(drow + offs_u, mask=vt, other=-1)
        # the loads do not wait on the destinations (masked by the chunk only)
        _copy_kv_rows(KN, VN, KV, (row0 + offs_u).to(tl.int64), h, dst_u, vt, dst_u >= 0, stride_knt, stride_knh,
                      stride_vnt, stride_vnh, stride_kvkv, D)


@triton.jit(do_not_specialize=["n_chunks", "stride_cl", "stride_s2hl"],
            do_not_specialize_on_alignment=["CU", "SLOT2HEAD"])
def _copy_selected_kernel(
    KN, VN, CU, COUNTS, SLOT2HEAD, KV, DST,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ci, stride_kvkv, stride_si, stride_sh,
    n_chunks, stride_knl, stride_vnl, stride_cl, stride_kvl, stride_s2hl,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The copy of :func:`snapkv_compress`'s kept tokens, one program per (slot, token block, chunk): each token's
    destination (or -1) was written to ``DST`` by the selecting program of its head, so the copy runs on every
    block at once instead of one program per head (measured on the H100: that serial copy was 15.7 of the 27.4 us
    of a 512-token Llama-3.1-8B chunk, benchmarks/compress_phases.py)."""
    slot, tb, lyr, i, li, row0, c, start, cnt = _compress_block(CU, COUNTS, stride_ci, stride_cl, n_chunks, BLOCK_T)
    if start >= c:
        return
    if (cnt <= 0) | (cnt >= c):  # nothing kept, or everything (copied by the selecting launch): no destinations
        return
    lyr64 = lyr.to(tl.int64)
    offs_t = start + tl.arange(0, BLOCK_T)
    vt = offs_t < c
    dst = tl.load(DST + li.to(tl.int64) * stride_si + slot * stride_sh + offs_t, mask=vt, other=-1)
    ok = dst >= 0
    _copy_kv_rows(KN + lyr64 * stride_knl, VN + lyr64 * stride_vnl, KV + lyr64 * stride_kvl,
                  (row0 + offs_t).to(tl.int64), tl.load(SLOT2HEAD + lyr64 * stride_s2hl + slot), dst, ok, ok,
                  stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kvkv, D)


# ----------------------------------------------------------------------------- host side


def score_width(max_chunk: int) -> int:
    """Padded score row length for chunks of up to ``max_chunk`` tokens: 1024 up to 1024 tokens, else the next
    power of two. It is the selection kernel's block (a compile-time constant): two or three classes over a run
    instead of one per power of two of the chunk lengths a trace produces (each a compile inside a timed step)."""
    return max(1024, triton.next_power_of_2(int(max_chunk)))


def prefill_attention_varlen(q, k, v, cu: torch.Tensor, max_chunk: int, kv_pool, block_table, head_lens,
                             head_to_slot, *, page_size: int, heads_per_group: int, sm_scale: float | None = None,
                             out: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64,
                             num_warps: int = 4, num_stages: int = 2,
                             lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every chunk of a step: ``q [N, Hq, d]``, ``k``/``v [N, H, d]`` (chunks concatenated, chunk
    ``i`` = rows ``cu[i]:cu[i+1]``; strided views allowed), ``block_table [kp, G, W]``, ``head_lens [kp, H]``
    (slot order, before the chunk). Returns ``out [N, Hq, d]`` and the base-2 LSE ``[Hq, N]`` (fp32; written
    into ``lse`` if given, e.g. a layer's row of a step's stacked LSE)."""
    N, Hq, d = q.shape
    H = k.shape[1]
    kp = head_lens.shape[0]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.empty((N, Hq, d), dtype=q.dtype, device=q.device) if out is None else out
    if lse is None:
        lse = torch.empty((Hq, N), device=q.device, dtype=torch.float32)
    if not runs_triton(q):
        from tangram.kernels.prefill import prefill_attention

        cu_np = cu.cpu().numpy()
        s2h = torch.argsort(head_to_slot.long()).to(torch.int32)
        for i in range(kp):
            a, b = int(cu_np[i]), int(cu_np[i + 1])
            o, ls = prefill_attention(q[a:b], k[a:b], v[a:b], kv_pool, block_table[i], head_lens[i], s2h,
                                      page_size=page_size, heads_per_group=heads_per_group, sm_scale=sm_scale)
            out[a:b] = o
            lse[:, a:b] = ls
        return out, lse
    if N == 0 or kp == 0:
        return out, lse
    grid = (triton.cdiv(int(max_chunk), block_m), Hq, kp)
    _prefill_varlen_kernel[grid](
        q, k, v, kv_pool, block_table, head_lens, head_to_slot, cu, out, lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        block_table.stride(0), block_table.stride(1), head_lens.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        HP=heads_per_group, GQ=Hq // H, P=page_size, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


def snapkv_scores_varlen(q, k, lse, cu: torch.Tensor, max_chunk: int, head_to_slot, *, window: int = 32,
                         sm_scale: float | None = None, out: torch.Tensor | None = None,
                         width: int | None = None) -> torch.Tensor:
    """Raw (unpooled) SnapKV scores ``[kp, H, width]`` fp32 (default ``score_width(max_chunk)``), slot order, 0
    past each chunk."""
    N, Hq, d = q.shape
    H = k.shape[1]
    gq = Hq // H
    kp = cu.numel() - 1
    CS = score_width(max_chunk) if width is None else int(width)
    if int(max_chunk) > CS:
        raise ValueError(f"snapkv_scores_varlen: width {CS} is narrower than the longest chunk ({int(max_chunk)} tokens)")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty((kp, H, CS), device=q.device, dtype=torch.float32)
    if not runs_triton(q):
        out.zero_()
        cu_np = cu.cpu().numpy()
        h2s = head_to_slot.long()
        for i in range(kp):
            a, b = int(cu_np[i]), int(cu_np[i + 1])
            c = b - a
            w = min(window, c)
            qw = q[b - w:b].double().view(w, H, gq, d)
            logits = torch.einsum("whgd,chd->hgwc", qw, k[a:b].double()) * (scale * LOG2E)
            rows = torch.arange(c - w, c, device=q.device)
            causal = torch.arange(c, device=q.device)[None, :] <= rows[:, None]
            p = torch.exp2(logits - lse[:, b - w:b].double().view(H, gq, w, 1)).masked_fill(~causal, 0.0)
            out[i, h2s, :c] = p.sum(dim=(1, 2)).float()
        return out
    if kp == 0:
        return out
    block_n = min(64, CS)
    gq_p2 = triton.next_power_of_2(gq)
    w_block = max(16 // gq_p2 if gq_p2 < 16 else 1, triton.next_power_of_2(window))  # >= 16 stacked rows
    _snapkv_varlen_kernel[(H, triton.cdiv(CS, block_n), kp)](
        q, k, lse, head_to_slot, cu, out, window, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), out.stride(0), out.stride(1),
        GQ=gq, GQ_P2=gq_p2, D=d, W_BLOCK=w_block, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out


def pool_scores(scores: torch.Tensor, pool_kernel: int = 7) -> torch.Tensor:
    """SnapKV's average pooling of ``[kp, H, CS]`` raw scores (zero padded), as :func:`select_scatter` does."""
    kp, H, CS = scores.shape
    if pool_kernel <= 1:
        return scores
    return F.avg_pool1d(scores.reshape(kp * H, 1, CS), pool_kernel, stride=1, padding=pool_kernel // 2).view(kp, H, CS)


def global_keep_counts(pooled: torch.Tensor, cu: torch.Tensor, global_keep: torch.Tensor,
                       max_keep: int | None = None) -> torch.Tensor:
    """Per-head counts ``[kp, H]`` int32 of each chunk's global top-``global_keep[i]`` over its ``H x c`` pooled
    scores (dynamic mode): the per-head top-count selection then keeps that same set (ties at the threshold go
    to the first slots, the earliest tokens). ``max_keep``: ``global_keep.max()`` known on the host (else read
    back from the device, a sync)."""
    kp, H, CS = pooled.shape
    c = (cu[1:] - cu[:-1]).long()
    valid = torch.arange(CS, device=pooled.device)[None, :] < c[:, None]  # [kp, CS]
    s = pooled.masked_fill(~valid[:, None, :], float("-inf")).reshape(kp, -1)
    gk = torch.minimum(global_keep.long(), c * H)
    kmax = max(1, int(max_keep if max_keep is not None else (gk.max() if gk.numel() else 1)))
    top = s.topk(min(kmax, s.shape[1]), dim=1).values  # [kp, kmax] descending
    thr = top.gather(1, (gk - 1).clamp(min=0)[:, None])[:, :, None]  # the gk-th largest score
    n_gt = ((pooled > thr) & valid[:, None, :]).sum(2)
    ties = ((pooled == thr) & valid[:, None, :]).sum(2)
    need = (gk - n_gt.sum(1))[:, None]  # scores equal to the threshold still to keep: to the first heads
    alloc = torch.minimum(ties, (need - (ties.cumsum(1) - ties)).clamp(min=0))
    counts = (n_gt + alloc).to(torch.int32)
    return torch.where(gk[:, None] > 0, counts, torch.zeros_like(counts))


def select_scatter(scores, k, v, cu: torch.Tensor, max_chunk: int, counts, kv_pool, block_table, head_lens,
                   slot_to_head, *, page_size: int, heads_per_group: int, pool_kernel: int = 7,
                   kept: torch.Tensor | None = None, block_t: int = 64) -> torch.Tensor:
    """Append each head's top-``counts[i, slot]`` new tokens of chunk ``i`` (by ``scores``, pooled here over
    ``pool_kernel`` neighbours) after its ``head_lens[i, slot]`` tokens. ``scores=None`` or ``counts=None``
    keeps every token (full). Tokens past a table's pages or on pages < 0 are dropped (the allocator reserved
    them). Returns the kept counts ``[kp, H]`` int32 (``kept``, if given, is filled)."""
    kp, H = head_lens.shape
    d = k.shape[2]
    if kept is None:
        kept = torch.empty((kp, H), dtype=torch.int32, device=k.device)
    select = scores is not None and counts is not None
    if not runs_triton(k):
        _torch_select_scatter(scores, k, v, cu, counts, kv_pool, block_table, head_lens, slot_to_head,
                              page_size, heads_per_group, pool_kernel if select else 1, kept, select)
        return kept
    if kp == 0:
        return kept
    sc = scores if select else kept
    cnt = counts if select else kept
    grid = (H, triton.cdiv(int(max_chunk), block_t), kp)
    _select_scatter_kernel[grid](
        sc, k, v, cu, cnt, head_lens, slot_to_head, block_table, kv_pool, kept,
        block_table.shape[2],
        sc.stride(0) if select else 0, sc.stride(1) if select else 0, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cnt.stride(0) if select else 0, head_lens.stride(0), block_table.stride(0),
        block_table.stride(1), kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        kept.stride(0),
        HP=heads_per_group, P=page_size, D=d, C_BLOCK=scores.shape[2] if select else 16, BLOCK_T=block_t,
        POOL=pool_kernel if select else 1, SELECT=select,
        # the threshold search is 32 reductions over the chunk's scores: fewer warps, cheaper reductions
        num_warps=2 if not select or scores.shape[2] <= 1024 else 4,
    )
    return kept


def _torch_select_scatter(scores, k, v, cu, counts, pool, table, lens, s2h, P, Hp, pool_kernel, kept, select):
    """The same selection in torch (CPU without the interpreter): stable top-k, earliest ties first."""
    cu_np = cu.cpu().numpy()
    kp, H = lens.shape
    pooled = pool_scores(scores.float(), pool_kernel) if select else None
    heads = s2h.long()
    for i in range(kp):
        a, b = int(cu_np[i]), int(cu_np[i + 1])
        c = b - a
        for slot in range(H):
            n = min(int(counts[i, slot]), c) if select else c
            kept[i, slot] = max(n, 0)
            if n <= 0:
                continue
            if n >= c:
                idx = torch.arange(c, device=k.device)
            else:
                s = pooled[i, slot, :c].double().cpu().numpy()
                order = np.argsort(-s, kind="stable")[:n]
                idx = torch.from_numpy(np.sort(order)).to(k.device)
            pos = int(lens[i, slot]) + torch.arange(idx.numel(), device=k.device)
            pidx = pos // P
            ok = pidx < table.shape[2]
            idx, pos, pidx = idx[ok], pos[ok], pidx[ok]
            page = table[i, slot // Hp, pidx].long()
            ok = page >= 0
            idx, pos, page = idx[ok], pos[ok], page[ok]
            h = int(heads[slot])
            pool[page, 0, slot % Hp, pos % P] = k[a + idx, h].to(pool.dtype)
            pool[page, 1, slot % Hp, pos % P] = v[a + idx, h].to(pool.dtype)


_COUNTERS: dict = {}  # device -> int32 arrival counters of snapkv_compress, zero between launches


def _counters(device, n: int) -> torch.Tensor:
    """The arrival counters (one per (chunk, head)); every launch leaves them at zero. Allocated once per device
    and grown (outside CUDA-graph capture in practice: the warm-up calls come first). Launches on one stream."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def snapkv_compress(q, k, v, lse, cu: torch.Tensor, max_chunk: int, counts, kv_pool, block_table, head_lens,
                    slot_to_head, *, page_size: int, heads_per_group: int, window: int, pool_kernel: int,
                    sm_scale: float | None = None, width: int | None = None, kept: torch.Tensor | None = None,
                    block_t: int = 64, block_c: int | None = None, num_warps: int = 8,
                    copy: str = "parallel", copy_block: int = 32, _phases: int = 3) -> torch.Tensor:
    """The engine's SnapKV compression of every chunk of a step in one launch: :func:`snapkv_scores_varlen`, then
    kvpress's finish (:func:`tangram.kernels.scoring.snapkv_finish_batched`: mean over the window's ``w * GQ``
    query rows, average pooling over the tokens before the window, the window kept), then :func:`select_scatter`
    of each head's top-``counts[i, slot]`` (ties to the earliest tokens). Returns the kept counts ``[kp, H]``.

    ``copy="parallel"``: the selecting program of each head writes every token's destination and a second launch
    copies the kept K/V on every token block at once; ``"serial"``: the selecting program copies them itself (one
    launch, a serial tail that grows with the chunk)."""
    if copy not in ("parallel", "serial"):
        raise ValueError(f"snapkv_compress: copy must be 'parallel' or 'serial', got {copy!r}")
    N, Hq, d = q.shape
    kp, H = head_lens.shape
    gq = Hq // H
    CS = score_width(max_chunk) if width is None else int(width)
    if int(max_chunk) > CS:  # the selection's block holds a whole chunk's scores
        raise ValueError(f"snapkv_compress: width {CS} is narrower than the longest chunk ({int(max_chunk)} tokens)")
    if kept is None:
        kept = torch.empty((kp, H), dtype=torch.int32, device=k.device)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if not runs_triton(q):
        from tangram.kernels.scoring import snapkv_finish_batched

        raw = snapkv_scores_varlen(q, k, lse, cu, max_chunk, torch.argsort(slot_to_head.long()).to(torch.int32),
                                   window=window, sm_scale=sm_scale, width=CS)
        c = (cu[1:] - cu[:-1]).cpu()
        fin = torch.cat([snapkv_finish_batched(raw[i:i + 1], c[i:i + 1], min(window, int(c[i])), gq, pool_kernel)
                         for i in range(kp)]) if kp else raw
        return select_scatter(fin, k, v, cu, max_chunk, counts, kv_pool, block_table, head_lens, slot_to_head,
                              page_size=page_size, heads_per_group=heads_per_group, pool_kernel=1, kept=kept)
    if kp == 0 or N == 0:
        return kept
    # one layer: the stacked launch with a layer axis of 1 (every layer stride 0)
    _compress_launch(q[None], k[None], v[None], lse[None], cu, max_chunk, counts[:, None], kv_pool[None],
                     block_table[:, None], head_lens[:, None], slot_to_head[None], kept[:, None], page_size=page_size,
                     heads_per_group=heads_per_group, window=window, pool_kernel=pool_kernel, scale=scale, width=CS,
                     block_t=block_t, block_c=block_c, num_warps=num_warps, copy=copy, copy_block=copy_block,
                     _phases=_phases)
    return kept


def snapkv_compress_layers(q, k, v, lse, cu: torch.Tensor, max_chunk: int, counts, kv_pool, block_table, head_lens,
                           slot_to_head, *, page_size: int, heads_per_group: int, window: int, pool_kernel: int,
                           sm_scale: float | None = None, width: int | None = None,
                           kept: torch.Tensor | None = None, block_t: int = 64, block_c: int | None = None,
                           num_warps: int = 8, copy_block: int = 32) -> torch.Tensor:
    """:func:`snapkv_compress` of the same chunks at every layer of a step in one launch (plus one copy launch):
    the fixed cost of a launch and the serial tail of each head's selection are paid once for all layers, not
    once per layer (at 512-token chunks they are most of the compression's time). Valid because a chunk's own
    attention never reads the pages its compression writes: the engine runs every layer's attention first.

    Every per-layer input has a leading layer axis (views with any strides, stride 0 allowed): ``q [L, N, Hq,
    d]``, ``k``/``v [L, N, H, d]``, ``lse [L, Hq, N]``, ``kv_pool [L, pages, 2, Hp, P, d]``, ``slot_to_head [L,
    H]``; the per-chunk ones have it second: ``counts``/``head_lens [kp, L, H]``, ``block_table [kp, L, G, W]``.
    Returns the kept counts ``[kp, L, H]`` (``kept``, if given, is filled)."""
    L, N, Hq, d = q.shape
    kp, _, H = head_lens.shape
    CS = score_width(max_chunk) if width is None else int(width)
    if int(max_chunk) > CS:
        raise ValueError(f"snapkv_compress_layers: width {CS} is narrower than the longest chunk "
                         f"({int(max_chunk)} tokens)")
    if kept is None:
        kept = torch.empty((kp, L, H), dtype=torch.int32, device=k.device)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if not runs_triton(q):  # layer by layer (the reference path)
        for l in range(L):
            kl = kept[:, l].clone()
            snapkv_compress(q[l], k[l], v[l], lse[l], cu, max_chunk, counts[:, l], kv_pool[l], block_table[:, l],
                            head_lens[:, l], slot_to_head[l], page_size=page_size, heads_per_group=heads_per_group,
                            window=window, pool_kernel=pool_kernel, sm_scale=sm_scale, width=CS, kept=kl)
            kept[:, l] = kl
        return kept
    if kp == 0 or N == 0 or L == 0:
        return kept
    _compress_launch(q, k, v, lse, cu, max_chunk, counts, kv_pool, block_table, head_lens, slot_to_head, kept,
                     page_size=page_size, heads_per_group=heads_per_group, window=window, pool_kernel=pool_kernel,
                     scale=scale, width=CS, block_t=block_t, block_c=block_c, num_warps=num_warps, copy="parallel",
                     copy_block=copy_block, _phases=3)
    return kept


def _compress_launch(q, k, v, lse, cu, max_chunk, counts, kv_pool, block_table, head_lens, slot_to_head, kept, *,
                     page_size, heads_per_group, window, pool_kernel, scale, width, block_t, block_c, num_warps,
                     copy, copy_block, _phases):
    """The launches of :func:`snapkv_compress_layers` (layer-stacked arguments, see there)."""
    L, N, Hq, d = q.shape
    kp, _, H = head_lens.shape
    gq = Hq // H
    CS = int(width)
    n = L * kp
    sc = torch.empty((n, H, CS), device=q.device, dtype=torch.float32)
    dst = torch.empty((n, H, CS), device=q.device, dtype=torch.int64)
    cnt = _counters(q.device, n * H)
    gq_p2 = triton.next_power_of_2(gq)
    w_block = max(16 // gq_p2 if gq_p2 < 16 else 1, triton.next_power_of_2(window))
    grid = (H, triton.cdiv(int(max_chunk), block_t), n)
    _snapkv_compress_kernel[grid](
        q, k, v, lse, cu, counts, head_lens, slot_to_head, block_table, kv_pool, kept, sc, dst, cnt,
        window, scale * LOG2E, 1.0 / (window * gq), block_table.shape[3],
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), lse.stride(1),
        counts.stride(0), head_lens.stride(0), block_table.stride(0), block_table.stride(2),
        kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4), kept.stride(0),
        sc.stride(0), sc.stride(1), H,
        kp, q.stride(0), k.stride(0), v.stride(0), lse.stride(0), counts.stride(1), head_lens.stride(1),
        block_table.stride(1), kv_pool.stride(0), kept.stride(1), slot_to_head.stride(0),
        HP=heads_per_group, GQ=gq, GQ_P2=gq_p2, W_BLOCK=w_block, D=d, P=page_size, C_BLOCK=CS, BLOCK_T=block_t,
        BLOCK_C=block_c or max(16, 16384 // d), POOL=pool_kernel, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, PHASES=min(_phases, 2) if copy == "parallel" else _phases,
    )
    if copy == "parallel" and _phases >= 3:
        _copy_selected_kernel[(H, triton.cdiv(int(max_chunk), copy_block), n)](
            k, v, cu, counts, slot_to_head, kv_pool, dst,
            k.stride(1), k.stride(2), v.stride(1), v.stride(2), counts.stride(0), kv_pool.stride(2), dst.stride(0),
            dst.stride(1),
            kp, k.stride(0), v.stride(0), counts.stride(1), kv_pool.stride(0), slot_to_head.stride(0),
            D=d, BLOCK_T=copy_block, num_warps=4,
        )


__all__ = ["prefill_attention_varlen", "snapkv_scores_varlen", "select_scatter", "snapkv_compress",
           "snapkv_compress_layers", "pool_scores",
           "global_keep_counts", "score_width"]

"""Fused element-wise kernels of the engine's layer loop: one launch where the torch code issued several.

An eager torch decoder layer issues ~40 launches (RMSNorm alone is six: cast, square, mean, rsqrt, two
multiplies; RoPE another dozen for q and k; the KV write two index_selects and two index_puts). Inside a CUDA
graph each still costs a few microseconds of launch gap and an HBM round trip of its intermediate, which at
decode batch sizes is most of the layer's non-GEMM time. These kernels do each group in one pass:

* :func:`rms_norm` / :func:`add_rms_norm`: (residual add +) RMSNorm of one row per program;
* :func:`silu_mul`: ``silu(gate) * up`` from the fused gate/up projection output;
* :func:`rope_qkv`: RoPE of q and k *in place* in the fused qkv projection output (optional per-head q/k RMSNorm
  of Qwen3 first) and, for the step's decode rows, each KV head's new K/V written into its page at its own
  position (slot order, ``head_lens - 1``): the step's KV writes in the same launch, no separate kernel.

Rounding: each kernel rounds where the torch code it replaces rounds (a bf16 product of two bf16 tensors is
computed in fp32 and rounded once), so bf16 results agree with the eager model up to the order of the fp32
reductions. On a CPU tensor without ``TRITON_INTERPRET=1`` the torch code itself runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tangram.kernels._triton import runs_triton, tl, triton


# ----------------------------------------------------------------------------- RMSNorm (+ residual)


@triton.jit
def _rms_norm_kernel(X, R, W, XOUT, Y, eps, n, stride_x, stride_r, stride_xo, stride_y,
                     BLOCK: tl.constexpr, HAS_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_R:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # the residual stream's own rounding
        tl.store(XOUT + row * stride_xo + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty)  # HF: normalise in fp32, cast, then * weight
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def _torch_rms_norm(x, w, eps):
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x * rsqrt(mean(x^2) + eps))`` over the last dim (Llama's RMSNorm), one launch."""
    if not runs_triton(x):
        return _torch_rms_norm(x, w, eps)
    x2 = _rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, w, x2, y, eps, n, x2.stride(0), 0, 0, y.stride(0),
                                         BLOCK=triton.next_power_of_2(n), HAS_R=False, num_warps=_warps(n))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r`` (the residual stream) and ``rms_norm(s)``, one launch."""
    if not runs_triton(x):
        s = x + r
        return s, _torch_rms_norm(s, w, eps)
    x2, r2 = _rows(x), _rows(r)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        x2, r2 = x2.contiguous(), r2.contiguous()
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(s)
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, s, y, eps, n, x2.stride(0), r2.stride(0), s.stride(0), y.stride(0),
                                         BLOCK=triton.next_power_of_2(n), HAS_R=True, num_warps=_warps(n))
    return s.view(x.shape), y.view(x.shape)


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8


# ----------------------------------------------------------------------------- SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(GU, OUT, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n + offs, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)  # F.silu rounds to the tensor's dtype, then * up
    tl.store(OUT + row * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[..., :n]) * gu[..., n:]`` of the fused gate/up projection output, one launch."""
    n = gu.shape[-1] // 2
    if not runs_triton(gu):
        return F.silu(gu[..., :n]) * gu[..., n:]
    g2 = _rows(gu)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    out = torch.empty((g2.shape[0], n), dtype=gu.dtype, device=gu.device)
    if g2.shape[0]:
        block = 1024
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, out, n, g2.stride(0), out.stride(0), BLOCK=block,
                                                               num_warps=4)
    return out.view(*gu.shape[:-1], n)


# ----------------------------------------------------------------------------- RoPE in place + decode KV write


@triton.jit
def _rope_heads(row_ptr, COS, SIN, QN, n_heads, eps,
                HB: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr, ROUND: tl.constexpr):
    """RoPE (rotate-half) of ``n_heads`` heads of one token at ``row_ptr``, in place; returns (lo, hi) halves
    after rotation (the caller may also store them elsewhere)."""
    HALF: tl.constexpr = D // 2
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, HALF)
    mh = offs_h < n_heads
    p_lo = row_ptr + offs_h[:, None] * D + offs_d[None, :]
    a = tl.load(p_lo, mask=mh[:, None], other=0.0)
    b = tl.load(p_lo + HALF, mask=mh[:, None], other=0.0)
    if QK_NORM:  # Qwen3: per-head RMSNorm before RoPE (fp32 statistics, cast, times the weight)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        var = (tl.sum(af * af, 1) + tl.sum(bf * bf, 1)) / D
        rs = 1.0 / tl.sqrt(var + eps)
        wa = tl.load(QN + offs_d).to(tl.float32)
        wb = tl.load(QN + HALF + offs_d).to(tl.float32)
        a = (wa[None, :] * (af * rs[:, None]).to(a.dtype).to(tl.float32)).to(a.dtype)
        b = (wb[None, :] * (bf * rs[:, None]).to(b.dtype).to(tl.float32)).to(b.dtype)
    ca = tl.load(COS + offs_d).to(tl.float32)
    cb = tl.load(COS + HALF + offs_d).to(tl.float32)
    sa = tl.load(SIN + offs_d).to(tl.float32)
    sb = tl.load(SIN + HALF + offs_d).to(tl.float32)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    # (x * cos + rotate_half(x) * sin) with torch's roundings: each product, then the sum, in the tensor's dtype
    t1 = af * ca[None, :]
    t2 = -bf * sa[None, :]
    t3 = bf * cb[None, :]
    t4 = af * sb[None, :]
    if ROUND:
        t1 = t1.to(a.dtype).to(tl.float32)
        t2 = t2.to(a.dtype).to(tl.float32)
        t3 = t3.to(a.dtype).to(tl.float32)
        t4 = t4.to(a.dtype).to(tl.float32)
    lo = (t1 + t2).to(a.dtype)
    hi = (t3 + t4).to(a.dtype)
    tl.store(p_lo, lo, mask=mh[:, None])
    tl.store(p_lo + HALF, hi, mask=mh[:, None])
    return lo, hi


# n_dec (the step's decode rows) takes any value: a specialisation per class would compile inside a run
@triton.jit(do_not_specialize=["n_dec"], do_not_specialize_on_alignment=["LENS", "H2S"])  # see compress.py
def _rope_qkv_kernel(
    QKV, COS, SIN, QN, KN, KV, BT, LENS, H2S,
    n_dec, eps,
    stride_t, stride_cs,
    stride_kvp, stride_kvkv, stride_kvh, stride_kvt,
    stride_btb, stride_btg, stride_lb,
    HQ: tl.constexpr, H: tl.constexpr, HQB: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
    HP: tl.constexpr, P: tl.constexpr,
    QK_NORM: tl.constexpr, WRITE_KV: tl.constexpr, ROUND: tl.constexpr,
):
    """One token: RoPE of its q and k heads in place in the fused qkv row; for a decode row (token < n_dec) its
    K (rotated) and V also go to the KV pool at each head's own position."""
    tok = tl.program_id(0).to(tl.int64)
    row = QKV + tok * stride_t
    cos = COS + tok * stride_cs
    sin = SIN + tok * stride_cs
    _rope_heads(row, cos, sin, QN, HQ, eps, HQB, D, QK_NORM, ROUND)
    klo, khi = _rope_heads(row + HQ * D, cos, sin, KN, H, eps, HB, D, QK_NORM, ROUND)
    if WRITE_KV:
        if tok < n_dec:
            HALF: tl.constexpr = D // 2
            offs_h = tl.arange(0, HB)
            offs_d = tl.arange(0, HALF)
            mh = offs_h < H
            slot = tl.load(H2S + offs_h, mask=mh, other=0)
            pos = tl.load(LENS + tok * stride_lb + slot, mask=mh, other=1) - 1
            page = tl.load(BT + tok * stride_btb + (slot // HP) * stride_btg + pos // P, mask=mh, other=0)
            dst = page.to(tl.int64) * stride_kvp + (slot % HP) * stride_kvh + (pos % P) * stride_kvt
            ptr = KV + dst[:, None] + offs_d[None, :]
            vrow = row + (HQ + H) * D + offs_h[:, None] * D + offs_d[None, :]
            tl.store(ptr, klo.to(KV.dtype.element_ty), mask=mh[:, None])
            tl.store(ptr + HALF, khi.to(KV.dtype.element_ty), mask=mh[:, None])
            tl.store(ptr + stride_kvkv, tl.load(vrow, mask=mh[:, None], other=0.0).to(KV.dtype.element_ty),
                     mask=mh[:, None])
            tl.store(ptr + stride_kvkv + HALF, tl.load(vrow + HALF, mask=mh[:, None], other=0.0)
                     .to(KV.dtype.element_ty), mask=mh[:, None])


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _torch_rope(x, cos, sin):
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
             head_dim: int, q_norm=None, k_norm=None, eps: float = 1e-6, kv_pool=None, block_table=None,
             head_lens=None, head_to_slot=None, page_size: int = 0, heads_per_group: int = 1,
             n_decode: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of q and k in place in ``qkv`` [N, (Hq + 2 H) d] (the fused projection output); returns the views
    ``q [N, Hq, d]``, ``k [N, H, d]``, ``v [N, H, d]`` into it.

    With ``kv_pool`` (one layer, ``[pages, 2, H_p, P, d]``), rows ``< n_decode`` also write their K and V into
    the pool: KV head ``h`` goes to slot ``head_to_slot[h]`` at position ``head_lens[row, slot] - 1`` through
    ``block_table[row, slot // H_p]`` (``[n_decode, G, W]``; ``head_lens`` ``[n_decode, H]`` int32, slot
    order, *after* this token). ``q_norm``/``k_norm``: per-head RMSNorm weights [d] applied before RoPE (Qwen3).
    """
    N = qkv.shape[0]
    Hq, H, d = num_q_heads, num_kv_heads, head_dim
    if qkv.shape[1] != (Hq + 2 * H) * d:
        raise ValueError(f"rope_qkv: qkv has {qkv.shape[1]} columns, expected (Hq + 2H) d = {(Hq + 2 * H) * d}")
    q = qkv[:, :Hq * d].view(N, Hq, d)
    k = qkv[:, Hq * d:(Hq + H) * d].view(N, H, d)
    v = qkv[:, (Hq + H) * d:].view(N, H, d)
    write = kv_pool is not None and n_decode > 0
    if not runs_triton(qkv):
        qq, kk = q, k
        if q_norm is not None:
            qq, kk = _torch_rms_norm(qq, q_norm, eps), _torch_rms_norm(kk, k_norm, eps)
        c, s = cos[:, None, :], sin[:, None, :]
        q.copy_(_torch_rope(qq, c, s))
        k.copy_(_torch_rope(kk, c, s))
        if write:
            _torch_kv_write(kv_pool, block_table, head_lens, head_to_slot, k[:n_decode], v[:n_decode], page_size,
                            heads_per_group)
        return q, k, v
    if qkv.stride(1) != 1 or d & (d - 1):
        raise ValueError("rope_qkv: qkv rows must be contiguous and head_dim a power of two")
    if N == 0:
        return q, k, v
    cos, sin = cos.contiguous(), sin.contiguous()
    qn = q_norm if q_norm is not None else cos
    kn = k_norm if k_norm is not None else cos
    if write:
        kvp, bt, lens, h2s = kv_pool, block_table, head_lens, head_to_slot
        kv_strides = (kvp.stride(0), kvp.stride(1), kvp.stride(2), kvp.stride(3))
        bt_strides = (bt.stride(0), bt.stride(1), lens.stride(0))
    else:
        kvp = bt = lens = h2s = qkv
        kv_strides, bt_strides = (0, 0, 0, 0), (0, 0, 0)
    _rope_qkv_kernel[(N,)](
        qkv, cos, sin, qn, kn, kvp, bt, lens, h2s,
        n_decode, eps, qkv.stride(0), cos.stride(0), *kv_strides, *bt_strides,
        HQ=Hq, H=H, HQB=triton.next_power_of_2(Hq), HB=triton.next_power_of_2(H), D=d,
        HP=heads_per_group, P=max(1, page_size), QK_NORM=q_norm is not None, WRITE_KV=write,
        ROUND=qkv.dtype != torch.float32, num_warps=4,
    )
    return q, k, v


def _torch_kv_write(pool, table, lens, head_to_slot, k, v, page_size, heads_per_group):
    """Reference KV write: KV head h of row b into slot head_to_slot[h] at lens[b, slot] - 1."""
    B, H = lens.shape
    slot = head_to_slot.long()[None, :].expand(B, H)
    pos = lens.long().gather(1, slot) - 1
    page = table.long()[torch.arange(B, device=k.device)[:, None], slot // heads_per_group, pos // page_size]
    j = slot % heads_per_group
    pool[page, 0, j, pos % page_size] = k.to(pool.dtype)
    pool[page, 1, j, pos % page_size] = v.to(pool.dtype)


__all__ = ["rms_norm", "add_rms_norm", "silu_mul", "rope_qkv"]

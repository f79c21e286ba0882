"""Plain-torch float64 references for every kernel (slow, loop over heads; for tests and checks only).

They read the same pools and tables as the kernels, so a layout mistake in a
kernel shows up as a mismatch rather than being copied into the reference.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _gather(kv_pool, bt_row, j, n, page_size):
    tok = torch.arange(n, device=kv_pool.device)
    pages = bt_row[tok // page_size].long()
    off = tok % page_size
    return kv_pool[pages, 0, j, off].double(), kv_pool[pages, 1, j, off].double()


def ref_paged_decode(q, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int, heads_per_group: int,
                     sm_scale: float | None = None) -> torch.Tensor:
    """o[b, h*gq + i] = softmax(q K^T * scale) V over the head's first head_lens tokens (0 for an empty head)."""
    B, Hq, d = q.shape
    H = head_lens.shape[1]
    gq = Hq // H
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros((B, Hq, d), dtype=torch.float64, device=q.device)
    lens = head_lens.cpu().numpy()
    s2h = slot_to_head.cpu().numpy()
    for b in range(B):
        for slot in range(H):
            n = int(lens[b, slot])
            if n == 0:
                continue
            g, j = divmod(slot, heads_per_group)
            K, V = _gather(kv_pool, block_table[b, g], j, n, page_size)
            h = int(s2h[slot])
            qh = q[b, h * gq:(h + 1) * gq].double()
            p = torch.softmax(qh @ K.T * scale, dim=-1)
            out[b, h * gq:(h + 1) * gq] = p @ V
    return out


def ref_prefill_attention(q, k_new, v_new, kv_pool, block_table, head_lens, slot_to_head, *, page_size: int,
                          heads_per_group: int, sm_scale: float | None = None, with_lse: bool = False):
    """Chunk attention: every cached token of the head, then causal over the chunk.

    Returns (out [c, Hq, d], probs) where probs[h] is [gq, c, n_h + c] float64
    (KV head h in original order); with ``with_lse`` (out, probs, lse): lse [Hq, c] the base-2 log-sum-exp of
    each query's scores in fp32, what the kernels return (the engine's CPU path takes all three from one pass).
    """
    c, Hq, d = q.shape
    H = k_new.shape[1]
    gq = Hq // H
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros((c, Hq, d), dtype=torch.float64, device=q.device)
    lse = torch.empty((Hq, c), dtype=torch.float32, device=q.device) if with_lse else None
    lens = head_lens.cpu().numpy()
    s2h = slot_to_head.cpu().numpy()
    probs = [None] * H
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    for slot in range(H):
        h = int(s2h[slot])
        n = int(lens[slot])
        g, j = divmod(slot, heads_per_group)
        Kc, Vc = _gather(kv_pool, block_table[g], j, n, page_size)
        K = torch.cat([Kc, k_new[:, h].double()])
        V = torch.cat([Vc, v_new[:, h].double()])
        qh = q[:, h * gq:(h + 1) * gq].double().transpose(0, 1)  # [gq, c, d]
        mask = torch.cat([torch.ones(c, n, dtype=torch.bool, device=q.device), causal], dim=1)
        s = (qh @ K.T * scale).masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, h * gq:(h + 1) * gq] = (p @ V).transpose(0, 1)
        probs[h] = p
        if with_lse:
            lse[h * gq:(h + 1) * gq] = (torch.logsumexp(s, -1) * (1.0 / math.log(2.0))).float()
    return (out, probs, lse) if with_lse else (out, probs)


def ref_snapkv_scores(probs, head_lens, slot_to_head, window: int, pool_kernel: int = 7) -> torch.Tensor:
    """Importance of each new token per KV head (slot order) [H, c], float64.

    Sum of the last w = min(window, c) queries' probabilities over the head's
    query heads, then 1-D average pooling (kernel ``pool_kernel``, zero padded), as SnapKV.
    """
    lens = head_lens.cpu().numpy()
    s2h = slot_to_head.cpu().numpy()
    rows = []
    for slot in range(len(s2h)):
        p = probs[int(s2h[slot])]
        n = int(lens[slot])
        c = p.shape[1]
        w = min(window, c)
        rows.append(p[:, c - w:, n:].sum(dim=(0, 1)))
    s = torch.stack(rows)
    return F.avg_pool1d(s[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]


def ref_topk_keep(scores: np.ndarray, keep_counts=None, global_keep: int | None = None) -> np.ndarray:
    """Boolean keep mask [H, c]: per-head top-k_h, or global top-k over the flattened scores."""
    s = np.asarray(scores, dtype=np.float64)
    H, c = s.shape
    keep = np.zeros((H, c), dtype=bool)
    if global_keep is not None:
        idx = np.argsort(-s.reshape(-1), kind="stable")[: min(int(global_keep), H * c)]
        keep.reshape(-1)[idx] = True
        return keep
    k = np.minimum(np.asarray(keep_counts, dtype=np.int64).reshape(H), c)
    order = np.argsort(-s, axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(c)[None, :].repeat(H, 0), axis=1)
    return ranks < k[:, None]


def ref_scatter(kv_pool, block_table, head_lens, slot_to_head, k_new, v_new, keep, *, page_size: int,
                heads_per_group: int):
    """Copy of the pool with each head's kept new K/V appended after its length, and the new lengths."""
    pool = kv_pool.clone()
    lens = head_lens.clone()
    s2h = slot_to_head.cpu().numpy()
    keep = torch.as_tensor(keep, device=kv_pool.device)
    for slot in range(len(s2h)):
        h = int(s2h[slot])
        g, j = divmod(slot, heads_per_group)
        idx = torch.nonzero(keep[slot]).flatten()
        pos = int(lens[slot]) + torch.arange(idx.numel(), device=pool.device)
        pages = block_table[g][pos // page_size].long()
        pool[pages, 0, j, pos % page_size] = k_new[idx, h].to(pool.dtype)
        pool[pages, 1, j, pos % page_size] = v_new[idx, h].to(pool.dtype)
        lens[slot] += idx.numel()
    return pool, lens


def is_topk_set(scores: np.ndarray, keep: np.ndarray, counts) -> bool:
    """True iff each row of ``keep`` has counts[h] entries and none of its dropped scores beats a kept one."""
    s = np.asarray(scores, dtype=np.float64)
    keep = np.asarray(keep, dtype=bool)
    for h in range(s.shape[0]):
        if keep[h].sum() != counts[h]:
            return False
        if keep[h].any() and (~keep[h]).any() and s[h][keep[h]].min() < s[h][~keep[h]].max():
            return False
    return True


def ref_rmsnorm(x, w, eps: float = 1e-5):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def ref_silu_mul(x):
    x = x.double()
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


# --------------------------------------------------------------------------- scorers (kernels/scoring.py)
# Written per head and per key with explicit formulas (rotation matrices, explicit pooling windows) rather than
# the vectorised tricks of the implementations, so a shared mistake is unlikely.


def _ref_probs(q, k, lse2, i, qh, h, scale):
    """p[j] = attention probability of query row i (query head qh) on new key j of KV head h (0 for j > i)."""
    c = k.shape[0]
    s = (k[:, h].double() @ q[i, qh].double()) * scale
    p = torch.exp(s - float(lse2[qh, i]) / LOG2E_REF)
    p[torch.arange(c) > i] = 0.0
    return p


LOG2E_REF = 1.0 / math.log(2.0)


def ref_snapkv_chunk(q, k, lse2, window: int, kernel: int) -> torch.Tensor:
    """kvpress SnapKV on one chunk [H, c] float64: window w = max(1, min(window, c - 1)) trailing queries, probs
    averaged over window and group, avg-pooled (zero padding, divisor = kernel) over the c - w non-window keys;
    window keys +inf."""
    c, Hq, _ = q.shape
    H = k.shape[1]
    g = Hq // H
    w = max(1, min(window, c - 1))
    scale = 1.0 / math.sqrt(q.shape[2])
    out = torch.full((H, c), math.inf, dtype=torch.float64)
    for h in range(H):
        raw = torch.zeros(c, dtype=torch.float64)
        for qh in range(h * g, (h + 1) * g):
            for i in range(c - w, c):
                raw += _ref_probs(q, k, lse2, i, qh, h, scale)
        raw /= w * g
        n = c - w
        for j in range(n):
            lo, hi = max(0, j - kernel // 2), min(n, j + kernel // 2 + 1)
            out[h, j] = raw[lo:hi].sum() / kernel
    return out


def ref_tova_chunk(q, k, lse2) -> torch.Tensor:
    """TOVA [H, c] float64: the last query's probabilities averaged over all query heads, shared by every KV
    head; the last key +inf."""
    c, Hq, _ = q.shape
    H = k.shape[1]
    g = Hq // H
    scale = 1.0 / math.sqrt(q.shape[2])
    acc = torch.zeros(c, dtype=torch.float64)
    for qh in range(Hq):
        acc += _ref_probs(q, k, lse2, c - 1, qh, qh // g, scale)
    acc /= Hq
    acc[c - 1] = math.inf
    return acc.repeat(H, 1)


def ref_keydiff_chunk(k) -> torch.Tensor:
    """KeyDiff [H, c] float64: minus the cosine between each key and the mean unit key of its head."""
    c, H, _ = k.shape
    out = torch.empty((H, c), dtype=torch.float64)
    for h in range(H):
        K = k[:, h].double()
        a = sum(K[j] / K[j].norm() for j in range(c)) / c
        for j in range(c):
            out[h, j] = -(K[j] @ a) / (K[j].norm() * a.norm())
    return out


def ref_rope_matrix(pos: int, inv_freq) -> torch.Tensor:
    """The d x d RoPE rotation at ``pos`` (HF rotate-half pairing: dims i and i + d/2), angle rounded to float32
    as the model computes it."""
    half = inv_freq.numel()
    R = torch.zeros((2 * half, 2 * half), dtype=torch.float64)
    for i in range(half):
        a = float(torch.tensor(float(pos), dtype=torch.float32) * inv_freq[i].float())
        R[i, i], R[i, i + half] = math.cos(a), -math.sin(a)
        R[i + half, i], R[i + half, i + half] = math.sin(a), math.cos(a)
    return R


def ref_expected_attention_chunk(q, k, v, pos0: int, inv_freq, *, n_sink: int = 4, n_future: int = 512,
                                 epsilon: float = 0.0) -> torch.Tensor:
    """Expected Attention [H, c] float64 from explicit rotation matrices: pre-RoPE queries R(p)^T q of the
    non-sink positions, their mean and covariance (divided by n) per query head, both rotated by the mean
    rotation Rbar of the next n_future positions, logits (Rbar mu).k/sqrt(d) + k^T Rbar S Rbar^T k/(2d),
    softmax over non-sink keys, mean over the group, times (. + epsilon) ||v||; sinks +inf."""
    c, Hq, d = q.shape
    H = k.shape[1]
    g = Hq // H
    pos = list(range(pos0, pos0 + c))
    obs = [i for i, p in enumerate(pos) if p >= n_sink]
    Rbar = sum(ref_rope_matrix(f, inv_freq) for f in range(pos0 + c, pos0 + c + n_future)) / n_future
    out = torch.zeros((H, c), dtype=torch.float64)
    for qh in range(Hq):
        h = qh // g
        Q = torch.stack([ref_rope_matrix(pos[i], inv_freq).T @ q[i, qh].double() for i in obs])
        mu = Q.mean(0)
        S = (Q - mu).T @ (Q - mu) / len(obs)
        mu_r, S_r = Rbar @ mu, Rbar @ S @ Rbar.T
        logit = torch.full((c,), -math.inf, dtype=torch.float64)
        for j in obs:
            kj = k[j, h].double()
            logit[j] = mu_r @ kj / math.sqrt(d) + kj @ S_r @ kj / (2 * d)
        out[h] += torch.softmax(logit, 0) / g
    for h in range(H):
        for j in range(c):
            out[h, j] = math.inf if pos[j] < n_sink else (out[h, j] + epsilon) * v[j, h].double().norm()
    return out

"""Key-importance scorers of one prefill chunk, and the selections of the budget scopes.

The engine's compression path (:func:`engine_chunk_scores`, slot order) and the
profiles package (:class:`tangram.profiles.scoring.ChunkScorer`, through
:func:`chunk_scores`, KV-head order) call the same code, so a profile is
calibrated with the scores the engine selects by.

Every scorer rates the NEW keys of the chunk [H, c] (higher = keep) when the
chunk is produced, from the chunk's own queries, keys, values and positions,
plus, for the attention-based ones, the log-sum-exp (base 2) of each query over
all keys it attends (the cached prefix and the chunk, causally), which the
prefill attention kernel writes anyway. No scorer reads a token after the
chunk: a chunk's kept set depends only on the tokens up to its end, so requests
sharing a chunk-aligned prefix keep the same KV for it (prefix reuse).
"Always kept" tokens get the score +inf.

========================  ==========================================================================================
method                    score of key j of the chunk (c tokens, positions p0..p0+c-1; GQA group g = Hq / H)
========================  ==========================================================================================
``ada-snapkv``            SnapKV (Li et al. 2024), as kvpress ``SnapKVPress``: the last w = min(window, c-1) queries'
                          attention probabilities, mean over the window and over the KV head's g query heads,
                          1-D average pooling (``kernel``, zero padded, over the non-window keys only); the window's
                          own w keys are kept. Ours: window 32, kernel 7 (kvpress: 64, 5). Allocation (Ada-KV, Feng
                          et al. 2024) is the budget scope's, not the scorer's; Ada-KV's safeguard floor is not used.
``pyramidkv``             SnapKV scores with PyramidKV's per-layer schedule (Cai et al. 2024; kvpress
                          ``PyramidKVPress``): layer l aims at ``tangram.budgets.pyramid_ratios`` instead of rho.
``keydiff``               KeyDiff (Park et al. 2025), as kvpress ``KeyDiffPress``: -cos(k_j, a), a = mean over the
                          chunk of the L2-normalised keys of the head (post-RoPE, as cached); the chunk is one
                          KeyDiff block (kvpress ``BlockPress`` with block = chunk).
``tova``                  TOVA (Oren et al. 2024), as kvpress ``TOVAPress``: the chunk's last query's attention
                          probability, mean over ALL query heads, the same for every KV head; the last token is kept.
``streaming-llm``         StreamingLLM (Xiao et al. 2024), as kvpress ``StreamingLLMPress``: score = position; the
                          first ``n_sink`` = 4 positions of the sequence are kept. Per chunk this keeps the chunk's
                          most recent tokens (compression happens once per chunk, so earlier chunks are not evicted
                          later as a sliding window would).
``expected-attention``    Expected Attention (Devoto et al. 2025), as kvpress ``ExpectedAttentionPress``: mean mu
                          and covariance S (normalised by n) of the chunk's pre-RoPE queries per query head (queries
                          at positions < n_sink left out; post-RoPE queries are un-rotated at their positions), both
                          rotated by the average RoPE rotation R of the next ``n_future`` = 512 positions after the
                          chunk; logit_j = (R mu).k_j / sqrt(d) + k_j^T (R S R^T) k_j / (2d); softmax over the chunk's
                          non-sink keys, mean over the group, times ||v_j|| (+ epsilon = 0 first); sinks kept.
``kvzip``                 KVzip (Kim et al. 2025) context reconstruction: needs a second forward of a repeat prompt
                          plus the chunk, so it is a profiles-only scorer
                          (:class:`tangram.profiles.scoring.KVzipScorer`); the engine rejects it.
========================  ==========================================================================================

Scopes (:func:`scope_keep_mask`): ``per-layer`` keeps each layer's top ceil(r_l H c) over all its heads'
keys at once (Ada-KV), ``cross-layer`` the top ceil(rho L H c) over every layer and head at once, ``uniform``
each head's top ceil(r_l c); r_l is rho, or PyramidKV's schedule (:func:`tangram.budgets.layer_targets`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tangram.budgets import METHODS, SCOPES, check_method_scope, layer_targets
from tangram.errors import ConfigError
from tangram.kernels.prefill import snapkv_scores

LOG2E = 1.4426950408889634
INF = float("inf")


@dataclass(frozen=True)
class ScoreParams:
    window: int = 32  # SnapKV / PyramidKV observation window (trailing queries of the chunk)
    kernel: int = 7  # SnapKV pooling kernel (odd)
    n_sink: int = 4  # StreamingLLM / Expected Attention sink tokens (sequence positions 0..n_sink-1)
    n_future: int = 512  # Expected Attention: future positions whose RoPE rotation is averaged
    epsilon: float = 0.0  # Expected Attention: added to the probability before the value-norm factor
    use_covariance: bool = True
    use_vnorm: bool = True

    def __post_init__(self) -> None:
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"scorer window must be >= 1 and pooling kernel odd, got {self.window}, {self.kernel}")
        if self.n_sink < 0 or self.n_future < 1:
            raise ConfigError(f"n_sink must be >= 0 and n_future >= 1, got {self.n_sink}, {self.n_future}")


@dataclass(frozen=True)
class Method:
    name: str
    scorer: str  # snapkv | tova | keydiff | streaming | expected | kvzip
    engine: bool  # runs in the engine's fused per-layer compression
    lse_rows: str  # which queries' log-sum-exp the scorer reads: window | last | none


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("ada-snapkv", "snapkv", True, "window"),
    Method("pyramidkv", "snapkv", True, "window"),
    Method("keydiff", "keydiff", True, "none"),
    Method("tova", "tova", True, "last"),
    Method("streaming-llm", "streaming", True, "none"),
    Method("expected-attention", "expected", True, "none"),
    Method("kvzip", "kvzip", False, "none"),
)}
assert tuple(REGISTRY) == METHODS, "tangram.budgets.METHODS and the scorer registry must list the same methods"
ENGINE_METHODS = tuple(m for m, spec in REGISTRY.items() if spec.engine)


def method_spec(method: str) -> Method:
    if method not in REGISTRY:
        raise ConfigError(f"unknown scoring method {method!r}; choose from {', '.join(METHODS)}")
    return REGISTRY[method]


def snapkv_window(window: int, c: int) -> int:
    """Observation window of a chunk of c tokens: at least one key is scored by attention when c >= 2."""
    return max(1, min(window, c - 1))


# --------------------------------------------------------------------------- scorers (torch, KV-head order)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, d] of the model's (HF rotate-half) RoPE, angles in float32 as the model computes them."""
    f = positions.float()[:, None] * inv_freq.float()[None, :].to(positions.device)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().double(), emb.sin().double()


def window_probs(q: torch.Tensor, k: torch.Tensor, lse2: torch.Tensor, w: int, scale: float) -> torch.Tensor:
    """Attention probabilities [H, g, w, c] of the chunk's last w queries on its new keys (causal), from the
    queries' base-2 log-sum-exp over everything they attend; fp32."""
    c, Hq, d = q.shape
    H = k.shape[1]
    g = Hq // H
    qw = q[c - w:].float().view(w, H, g, d)
    logits = torch.einsum("whgd,chd->hgwc", qw, k.float()) * (scale * LOG2E)
    rows = torch.arange(c - w, c, device=q.device)
    causal = torch.arange(c, device=q.device)[None, :] <= rows[:, None]  # [w, c]
    p = torch.exp2(logits - lse2[:, c - w:].float().reshape(H, g, w, 1))
    return p.masked_fill(~causal, 0.0)


def snapkv_finish(raw: torch.Tensor, w: int, g: int, kernel: int) -> torch.Tensor:
    """SnapKV from the window's summed probabilities ``raw`` [H, c] (sum over w queries and g heads)."""
    c = raw.shape[1]
    return snapkv_finish_batched(raw[None], torch.tensor([c], device=raw.device), w, g, kernel)[0]


def snapkv_finish_batched(raw: torch.Tensor, lengths: torch.Tensor, w: int, g: int, kernel: int) -> torch.Tensor:
    """:func:`snapkv_finish` of ``kp`` chunks at once: ``raw`` [kp, H, CS] zero past each chunk's ``lengths[i]``.
    Mean probability over the window's queries, average pooling (zero padded) over the tokens before the window,
    the window itself kept (+inf), 0 past the chunk."""
    CS = raw.shape[2]
    cols = torch.arange(CS, device=raw.device)[None, None, :]
    c = lengths.to(raw.device).long()[:, None, None]
    before = cols < c - w  # the tokens before the window
    s = (raw.float() / (w * g)).masked_fill(~before, 0.0)
    s = F.avg_pool1d(s.reshape(-1, 1, CS), kernel, stride=1, padding=kernel // 2).view(s.shape)
    s = s.masked_fill(~before & (cols < c), INF)
    return s.masked_fill(cols >= c, 0.0)


def tova_finish(raw_last: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """TOVA from the last query's probabilities summed over each KV head's query heads ``raw_last`` [H, c]."""
    H, c = raw_last.shape
    s = (raw_last.float().sum(0) / num_q_heads).expand(H, c).clone()
    s[:, c - 1] = INF
    return s


def keydiff_scores(k: torch.Tensor) -> torch.Tensor:
    kf = k.float()  # [c, H, d]
    anchor = F.normalize(kf, p=2, dim=-1).mean(dim=0, keepdim=True)
    return -F.cosine_similarity(kf, anchor, dim=-1).transpose(0, 1).contiguous()


def streaming_scores(c: int, H: int, pos0: int, n_sink: int, device=None) -> torch.Tensor:
    pos = torch.arange(pos0, pos0 + c, dtype=torch.float32, device=device)
    pos = pos.masked_fill(pos < n_sink, INF)
    return pos.expand(H, c).contiguous()


def expected_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, inv_freq: torch.Tensor,
                              scale: float, p: ScoreParams) -> torch.Tensor:
    c, Hq, d = q.shape
    H = k.shape[1]
    g = Hq // H
    dev = q.device
    pos = torch.arange(pos0, pos0 + c, device=dev)
    sink = pos < p.n_sink
    if bool(sink.all()):
        return torch.full((H, c), INF, dtype=torch.float32, device=dev)
    cos, sin = rope_cos_sin(pos, inv_freq)
    qd = q.double()
    q_pre = qd * cos[:, None] - _rotate_half(qd) * sin[:, None]  # R(p)^T q: the query before RoPE
    qo = q_pre[~sink]  # [n, Hq, d]
    n = qo.shape[0]
    mu = qo.mean(0)  # [Hq, d]
    fcos, fsin = rope_cos_sin(torch.arange(pos0 + c, pos0 + c + p.n_future, device=dev), inv_freq)
    cbar, sbar = fcos.mean(0), fsin.mean(0)  # mean rotation Rbar = C + S P; Rbar^T k = k C - P(k) S
    kd = k.double()
    kr = (kd * cbar - _rotate_half(kd) * sbar).repeat_interleave(g, dim=1)  # [c, Hq, d]
    logit = torch.einsum("hd,chd->hc", mu, kr) * scale
    if p.use_covariance and n >= 2:
        xc = qo - mu
        cov = torch.einsum("nhi,nhj->hij", xc, xc) / n
        logit = logit + 0.5 * scale * scale * torch.einsum("chi,hij,chj->hc", kr, cov, kr)
    logit = logit.masked_fill(sink[None, :], -INF)
    prob = torch.softmax(logit, dim=-1).view(H, g, c).mean(1)
    if p.use_vnorm:
        prob = (prob + p.epsilon) * v.double().norm(dim=-1).transpose(0, 1)
    return prob.float().masked_fill(sink[None, :], INF)


def chunk_scores(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse2: torch.Tensor | None, *,
                 pos0: int, inv_freq: torch.Tensor | None = None, params: ScoreParams = ScoreParams(),
                 scale: float | None = None) -> torch.Tensor:
    """Scores [H, c] (fp32, KV-head order) of one chunk's new keys.

    ``q`` [c, Hq, d] post-RoPE queries, ``k``/``v`` [c, H, d] (keys post-RoPE), ``pos0`` the chunk's first
    position, ``lse2`` [Hq, c] each query's base-2 log-sum-exp over the keys it attends (only the rows
    :attr:`Method.lse_rows` names are read), ``inv_freq`` the model's RoPE frequencies (Expected Attention)."""
    spec = method_spec(method)
    c, Hq, d = q.shape
    H = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if spec.scorer == "snapkv":
        w = snapkv_window(params.window, c)
        return snapkv_finish(window_probs(q, k, lse2, w, scale).sum(dim=(1, 2)), w, Hq // H, params.kernel)
    if spec.scorer == "tova":
        return tova_finish(window_probs(q, k, lse2, 1, scale).sum(dim=(1, 2)), Hq)
    if spec.scorer == "keydiff":
        return keydiff_scores(k)
    if spec.scorer == "streaming":
        return streaming_scores(c, H, pos0, params.n_sink, q.device)
    if spec.scorer == "expected":
        if inv_freq is None:
            raise ConfigError("expected-attention needs the model's RoPE inv_freq")
        return expected_attention_scores(q, k, v, pos0, inv_freq, scale, params)
    raise ConfigError(f"method {method!r} cannot score a chunk on its own (it needs a reconstruction forward)")


def engine_chunk_scores(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse2: torch.Tensor,
                        slot_to_head: torch.Tensor, *, pos0: int, inv_freq: torch.Tensor | None = None,
                        params: ScoreParams = ScoreParams(), head_to_slot: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """The engine's dispatch: scores [H, c] (fp32) in SLOT order for ``select_keep``.

    SnapKV, PyramidKV and TOVA read the window's probabilities through :func:`tangram.kernels.snapkv_scores`
    (the Triton kernel on the GPU, which rebuilds them from the prefill kernel's LSE) with pooling off, then
    finish in torch; the others are torch on the chunk alone (no pass over the cache; Expected Attention's
    statistics in float64)."""
    spec = method_spec(method)
    if not spec.engine:
        raise ConfigError(f"method {method!r} does not run in the engine (profiles only)")
    c, Hq, _ = q.shape
    H = k.shape[1]
    if spec.scorer in ("snapkv", "tova"):
        w = snapkv_window(params.window, c) if spec.scorer == "snapkv" else 1
        raw = snapkv_scores(q, k, lse2, slot_to_head, sm_scale=scale, window=w, pool_kernel=1,
                            head_to_slot=head_to_slot)
        if spec.scorer == "snapkv":
            return snapkv_finish(raw, w, Hq // H, params.kernel)
        return tova_finish(raw, Hq)
    return chunk_scores(method, q, k, v, lse2, pos0=pos0, inv_freq=inv_freq, params=params,
                        scale=scale)[slot_to_head.long()]


# --------------------------------------------------------------------------- scope selections


def rank_desc(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rank of each entry in descending score order (ties: lower index first), as int64."""
    order = torch.argsort(scores, dim=dim, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(dim, order, torch.arange(scores.shape[dim], device=scores.device).expand_as(order).contiguous())
    return ranks


def _kept(share, n: int) -> np.ndarray:
    return np.clip(np.ceil(np.asarray(share, dtype=np.float64) * n - 1e-9), 1, n).astype(np.int64)


def scope_ranks(scores: torch.Tensor, scope: str, ranks: dict | None = None) -> torch.Tensor:
    """:func:`rank_desc` of scores [L, H, T] in a scope's order: over everything (cross-layer), per layer over all
    heads (per-layer), per head (uniform), shaped [L, H, T]. ``ranks`` memoises them by scope: every share and
    every budget of one scores tensor selects from the same ranks (the evaluation selects 30-odd modes a chunk)."""
    kind = scope if scope in ("cross-layer", "per-layer") else "uniform"
    if ranks is not None and kind in ranks:
        return ranks[kind]
    L, H, T = scores.shape
    if kind == "cross-layer":
        out = rank_desc(scores.reshape(-1)).reshape(L, H, T)
    elif kind == "per-layer":
        out = rank_desc(scores.reshape(L, H * T)).reshape(L, H, T)
    else:
        out = rank_desc(scores)
    if ranks is not None:
        ranks[kind] = out
    return out


def scope_keep_mask(scores: torch.Tensor, rho: float, scope: str, method: str = "ada-snapkv",
                    ranks: dict | None = None) -> torch.Tensor:
    """Keep mask [L, H, T] of one chunk's scores [L, H, T] under a budget scope (ties: lower index first).

    per-layer: layer l keeps its top ceil(r_l H T) over all heads at once; cross-layer: the top ceil(rho L H T)
    over everything; uniform: each head its top ceil(r_l T). r_l: :func:`tangram.budgets.layer_targets`.
    ``ranks``: a memo of :func:`scope_ranks` for these scores."""
    check_method_scope(method, scope)
    L, H, T = scores.shape
    targets = layer_targets(method, scope, L, rho)
    dev = scores.device
    rk = scope_ranks(scores, scope, ranks)
    if scope == "cross-layer":
        return rk < int(_kept(rho, L * H * T))
    if scope == "per-layer":
        return rk < torch.as_tensor(_kept(targets, H * T), device=dev)[:, None, None]
    return rk < torch.as_tensor(_kept(targets, T), device=dev)[:, None, None]


__all__ = ["ScoreParams", "Method", "REGISTRY", "METHODS", "SCOPES", "ENGINE_METHODS", "method_spec", "chunk_scores",
           "engine_chunk_scores", "scope_keep_mask", "scope_ranks", "rank_desc", "snapkv_window", "window_probs", "snapkv_finish", "snapkv_finish_batched",
           "tova_finish", "keydiff_scores", "streaming_scores", "expected_attention_scores", "rope_cos_sin"]

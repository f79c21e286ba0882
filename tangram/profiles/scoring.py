"""Key-importance scoring methods and the token-selection policies of the serving modes.

Scorers are observers of :class:`tangram.engine.model.TorchAttention`: on every
prefill chunk they score that chunk's new keys per KV head ([B, Hkv, T]) from
the layer's queries and cache, exactly when an engine would compress the chunk.

* ``ada-snapkv``: SnapKV (Li et al. 2024) scores -- attention of the chunk's
  last ``window`` queries, summed over the window, max-pooled (kernel 7) along
  keys, averaged over the KV head's query heads (GQA); the window's own tokens
  are always kept (score = +inf). Ada-KV (Feng et al. 2024) then allocates
  non-uniformly by a layer-wide top-k over all KV heads (see
  :func:`global_topk_mask`). Ada-KV's safeguard floor is not applied.
* ``expected-attention``: Devoto et al. 2025 -- fit a Gaussian N(mu, Sigma) to
  the chunk's last ``window`` post-RoPE queries of each query head and score a
  key by its expected attention exp(s mu.k + s^2/2 k^T Sigma k) (the Gaussian
  moment-generating function), normalised over the keys the head can see,
  times ||v||. Simplification: statistics come from the recent queries as
  they are, not rotated to averaged future positions as in kvpress.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tangram.engine.model import AttnEvent, attention_probs
from tangram.errors import ConfigError

METHODS = ("ada-snapkv", "expected-attention")


class ChunkScorer:
    """Collects per-layer scores of the newest prefill chunk's keys."""

    def __init__(self, num_layers: int, window: int = 32, min_tokens: int = 2):
        self.window, self.min_tokens = window, min_tokens
        self.scores: list[torch.Tensor | None] = [None] * num_layers
        self.enabled = True

    def __call__(self, ev: AttnEvent) -> None:
        T = ev.q.shape[2]
        if not self.enabled or T < self.min_tokens:
            self.scores[ev.layer] = None  # decode steps: tokens are kept, nothing to score
            return
        self.scores[ev.layer] = self.score(ev).float()

    def take(self) -> torch.Tensor:
        """Scores of the last chunk for all layers [L, B, Hkv, T]."""
        if any(s is None for s in self.scores):
            raise RuntimeError("no prefill chunk was scored")
        out = torch.stack(self.scores)  # type: ignore[arg-type]
        self.scores = [None] * len(self.scores)
        return out

    def score(self, ev: AttnEvent) -> torch.Tensor:
        raise NotImplementedError


def _window_allowed(ev: AttnEvent, w: int) -> torch.Tensor:
    qp = ev.q_pos[-w:]
    return ev.keep[:, :, None, :] & (ev.k_pos[None, None, None, :] <= qp[None, None, :, None])


class SnapKVScorer(ChunkScorer):
    name = "ada-snapkv"

    def __init__(self, num_layers: int, window: int = 32, kernel: int = 7):
        super().__init__(num_layers, window)
        self.kernel = kernel

    def score(self, ev: AttnEvent) -> torch.Tensor:
        T = ev.q.shape[2]
        w = min(self.window, T)
        B, Hkv = ev.k.shape[:2]
        g = ev.q.shape[1] // Hkv
        allowed = _window_allowed(ev, w).repeat_interleave(g, dim=1)
        p = attention_probs(ev.q[:, :, -w:], ev.k, allowed, ev.scale)  # [B, Hq, w, N]
        s = p[..., ev.new_start:].sum(dim=2)  # [B, Hq, T]
        s = F.max_pool1d(s.reshape(-1, 1, T), self.kernel, stride=1, padding=self.kernel // 2).reshape(s.shape)
        s = s.reshape(B, Hkv, g, T).mean(dim=2)
        s[..., T - w:] = float("inf")  # SnapKV keeps its observation window
        return s


class ExpectedAttentionScorer(ChunkScorer):
    name = "expected-attention"

    def __init__(self, num_layers: int, window: int = 64, use_vnorm: bool = True):
        super().__init__(num_layers, window)
        self.use_vnorm = use_vnorm

    def score(self, ev: AttnEvent) -> torch.Tensor:
        T = ev.q.shape[2]
        w = min(self.window, T)
        B, Hkv, N, D = ev.k.shape
        g = ev.q.shape[1] // Hkv
        qw = ev.q[:, :, -w:].double()
        mu = qw.mean(dim=2)  # [B, Hq, D]
        xc = qw - mu[:, :, None]
        cov = xc.transpose(-1, -2) @ xc / max(w - 1, 1)  # [B, Hq, D, D]
        K = ev.k.double().repeat_interleave(g, dim=1)  # [B, Hq, N, D]
        s = ev.scale
        logit = s * torch.einsum("bhnd,bhd->bhn", K, mu) + 0.5 * s * s * torch.einsum("bhnd,bhde,bhne->bhn", K, cov, K)
        visible = ev.keep.repeat_interleave(g, dim=1)  # the chunk's future queries see every kept key
        logit = logit.masked_fill(~visible, float("-inf"))
        ea = torch.softmax(logit, dim=-1)[..., ev.new_start:]  # [B, Hq, T]
        if self.use_vnorm:
            ea = ea * ev.v[:, :, ev.new_start:].double().norm(dim=-1).repeat_interleave(g, dim=1)
        return ea.reshape(B, Hkv, g, T).mean(dim=2)


def make_scorer(method: str, num_layers: int, window: int | None = None) -> ChunkScorer:
    if method == "ada-snapkv":
        return SnapKVScorer(num_layers, window or 32)
    if method == "expected-attention":
        return ExpectedAttentionScorer(num_layers, window or 64)
    raise ConfigError(f"unknown scoring method {method!r}; choose from {', '.join(METHODS)}")


# --------------------------------------------------------------------------- selection policies


def _rank_desc(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rank of each entry in descending score order (ties: lower index first), as int64."""
    order = torch.argsort(scores, dim=dim, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(dim, order, torch.arange(scores.shape[dim], device=scores.device).expand_as(order).contiguous())
    return ranks


def budget_tokens(ratio, n: int) -> np.ndarray:
    """Tokens a head keeps of ``n`` new ones at ratio B: ceil(B * n), at least 1, at most n."""
    return np.clip(np.ceil(np.asarray(ratio, dtype=np.float64) * n), 1, n).astype(np.int64)


def per_head_topk_mask(scores: torch.Tensor, budgets: np.ndarray | torch.Tensor | float) -> torch.Tensor:
    """Tangram/uniform selection: head (l, h) keeps its top-ceil(B[l,h] * T) keys. scores [..., H, T]."""
    T = scores.shape[-1]
    k = torch.as_tensor(budget_tokens(np.broadcast_to(np.asarray(budgets, dtype=np.float64), scores.shape[:-1]), T),
                        device=scores.device)
    return _rank_desc(scores) < k[..., None]


def global_topk_mask(scores: torch.Tensor, rho: float) -> torch.Tensor:
    """Ada-KV / dynamic selection: per layer, top-ceil(rho * H * T) over all heads' keys at once. scores [..., H, T]."""
    H, T = scores.shape[-2:]
    k = int(min(H * T, max(1, math.ceil(rho * H * T))))
    flat = scores.reshape(*scores.shape[:-2], H * T)
    return (_rank_desc(flat) < k).reshape(scores.shape)


__all__ = ["METHODS", "ChunkScorer", "SnapKVScorer", "ExpectedAttentionScorer", "make_scorer",
           "per_head_topk_mask", "global_topk_mask", "budget_tokens"]

"""Llama-family decoder (Llama 3.x, Qwen3, Qwen2.5, SmolLM2) in plain torch, gpt-fast style.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so safetensors load
as-is and the transformers reference accepts our state dict unchanged.

Attention is pluggable: after projections, q/k-norm and RoPE every layer calls
``backend(layer_idx, q, k, v, ctx)``. :class:`TorchAttention` is the CPU
reference backend (a per-sequence KV cache with a per-head keep mask, so
compression is exact and reversible in tests); the GPU executor swaps in paged
kernels with the same call signature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tangram.config import ModelConfig

# --------------------------------------------------------------------------- backend interface


@dataclass
class AttnContext:
    """Per-forward context handed to the backend.

    ``input_pos`` are the absolute positions of the new tokens [T] (shared over
    the batch). Backends may read/write ``extra`` for their own state.
    """

    input_pos: Tensor
    extra: dict = field(default_factory=dict)


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext) -> Tensor:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] (RoPE applied) -> output [B, Hq, T, D]."""


@dataclass
class AttnEvent:
    """What an observer sees after a layer appended its new keys (used for scoring and fidelity)."""

    layer: int
    q: Tensor  # [B, Hq, T, D] new queries (post-RoPE)
    k: Tensor  # [B, Hkv, N, D] whole cache incl. evicted (masked) tokens
    v: Tensor  # [B, Hkv, N, D]
    keep: Tensor  # [B, Hkv, N] bool: token still in the (compressed) cache
    k_pos: Tensor  # [N] positions of cached tokens
    q_pos: Tensor  # [T]
    new_start: int  # index in the cache of the first new token
    scale: float
    inv_freq: Tensor | None = None  # the model's RoPE frequencies [D/2] (scorers that undo or predict RoPE)


class TorchAttention:
    """Reference attention with a per-sequence KV cache (one batch of equal-length sequences).

    Evicted tokens stay in memory but are masked out, so the attention result is
    exactly that of a cache holding only the kept tokens, while fidelity tools
    can still measure what the full cache would have attended to.
    """

    def __init__(self, cfg: ModelConfig, observers: list[Callable[[AttnEvent], None]] | None = None):
        self.cfg = cfg
        self.observers = list(observers or [])
        self.inv_freq = rope_inv_freq(cfg)
        self.reset()

    def reset(self) -> None:
        L = self.cfg.num_layers
        self.k: list[Tensor | None] = [None] * L
        self.v: list[Tensor | None] = [None] * L
        self.keep: list[Tensor | None] = [None] * L
        self.pos: Tensor | None = None
        self._pos_layer = -1

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first ``n`` tokens (e.g. drop a speculative answer)."""
        for l in range(self.cfg.num_layers):
            if self.k[l] is not None:
                self.k[l] = self.k[l][:, :, :n]
                self.v[l] = self.v[l][:, :, :n]
                self.keep[l] = self.keep[l][:, :, :n]
        if self.pos is not None:
            self.pos = self.pos[:n]

    def evict(self, layer: int, start: int, keep: Tensor) -> None:
        """Apply a keep mask [B, Hkv, n] to cached tokens [start, start+n) of one layer (AND with current)."""
        n = keep.shape[-1]
        cur = self.keep[layer]
        cur[:, :, start:start + n] &= keep.to(device=cur.device, dtype=torch.bool)

    def kept_counts(self) -> Tensor:
        """Tokens each head keeps [L, B, Hkv]."""
        return torch.stack([kp.sum(-1) for kp in self.keep])

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext) -> Tensor:
        B, Hkv, T, D = k.shape
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = k, v
            self.keep[layer_idx] = torch.ones(B, Hkv, T, dtype=torch.bool, device=k.device)
        else:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=2)
            self.keep[layer_idx] = torch.cat(
                [self.keep[layer_idx], torch.ones(B, Hkv, T, dtype=torch.bool, device=k.device)], dim=2)
        if layer_idx == 0:
            self.pos = ctx.input_pos.clone() if self.pos is None else torch.cat([self.pos, ctx.input_pos])
        K, V, keep = self.k[layer_idx], self.v[layer_idx], self.keep[layer_idx]
        N = K.shape[2]
        scale = 1.0 / math.sqrt(D)
        if self.observers:
            ev = AttnEvent(layer_idx, q, K, V, keep, self.pos, ctx.input_pos, N - T, scale, self.inv_freq)
            for obs in self.observers:
                obs(ev)
        return self._attend(q, K, V, keep, ctx, scale)

    def _attend(self, q: Tensor, K: Tensor, V: Tensor, keep: Tensor, ctx: AttnContext, scale: float) -> Tensor:
        """Attention of the new queries over the kept tokens (subclasses trade memory for speed here)."""
        allowed = keep[:, :, None, :] & (self.pos[None, None, None, :] <= ctx.input_pos[None, None, :, None])
        g = q.shape[1] // K.shape[1]
        allowed = allowed.repeat_interleave(g, dim=1)
        Kq, Vq = K.repeat_interleave(g, dim=1), V.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, Kq, Vq, attn_mask=allowed, scale=scale)


def attention_probs(q: Tensor, K: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Softmax attention probabilities [B, Hq, T, N] in float32 (GQA: K is [B, Hkv, N, D])."""
    g = q.shape[1] // K.shape[1]
    s = torch.einsum("bhtd,bhnd->bhtn", q.float(), K.float().repeat_interleave(g, dim=1)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1)


# --------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] with llama3-style scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type", "llama3") == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wl >= hi_wl) & (wl <= lo_wl)
        inv = torch.where(mid, smoothed, scaled)
    elif sc:
        raise ValueError(f"unsupported rope scaling {sc}")
    return inv.float()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF (non-interleaved, rotate-half) RoPE; x [B, H, T, D], cos/sin [T, D]."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.hidden, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_q_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_q_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, ctx: AttnContext) -> Tensor:
        B, T, _ = x.shape
        c, d = self.cfg, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, c.num_q_heads, d)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, d)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, d)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = backend(self.layer_idx, q, k, v, ctx)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, c.num_q_heads * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(self, x, cos, sin, backend, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(tokens [B, T], input_pos [T], backend)`` -> logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, input_pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        f = input_pos.float()[:, None] * self.inv_freq[None, :].to(input_pos.device)
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens: Tensor, input_pos: Tensor, backend: AttentionBackend,
                ctx: AttnContext | None = None, last_only: bool = False) -> Tensor:
        if tokens.dim() == 1:
            tokens = tokens[None]
        ctx = ctx or AttnContext(input_pos)
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope(input_pos, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, ctx)
        x = self.model.norm(x)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x)


def fuse_projections(model: "Transformer") -> None:
    """Store each layer's q/k/v and gate/up weights as one tensor each, the separate projections' weights
    becoming row views of it (no extra memory): a decode step then runs 4 GEMMs per layer instead of 7, each
    with a wider N (better bandwidth at small batch). Idempotent; the state dict keeps Hugging Face's names
    and values. The fused tensors are plain attributes (``_qkv``, ``_qkv_bias``, ``_gate_up``), not
    parameters, so nothing is saved twice."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if getattr(a, "_qkv", None) is not None and a._qkv.data_ptr() == a.q_proj.weight.data_ptr() \
                and getattr(m, "_gate_up", None) is not None and m._gate_up.data_ptr() == m.gate_proj.weight.data_ptr():
            continue
        with torch.no_grad():
            projs = (a.q_proj, a.k_proj, a.v_proj)
            a._qkv = _fuse_rows([p.weight for p in projs], projs, "weight")
            a._qkv_bias = _fuse_rows([p.bias for p in projs], projs, "bias") if a.q_proj.bias is not None else None
            m._gate_up = _fuse_rows([m.gate_proj.weight, m.up_proj.weight], (m.gate_proj, m.up_proj), "weight")


def _fuse_rows(tensors, modules, name: str) -> Tensor:
    fused = torch.cat([t.detach() for t in tensors])
    row = 0
    for t, mod in zip(tensors, modules):
        n = t.shape[0]
        setattr(mod, name, nn.Parameter(fused[row:row + n], requires_grad=t.requires_grad))
        row += n
    return fused


# --------------------------------------------------------------------------- sequence helper


class Session:
    """One sequence on the reference backend: prefill (optionally chunked), decode, roll back. ``rows`` > 1 feeds
    the same tokens to every row of a batched cache (e.g. differently compressed copies of one prompt); the logits
    returned are the first row's."""

    def __init__(self, model: Transformer, backend: TorchAttention | None = None, rows: int = 1):
        self.model = model
        self.backend = backend or TorchAttention(model.cfg)
        self.rows = rows

    @property
    def length(self) -> int:
        return self.backend.length

    @torch.no_grad()
    def forward(self, tokens: list[int] | Tensor, last_only: bool = False) -> Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.model.lm_head.weight.device)
        n0 = self.length
        pos = torch.arange(n0, n0 + t.numel(), device=t.device)
        return self.model(t[None].expand(self.rows, -1), pos, self.backend, last_only=last_only)[0]

    @torch.no_grad()
    def generate(self, first_logits: Tensor, max_new: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy decode from the logits of the last prefilled token; returns new tokens (stop token included)."""
        out: list[int] = []
        logits = first_logits
        for _ in range(max_new):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stop_ids or len(out) == max_new:
                break
            logits = self.forward([tok])[-1]
        return out


__all__ = ["AttnContext", "AttnEvent", "AttentionBackend", "TorchAttention", "Transformer", "Session", "fuse_projections",
           "RMSNorm", "rope_inv_freq", "apply_rope", "attention_probs"]

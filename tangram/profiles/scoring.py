"""Scoring methods as observers of the reference backend, and the token-selection policies of the serving modes.

Scorers are observers of :class:`tangram.engine.model.TorchAttention`: on every
prefill chunk they score that chunk's new keys per KV head ([B, Hkv, T]) from
the layer's queries and cache, exactly when an engine would compress the chunk.
The formulas (one per method, with sources and parameters) live in
:mod:`tangram.kernels.scoring`, which the engine's compression path calls too;
this module turns an :class:`AttnEvent` into that module's chunk layout.

``make_scorer(method, num_layers, window)`` is the registry every caller uses
(profiles CLI, fidelity harness). KVzip is the one scorer that needs more than
an observer: after a chunk is prefilled it runs a second forward (the repeat
prompt plus the chunk) through the session, so its callers invoke
:meth:`ChunkScorer.after_chunk` after every chunk (a no-op for the others).
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from tangram.budgets import METHODS, SCOPES
from tangram.engine.model import AttnEvent
from tangram.errors import ConfigError
from tangram.kernels.scoring import (LOG2E, ScoreParams, chunk_scores, method_spec, rank_desc, scope_keep_mask,
                                     scope_ranks,
                                     snapkv_window)


class ChunkScorer:
    """Collects per-layer scores of the newest prefill chunk's keys (one method of :mod:`tangram.kernels.scoring`)."""

    def __init__(self, num_layers: int, method: str = "ada-snapkv", params: ScoreParams | None = None,
                 min_tokens: int = 2):
        self.spec = method_spec(method)
        self.name = method
        self.params = params or ScoreParams()
        self.window = self.params.window
        self.min_tokens = min_tokens
        self.scores: list[torch.Tensor | None] = [None] * num_layers
        self.enabled = True
        self.seconds = 0.0  # wall time spent scoring (calibration reports it per method)
        self.cpu_seconds = 0.0  # process CPU time spent scoring (insensitive to other jobs on the cores)

    def __call__(self, ev: AttnEvent) -> None:
        T = ev.q.shape[2]
        if not self.enabled or T < self.min_tokens:
            self.scores[ev.layer] = None  # decode steps: tokens are kept, nothing to score
            return
        t, c = time.perf_counter(), time.process_time()
        self.scores[ev.layer] = self.score(ev).float()
        self.seconds += time.perf_counter() - t
        self.cpu_seconds += time.process_time() - c

    def after_chunk(self, sess, tokens: list[int]) -> None:
        """Called by the chunk loop after each prefill chunk's forward; only KVzip uses it."""

    @property
    def extra_forward(self) -> bool:
        """Whether :meth:`after_chunk` runs a forward of its own (the caller then switches other observers off)."""
        return type(self).after_chunk is not ChunkScorer.after_chunk

    def clone(self) -> "ChunkScorer":
        """The same method and parameters with no pending scores, continuing this scorer's chunk history (KVzip
        prompts a later chunk with the previous chunk's tail): a batch forked from a shared first chunk."""
        new = copy.copy(self)
        new.scores = [None] * len(self.scores)
        new.seconds = new.cpu_seconds = 0.0
        return new

    def take(self) -> torch.Tensor:
        """Scores of the last chunk for all layers [L, B, Hkv, T]."""
        if any(s is None for s in self.scores):
            raise RuntimeError("no prefill chunk was scored")
        out = torch.stack(self.scores)  # type: ignore[arg-type]
        self.scores = [None] * len(self.scores)
        return out

    def _lse_rows(self, T: int) -> int:
        rows = self.spec.lse_rows
        return snapkv_window(self.params.window, T) if rows == "window" else 1 if rows == "last" else 0

    def score(self, ev: AttnEvent) -> torch.Tensor:
        B, Hkv = ev.k.shape[:2]
        T = ev.q.shape[2]
        r = self._lse_rows(T)
        out = []
        for b in range(B):
            q = ev.q[b].transpose(0, 1)  # [T, Hq, D]
            k = ev.k[b, :, ev.new_start:].transpose(0, 1)
            v = ev.v[b, :, ev.new_start:].transpose(0, 1)
            lse2 = event_lse2(ev, b, r) if r else None
            out.append(chunk_scores(self.name, q, k, v, lse2, pos0=int(ev.q_pos[0]), inv_freq=ev.inv_freq,
                                    params=self.params, scale=ev.scale))
        return torch.stack(out)


def event_lse2(ev: AttnEvent, b: int, rows: int) -> torch.Tensor:
    """Base-2 log-sum-exp [Hq, T] of the chunk's last ``rows`` queries over every key they attend (kept cache +
    the chunk, causal), as the engine's prefill kernel writes it; the other rows are +inf (never read)."""
    Hq, T = ev.q.shape[1], ev.q.shape[2]
    g = Hq // ev.k.shape[1]
    qr = ev.q[b, :, T - rows:].float()  # [Hq, r, D]
    s = torch.einsum("hrd,hnd->hrn", qr, ev.k[b].float().repeat_interleave(g, dim=0)) * ev.scale
    ok = ev.keep[b].repeat_interleave(g, dim=0)[:, None, :] & (ev.k_pos[None, None, :] <= ev.q_pos[T - rows:][None, :, None])
    lse = torch.full((Hq, T), math.inf)
    lse[:, T - rows:] = torch.logsumexp(s.masked_fill(~ok, -math.inf), dim=-1) * LOG2E
    return lse


_SCORE_BLOCK = 1 << 20  # elements of one block of KVzip's repeat-query scores (4 MB in float32)


class KVzipScorer(ChunkScorer):
    """KVzip (Kim et al. 2025; kvpress ``KVzipPress``): a key matters as much as the model needs it to repeat its
    context. After a chunk is prefilled, ``after_chunk`` feeds "\\n\\nRepeat the previous context exactly." (later
    chunks: "...the part of the previous context exactly, starting with" + the previous chunk's last 8 tokens),
    the chat template's end of turn and the chunk's tokens again; per layer, each repeat query's softmax over the
    sink keys, the chunk's keys and the repeat's own keys (causal) is taken, and a chunk key's score is its largest
    probability over the repeat queries and the KV head's query heads. The repeat's KV is then dropped. It reads
    nothing after the chunk (the cache holds only the prefix and the chunk), but costs a second forward of about
    c + 20 tokens per chunk of c, so it is a calibration/fidelity scorer; the engine's fused per-layer compression
    cannot run it. Sequence positions < n_sink are kept (kvpress sets their score to 1)."""

    def __init__(self, num_layers: int, tokenizer, params: ScoreParams | None = None, min_tokens: int = 2,
                 tail: int = 8):
        super().__init__(num_layers, "kvzip", params, min_tokens)
        if tokenizer is None:
            raise ConfigError("kvzip scoring needs the model's tokenizer (make_scorer(..., tokenizer=tok))")
        self.tok, self.tail = tokenizer, tail
        text = tokenizer.render_chat([{"role": "user", "content": "\x00"}], add_generation_prompt=True)
        self.suffix = tokenizer.encode(text.split("\x00", 1)[1]) if "\x00" in text else tokenizer.encode("\n")
        self.first_prompt = tokenizer.encode("\n\nRepeat the previous context exactly.")
        self.next_prompt = tokenizer.encode("\n\nRepeat the part of the previous context exactly, starting with")
        self._repeat = False
        self._chunk: tuple[int, int] = (0, 0)
        self._prev: list[int] = []

    def __call__(self, ev: AttnEvent) -> None:
        if not self.enabled:
            self.scores[ev.layer] = None
            return
        if not self._repeat:  # the chunk's own forward: only note where its keys are
            T = ev.q.shape[2]
            self.scores[ev.layer] = None
            if T >= self.min_tokens:
                self._chunk = (ev.new_start, ev.k.shape[2])
            return
        t, c = time.perf_counter(), time.process_time()
        self.scores[ev.layer] = self._reconstruction_scores(ev)
        self.seconds += time.perf_counter() - t
        self.cpu_seconds += time.process_time() - c

    def _reconstruction_scores(self, ev: AttnEvent) -> torch.Tensor:
        """Each chunk key's largest repeat-query probability. The masking, softmax and max run a block of repeat
        queries at a time (about ``_SCORE_BLOCK`` elements, reused from block to block, instead of three more
        [B, Hq, R, n] tensors per layer); the score GEMM runs whole (its bits depend on its row count), each
        softmax row is computed as when whole and the max over blocks is exact: the scores equal the unblocked
        computation's bit for bit."""
        cs, ce = self._chunk
        B, H, N, D = ev.k.shape
        Hq, R = ev.q.shape[1], ev.q.shape[2]
        g, c = Hq // H, ce - cs
        sink = min(self.params.n_sink, cs)
        idx = torch.cat([torch.arange(sink), torch.arange(cs, ce), torch.arange(ev.new_start, N)])
        n, off = idx.numel(), sink + c
        Ks = ev.k[:, :, idx].float().repeat_interleave(g, dim=1)  # [B, Hq, n, D]
        q = ev.q.float()
        drop = ~ev.keep[:, :, idx].repeat_interleave(g, dim=1)[:, :, None, :]  # [B, Hq, 1, n]
        drop = drop if bool(drop.any()) else None  # a first chunk has evicted nothing: the fill would change nothing
        rep = torch.arange(R)
        step = max(1, _SCORE_BLOCK // max(1, B * Hq * n))
        best = None
        S = torch.einsum("bhrd,bhnd->bhrn", q, Ks)  # whole: a GEMM's bits depend on its row count
        for a in range(0, R, step):
            s = S[:, :, a:a + step] * ev.scale
            if drop is not None:
                s.masked_fill_(drop, -math.inf)
            # the repeat is causal: repeat query a + i sees repeat keys up to a + i (every row of the block sees
            # those up to a, so the fill starts after a)
            s[..., off + a + 1:].masked_fill_(rep[None, a + 1:] > rep[a:a + step, None], -math.inf)
            blk = torch.softmax(s, dim=-1)[..., sink:off].amax(dim=2)  # [B, Hq, c]
            best = blk if best is None else torch.maximum(best, blk)
        sc = best.view(B, H, g, c).amax(dim=2)
        pos = ev.k_pos[cs:ce]
        return sc.masked_fill((pos < self.params.n_sink)[None, None, :], math.inf)

    def after_chunk(self, sess, tokens: list[int]) -> None:
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        n0 = sess.length
        if n0 != self._chunk[1]:
            raise RuntimeError("kvzip: after_chunk must follow the chunk's forward")
        first = self._chunk[0] == 0
        prompt = self.first_prompt if first or not self._prev else self.next_prompt + self._prev[-self.tail:]
        self._repeat = True
        t, c, inner, inner_cpu = time.perf_counter(), time.process_time(), self.seconds, self.cpu_seconds
        try:
            sess.forward(prompt + self.suffix + list(tokens), last_only=True)
        finally:
            self._repeat = False
            sess.backend.truncate(n0)
        self.seconds = inner + time.perf_counter() - t  # the repeat forward is this scorer's cost
        self.cpu_seconds = inner_cpu + time.process_time() - c
        self._prev = list(tokens)


def make_scorer(method: str, num_layers: int, window: int | None = None, *, params: ScoreParams | None = None,
                tokenizer=None) -> ChunkScorer:
    """The scorer registry: ``method`` in :data:`METHODS`; ``window`` overrides the SnapKV observation window."""
    if method not in METHODS:
        raise ConfigError(f"unknown scoring method {method!r}; choose from {', '.join(METHODS)}")
    params = params or ScoreParams()
    if window is not None:
        params = ScoreParams(**{**params.__dict__, "window": int(window)})
    if method == "kvzip":
        return KVzipScorer(num_layers, tokenizer, params)
    return ChunkScorer(num_layers, method, params)


# --------------------------------------------------------------------------- selection policies


def _rank_desc(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return rank_desc(scores, dim)


def budget_tokens(ratio, n: int) -> np.ndarray:
    """Tokens a head keeps of ``n`` new ones at ratio B: ceil(B * n), at least 1, at most n."""
    return np.clip(np.ceil(np.asarray(ratio, dtype=np.float64) * n), 1, n).astype(np.int64)


def per_head_topk_mask(scores: torch.Tensor, budgets: np.ndarray | torch.Tensor | float,
                       ranks: dict | None = None) -> torch.Tensor:
    """Tangram/uniform selection: head (l, h) keeps its top-ceil(B[l,h] * T) keys. scores [..., H, T];
    ``ranks``: a memo of :func:`scope_ranks` for scores [L, H, T] (their per-head ranks are these)."""
    T = scores.shape[-1]
    k = torch.as_tensor(budget_tokens(np.broadcast_to(np.asarray(budgets, dtype=np.float64), scores.shape[:-1]), T),
                        device=scores.device)
    rk = scope_ranks(scores, "uniform", ranks) if ranks is not None else _rank_desc(scores)
    return rk < k[..., None]


def global_topk_mask(scores: torch.Tensor, rho: float) -> torch.Tensor:
    """Ada-KV / dynamic selection: per layer, top-ceil(rho * H * T) over all heads' keys at once. scores [..., H, T]."""
    H, T = scores.shape[-2:]
    k = int(min(H * T, max(1, math.ceil(rho * H * T))))
    flat = scores.reshape(*scores.shape[:-2], H * T)
    return (_rank_desc(flat) < k).reshape(scores.shape)


__all__ = ["METHODS", "SCOPES", "ScoreParams", "ChunkScorer", "KVzipScorer", "make_scorer", "event_lse2",
           "per_head_topk_mask", "global_topk_mask", "scope_keep_mask", "budget_tokens"]

"""Accuracy harness: every serving mode on the same generated samples, through the real model, sharing what is exact.

What one sample costs, and what is shared (``evaluate_sample``):

1. The first prefill chunk (``chunk`` tokens, the engine's chunk size) runs once, uncompressed, with every
   scorer attached as an observer: no mode has compressed anything yet, so its keys, values, logits and every
   scorer's scores are those of every mode. With the report's context lengths the whole first-turn prompt is
   one chunk, so the whole prefill is shared.
2. Each mode then selects its kept tokens from its scorer's scores of that chunk (a mask; evicted tokens stay
   in memory but are masked out, exactly as :class:`tangram.engine.model.TorchAttention` does).
3. Everything after that depends on the mode and is recomputed per mode, with the modes as batch rows (rows of
   one scorer share a batch, ``batch`` rows at a time): later prompt chunks (they attend to a compressed
   cache, so their keys/values and scores differ), follow-up turns (their question chunk is compressed too,
   as the engine compresses every prefill chunk), the answer tokens and the KL continuation. Decoded tokens
   are never compressed.

Answers are scored by teacher forcing: the gold answer tokens are fed after the prompt and the row is correct
when the greedy (argmax) prediction at every answer position equals the gold token and the prediction after
the answer does not continue the word (a digit or letter). That is exactly "greedy decoding starts with the
gold tokens, then a word boundary"; it differs from free decoding only when greedy emits the same text in a
non-canonical tokenization (digits are one token each in SmolLM2's vocabulary; the report counts how often
free decoding of the full cache disagrees). The first answer token of a one-chunk prompt comes from the
prefill logits, before compression, so it is the full cache's for every mode (as in the engine).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tangram.budgets import BudgetProfile, calibrate
from tangram.engine.model import Session, TorchAttention
from tangram.errors import ConfigError
from tangram.profiles.scoring import budget_tokens, make_scorer, per_head_topk_mask, scope_keep_mask
from tangram.profiles.tasks import task_version

SCOPES = ("per-layer", "cross-layer", "uniform")
POLICIES = ("full", "uniform", "dynamic", "tangram")
_MASK_BUDGET = 1 << 26  # elements of one attention-score block (256 MB in float32)


# --------------------------------------------------------------------------- selection at a budget scope


def crosslayer_topk_mask(scores: torch.Tensor, rho: float) -> torch.Tensor:
    """Cross-layer dynamic selection: top-ceil(rho * L * H * T) over every layer's and head's keys. [L, H, T]."""
    n = scores.numel()
    k = int(min(n, max(1, math.ceil(rho * n - 1e-9))))
    order = torch.argsort(scores.reshape(-1), descending=True, stable=True)
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    mask[order[:k]] = True
    return mask.reshape(scores.shape)


def scope_mask(scores: torch.Tensor, rho: float, scope: str, method: str = "ada-snapkv",
               ranks: dict | None = None) -> torch.Tensor:
    """A compression method's own (dynamic) selection at a budget scope; scores [L, H, T]. The engine's own
    selection (``scope_keep_mask``): per-layer, each layer keeps its target share (rho; PyramidKV's schedule for
    ``pyramidkv``) spread over its heads by score (Ada-KV); cross-layer, one top-k over everything; uniform, each
    head its layer's target. (Before 2026-11-24 this evaluation gave every layer rho, so PyramidKV's dynamic and
    uniform rows were SnapKV's.)"""
    if scope not in SCOPES:
        raise ConfigError(f"unknown budget scope {scope!r}; choose from {', '.join(SCOPES)}")
    return scope_keep_mask(scores, rho, scope, method, ranks)


@dataclass
class Mode:
    """One row of the evaluation: a selection policy, its scorer and scope, at a target ratio."""

    policy: str  # full | uniform | dynamic | tangram
    scorer: str | None = None
    scope: str | None = None
    rho: float = 1.0  # the target ratio (the table column)
    alpha: float | None = None  # tangram: safety margin of eq. 5
    budgets: np.ndarray | None = field(default=None, repr=False)  # tangram: B(alpha) [L, H]
    match: np.ndarray | None = field(default=None, repr=False)  # control: keep as many tokens as these budgets
    match_label: str | None = None  # e.g. "tangram a=2" (the row this control is memory-matched to)
    profile: str | None = None

    @property
    def key(self) -> str:
        a = "" if self.alpha is None else f"a={self.alpha:g}"
        m = "" if self.match_label is None else f"kv={self.match_label}"
        return "|".join([self.policy, self.scorer or "-", self.scope or "-", f"{self.rho:g}", a, m])

    def keep_ratio(self, L: int, H: int, T: int) -> float:
        """Share of a T-token chunk's head-tokens the mode keeps (exact for static budgets and controls)."""
        if self.policy == "full":
            return 1.0
        if self.policy == "tangram":
            return float(budget_tokens(self.budgets, T).sum()) / (L * H * T)
        if self.match is not None:
            return float(budget_tokens(self.match, T).sum()) / (L * H * T)
        return self.rho

    def select(self, scores: torch.Tensor, ranks: dict | None = None) -> torch.Tensor | None:
        """Keep mask [L, H, T] of one chunk from its scores [L, H, T]; None keeps everything. ``ranks``: a memo
        of these scores' ranks shared by the modes that select from them (``scope_ranks``)."""
        if self.policy == "full":
            return None
        if self.policy == "tangram":
            return per_head_topk_mask(scores, self.budgets, ranks)
        L, H, T = scores.shape
        r = self.keep_ratio(L, H, T)
        if self.policy == "uniform":
            return scope_mask(scores, r, "uniform", self.scorer, ranks)
        return scope_mask(scores, r, self.scope, self.scorer, ranks)


# --------------------------------------------------------------------------- profiles


def profile_scope(prof: BudgetProfile, path: str | Path | None = None) -> str:
    """A profile's budget scope: its provenance's ``scope``, else a scope named in its file name, else per-layer
    (the profiles shipped before scopes existed are per-layer)."""
    sc = prof.provenance.get("scope") or prof.provenance.get("budget_scope")
    if sc:
        return str(sc).replace("_", "-")
    name = Path(path).name if path else ""
    for s in ("cross-layer", "per-layer", "crosslayer", "perlayer"):
        if s in name:
            return {"crosslayer": "cross-layer", "perlayer": "per-layer"}.get(s, s)
    return "per-layer"


class ProfileStore:
    """Budget profiles found in folders, indexed by (method, scope, rho); scope from provenance, else per-layer."""

    def __init__(self, model: str, dirs: list[str | Path]):
        self.model, self.dirs = model, [Path(d) for d in dirs]
        self.index: dict[tuple[str, str, float], tuple[str, BudgetProfile]] = {}
        for d in self.dirs:
            if not d.is_dir():
                continue
            for p in sorted(list(d.glob("*.npz")) + list(d.glob("*.json"))):
                try:
                    prof = BudgetProfile.load(p)
                except Exception:  # noqa: BLE001 - other data files live in the same folder
                    continue
                if prof.model != model:
                    continue
                key = (prof.method, profile_scope(prof, p), round(float(prof.rho), 6))
                self.index.setdefault(key, (str(p), prof))

    def get(self, method: str, scope: str, rho: float) -> tuple[str, BudgetProfile] | None:
        return self.index.get((method, scope, round(float(rho), 6)))


def build_modes(L: int, H: int, scorers: list[str], scopes: list[str], rhos: list[float], alphas: list[float],
                profiles: ProfileStore, matched: bool = True) -> tuple[list[Mode], list[str]]:
    """The full cache, then per scorer and ratio: uniform, and per non-uniform scope the method's own dynamic
    selection, tangram's static budgets per alpha, and (``matched``) the dynamic and uniform selections at
    tangram's kept share. Returns (modes, notes about profiles that were not found)."""
    modes, notes = [Mode("full")], []
    for s in scorers:
        for r in rhos:
            if "uniform" in scopes:
                modes.append(Mode("uniform", s, "uniform", r))
            for scope in (x for x in scopes if x != "uniform"):
                if s == "pyramidkv" and scope == "cross-layer":  # its schedule fixes each layer's budget
                    if r == rhos[0]:
                        notes.append(f"{s} {scope}: skipped (PyramidKV's schedule fixes each layer's budget; "
                                     "tangram.budgets.check_method_scope)")
                    continue
                modes.append(Mode("dynamic", s, scope, r))
                found = profiles.get(s, scope, r)
                if found is None:
                    notes.append(f"no {s} {scope} profile at rho={r:g}: tangram rows skipped")
                    continue
                path, prof = found
                prof.check_model(L, H, profiles.model)
                for a in alphas:
                    B = prof.with_alpha(a).B
                    modes.append(Mode("tangram", s, scope, r, alpha=a, budgets=B, profile=path))
                    if matched and a > 0:  # at alpha = 0 tangram keeps about rho: dynamic@rho is its control
                        lab = f"tangram a={a:g}"
                        modes.append(Mode("dynamic", s, scope, r, match=B, match_label=lab))
                        if "uniform" in scopes:
                            modes.append(Mode("uniform", s, "uniform", r, match=B, match_label=f"{lab} {scope}"))
    return modes, notes


# --------------------------------------------------------------------------- backend


class EvalAttention(TorchAttention):
    """:class:`TorchAttention` with the same cache and keep-mask semantics and faster CPU attention: the first
    chunk of an empty cache uses causal SDPA (no mask tensor), later calls an additive mask in query blocks, both
    with SDPA's grouped-query path instead of repeating K/V. Tested equal to TorchAttention."""

    kv_dtype: torch.dtype | None = None  # set: K/V cached, and attention computed, in this dtype (see NUMERICS)

    def __call__(self, layer_idx, q, k, v, ctx):
        if self.kv_dtype is not None and k.dtype != self.kv_dtype:
            # exact (bfloat16 -> float32): the cache holds the model's values in a wider container, so every
            # observer (they all upcast before scoring) sees the same numbers
            k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
        return super().__call__(layer_idx, q, k, v, ctx)

    @classmethod
    def fork(cls, base: TorchAttention, rows: int, observers=None) -> "EvalAttention":
        """``rows`` copies of a batch-1 cache (K/V shared as expanded views until the next append)."""
        nb = cls(base.cfg, observers=observers)
        nb.kv_dtype = getattr(base, "kv_dtype", None)
        for l in range(base.cfg.num_layers):
            if base.k[l] is None:
                continue
            nb.k[l] = base.k[l].expand(rows, -1, -1, -1)
            nb.v[l] = base.v[l].expand(rows, -1, -1, -1)
            nb.keep[l] = base.keep[l].expand(rows, -1, -1).clone()
        nb.pos = None if base.pos is None else base.pos.clone()
        return nb

    @classmethod
    def take(cls, base: TorchAttention, rows: list[int]) -> "EvalAttention":
        """A cache of the given rows of ``base`` (a batch-1 base: expanded views until the next append)."""
        B = base.k[0].shape[0] if base.k[0] is not None else 1
        if B == 1:
            return cls.fork(base, len(rows))
        nb = cls(base.cfg)
        nb.kv_dtype = getattr(base, "kv_dtype", None)
        idx = torch.as_tensor(rows, dtype=torch.long)
        for l in range(base.cfg.num_layers):
            if base.k[l] is None:
                continue
            nb.k[l] = base.k[l].index_select(0, idx)
            nb.v[l] = base.v[l].index_select(0, idx)
            nb.keep[l] = base.keep[l].index_select(0, idx)
        nb.pos = None if base.pos is None else base.pos.clone()
        return nb

    def _attend(self, q, K, V, keep, ctx, scale):
        """Attention in the cache's dtype (the query's when they are equal), rounded to the query's dtype."""
        if q.dtype != K.dtype:
            return self._attend(q.to(K.dtype), K, V, keep, ctx, scale).to(q.dtype)
        B, Hkv, N, _ = K.shape
        T = q.shape[2]
        if N == T:  # empty cache before this call: plain causal attention over the new tokens
            return F.scaled_dot_product_attention(q, K, V, is_causal=True, scale=scale, enable_gqa=True)
        g = q.shape[1] // Hkv
        Hq = q.shape[1]
        # nothing evicted (KVzip's repeat over a first chunk, the rows of the full cache): the mask is the causal one
        # of every row and head, passed once and broadcast (the same values added: the same output bit for bit)
        causal = bool(keep.all())
        step = max(1, _MASK_BUDGET // max(1, (1 if causal else B * Hq) * N))
        outs = []
        for a in range(0, T, step):
            qp = ctx.input_pos[a:a + step]
            allowed = self.pos[None, None, None, :] <= qp[None, None, :, None]
            if not causal:
                allowed = keep[:, :, None, :] & allowed
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
            if not causal:
                bias = bias.repeat_interleave(g, dim=1)
            outs.append(F.scaled_dot_product_attention(q[:, :, a:a + step], K, V, attn_mask=bias, scale=scale,
                                                       enable_gqa=True))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary (last dim), first index on ties. bfloat16 logits are compared as float32 (exact
    conversion, the same argmax): torch's bfloat16 argmax is about 3x slower on this CPU."""
    return (logits.float() if logits.dtype == torch.bfloat16 else logits).argmax(-1)


def _forward(model, backend: TorchAttention, ids: list[int], rows: int, last_only: bool) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)[None].expand(rows, -1)
    n0 = backend.length
    pos = torch.arange(n0, n0 + len(ids))
    return model(t, pos, backend, last_only=last_only)  # [rows, T or 1, V]


def word_continuation_mask(tok, vocab: int) -> torch.Tensor:
    """[V] bool: tokens whose text starts with a letter or digit (they would extend the answer's last word)."""
    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(min(vocab, tok.vocab_size)):
        s = tok.decode([i])
        out[i] = bool(s) and s[0].isalnum()
    return out


@dataclass
class SampleResult:
    correct: np.ndarray  # [modes, turns] bool
    first_wrong: np.ndarray  # [modes, turns] index of the first wrong answer position (-1: none)
    kept: np.ndarray  # [modes] kept share of the compressed prompt tokens (first turn)
    kl: np.ndarray | None = None  # [modes] mean KL(full || mode) over the continuation
    top1: np.ndarray | None = None  # [modes] share of continuation positions whose argmax equals full's
    free: dict | None = None  # full cache, first turn: free greedy decoding checks
    seconds: float = 0.0


def _events(turns: list[tuple[list[int], list[int] | None]], chunk: int, continuation: list[int] | None
            ) -> list[tuple]:
    """What every row goes through after the shared first chunk, in order: ("chunk", ids, counted) prompt
    chunks (counted: the first turn's, whose kept share is reported), ("answer", turn, ids), ("continuation",)."""
    prompt0 = turns[0][0]
    ev: list[tuple] = [("chunk", prompt0[a:a + chunk], True) for a in range(chunk, len(prompt0), chunk)]
    for t, (prompt, ans) in enumerate(turns):
        if t > 0:
            ev += [("chunk", prompt[a:a + chunk], False) for a in range(0, len(prompt), chunk)]
        if ans is not None:
            ev.append(("answer", t, ans))
    if continuation is not None:
        ev.append(("continuation",))
    return ev


@dataclass
class _Rows:
    """A batch of distinct cache states: row r is shared by the modes ``members[r]``; ``lg`` their last logits."""

    cache: EvalAttention
    members: list[list[int]]
    lg: torch.Tensor  # [R, V]


class _SharedEval:
    """One sample through every mode, one batch row per distinct cache state (see :func:`evaluate_sample`)."""

    def __init__(self, model, modes, turns, chunk, batch, eos, continues, continuation, free_check, base_sc,
                 full_idx):
        self.model, self.modes, self.turns, self.batch, self.eos = model, modes, turns, batch, eos
        self.continues, self.continuation, self.free_check = continues, continuation, free_check
        self.base_sc, self.full_idx = base_sc, full_idx
        L, H = model.cfg.num_layers, model.cfg.num_kv_heads
        self.L, self.H = L, H
        M, nT = len(modes), len(turns)
        self.correct = np.zeros((M, nT), dtype=bool)
        self.first_wrong = np.full((M, nT), -1, dtype=np.int64)
        self.kept_tok = np.zeros(M)
        self.kl = np.zeros(M) if continuation is not None else None
        self.top1 = np.ones(M) if continuation is not None else None
        self.free = None
        self.full_logp = self.full_p = None
        self.events = _events(turns, chunk, continuation)

    # ------------------------------------------------------------------ selection
    def split(self, rows: _Rows, scores: dict[str, torch.Tensor], T: int, count: bool
              ) -> list[tuple[int, torch.Tensor, list[int]]]:
        """Each member's keep mask of the newest chunk from its scorer's scores; members of a row whose masks are
        equal stay together. Returns children (parent row, mask [L, H, T], members), the full cache's first."""
        L, H = self.L, self.H
        out: list[tuple[int, torch.Tensor, list[int]]] = []
        for r, members in enumerate(rows.members):
            by: dict[bytes, int] = {}
            ranks: dict[str, dict] = {}  # per scorer: its scores' ranks, shared by every share and budget
            for i in members:
                m = self.modes[i]
                sc = scores.get(m.scorer) if m.scorer else None
                mk = None if sc is None else m.select(sc[:, r if sc.shape[1] > 1 else 0],
                                                      ranks.setdefault(m.scorer, {}))
                if mk is None:
                    mk = torch.ones(L, H, T, dtype=torch.bool)
                key = np.packbits(mk.numpy()).tobytes()
                if key not in by:
                    by[key] = len(out)
                    out.append((r, mk, []))
                out[by[key]][2].append(i)
                if count:
                    self.kept_tok[i] += float(mk.sum()) / (L * H)
        return sorted(out, key=lambda c: (self.full_idx not in c[2], self._scorers_of(c[2]), c[2][0]))

    def batches(self, children: list) -> list[list]:
        """Children in batches of at most ``batch`` rows, never mixing rows that use different scorers (a batch's
        later chunks are scored, and KVzip's repeat forward run, for every row of it)."""
        out, a = [], 0
        while a < len(children):
            key = self._scorers_of(children[a][2])
            b = a
            while b < len(children) and b - a < self.batch and self._scorers_of(children[b][2]) == key:
                b += 1
            out.append(children[a:b])
            a = b
        return out

    def _scorers_of(self, members: list[int]) -> tuple[str, ...]:
        return tuple(sorted({self.modes[i].scorer for i in members if self.modes[i].scorer}))

    def materialize(self, parent: EvalAttention, lg: torch.Tensor, children, start: int) -> _Rows:
        """A batch of child rows: each a copy of its parent row with its mask applied to tokens [start, ...)."""
        idx = [c[0] for c in children]
        cache = EvalAttention.take(parent, idx)
        mk = torch.stack([c[1] for c in children], dim=1)  # [L, R, H, T]
        for l in range(self.L):
            cache.evict(l, start, mk[l])
        return _Rows(cache, [list(c[2]) for c in children], lg[idx])

    # ------------------------------------------------------------------ traversal
    def descend(self, rows: _Rows, e0: int, scorers: dict) -> None:
        """Run the events from ``e0`` on a batch; a chunk whose selections split a row continues in child
        batches of at most ``batch`` rows. ``scorers``: this branch's scorer clones (KVzip keeps chunk history)."""
        for e in range(e0, len(self.events)):
            ev = self.events[e]
            if ev[0] == "answer":
                self.answer(rows, ev[1], ev[2])
            elif ev[0] == "continuation":
                self.continuation_kl(rows)
            else:
                piece, count = ev[1], ev[2]
                br, R = rows.cache, len(rows.members)
                need = sorted({self.modes[i].scorer for ms in rows.members for i in ms if self.modes[i].scorer})
                active = [scorers[s] for s in need if len(piece) >= scorers[s].min_tokens]
                for sc in active:
                    sc.enabled = True
                br.observers = active
                start = br.length
                rows.lg = _forward(self.model, br, piece, R, True)[:, -1]
                scores = {sc.name: sc.take() for sc in active if not sc.extra_forward}
                for sc in active:  # KVzip's repeat forward, with the other scorers off
                    if sc.extra_forward:
                        br.observers = [sc]
                        sc.after_chunk(Session(self.model, br, R), piece)
                        scores[sc.name] = sc.take()
                br.observers = []
                children = self.split(rows, scores, len(piece), count)
                if len(children) == R:  # no row split: apply the masks in place
                    children.sort(key=lambda c: c[0])
                    mk = torch.stack([c[1] for c in children], dim=1)  # [L, R, H, T]
                    for l in range(self.L):
                        br.evict(l, start, mk[l])
                    continue
                for part in self.batches(children):
                    sub = self.materialize(br, rows.lg, part, start)
                    self.descend(sub, e + 1, {s: sc.clone() for s, sc in scorers.items()})
                return

    def answer(self, rows: _Rows, t: int, ans: list[int]) -> None:
        br, R = rows.cache, len(rows.members)
        if self.free_check is not None and t == 0:
            for r, ms in enumerate(rows.members):
                if self.full_idx in ms:
                    one = EvalAttention.take(br, [r])
                    self.free = _free_decode(self.model, one, rows.lg[r:r + 1], ans, self.free_check, self.eos)
        feed = list(ans) + ([self.eos] if t < len(self.turns) - 1 and self.eos is not None else [])
        lgA = _forward(self.model, br, feed, R, False)  # [R, len(feed), V]
        n = len(ans)
        preds = torch.cat([greedy(rows.lg)[:, None], greedy(lgA[:, :n])], dim=1)  # [R, n + 1]
        hit = preds[:, :n] == torch.as_tensor(ans)[None]
        ok = hit.all(dim=1)
        if self.continues is not None:
            ok &= ~self.continues[preds[:, n]]
        wrong = torch.where(hit.all(dim=1), torch.full((R,), n), (~hit).int().argmax(dim=1))
        for r, ms in enumerate(rows.members):
            self.correct[ms, t] = bool(ok[r])
            self.first_wrong[ms, t] = -1 if bool(ok[r]) else int(wrong[r])
        rows.lg = lgA[:, -1]

    def continuation_kl(self, rows: _Rows) -> None:
        R = len(rows.members)
        lp = torch.log_softmax(_forward(self.model, rows.cache, self.continuation, R, False).float(), dim=-1)
        if self.full_logp is None:
            ref = [r for r, ms in enumerate(rows.members) if self.full_idx in ms]
            if not ref:
                raise RuntimeError("the full cache must be evaluated first")
            self.full_logp = lp[ref[0]].clone()
            self.full_p = self.full_logp.exp()
        agree = (lp.argmax(-1) == self.full_logp.argmax(-1)[None]).float()
        # sum_v p (log p - log q), in place on lp (a [R, K, V] float32 block: no two more temporaries of its size)
        d = torch.sub(self.full_logp[None], lp, out=lp).mul_(self.full_p[None]).sum(-1)  # [R, K]
        for r, ms in enumerate(rows.members):
            self.kl[ms] = float(d[r].mean())
            self.top1[ms] = float(agree[r].mean())


@torch.no_grad()
def first_chunk(model, modes: list[Mode], c0: list[int], window: int | None, tokenizer=None):
    """The first prefill chunk, run once and uncompressed, with every scorer the modes use as an observer (KVzip:
    its repeat forward alone, the other scorers off). Returns (scorers by name, the backend holding the chunk's
    cache, the last position's logits [1, V], each scorer's scores [L, 1, H, T])."""
    L = model.cfg.num_layers
    base_sc = {s: make_scorer(s, L, window, tokenizer=tokenizer) for s in sorted({m.scorer for m in modes
                                                                                  if m.scorer})}
    base = EvalAttention(model.cfg, observers=list(base_sc.values()))
    base.kv_dtype = getattr(model, "kv_dtype", None)  # numerics_model: bfloat16-f32compute caches in float32
    logits0 = _forward(model, base, c0, 1, True)[:, -1]
    scores0 = {s: sc.take() for s, sc in base_sc.items() if not sc.extra_forward}
    for s, sc in base_sc.items():
        if sc.extra_forward:
            base.observers = [sc]
            sc.after_chunk(Session(model, base), c0)
            scores0[s] = sc.take()
    base.observers = []
    return base_sc, base, logits0, scores0


@torch.no_grad()
def evaluate_sample(model, modes: list[Mode], turns: list[tuple[list[int], list[int] | None]], *, chunk: int,
                    batch: int = 16, window: int | None = None, eos: int | None = None,
                    continues: torch.Tensor | None = None, continuation: list[int] | None = None,
                    free_check: tuple[int, callable] | None = None, tokenizer=None) -> SampleResult:
    """All modes on one sample. ``turns``: (prompt ids, gold answer ids) per turn (answer None for a KL text);
    ``continuation``: ids scored by KL after the last prompt. ``free_check``: (max new tokens, decode fn) to also
    decode the full cache's first answer freely. ``tokenizer``: needed by KVzip's reconstruction prompt.

    Rows are cache states, not modes: every scorer scores a chunk once per state, every mode selects from its
    scorer's scores, and modes whose selections are equal (the same keep mask bit for bit, e.g. a scorer's
    dynamic and uniform rows when they coincide, two scorers with equal scores, a budget that keeps everything)
    share one row for everything after it; a later chunk whose selections differ splits the row. The verdicts,
    kept shares and KL equal those of one row per mode (``tests/accuracy_reference.py``)."""
    t0 = time.time()
    M, nT = len(modes), len(turns)
    full_idx = next((i for i, m in enumerate(modes) if m.policy == "full"), None)
    if full_idx is None and continuation is not None:
        raise ConfigError("KL needs the full cache among the modes (its distribution is the reference)")
    prompt0 = turns[0][0]
    c0 = prompt0[:chunk]
    base_sc, base, logits0, scores0 = first_chunk(model, modes, c0, window, tokenizer)
    ev = _SharedEval(model, modes, turns, chunk, batch, eos, continues, continuation, free_check, base_sc, full_idx)
    if (nT == 1 and continuation is None and len(prompt0) <= chunk and turns[0][1]
            and int(greedy(logits0[0])) != turns[0][1][0]):
        # one chunk, one question: the first answer token comes from the shared prefill logits for every mode,
        # and it is wrong, so every mode is wrong (kept shares are not measured for this sample)
        if free_check is not None:
            ev.free = _free_decode(model, base, logits0, turns[0][1], free_check, eos)
        ev.first_wrong[:] = 0
        return SampleResult(ev.correct, ev.first_wrong, np.full(M, np.nan), None, None, ev.free, time.time() - t0)
    root = _Rows(base, [list(range(M))], logits0)
    children = ev.split(root, scores0, len(c0), True)
    # the full cache's row alone first: its outputs are the KL reference and its free decoding runs on it
    parts = [children[:1]] if children and full_idx in children[0][2] else []
    parts += ev.batches(children[len(parts):])
    for part in parts:
        sub = ev.materialize(base, logits0, part, 0)
        ev.descend(sub, 0, {s: sc.clone() for s, sc in base_sc.items()})
    kept = ev.kept_tok / max(len(prompt0), 1)
    return SampleResult(ev.correct, ev.first_wrong, kept, ev.kl, ev.top1, ev.free, time.time() - t0)


def _free_decode(model, br: TorchAttention, lg: torch.Tensor, ans: list[int], check, eos) -> dict:
    """Free greedy decoding of the full cache's answer (batch 1), rolled back afterwards."""
    max_new, decode = check
    n0 = br.length
    out, logits = [], lg[0]
    for _ in range(max_new):
        t = int(greedy(logits))
        out.append(t)
        if t == eos:
            break
        logits = _forward(model, br, [t], 1, True)[0, -1]
    br.truncate(n0)
    text = decode(out)
    gold = decode(ans).strip()
    s = text.strip()
    prefix = s.startswith(gold) and not (len(s) > len(gold) and s[len(gold)].isalnum())
    return {"text": text, "prefix": bool(prefix), "contains": gold.lower() in text.lower(),
            "tokens_equal": out[:len(ans)] == list(ans)}


# --------------------------------------------------------------------------- calibration of missing profiles


@torch.no_grad()
def retention_of_prompt(model, ids: list[int], needs: dict[str, set[str]], rhos: list[float], chunk: int,
                        window: int | None = None, tokenizer=None) -> dict[tuple[str, str, float], np.ndarray]:
    """Per-head retention [chunks, L, H] of each scorer's dynamic selection at each scope and ratio, on the
    uncompressed model (as ``tangram-profile`` calibrates); only chunks of the prompt's largest size count."""
    from tangram.profiles.retention import chunk_scores_multi
    L = model.cfg.num_layers
    names = sorted(needs)
    scored = chunk_scores_multi(model, ids, [make_scorer(s, L, window, tokenizer=tokenizer) for s in names], chunk,
                                backend=EvalAttention)
    chunks: dict[str, list[torch.Tensor]] = dict(zip(names, scored))
    out = {}
    for s, scopes in needs.items():
        full = max(x.shape[-1] for x in chunks[s])
        use = [x for x in chunks[s] if x.shape[-1] == full]
        for scope in scopes:
            for r in rhos:
                out[(s, scope, r)] = np.stack([scope_mask(x, r, scope, s).sum(-1).double().numpy() / full
                                               for x in use])
    return out


def write_profiles(samples: dict[tuple[str, str, float], list[np.ndarray]], alpha: float, model: str,
                   out_dir: Path, provenance: dict) -> list[str]:
    """Fit eq. 5 on the collected retention samples and save one profile per (scorer, scope, rho)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for (s, scope, r), parts in sorted(samples.items()):
        arr = np.concatenate(parts)
        prof = calibrate(arr, alpha, rho=r, method=s, model=model,
                         provenance=dict(provenance, method=s, scope=scope, retention_samples=int(arr.shape[0])))
        p = out_dir / f"{model}_{s}_{scope}_rho{r:g}.npz"
        prof.save(p)
        written.append(str(p))
    return written


# --------------------------------------------------------------------------- numerics of the task model

# The task model's numerics (``--dtype``): a label every task/curve result records and its resume key names
# (accuracy_report._versioned), so results of two numerics are never mixed. KL and calibration run in float32.
NUMERICS = {
    "float32": "float32 weights, activations, KV cache and compute",
    "bfloat16": "bfloat16 weights, activations and KV cache, every op in bfloat16 (torch's CPU bfloat16 kernels)",
    "bfloat16-f32compute": "the bfloat16 model's weights, activations and KV values (rounded to bfloat16 where it "
                           "rounds), its GEMMs and attention computed in float32 from those values and rounded "
                           "to bfloat16 (float32 accumulation, as GPU bfloat16 kernels accumulate)",
}
NUMERICS_DEFAULT = "bfloat16"  # task results recorded without a numerics label were computed in bfloat16


def job_numerics(kind: str, numerics: str) -> str:
    """The numerics a job runs in when the task model's are ``numerics``: task and curve samples in those, KL
    and calibration always in float32."""
    return numerics if kind in ("task", "curve") else "float32"


class F32ComputeLinear(nn.Linear):
    """A bfloat16 linear layer computed in float32: ``F.linear`` of the upcast input with the upcast weights
    (both exact: every bfloat16 is a float32), the result rounded to the input's dtype. The same products as
    the bfloat16 kernel, accumulated in float32 in another order; about 4x faster than torch's bfloat16 GEMM on a
    CPU without AVX512-BF16. ``weight`` stays the bfloat16 parameter (state dict unchanged)."""

    w32: torch.Tensor
    b32: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.w32, self.b32).to(x.dtype)


def numerics_model(model, numerics: str):
    """The task model for a ``NUMERICS`` label, from the float32 ``model`` (returned as is for float32)."""
    from tangram.engine.weights import build_model
    if numerics not in NUMERICS:
        raise ConfigError(f"unknown numerics {numerics!r}; choose from {', '.join(NUMERICS)}")
    if numerics == "float32":
        return model
    tm = build_model(model.cfg, model.state_dict(), torch.bfloat16)
    if numerics == "bfloat16-f32compute":
        for m in tm.modules():
            if type(m) is nn.Linear:
                m.__class__ = F32ComputeLinear
                m.w32 = m.weight.detach().float()
                m.b32 = None if m.bias is None else m.bias.detach().float()
        tm.kv_dtype = torch.float32  # EvalAttention caches K/V in float32 (exact) and attends in float32
    tm.numerics = numerics
    return tm


# --------------------------------------------------------------------------- worker pool

_W: dict = {}


def init_worker(model_name: str, weights: str, threads: int, modes: list[Mode], opts: dict) -> None:
    """Load the model and tokenizer once per process (``torch.set_num_threads(threads)``)."""
    from tangram.host_memory import retain_freed_memory
    retain_freed_memory()  # the rows' caches are large and short-lived: reuse their pages (same results)
    torch.set_num_threads(max(1, threads))
    from tangram.tokenizer import load_tokenizer
    from tangram.engine.weights import load_model
    model, info = load_model(model_name, weights)
    model.eval()
    tok = load_tokenizer(info.get("gguf_path"))
    dtype = opts.get("dtype", "float32")
    task_model = numerics_model(model, dtype)
    _W.update(model=model, task_model=task_model, tok=tok, modes=modes, opts=opts, info=info,
              continues=word_continuation_mask(tok, model.cfg.vocab), loaded=(model_name, weights, dtype))


def prompt_ids(tok, sample, turn: int) -> list[int]:
    """Turn 0: chat template with the context and first question, generation prompt, answer prefix. Later
    turns: the next user message and assistant header after the previous answer's end-of-turn token."""
    q = sample.questions[turn]
    if turn == 0:
        return tok.encode(tok.render_chat([{"role": "user", "content": sample.user_message(0)}]) + q.answer_prefix)
    return tok.encode(f"\n<|im_start|>user\n{q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer_prefix}")


def answer_ids(tok, sample, turn: int) -> list[int]:
    return tok.encode(" " + sample.questions[turn].answer)


def build_task_sample(tok, task: str, split: str, index: int, length: int, n_turns: int):
    from tangram.profiles.tasks import make_task
    return make_task(task, split, index, length, measure=lambda s: len(prompt_ids(tok, s, 0)), n_turns=n_turns)


def run_job(job: tuple) -> dict:
    """:func:`_run_job` plus the CPU time it took in this process (wall time depends on the machine's load)."""
    c0 = time.process_time()
    out = _run_job(job)
    out["cpu_seconds"] = round(time.process_time() - c0, 3)
    return out


def _run_job(job: tuple) -> dict:
    """One sample in a worker: ('task'|'curve', task, index, length) | ('kl', index) | ('calib', index).

    Task samples run in ``opts['dtype']`` (the task model); KL and calibration always in float32 (bfloat16
    logits put a KL noise floor of about 1e-3 nats, as large as the KL at rho = 0.75)."""
    model, tok, modes, o = _W["model"], _W["tok"], _W["modes"], _W["opts"]
    kind = job[0]
    dec = lambda ids: tok.decode(ids, skip_special=True)  # noqa: E731
    if kind in ("task", "curve"):
        _, task, index, length = job
        split = o.get("curve_split", o["split"]) if kind == "curve" else o["split"]
        s = build_task_sample(tok, task, split, index, length, o["turns"])
        turns = [(prompt_ids(tok, s, t), answer_ids(tok, s, t)) for t in range(len(s.questions))]
        use = modes[:1] if kind == "curve" else modes
        r = evaluate_sample(_W["task_model"], use, turns, chunk=o["chunk"], batch=o["batch"], window=o["window"],
                            eos=tok.eos_id, continues=_W["continues"],
                            free_check=(len(turns[0][1]) + 4, dec) if kind == "task" and o.get("free_check", True)
                            else None,
                            tokenizer=tok)
        out = {"kind": kind, "task": task, "task_version": task_version(task),
               "numerics": job_numerics(kind, o.get("dtype", "float32")), "index": index, "length": length,
               "prompt_tokens": len(turns[0][0]),
               "correct": r.correct, "first_wrong": r.first_wrong, "kept": r.kept, "free": r.free,
               "seconds": r.seconds, "split": split, "depth": s.meta.get("depth", s.meta.get("depths"))}
        if kind == "task" and _W["task_model"] is not model and index < o.get("dtype_check", 0):
            f = evaluate_sample(model, modes[:1], turns, chunk=o["chunk"], eos=tok.eos_id, continues=_W["continues"])
            out["full_float32"] = f.correct[0]
        return out
    if kind == "kl":
        from tangram.profiles.tasks import make_text
        _, index = job
        s = make_text(o["split"], index, o["kl_context"], o["kl_continuation"], encode=tok.encode, decode=dec)
        ids, cont = s.meta["context_ids"], s.meta["continuation_ids"]
        r = evaluate_sample(model, modes, [(ids, None)], chunk=o["chunk"], batch=o["batch"], window=o["window"],
                            continuation=cont, tokenizer=tok)
        return {"kind": "kl", "task": "kl_text", "numerics": job_numerics(kind, o.get("dtype", "float32")),
                "index": index, "prompt_tokens": len(ids), "kl": r.kl,
                "top1": r.top1, "kept": r.kept, "seconds": r.seconds}
    if kind == "calib":
        from tangram.profiles.corpus import make_sample, TASKS as CTASKS
        from tangram.profiles.retention import prompt_tokens
        _, index = job
        smp = make_sample(CTASKS[index % len(CTASKS)], "calib", index // len(CTASKS), o["calib_context"])
        t0 = time.time()
        ret = retention_of_prompt(model, prompt_tokens(tok, smp), o["calib_needs"], o["calib_rhos"], o["chunk"],
                                  o["window"], tokenizer=tok)
        return {"kind": "calib", "index": index, "retention": ret, "seconds": time.time() - t0}
    raise ValueError(f"unknown job {job!r}")


def run_jobs(jobs: list[tuple], *, workers: int, threads: int, model_name: str, weights: str, modes: list[Mode],
             opts: dict, desc: str, progress: bool = True):
    """Run jobs on ``workers`` processes (spawned; each loads the model once), yielding results as they finish."""
    from tqdm import tqdm
    bar = tqdm(total=len(jobs), desc=desc, unit="sample", disable=not progress)
    if workers <= 1:  # in this process; a model already loaded here (same weights and precision) is reused
        if _W.get("loaded") != (model_name, weights, opts.get("dtype", "float32")):
            init_worker(model_name, weights, threads, modes, opts)
        _W["modes"], _W["opts"] = modes, opts
        for j in jobs:
            yield run_job(j)
            bar.update(1)
        bar.close()
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=init_worker,
                             initargs=(model_name, weights, threads, modes, opts)) as ex:
        futs = [ex.submit(run_job, j) for j in jobs]
        for f in as_completed(futs):
            yield f.result()
            bar.update(1)
    bar.close()


__all__ = ["SCOPES", "POLICIES", "Mode", "ProfileStore", "build_modes", "scope_mask", "crosslayer_topk_mask",
           "EvalAttention", "evaluate_sample", "NUMERICS", "NUMERICS_DEFAULT", "numerics_model",
           "job_numerics", "F32ComputeLinear", "SampleResult", "prompt_ids", "answer_ids", "build_task_sample",
           "retention_of_prompt", "first_chunk", "write_profiles", "run_jobs", "init_worker", "run_job", "word_continuation_mask"]

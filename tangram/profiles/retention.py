"""Per-head retention samples from a scoring method run on the real model, and the profile built from them."""
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from tangram.budgets import BudgetProfile, calibrate, check_method_scope
from tangram.profiles.corpus import Sample
from tangram.profiles.scoring import ChunkScorer, make_scorer, scope_keep_mask
from tangram.engine.model import Session, TorchAttention, Transformer


def prompt_tokens(tok, sample: Sample) -> list[int]:
    """The first turn as the engine prefills it: chat template, context + first question, generation prompt."""
    return tok.apply_chat([{"role": "user", "content": sample.user_message(0)}], add_generation_prompt=True)


@torch.no_grad()
def chunk_scores(model: Transformer, tokens: list[int], scorer: ChunkScorer, chunk: int) -> list[torch.Tensor]:
    """Scores [L, Hkv, c] of each prefill chunk's keys, scored when the chunk is produced (full cache)."""
    return chunk_scores_multi(model, tokens, [scorer], chunk)[0]


@torch.no_grad()
def chunk_scores_multi(model: Transformer, tokens: list[int], scorers: list[ChunkScorer],
                       chunk: int, backend: type[TorchAttention] = TorchAttention) -> list[list[torch.Tensor]]:
    """Several methods from one model forward per chunk (the forward dominates calibration on a CPU): per
    scorer, the scores [L, Hkv, c] of each chunk. A scorer's own extra forward (KVzip's repeat) runs after the
    others have taken their scores, with them switched off. ``backend``: the attention class (the accuracy
    report passes its faster CPU one)."""
    sess = Session(model, backend(model.cfg, observers=list(scorers)))
    out: list[list[torch.Tensor]] = [[] for _ in scorers]
    for a in range(0, len(tokens), chunk):
        piece = tokens[a:a + chunk]
        sess.forward(piece, last_only=True)
        for i, sc in enumerate(scorers):
            if not sc.extra_forward:
                out[i].append(sc.take()[:, 0])
        for i, sc in enumerate(scorers):
            if sc.extra_forward:
                others = [o for o in scorers if o is not sc]
                for o in others:
                    o.enabled = False
                try:
                    sc.after_chunk(sess, piece)
                finally:
                    for o in others:
                        o.enabled = True
                out[i].append(sc.take()[:, 0])
    return out


def retention_from_scores(scores: list[torch.Tensor], rho: float, unit: str = "sample", scope: str = "per-layer",
                          method: str = "ada-snapkv") -> np.ndarray:
    """Implicit per-head retention of the method's threshold per chunk (``scope``: per-layer = Ada-KV's
    layer-wide top-ceil(r_l*H*c), cross-layer = one top-ceil(rho*L*H*c) over every layer and head).

    unit="sample": one [L, H] ratio over the whole prompt (the paper's per-input ratio).
    unit="chunk": one [L, H] ratio per full-size chunk, [c, L, H] -- the unit the engine reserves budgets for,
    so sigma also covers chunk-to-chunk variation (a prompt shorter than one chunk counts as one chunk).
    """
    masks = [scope_keep_mask(s, rho, scope, method).sum(-1).double() for s in scores]
    if unit == "sample":
        return (sum(masks) / sum(s.shape[-1] for s in scores)).cpu().numpy()
    if unit != "chunk":
        raise ValueError(f"unit must be 'sample' or 'chunk', got {unit!r}")
    full = max(s.shape[-1] for s in scores)
    per = [m / s.shape[-1] for m, s in zip(masks, scores) if s.shape[-1] == full]
    return torch.stack(per).cpu().numpy()


def retention_by_scope(model: Transformer, tok, samples: list[Sample], method: str, rhos: list[float],
                       scopes: list[str], *, chunk: int = 512, window: int | None = None, progress: bool = True,
                       unit: str = "sample") -> dict[tuple[str, float], np.ndarray]:
    """{(scope, rho): [n, L, H]}: one scoring pass per sample serves every scope and ratio (scores depend on
    neither)."""
    r, _ = retention_multi(model, tok, samples, {method: scopes}, rhos, chunk=chunk, window=window,
                           progress=progress, unit=unit)
    return {(sc, rho): x for (_, sc, rho), x in r.items()}


def retention_multi(model: Transformer, tok, samples: list[Sample], scopes: dict[str, list[str]],
                    rhos: list[float], *, chunk: int = 512, window: int | None = None, progress: bool = True,
                    unit: str = "sample") -> tuple[dict[tuple[str, str, float], np.ndarray], dict[str, float]]:
    """{(method, scope, rho): [n, L, H]} for every method of ``scopes`` ({method: [scope, ...]}) from one model
    forward per chunk, and the pass's seconds: ``forward`` (the shared model forward and bookkeeping, scorers
    excluded) and per method its scorer's own time (KVzip: with its repeat forward), wall and, under ``NAME:cpu``,
    process CPU time (which other jobs on the cores do not inflate)."""
    import time

    for m, scs in scopes.items():
        for sc in scs:
            check_method_scope(m, sc)
    methods = list(scopes)
    scorers = [make_scorer(m, model.cfg.num_layers, window, tokenizer=tok) for m in methods]
    out: dict[tuple[str, str, float], list[np.ndarray]] = {
        (m, sc, r): [] for m in methods for sc in scopes[m] for r in rhos}
    t0, c0 = time.perf_counter(), time.process_time()
    for s in tqdm(samples, desc=f"calibrate {','.join(methods)}", unit="sample", disable=not progress):
        per = chunk_scores_multi(model, prompt_tokens(tok, s), scorers, chunk)
        for m, sc_list in zip(methods, per):
            for scope in scopes[m]:
                for r in rhos:
                    x = retention_from_scores(sc_list, r, unit, scope, m)
                    out[(m, scope, r)].extend(x if unit == "chunk" else [x])
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    seconds = {m: sc.seconds for m, sc in zip(methods, scorers)}
    seconds["forward"] = total - sum(seconds.values())
    for m, sc in zip(methods, scorers):
        seconds[f"{m}:cpu"] = sc.cpu_seconds
    seconds["forward:cpu"] = cpu - sum(sc.cpu_seconds for sc in scorers)
    return {k: np.stack(v) for k, v in out.items()}, seconds


def retention_samples(model: Transformer, tok, samples: list[Sample], method: str, rhos: list[float], *,
                      chunk: int = 512, window: int | None = None, progress: bool = True,
                      unit: str = "sample", scope: str = "per-layer") -> dict[float, np.ndarray]:
    """{rho: [n, L, H]} under one scope."""
    r = retention_by_scope(model, tok, samples, method, rhos, [scope], chunk=chunk, window=window,
                           progress=progress, unit=unit)
    return {rho: r[(scope, rho)] for rho in rhos}


def profile_from_samples(r: np.ndarray, alpha: float, rho: float, method: str, model: str,
                         provenance: dict, scope: str = "per-layer") -> BudgetProfile:
    return calibrate(r, alpha, rho=rho, method=method, model=model, provenance=provenance, scope=scope)


__all__ = ["prompt_tokens", "chunk_scores", "chunk_scores_multi", "retention_from_scores", "retention_by_scope",
           "retention_multi", "retention_samples",
           "profile_from_samples"]

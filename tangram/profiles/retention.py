"""Per-head retention samples from a scoring method run on the real model, and the profile built from them."""
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from tangram.budgets import BudgetProfile, calibrate
from tangram.profiles.corpus import Sample
from tangram.profiles.scoring import ChunkScorer, global_topk_mask, make_scorer
from tangram.engine.model import Session, TorchAttention, Transformer


def prompt_tokens(tok, sample: Sample) -> list[int]:
    """The first turn as the engine prefills it: chat template, context + first question, generation prompt."""
    return tok.apply_chat([{"role": "user", "content": sample.user_message(0)}], add_generation_prompt=True)


@torch.no_grad()
def chunk_scores(model: Transformer, tokens: list[int], scorer: ChunkScorer, chunk: int) -> list[torch.Tensor]:
    """Scores [L, Hkv, c] of each prefill chunk's keys, scored when the chunk is produced (full cache)."""
    sess = Session(model, TorchAttention(model.cfg, observers=[scorer]))
    out = []
    for a in range(0, len(tokens), chunk):
        sess.forward(tokens[a:a + chunk], last_only=True)
        out.append(scorer.take()[:, 0])
    return out


def retention_from_scores(scores: list[torch.Tensor], rho: float, unit: str = "sample") -> np.ndarray:
    """Implicit per-head retention of a layer-wide top-ceil(rho*H*c) per chunk (Ada-KV allocation).

    unit="sample": one [L, H] ratio over the whole prompt (the paper's per-input ratio).
    unit="chunk": one [L, H] ratio per full-size chunk, [c, L, H] -- the unit the engine reserves budgets for,
    so sigma also covers chunk-to-chunk variation (a prompt shorter than one chunk counts as one chunk).
    """
    masks = [global_topk_mask(s, rho).sum(-1).double() for s in scores]
    if unit == "sample":
        return (sum(masks) / sum(s.shape[-1] for s in scores)).cpu().numpy()
    if unit != "chunk":
        raise ValueError(f"unit must be 'sample' or 'chunk', got {unit!r}")
    full = max(s.shape[-1] for s in scores)
    per = [m / s.shape[-1] for m, s in zip(masks, scores) if s.shape[-1] == full]
    return torch.stack(per).cpu().numpy()


def retention_samples(model: Transformer, tok, samples: list[Sample], method: str, rhos: list[float], *,
                      chunk: int = 512, window: int | None = None, progress: bool = True,
                      unit: str = "sample") -> dict[float, np.ndarray]:
    """{rho: [n, L, H]}: one scoring pass per sample serves every target ratio (scores do not depend on rho)."""
    scorer = make_scorer(method, model.cfg.num_layers, window)
    out: dict[float, list[np.ndarray]] = {r: [] for r in rhos}
    for s in tqdm(samples, desc=f"calibrate {method}", unit="sample", disable=not progress):
        sc = chunk_scores(model, prompt_tokens(tok, s), scorer, chunk)
        for r in rhos:
            x = retention_from_scores(sc, r, unit)
            out[r].extend(x if unit == "chunk" else [x])
    return {r: np.stack(v) for r, v in out.items()}


def profile_from_samples(r: np.ndarray, alpha: float, rho: float, method: str, model: str,
                         provenance: dict) -> BudgetProfile:
    return calibrate(r, alpha, rho=rho, method=method, model=model, provenance=provenance)


__all__ = ["prompt_tokens", "chunk_scores", "retention_from_scores", "retention_samples", "profile_from_samples"]

"""Token sampling for the engine: greedy, or temperature + nucleus (top-p), batched on the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. EOS is never special: the engine generates exactly the trace's output length."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    """One generator per engine so a run is reproducible for a given seed and step order."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.gen = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] -> token ids [R] (int64, same device)."""
        p = self.params
        if logits.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=logits.device)
        if p.temperature == 0.0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sp, idx = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (sp.cumsum(-1) - sp) >= p.top_p
            sp = sp.masked_fill(drop, 0.0)
            choice = torch.multinomial(sp, 1, generator=self.gen)
            return idx.gather(-1, choice)[:, 0]
        return torch.multinomial(probs, 1, generator=self.gen)[:, 0]

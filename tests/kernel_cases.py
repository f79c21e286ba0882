"""Random inputs shared by the kernel tests: a batch of prefill chunks over a paged, ragged KV pool."""
from __future__ import annotations

import numpy as np
import torch


def batched_case(g: torch.Generator, P: int, D: int, H=4, gq=2, Hp=2, cs=(5, 37, 20), cached=(0, 9, 30), W=24,
                 dtype=torch.float32):
    """Chunks of ``cs`` new tokens on rows whose heads already hold ``cached - 2 * slot`` tokens: returns
    (cu, pool, tables, slot_to_head, lens, q, k, v), q/k/v views of one fused projection."""
    kp, N = len(cs), sum(cs)
    G = H // Hp
    Hq = H * gq
    cu = torch.tensor(np.concatenate([[0], np.cumsum(cs)]), dtype=torch.int32)
    pool = torch.randn(kp * G * W + 4, 2, Hp, P, D, generator=g).to(dtype)
    tables = torch.randperm(pool.shape[0], generator=g)[:kp * G * W].view(kp, G, W).to(torch.int32)
    s2h = torch.randperm(H, generator=g).to(torch.int32)
    lens = torch.tensor([[max(0, c - 2 * s) for s in range(H)] for c in cached], dtype=torch.int32)
    qkv = torch.randn(N, (Hq + 2 * H) * D, generator=g).to(dtype)
    q = qkv[:, :Hq * D].view(N, Hq, D)
    k = qkv[:, Hq * D:(Hq + H) * D].view(N, H, D)
    v = qkv[:, (Hq + H) * D:].view(N, H, D)
    return cu, pool, tables, s2h, lens, q, k, v

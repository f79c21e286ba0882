"""The accuracy harness's first evaluation path, kept as the reference the shared-state path is tested against.

Every mode is its own batch row (rows of one scorer share a batch), forked from the shared first chunk: the
plainest reading of the protocol in :mod:`tangram.profiles.evaluate`'s docstring. ``evaluate_sample`` there
shares rows between modes whose selections coincide; ``tests/test_accuracy.py`` checks both give the same
verdicts, first wrong positions, kept shares and KL.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from tangram.engine.model import Session
from tangram.profiles.evaluate import EvalAttention, Mode, SampleResult, _forward, _free_decode, first_chunk


def _groups(modes: list[Mode], batch: int) -> list[list[int]]:
    """Row groups: the full cache alone first (its outputs are the KL reference), then per scorer in batches."""
    out = [[i for i, m in enumerate(modes) if m.policy == "full"]]
    by: dict[str, list[int]] = {}
    for i, m in enumerate(modes):
        if m.policy != "full":
            by.setdefault(m.scorer, []).append(i)
    for idx in by.values():
        out += [idx[a:a + batch] for a in range(0, len(idx), batch)]
    return [g for g in out if g]


@torch.no_grad()
def evaluate_sample_per_mode(model, modes: list[Mode], turns: list[tuple[list[int], list[int] | None]], *, chunk: int,
                    batch: int = 16, window: int | None = None, eos: int | None = None,
                    continues: torch.Tensor | None = None, continuation: list[int] | None = None,
                    free_check: tuple[int, callable] | None = None, tokenizer=None) -> SampleResult:
    """All modes on one sample. ``turns``: (prompt ids, gold answer ids) per turn (answer None for a KL text);
    ``continuation``: ids scored by KL after the last prompt. ``free_check``: (max new tokens, decode fn) to also
    decode the full cache's first answer freely. ``tokenizer``: needed by KVzip's reconstruction prompt."""
    t0 = time.time()
    cfg = model.cfg
    L, H = cfg.num_layers, cfg.num_kv_heads
    M, nT = len(modes), len(turns)
    correct = np.zeros((M, nT), dtype=bool)
    first_wrong = np.full((M, nT), -1, dtype=np.int64)
    kept = np.ones(M)
    kl = np.zeros(M) if continuation is not None else None
    top1 = np.ones(M) if continuation is not None else None
    free = None
    prompt0 = turns[0][0]
    c0 = prompt0[:chunk]
    base_sc, base, logits0, scores0 = first_chunk(model, modes, c0, window, tokenizer)
    if (nT == 1 and continuation is None and len(prompt0) <= chunk and turns[0][1]
            and int(logits0[0].argmax()) != turns[0][1][0]):
        # one chunk, one question: the first answer token comes from the shared prefill logits for every mode,
        # and it is wrong, so every mode is wrong (kept shares are not measured for this sample)
        if free_check is not None:
            free = _free_decode(model, base, logits0, turns[0][1], free_check, eos)
        first_wrong[:] = 0
        return SampleResult(correct, first_wrong, np.full(M, np.nan), None, None, free, time.time() - t0)
    full_logp = None
    for idx in _groups(modes, batch):
        ms = [modes[i] for i in idx]
        B = len(ms)
        sname = ms[0].scorer
        scorer = base_sc[sname].clone() if sname else None
        br = EvalAttention.fork(base, B, observers=[scorer] if scorer else [])
        kept_tok = np.zeros(B)
        kept_den = [0]

        def compress(start: int, sc: torch.Tensor, count: bool) -> None:
            T = sc.shape[-1]
            masks = []
            for b, m in enumerate(ms):
                mk = m.select(sc[:, b if sc.shape[1] > 1 else 0])
                masks.append(torch.ones(L, H, T, dtype=torch.bool) if mk is None else mk)
            mk = torch.stack(masks, dim=1)  # [L, B, H, T]
            for l in range(L):
                br.evict(l, start, mk[l])
            if count:
                kept_tok[:] += mk.sum(dim=(0, 2, 3)).numpy() / (L * H)
                kept_den[0] += T

        if scorer is not None:
            compress(0, scores0[sname], True)
        else:
            kept_den[0] += len(c0)
            kept_tok[:] += len(c0)
        lg = logits0.expand(B, -1)

        def prefill(ids: list[int], count: bool):
            nonlocal lg
            for a in range(0, len(ids), chunk):
                piece = ids[a:a + chunk]
                start = br.length
                lg = _forward(model, br, piece, B, True)[:, -1]
                if scorer is not None and len(piece) >= scorer.min_tokens:
                    scorer.after_chunk(Session(model, br, B), piece)  # KVzip's repeat; a no-op for the others
                    compress(start, scorer.take(), count)
                elif count:
                    kept_tok[:] += len(piece)
                    kept_den[0] += len(piece)

        prefill(prompt0[chunk:], True)
        for t, (prompt, ans) in enumerate(turns):
            if t > 0:
                prefill(prompt, False)
            if ans is None:
                continue
            if scorer is not None:
                scorer.enabled = False
            if free_check is not None and t == 0 and ms[0].policy == "full":
                free = _free_decode(model, br, lg, ans, free_check, eos)
            feed = list(ans) + ([eos] if t < nT - 1 and eos is not None else [])
            lgA = _forward(model, br, feed, B, False)  # [B, len(feed), V]
            n = len(ans)
            preds = torch.cat([lg.argmax(-1)[:, None], lgA[:, :n].argmax(-1)], dim=1)  # [B, n + 1]
            hit = preds[:, :n] == torch.as_tensor(ans)[None]
            ok = hit.all(dim=1)
            if continues is not None:
                ok &= ~continues[preds[:, n]]
            wrong = torch.where(hit.all(dim=1), torch.full((B,), n), (~hit).int().argmax(dim=1))
            for b, i in enumerate(idx):
                correct[i, t] = bool(ok[b])
                first_wrong[i, t] = -1 if bool(ok[b]) else int(wrong[b])
            lg = lgA[:, -1]
            if scorer is not None:
                scorer.enabled = True
        if continuation is not None:
            if scorer is not None:
                scorer.enabled = False
            lp = torch.log_softmax(_forward(model, br, continuation, B, False).float(), dim=-1)  # [B, K, V]
            if full_logp is None:
                if ms[0].policy != "full":
                    raise RuntimeError("the full cache must be evaluated first")
                full_logp = lp[0]
            p = full_logp.exp()
            d = (p[None] * (full_logp[None] - lp)).sum(-1)  # [B, K]
            agree = (lp.argmax(-1) == full_logp.argmax(-1)[None]).float()
            for b, i in enumerate(idx):
                kl[i] = float(d[b].mean())
                top1[i] = float(agree[b].mean())
        for b, i in enumerate(idx):
            kept[i] = kept_tok[b] / max(kept_den[0], 1)
    return SampleResult(correct, first_wrong, kept, kl, top1, free, time.time() - t0)

"""Where the one-launch SnapKV compression's time goes at short chunks (H100 issue-18 line: compression <= 50% of
the chunk's attention at 512-token chunks).

Per layer-call of one request's chunk (``n_calls`` distinct layers' inputs, one CUDA graph each variant, replays
interleaved): the chunk's attention, the full mode's KV copy, ``snapkv_compress`` stopped after its scores
(phase 1), after the selection (phase 2) and whole (phase 3), tile variants of it, and ``fused_layers``: the
engine's deferred form, ``snapkv_compress_layers`` of all ``n_calls`` layers' chunks in one launch (plus its copy
launch), divided by ``n_calls`` (the engine defers every layer of a step, 30-32, when they fit
DEFER_COMPRESS_MAX_BYTES: ``n_calls`` = 8 understates its amortisation). Prints a table and, last line, JSON.
GPU only.

    python benchmarks/compress_phases.py --out DIR [--chunks 512,1024] [--cached 0,8192]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tangram.budgets import head_groups, synthetic_profile
from tangram.config import get_model
from tangram.kernels import compress as cmp
from tangram.kernels import prefill as pre
from tangram.kernels.bench.timing import log, time_graphs
from tangram.kernels.scoring import ScoreParams, snapkv_finish_batched


def setup(m, c: int, cached: int, n_calls: int, dev):
    H, Hq, d, P = m.num_kv_heads, m.num_q_heads, m.head_dim, 16
    Hp = 4 if H % 4 == 0 else 1
    G = H // Hp
    prof = synthetic_profile(m.num_layers, H, 0.25, seed=0)
    perm = head_groups(prof.B, Hp)
    calls = []
    for li in range(n_calls):
        ratios = prof.B[li][perm[li]]
        lens0 = np.ceil(ratios * cached - 1e-9).astype(np.int32)
        maxp = -(-(int(-(-(lens0.reshape(G, Hp).max(1).max() + c) // P)) + 1) // 16) * 16
        pool = torch.randn(G * maxp + 4, 2, Hp, P, d, device=dev, dtype=torch.bfloat16)
        bt = torch.randperm(pool.shape[0], device=dev)[:G * maxp].view(1, G, maxp).to(torch.int32)
        s2h = torch.from_numpy(perm[li].astype(np.int32)).to(dev)
        qkv = torch.randn(c, (Hq + 2 * H) * d, device=dev, dtype=torch.bfloat16)
        counts_np, _ = pre.keep_budget("tangram", c, H, ratios=ratios)
        calls.append(dict(pool=pool, bt=bt, s2h=s2h, h2s=torch.argsort(s2h.long()).to(torch.int32),
                          q=qkv[:, :Hq * d].view(c, Hq, d), k=qkv[:, Hq * d:(Hq + H) * d].view(c, H, d),
                          v=qkv[:, (Hq + H) * d:].view(c, H, d), lens=torch.from_numpy(lens0[None]).to(dev),
                          counts=torch.from_numpy(np.minimum(counts_np, c).astype(np.int32)[None]).to(dev),
                          out=torch.empty(c, Hq, d, device=dev, dtype=torch.bfloat16)))
    return calls, Hp


def stacked(calls, lse, dev):
    """The calls as the layers of one step: one pool (each layer's pages offset), tables ``[1, n, G, W]`` (-1
    padded), q/k/v/lse and the counts, lens and slot maps with a layer axis (snapkv_compress_layers' arguments)."""
    n = len(calls)
    G, Wmax = calls[0]["bt"].shape[1], max(x["bt"].shape[2] for x in calls)
    pool = torch.cat([x["pool"] for x in calls])
    bt = torch.full((1, n, G, Wmax), -1, dtype=torch.int32, device=dev)
    off = 0
    for li, x in enumerate(calls):
        bt[0, li, :, :x["bt"].shape[2]] = x["bt"][0] + off
        off += x["pool"].shape[0]
    stack = lambda key: torch.stack([x[key] for x in calls])  # noqa: E731
    return dict(pool=pool.expand(n, *pool.shape), bt=bt, q=stack("q"), k=stack("k"), v=stack("v"),
                lse=torch.stack(lse), counts=stack("counts").transpose(0, 1).contiguous(),
                lens=stack("lens").transpose(0, 1).contiguous(), s2h=stack("s2h"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="llama-3.1-8b,smollm2-135m")
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--cached", default="0,8192")
    ap.add_argument("--n-calls", type=int, default=8)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    W, K = ScoreParams().window, ScoreParams().kernel
    rows = []
    for name in a.models.split(","):
        m = get_model(name)
        for cached in map(int, a.cached.split(",")):
            for c in map(int, a.chunks.split(",")):
                calls, Hp = setup(m, c, cached, a.n_calls, dev)
                cu = torch.tensor([0, c], dtype=torch.int32, device=dev)
                lse = [cmp.prefill_attention_varlen(x["q"], x["k"], x["v"], cu, c, x["pool"], x["bt"], x["lens"],
                                                    x["h2s"], page_size=16, heads_per_group=Hp, out=x["out"])[1]
                       for x in calls]

                def attn():
                    for x in calls:
                        cmp.prefill_attention_varlen(x["q"], x["k"], x["v"], cu, c, x["pool"], x["bt"], x["lens"],
                                                     x["h2s"], page_size=16, heads_per_group=Hp, out=x["out"])

                def copy():
                    for x in calls:
                        cmp.select_scatter(None, x["k"], x["v"], cu, c, None, x["pool"], x["bt"], x["lens"], x["s2h"],
                                           page_size=16, heads_per_group=Hp)

                def fused(**kw):
                    def f():
                        for i, x in enumerate(calls):
                            cmp.snapkv_compress(x["q"], x["k"], x["v"], lse[i], cu, c, x["counts"], x["pool"],
                                                x["bt"], x["lens"], x["s2h"], page_size=16, heads_per_group=Hp,
                                                window=W, pool_kernel=K, **kw)
                    return f

                st = stacked(calls, lse, dev)

                def fused_layers():
                    cmp.snapkv_compress_layers(st["q"], st["k"], st["v"], st["lse"], cu, c, st["counts"], st["pool"],
                                               st["bt"], st["lens"], st["s2h"], page_size=16, heads_per_group=Hp,
                                               window=W, pool_kernel=K)

                def scores():
                    for i, x in enumerate(calls):
                        cmp.snapkv_scores_varlen(x["q"], x["k"], lse[i], cu, c, x["h2s"], window=W)

                gq, CS, clen = m.num_q_heads // m.num_kv_heads, cmp.score_width(c), cu[1:] - cu[:-1]
                raw = [cmp.snapkv_scores_varlen(x["q"], x["k"], lse[i], cu, c, x["h2s"], window=W)
                       for i, x in enumerate(calls)]

                def unfused():  # scores, kvpress's finish, the select + scatter launch
                    for i, x in enumerate(calls):
                        r = cmp.snapkv_scores_varlen(x["q"], x["k"], lse[i], cu, c, x["h2s"], window=W, width=CS,
                                                     out=raw[i])
                        fin = snapkv_finish_batched(r, clen, W, gq, K)
                        cmp.select_scatter(fin, x["k"], x["v"], cu, c, x["counts"], x["pool"], x["bt"], x["lens"],
                                           x["s2h"], page_size=16, heads_per_group=Hp, pool_kernel=1)

                variants = {"attention": attn, "copy": copy, "unfused": unfused,
                            "fused_p1_scores": fused(_phases=1), "fused_p2_select": fused(_phases=2),
                            "fused": fused(), "fused_cb32": fused(copy_block=32), "fused_cb128": fused(copy_block=128),
                            "fused_serial": fused(copy="serial"),
                            "fused_serial_bc64": fused(copy="serial", block_c=64), "fused_layers": fused_layers}
                times = time_graphs(list(variants.values()))
                us = {k: t[0] / a.n_calls * 1e3 for k, t in zip(variants, times)}
                row = {"model": m.name, "chunk": c, "cached": cached, **{f"{k}_us": v for k, v in us.items()}}
                row["compression_vs_attention"] = (us["fused"] - us["copy"]) / us["attention"]
                row["deferred_vs_attention"] = (us["fused_layers"] - us["copy"]) / us["attention"]
                rows.append(row)
                log(f"{m.name} c={c} cached={cached}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()) +
                    f" us; (fused - copy) / attention {row['compression_vs_attention']:.0%}, deferred "
                    f"{row['deferred_vs_attention']:.0%}")
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / "compress_phases.csv", index=False)
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

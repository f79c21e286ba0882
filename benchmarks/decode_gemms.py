"""Decode-step GEMMs against the copy bandwidth: each projection of a model shape at decode batch sizes, through
the BLAS backends torch offers (cuBLAS, cuBLASLt), replayed from CUDA graphs over enough weight copies that L2
never holds them (a decode step reads every layer's weights once). Last line: JSON.

Why: the decode roofline (reports/engine/roofline/) puts tangram's GEMMs at ~87% of copy bandwidth; this says
which shapes lose it and whether another backend keeps it.

    python3 benchmarks/decode_gemms.py --out DIR [--model llama-3.1-8b] [--batches 1,8,32,64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.config import get_model  # noqa: E402
from tangram.engine.roofline import copy_bandwidth  # noqa: E402

L2_MULTIPLE = 4  # weight copies per shape: at least this many times the L2 cache


def shapes(m) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode GEMM (out features, in features), as the engine fuses them."""
    h, d = m.hidden, m.head_dim
    return {"qkv": ((m.num_q_heads + 2 * m.num_kv_heads) * d, h), "o": (h, m.num_q_heads * d),
            "gate_up": (2 * m.intermediate, h), "down": (h, m.intermediate), "lm_head": (m.vocab, h)}


@triton.jit
def _skinny_gemm_kernel(X, W, Y, M, N, KD, sxm, swn, sym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Y[M, N] = X[M, K] @ W[N, K]^T for small M: one program per BLOCK_N output columns streams its rows of W
    once (a candidate for the weight-streaming decode GEMMs; no split-K, so deterministic)."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mm = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, KD // BLOCK_K):
        k0 = kb * BLOCK_K
        x = tl.load(X + offs_m[:, None] * sxm + (k0 + offs_k)[None, :], mask=mm[:, None], other=0.0)
        w = tl.load(W + offs_n[:, None].to(tl.int64) * swn + (k0 + offs_k)[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(Y + offs_m[:, None] * sym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None])


TRITON_TILES = [(bn, bk, w, st) for bn, bk, w, st in
                [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 128, 8, 4), (64, 256, 8, 3), (128, 128, 8, 3),
                 (32, 128, 4, 6), (64, 64, 4, 6)]]


def skinny_gemm(x, w, out, tile):
    bn, bk, nw, ns = tile
    M, K = x.shape
    N = w.shape[0]
    _skinny_gemm_kernel[(N // bn,)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                    BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
                                    num_warps=nw, num_stages=ns)


def time_graph(fn, reps: int = 20) -> float:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    return float(np.median(ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--backends", default="cublas,cublaslt")
    ap.add_argument("--triton", action="store_true", help="also a Triton skinny GEMM over TRITON_TILES")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    m = get_model(a.model)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    bw = copy_bandwidth(torch, dev)
    rows = []
    torch.manual_seed(0)
    for name, (n, k) in shapes(m).items():
        wbytes = n * k * 2
        copies = max(2, -(-L2_MULTIPLE * l2 // wbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for b in [int(x) for x in a.batches.split(",")]:
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            outs = [torch.empty(b, n, device=dev, dtype=torch.bfloat16) for _ in ws]
            ref = None
            variants = [(be, None) for be in a.backends.split(",")]
            if a.triton:
                variants += [(f"triton_{t[0]}x{t[1]}x{t[2]}x{t[3]}", t) for t in TRITON_TILES
                             if n % t[0] == 0 and k % t[1] == 0]
            for be, tile in variants:
                if tile is None:
                    torch.backends.cuda.preferred_blas_library(be)

                    def fn():
                        for w, o in zip(ws, outs):
                            torch.mm(x, w.t(), out=o)
                else:
                    def fn(tile=tile):
                        for w, o in zip(ws, outs):
                            skinny_gemm(x, w, o, tile)
                t = time_graph(fn) / copies
                if ref is None:
                    ref = F.linear(x.float(), ws[0].float())
                err = float((outs[0].float() - ref).abs().max() / ref.abs().max())
                rows.append({"gemm": name, "n": n, "k": k, "batch": b, "backend": be, "us": t * 1e6,
                             "share_of_copy_bw": wbytes / t / bw, "rel_err": err})
                print(f"{name:8s} N={n:6d} K={k:5d} B={b:3d} {be:9s} {t * 1e6:8.1f} us "
                      f"{wbytes / t / bw * 100:5.1f}% of copy BW  err {err:.1e}", flush=True)
        ws = outs = None
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    import pandas as pd
    df = pd.DataFrame(rows)
    best = df.loc[df.groupby(["gemm", "batch", df.backend.str.startswith("triton")]).us.idxmin()]
    best = best[best.backend.str.startswith("triton")].assign(backend="triton_best")
    df = pd.concat([df, best])
    df.to_csv(out / "decode_gemms.csv", index=False)
    print(df[df.backend.isin(["cublas", "triton_best"])].pivot_table(index=["gemm", "batch"], columns="backend",
                                                                       values="share_of_copy_bw").to_string())
    step = {}
    for (be, b), g in df[~df.backend.str.match(r"triton_\d")].groupby(["backend", "batch"]):
        per_layer = g[g.gemm != "lm_head"].us.sum() * m.num_layers + g[g.gemm == "lm_head"].us.sum()
        wb = sum(n * k * 2 for nm, (n, k) in shapes(m).items() if nm != "lm_head") * m.num_layers \
            + shapes(m)["lm_head"][0] * shapes(m)["lm_head"][1] * 2
        step[f"{be}_b{b}"] = {"step_gemm_ms": per_layer / 1e3, "share_of_copy_bw": wb / (per_layer * 1e-6) / bw}
    res = {"device": torch.cuda.get_device_name(dev), "copy_bw_gbs": bw / 1e9, "model": m.name, "step": step}
    (out / "decode_gemms.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

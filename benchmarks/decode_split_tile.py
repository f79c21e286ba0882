"""Decode attention on the GPU: split granularity x tile config on the engine's ragged layouts, with the share of
copy bandwidth each variant reaches.

    python benchmarks/decode_split_tile.py --out DIR [--points paper:32:8192,...] [--configs 128x8x3,...]

A point is ``PROFILE:BATCH:CONTEXT`` with PROFILE ``paper`` (H_p 4) / ``tuned`` (H_p 1): the roofline's synthetic
Llama-3.1-8B profile (rho 0.25, alpha 2, as ``tangram.engine.roofline`` builds it), or ``uniform`` (every head at
the full context, H_p = H). Per point every split map (no split; Algorithm 1 at 1/2/4 waves; every head cut into
pieces of at most T tokens; the engine's routed map) is launched with each tile config, checked once
against the float64 reference on a NaN-poisoned output, and timed in one interleaved set of CUDA-graph replays
(``kernels.bench.timing.time_graphs``), so the ratios within a point compare like with like. Last line: JSON.

Measured with it on the H100 (2026-11-24): a merge fused into the split kernel (the head's last split, found by an
atomic arrival counter, merges; commit bf9c117) was never faster than the separate merge launch: 1.00x with 2
splits a head, up to 5.8x slower with many (batch 1: every split of a head serialises on its counter's
acquire/release atomic), so the engine keeps the separate merge (reports/engine/decode_split_tile/).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from tangram.config import get_model, gpu_for_device_name
from tangram.engine.roofline import copy_bandwidth
from tangram.engine.split_table import AotSplitTable
from tangram.kernels import decode as dec
from tangram.kernels.bench.cases import Arena, DecodeCase, point_profile
from tangram.kernels.bench.timing import log, time_graphs
from tangram.kernels.reference import ref_paged_decode
from tangram.planner import DecodeCosts, aot_n_cta, aot_split_map, tables_dir


def split_maps(case: DecodeCase, n_occ: int, costs, num_sms: int) -> dict[str, np.ndarray]:
    """Candidate maps [L, G] of one point (layers of the case's calls)."""
    Hp, b, ctx = case.Hp, case.batch, case.ctx
    Bs = np.take_along_axis(case.Bratio, case.perm, axis=1)
    gmax = Bs.reshape(Bs.shape[0], -1, Hp).max(axis=2)
    L, G = gmax.shape
    maps = {"none": np.ones((L, G), np.int32)}
    for w in (1, 2, 4):
        maps[f"alg1_w{w}"] = aot_split_map(case.Bratio, case.perm, Hp, aot_n_cta(n_occ, b, Hp, w))
    for T in (512, 1024, 2048):
        maps[f"max{T}tok"] = np.clip(np.ceil(np.ceil(gmax * ctx) / T), 1, 64).astype(np.int32)
    table = AotSplitTable(case.Bratio, case.perm, Hp, n_occ, max_batch=max(b, 1), costs=costs, gq=case.m.gqa_group,
                          head_dim=case.d, num_sms=num_sms)
    maps["routed"] = table.split_map(b, ctx)
    return maps


def run_point(arena, m, prof_name, batch, ctx, n_occ, costs, num_sms, configs, bw, rows, paired_sms=0):
    Bratio, Hp, n_calls = point_profile(m, prof_name, batch, ctx)
    case = DecodeCase(arena, m, batch, ctx, 0.25, Hp, 0, 16, Bratio, n_calls)
    maps = split_maps(case, n_occ, costs, num_sms)
    variants = []  # (name, merge, config, schedules)
    Bs = np.take_along_axis(case.Bratio, case.perm, axis=1)  # [L, H] slot-order budgets: the LPT weights
    for name, S in maps.items():
        scheds = [dec.schedule_from_split_map(S[l], Hp, arena.device) for l in case.layers]
        mg = "separate" if S.max() > 1 else "none"
        for cfg in (configs if name in ("none", "alg1_w2", "max1024tok", "routed") else configs[:1]):
            variants.append((name, mg, cfg, scheds, S))
        if name in ("none", "alg1_w2", "routed") and prof_name != "uniform":  # the same items, longest first
            lpt = [dec.schedule_from_split_map(S[l], Hp, arena.device, lpt_weights=Bs[l]) for l in case.layers]
            for cfg in configs[:2]:
                variants.append((name + "_lpt", mg, cfg, lpt, S))
            if paired_sms:  # one wave: the num_sms heaviest first, then the rest lightest first (SM k: k-th of each)
                pr = [dec.paired_schedule(S[l], Hp, batch, Bs[l], paired_sms, n_occ, arena.device)
                      for l in case.layers]
                if max(p.n_items for p in pr) <= n_occ:
                    for cfg in configs[:2]:
                        variants.append((name + "_paired", mg, cfg, pr, S))
    ref = ref_paged_decode(case.q[0], case.pool, case.bt[0], case.lens_t[0], case.s2h[0], page_size=16,
                           heads_per_group=Hp)
    fns = []
    for name, mg, cfg, scheds, S in variants:
        def fn(scheds=scheds, cfg=cfg):
            for i in range(n_calls):
                dec.launch_decode(case.q[i], case.pool, case.bt[i], case.lens_t[i], case.s2h[i], scheds[i],
                                  page_size=16, heads_per_group=Hp, out=case.out[i], config=cfg)
        case.out[0].fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = float((case.out[0].double() - ref).norm() / ref.norm())
        if not (torch.isfinite(case.out[0]).all() and err < 1e-2):
            raise SystemExit(f"error: {prof_name} B{batch} ctx{ctx} {name}/{mg}: wrong output (rel err {err:.2e})")
        fns.append(fn)
    timed = time_graphs(fns)
    kv_bytes = case.bytes
    for (name, mg, cfg, scheds, S), (med, p20, p80, timer) in zip(variants, timed):
        us = med / n_calls * 1e3
        rows.append(dict(profile=prof_name, heads_per_group=Hp, batch=batch, context=ctx, split=name, merge=mg,
                         block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         ctas=int(np.mean([s.n_items * (batch if s.per_request else 1) for s in scheds])),
                         max_splits=int(S.max()),
                         us_per_layer=us, p20_us=p20 / n_calls * 1e3, p80_us=p80 / n_calls * 1e3,
                         of_copy_bw=kv_bytes / (us * 1e-6) / bw, timer=timer))
        log(f"{prof_name} B{batch} ctx{ctx} {name:10s} {mg:8s} {cfg.block_n}x{cfg.num_warps}x{cfg.num_stages}: "
            f"{us:7.1f} us/layer  {rows[-1]['of_copy_bw']:.1%} of copy bw  ({rows[-1]['ctas']} CTAs)")


def _measured_n_occ(m, dev) -> int:
    """Resident CTAs of the shipped decode tile on this device: compile it on a dummy launch, ask its occupancy."""
    H, d = m.num_kv_heads, m.head_dim
    pool = torch.zeros((2, 2, 1, 16, d), dtype=torch.bfloat16, device=dev)
    q = torch.zeros((1, m.num_q_heads, d), dtype=torch.bfloat16, device=dev)
    bt = torch.zeros((1, H, 1), dtype=torch.int32, device=dev)
    lens = torch.ones((1, H), dtype=torch.int32, device=dev)
    dec.paged_decode(q, pool, bt, lens, torch.arange(H, dtype=torch.int32, device=dev), np.ones(H, np.int64),
                     page_size=16, heads_per_group=1)
    torch.cuda.synchronize()
    return dec.decode_n_cta(dec.kernel_resources())


def plot_order(csvs: list[str], out: str) -> None:
    """us per layer-call of the routed map in request order and longest first (tile of the first config), per
    point of the CSVs (``python benchmarks/decode_split_tile.py --plot-order OUT.png A.csv B.csv``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.concat([pd.read_csv(c) for c in csvs])
    df = df[df.split.isin(["routed", "routed_lpt"])]
    tile = df.iloc[0][["block_n", "num_warps", "num_stages"]].tolist()
    df = df[(df.block_n == tile[0]) & (df.num_warps == tile[1]) & (df.num_stages == tile[2])]
    t = df.pivot_table(index=["profile", "batch", "context"], columns="split", values="us_per_layer").dropna()
    ratio = t["routed"] / t["routed_lpt"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.bar(range(len(ratio)), ratio.values, color=["tab:green" if r >= 1 else "tab:red" for r in ratio.values])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(ratio)), [f"{p} B{b}\n{c // 1024}K" for p, b, c in ratio.index], fontsize=7)
    ax.set_ylabel("request order / longest first")
    ax.set_title(f"decode attention, routed maps, tile {tile[0]}x{tile[1]}x{tile[2]}: speed-up of longest-first launch")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--plot-order":
        plot_order(argv[2:], argv[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="paper:32:8192,paper:64:8192,tuned:32:8192,tuned:64:8192,uniform:16:8192,"
                                        "paper:1:8192,paper:8:32768,uniform:1:8192")
    ap.add_argument("--configs", default="128x8x3,64x4x3,64x4x4,128x4x3",
                    help="BLOCK_NxWARPSxSTAGES tile configs (the first is timed for every map)")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--paired", action="store_true",
                    help="also time one-wave launches ordered to pair a heavy and a light piece on each SM")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    m = get_model(a.model)
    configs = [dec.DecodeConfig(*map(int, c.split("x"))) for c in a.configs.split(",")]
    bw = copy_bandwidth(torch, dev)
    fam = props.name.lower().replace("nvidia", "").strip().split()[0]
    gpu = gpu_for_device_name(props.name)
    meta = tables_dir(fam) / "meta.json"
    # the costs the engine routes with on this GPU: its family's fitted tables, else those transferred to it
    costs = DecodeCosts.load(tables_dir(fam), m.name) if meta.exists() or gpu is None else \
        DecodeCosts.for_gpu(gpu.name, m.name)
    log(f"{props.name}: copy bandwidth {bw / 1e9:.0f} GB/s; decode costs {costs.source}")
    arena = Arena(int(min(48 * 2**30, torch.cuda.mem_get_info()[0] * 0.7)), dev)
    # N_CTA of the shipped calibration, else of the shipped tile compiled here (as the engine measures it)
    n_occ = dec.decode_n_cta(calibration=str(tables_dir(fam))) if meta.exists() else _measured_n_occ(m, dev)
    rows: list[dict] = []
    for p in a.points.split(","):
        prof, b, c = p.split(":")
        run_point(arena, m, prof, int(b), int(c), n_occ, costs, props.multi_processor_count, configs, bw, rows,
                  paired_sms=props.multi_processor_count if a.paired else 0)
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(out / "decode_split_tile.csv", index=False)
    best = df.loc[df.groupby(["profile", "batch", "context"])["us_per_layer"].idxmin()]
    base = df[(df.split == "routed") & (df.block_n == configs[0].block_n) & (df.num_warps == configs[0].num_warps)
              & (df.num_stages == configs[0].num_stages)]
    summary = {"device": props.name, "copy_bw_gbps": bw / 1e9, "n_occ": n_occ,
               "best": best[["profile", "batch", "context", "split", "merge", "block_n", "num_warps", "num_stages",
                             "us_per_layer", "of_copy_bw"]].to_dict("records"),
               "routed_today": base[["profile", "batch", "context", "split", "merge", "us_per_layer",
                                     "of_copy_bw"]].to_dict("records")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

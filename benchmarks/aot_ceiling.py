"""How much can a split map chosen ahead of time gain over FlashDecoding's split on this GPU? (one device call)

The kernel sweep compares the engine's routed AOT map with FlashDecoding's static split; the routing keeps the static
split unless the fitted decode-cost model predicts a gain beyond its error margin, so the sweep cannot show what a
better choice would have given. This benchmark times, per point and interleaved (``time_graphs``), the same kernel on
the same ragged pool under the maps the routing chooses among (``tangram.planner.split_candidates``, all computable
before serving: the budgets are static) and under the routed map itself. Its JSON is also what
``python -m tangram.sim.fit_decode --ratio-margins FILE`` fits the routing's per-batch margins on (the p90 error of
the model's predicted candidate / static ratio):

* ``static``: FlashDecoding's split (FlashAttention-2's heuristic at twice the SMs), every head alike;
* ``routed``: what the engine launches (``AotSplitTable`` with the shipped decode costs and the SM count);
* ``alg1_w{w}``: Algorithm 1 at ``w`` waves of the kernel's resident CTAs, capped at the minimum split tokens;
* ``balanced_x{k}``: FlashInfer's balanced chunking (``tangram.planner.runtime_plan``) at ``k`` x the resident
  CTAs, computed once from the point's retained lengths (the AOT analogue of the runtime plan: same CTAs, no
  per-step host work);
* ``uniform_s{s}``: ``s`` splits for every head.

Prints one JSON line per point and a summary line: per point the best map and its speed over ``static``, and the
routed map's. Llama-3.1-8B shape, random bf16 KV, synthetic budget profile (``--seed``), H_p = 1 unless ``--hps``.
Usage (on the GPU): ``python benchmarks/aot_ceiling.py --out DIR``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from tangram.budgets import constant_profile, synthetic_profile
from tangram.config import get_model
from tangram.engine.split_table import AotSplitTable
from tangram.kernels import decode as dec
from tangram.kernels.bench.cases import Arena, DecodeCase
from tangram.kernels.bench.timing import L2_BYTES, time_graphs
from tangram.planner import DecodeCosts, split_candidates
from tangram.sim.tables import tables_dir_for


def _maps(case: DecodeCase, n_occ: int, num_sms: int, costs: DecodeCosts, m) -> dict[str, list]:
    """Per candidate (``tangram.planner.split_candidates`` at the point's own lengths, and the routed map), one
    schedule per layer-call of the case."""
    dev = case.q[0].device
    named = split_candidates(case.Bratio, case.perm, case.Hp, n_occ, case.batch, context=case.ctx, num_sms=num_sms,
                             head_dim=m.head_dim, lens=case.lens_slot)
    out = {k: [dec.schedule_from_split_map(S[l], case.Hp, dev) for l in case.layers] for k, S in named.items()}
    table = AotSplitTable(case.Bratio, case.perm, case.Hp, n_occ, max_batch=256, costs=costs, gq=m.gqa_group,
                          head_dim=m.head_dim, dtype_bytes=m.dtype_bytes, num_sms=num_sms, device=dev)
    out["routed"] = [table.lookup(l, case.batch, case.ctx) for l in case.layers]
    return out


def summarize(files: list[str]) -> str:
    """Markdown: per file and H_p, the routed and the best candidate's speed over FlashDecoding's split, over all
    points and over the skewed long-context ones (rho < 1, batch >= 4, context >= 32K), and the points where the
    routed map ran below 0.99x."""
    lines = ["| file | H_p | points | routed / static: min, median, max | best candidate / static: median, max | "
             "skewed, batch >= 4, context >= 32K: routed median / best median (points) | routed < 0.99x at |",
             "|---|---|---|---|---|---|---|"]
    for f in files:
        rows = json.loads(Path(f).read_text())
        for hp in sorted({r["hp"] for r in rows}):
            rr = [r for r in rows if r["hp"] == hp]
            rv = np.array([r["routed_vs_static"] for r in rr])
            bv = np.array([r["best_vs_static"] for r in rr])
            sk = [r for r in rr if r["rho"] < 1 and r["batch"] >= 4 and r["context"] >= 32768]
            low = ", ".join(f"B{r['batch']}/{r['context'] // 1024}K/rho {r['rho']:g}: {r['routed_vs_static']:.3f}"
                            for r in rr if r["routed_vs_static"] < 0.99) or "none"
            skx = (f"{np.median([r['routed_vs_static'] for r in sk]):.3f} / "
                   f"{np.median([r['best_vs_static'] for r in sk]):.3f} ({len(sk)})") if sk else "-"
            lines.append(f"| {f} | {hp} | {len(rr)} | {rv.min():.3f}, {np.median(rv):.3f}, {rv.max():.3f} | "
                         f"{np.median(bv):.3f}, {bv.max():.3f} | {skx} | {low} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="no GPU: print the Markdown summary of runs")
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--rhos", default="0.25,0.5,1.0")
    ap.add_argument("--hps", default="1")
    ap.add_argument("--seed", type=int, default=0, help="synthetic profile seed")
    ap.add_argument("--arena-gb", type=float, default=30.0)
    ap.add_argument("--budget-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    if a.summarize:
        print(summarize(a.summarize))
        return
    if not a.out:
        ap.error("--out is required (or --summarize)")
    t_end = time.time() + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    m = get_model("llama-3.1-8b")
    cfg = dec.DEFAULT_CONFIG
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    costs = DecodeCosts.load(tables_dir_for("h100-80gb"), m.name)
    arena = Arena(int(a.arena_gb * 2**30), dev)
    rows, n_occ = [], None
    for hp in map(int, a.hps.split(",")):
        for rho in map(float, a.rhos.split(",")):
            Bratio = constant_profile(m.num_layers, m.num_kv_heads, 1.0).B if rho >= 1 else \
                synthetic_profile(m.num_layers, m.num_kv_heads, rho, seed=a.seed).B
            for ctx in map(int, a.contexts.split(",")):
                for batch in map(int, a.batches.split(",")):
                    if time.time() > t_end:
                        break
                    per_layer = batch * m.num_kv_heads * ctx * 2 * m.head_dim * 2 * float(Bratio.mean())
                    n_calls = int(min(2 * m.num_layers, max(4, math.ceil(4 * L2_BYTES / per_layer))))
                    try:
                        case = DecodeCase(arena, m, batch, ctx, rho, hp, a.seed, 16, Bratio, n_calls)
                    except MemoryError:
                        continue
                    if n_occ is None:  # the kernel's resident CTAs, once it was compiled
                        dec.launch_decode(case.q[0], case.pool, case.bt[0], case.lens_t[0], case.s2h[0],
                                          dec.static_schedule(m.num_kv_heads, 1, dev), page_size=16,
                                          heads_per_group=hp, out=case.out[0], config=cfg)
                        torch.cuda.synchronize()
                        n_occ = dec.decode_n_cta(dec.kernel_resources(cfg), dec.device_limits(dev))
                    maps = _maps(case, n_occ, num_sms, costs, m)
                    names = list(maps)
                    timed = time_graphs([case.launcher(maps[k], cfg) for k in names])
                    ms = {k: t[0] / case.n_calls for k, t in zip(names, timed)}
                    ctas = {k: int(np.mean([s.n_items for s in maps[k]])) * batch for k in names}
                    best = min(ms, key=ms.get)
                    row = {"model": m.name, "profile_seed": a.seed, "num_sms": num_sms, "batch": batch, "context": ctx,
                           "rho": rho, "hp": hp, "n_occ": n_occ, "ms": ms,
                           "ctas": ctas, "best": best, "best_vs_static": ms["static"] / ms[best],
                           "routed_vs_static": ms["static"] / ms["routed"], "gbps_static": case.bytes / ms["static"] / 1e6}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del case
    (out / "aot_ceiling.json").write_text(json.dumps(rows, indent=1))
    summ = {"points": len(rows),
            "best_vs_static_max": max((r["best_vs_static"] for r in rows), default=None),
            "best_vs_static_median": float(np.median([r["best_vs_static"] for r in rows])) if rows else None,
            "routed_vs_static_min": min((r["routed_vs_static"] for r in rows), default=None),
            "points_best_over_5pct": sum(r["best_vs_static"] > 1.05 for r in rows),
            "gpu": torch.cuda.get_device_name(dev), "num_sms": num_sms, "n_occ": n_occ, "tile": str(cfg)}
    print(json.dumps({"summary": summ}), flush=True)


if __name__ == "__main__":
    main()

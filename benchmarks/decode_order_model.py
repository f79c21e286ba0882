"""Launch order in the decode-cost models against measured kernel times (CPU only; reads decode_split_tile CSVs).

    python benchmarks/decode_order_model.py CSV [CSV ...] --bw GBPS [--gpu h200] [--out FILE.md]

For every point of ``benchmarks/decode_split_tile.py``'s CSVs (profile, batch, context) whose unsplit map ("none")
was timed in request order and longest first ("none_lpt"), both orders are priced per layer-call of the case (its
layers and lengths rebuilt as the benchmark builds them) by

* ``waves``: :func:`tangram.planner.launch_layer_times`, the model the AOT routing and the simulator price decode
  with (waves at full bandwidth, the last wave's CTAs sized one by one), with the GPU's decode costs;
* ``dispatch``: :func:`tangram.planner.dispatch_time`, CTAs dispatched one by one into the resident slots as they
  free, the same costs' rates (no launch or per-wave constants: compare ratios and shapes, not intercepts);

at the copy bandwidth ``--bw`` the run measured (its log's first line). Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pandas as pd

from tangram.budgets import head_groups
from tangram.config import get_model
from tangram.kernels.bench.cases import layer_lens, point_profile
from tangram.kernels.report import _md_table
from tangram.planner import DecodeCosts, dispatch_time, launch_layer_times, wave_launch


def case_layers(m, prof_name: str, batch: int, ctx: int):
    """(lens [calls, H] in slot order, H_p) of the benchmark's case for this point (decode_split_tile.run_point)."""
    Bratio, Hp, n_calls = point_profile(m, prof_name, batch, ctx)
    lens = layer_lens(Bratio, head_groups(Bratio, Hp), ctx)
    return np.stack([lens[c % m.num_layers] for c in range(n_calls)]), Hp


def price(m, lens: np.ndarray, batch: int, order: str, n_occ: int, costs: DecodeCosts, bw: float) -> dict:
    tok = 2 * m.head_dim * m.dtype_bytes
    out = {"waves": 0.0, "dispatch": 0.0}
    for row in lens:  # one layer-call: every request's heads, one CTA each (the unsplit map)
        size = row.astype(np.float64) * tok
        if order == "lpt":
            ordered = np.repeat(np.sort(size)[::-1], batch)  # item-major, longest first
        else:
            ordered = np.tile(size, batch)  # request-major, slots in budget order
        out["waves"] += float(launch_layer_times(ordered[None], wave_launch(np.ones((1, ordered.size)), n_occ),
                                                 costs, gq=m.gqa_group, head_dim=m.head_dim)[0])
        out["dispatch"] += dispatch_time(ordered, n_occ, bw, costs.cta_bw, costs.rate_model)
    return {k: v / len(lens) * 1e6 for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--bw", type=float, required=True, help="copy bandwidth of the run, GB/s")
    ap.add_argument("--gpu", default="h200", help="GPU preset whose decode costs price the launches")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--n-occ", type=int, default=264, help="resident CTAs of the timed tile (default: 264)")
    ap.add_argument("--out", help="also write the table as Markdown here")
    a = ap.parse_args(argv)
    m = get_model(a.model)
    costs = DecodeCosts.for_gpu(a.gpu, m.name)
    bw = a.bw * 1e9
    df = pd.concat([pd.read_csv(c) for c in a.csv])
    first = df.iloc[0]
    df = df[(df.block_n == first.block_n) & (df.num_warps == first.num_warps) & (df.num_stages == first.num_stages)]
    rows = []
    for (prof, batch, ctx), g in df.groupby(["profile", "batch", "context"]):
        meas = g.set_index("split")["us_per_layer"]
        if not {"none", "none_lpt"} <= set(meas.index):
            continue
        lens, _ = case_layers(m, prof, int(batch), int(ctx))
        r = {"profile": prof, "batch": int(batch), "context": int(ctx)}
        for order, name in (("request", "none"), ("lpt", "none_lpt")):
            p = price(m, lens, int(batch), order, a.n_occ, costs, bw)
            r[f"measured_{order}_us"] = float(meas[name])
            r[f"waves_{order}_us"] = p["waves"]
            r[f"dispatch_{order}_us"] = p["dispatch"]
        for k in ("measured", "waves", "dispatch"):
            r[f"{k}_ratio"] = r[f"{k}_request_us"] / r[f"{k}_lpt_us"]
        rows.append(r)
    t = pd.DataFrame(rows)
    cols = ["profile", "batch", "context", "measured_request_us", "measured_lpt_us", "measured_ratio",
            "waves_request_us", "waves_lpt_us", "waves_ratio", "dispatch_request_us", "dispatch_lpt_us",
            "dispatch_ratio"]
    md = _md_table(t[cols], "{:.4g}")
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"Decode costs of {a.gpu} ({costs.source}), copy bandwidth {a.bw:g} GB/s, N_CTA {a.n_occ}, "
                    f"tile {first.block_n}x{first.num_warps}x{first.num_stages}; us per layer-call, unsplit maps.\n\n"
                    + md + "\n")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m tangram.sim.fit_decode [TABLES_DIR]``: fit the decode-launch costs the AOT regime choice uses.

The split table (engine) and the cost model (simulator) choose each (batch bucket, context bucket, layer)'s split
map by :func:`tangram.planner.decode_layer_times`, whose five constants (:class:`tangram.planner.DecodeCosts`)
this fits to the kernel benchmark's ``decode_attention.csv``: every ``static_split`` and ``tangram_aot`` row is
re-priced from the lengths and split maps it ran with (the synthetic profile of its rho and seed, the
FlashDecoding split count or the row's AOT table), and the constants minimise the squared log error
(``scipy.optimize.least_squares``, positive by construction). Writes ``decode_costs.json`` into the folder with
the fit's error per kernel, so a reader sees how well the choice is informed.

``--ratio-margins FILE ...`` (no refit): the routing's per-batch margins from benchmarks/aot_ceiling.py's paired
timings, each candidate map and FlashDecoding's split on one point: the p90 over candidates and points of
``|log(predicted ratio) - log(measured ratio)|`` per batch, written into the model's ``by_model`` entry.
"""
from __future__ import annotations

import dataclasses

import datetime as _dt
import json
import sys
from pathlib import Path

import numpy as np

from tangram.budgets import constant_profile, head_groups, synthetic_profile
from tangram.config import get_model
from tangram.errors import ConfigError
from tangram.cli import Parser, cli_main, parse
from tangram.planner import (DecodeCosts, aot_bucket_split_map, decode_context_bucket, decode_layer_times,
                             flashdecoding_num_splits, runtime_plan, split_candidates, split_kv_block)

from .tables import TABLES_ROOT, CostTables

KERNELS = ("static_split", "static_split_ragged", "runtime_plan", "tangram_aot")
# kernels whose CTAs a row's columns determine whatever decode costs were in force when it ran (an AOT row's map
# depends on the costs it was routed with: only the folder's own rows, from before routing, are re-priced)
FIXED_MAP_KERNELS = ("static_split", "static_split_ragged", "runtime_plan")
ROUTED_KERNELS = ("static_split", "static_split_ragged", "tangram_aot")  # the kinds of map the routing picks from
MODELS = ("llama-3.1-8b", "smollm2-135m")
NAMES = ("bw", "cta_bw", "cta_s", "launch_s", "merge_s")


def _profile(model, rho: float, seed):
    if rho >= 1.0:
        return constant_profile(model.num_layers, model.num_kv_heads, 1.0).B
    return synthetic_profile(model.num_layers, model.num_kv_heads, rho, seed=int(float(seed))).B


def _is_set(x) -> bool:
    return str(x) not in ("", "nan", "None")


def row_cases(df, n_occ: int, num_sms: int, max_rows: int = 400, seed: int = 0) -> list[dict]:
    """Each usable row as (lens [calls, H], S [calls, G], H_p, batch, gq, d, measured seconds per layer-call):
    the lengths and split maps it ran with (the synthetic profile of its rho and seed; FlashDecoding's split
    count for the static kernels, FlashInfer-style balanced chunks for ``runtime_plan`` — every request of a
    bench point holds the same lengths, so one request's chunk counts per head are the map — and Algorithm 1
    for ``tangram_aot``)."""
    rows = df[df["kernel"].isin(KERNELS)]
    rows = rows[rows["model"].astype(str).isin(MODELS)]
    if len(rows) > max_rows:  # stratified: every (kernel, batch) keeps its share
        rng = np.random.default_rng(seed)
        keep = []
        for _, g in rows.groupby(["kernel", "batch"]):
            n = min(len(g), max(2, max_rows * len(g) // len(rows)))
            keep += list(g.index[np.sort(rng.choice(len(g), n, replace=False))])
        rows = rows.loc[keep]
    out = []
    for _, r in rows.iterrows():
        m = get_model(str(r["model"]))
        H, d, gq = m.num_kv_heads, m.head_dim, m.num_q_heads // m.num_kv_heads
        batch, ctx, rho = int(r["batch"]), int(r["context"]), float(r["rho"])
        seed_r = r["profile_seed"] if _is_set(r.get("profile_seed", "")) else 0
        B = _profile(m, rho, seed_r)
        calls = [c % m.num_layers for c in range(int(r["n_calls"]))]
        block_n = split_kv_block(d)
        if r["kernel"] == "static_split":
            Hp = H
            perm = np.tile(np.arange(H), (m.num_layers, 1))
        else:
            Hp = int(r["heads_per_group"])
            perm = head_groups(B, Hp)
        lens = np.minimum(ctx, np.ceil(np.take_along_axis(B, perm, axis=1) * ctx - 1e-9))[calls]
        if r["kernel"] in ("static_split", "static_split_ragged"):
            # the launch as measured (the bench records its splits; the heuristic changed on 2026-11-27, and
            # tables measured before keep their own launches), else FlashDecoding's split as the bench computes it
            ns = int(r["max_splits"]) if _is_set(r.get("max_splits", "")) else \
                flashdecoding_num_splits(batch * H, num_sms, max(1, -(-int(lens.max()) // block_n)))
            S = np.full((len(calls), H // Hp), ns)
        elif r["kernel"] == "runtime_plan":
            n_cta = int(r["n_cta"]) if _is_set(r.get("n_cta", "")) else n_occ
            # the bench plans the whole batch ([requests, calls, H]); its requests are identical
            rp = runtime_plan(np.broadcast_to(lens[None], (batch,) + lens.shape).astype(np.int64), n_cta)
            S, Hp = np.stack([s[0] for s in rp.splits]), 1
        else:
            waves = float(r["waves"]) if _is_set(r.get("waves", "")) else 1.0
            S = aot_bucket_split_map(B, perm, Hp, n_occ, batch, waves=waves, context=decode_context_bucket(ctx))[calls]
        out.append({"kernel": r["kernel"], "model": m.name, "lens": lens, "S": S, "hp": Hp, "batch": batch, "gq": gq,
                    "d": d, "meas": float(r["median_ms"]) * 1e-3})
    return out


def predict(cases: list[dict], costs: DecodeCosts, n_occ: int) -> np.ndarray:
    return np.array([decode_layer_times(c["lens"], c["S"], c["hp"], c["batch"], n_occ, costs, gq=c["gq"],
                                        head_dim=c["d"]).mean() for c in cases])


def _fit_cases(cases: list[dict], n_occ: int, copy: float, start: DecodeCosts, rate_model: str,
               label: str) -> tuple[DecodeCosts, dict]:
    """Least squares of the log error over ``cases``; the margin is the worst kernel's p90 relative error."""
    from scipy.optimize import least_squares

    meas = np.array([c["meas"] for c in cases])
    x0 = np.log([getattr(start, k) for k in NAMES])

    def make(x) -> DecodeCosts:
        return DecodeCosts(**dict(zip(NAMES, np.exp(x))), rate_model=rate_model)

    def resid(x):
        return np.log(predict(cases, make(x), n_occ) / meas)

    # physical bounds: a launch streams at most the copy bandwidth; a lone CTA (head_dim 128) keeps a few tiles in
    # flight per round trip (5-200 GB/s); without them a table with no few-CTA rows lets cta_bw run to infinity
    lo = np.log([0.7 * copy, 5e9, 2e-7, 1e-6, 5e-7])
    hi = np.log([1.0 * copy, 2e11, 1e-5, 2e-5, 2e-5])
    best = None
    for cta in np.geomspace(1e10, 1e11, 5):  # the surface has local minima along cta_bw: start from a grid
        x = np.clip(x0, lo + 1e-9, hi - 1e-9)
        x[1] = np.log(cta)
        res = least_squares(resid, x, bounds=(lo, hi), method="trf", max_nfev=100)
        if best is None or res.cost < best.cost:
            best = res
    costs = make(best.x)
    err = np.abs(predict(cases, costs, n_occ) / meas - 1)
    kinds = np.array([c["kernel"] for c in cases])
    stats = {k: {"rows": int((kinds == k).sum()), "median_abs_rel_err": float(np.median(err[kinds == k])),
                 "p90_abs_rel_err": float(np.quantile(err[kinds == k], 0.9))} for k in KERNELS if (kinds == k).any()}
    # the regime choice keeps FlashDecoding's split unless another map is predicted faster by more than this error:
    # the worst p90 of the kinds of map it chooses between (runtime plans, up to ~170 chunks a head at batch 1,
    # inform the rates but are never a candidate)
    chosen = [v["p90_abs_rel_err"] for k, v in stats.items() if k in ROUTED_KERNELS] or \
        [v["p90_abs_rel_err"] for v in stats.values()]
    costs = dataclasses.replace(costs, margin=float(max(chosen)),
                                source=f"fitted on {len(cases)} rows ({label})")
    return costs, stats


def fit(tables_dir: Path, max_rows: int = 400, extra: list[Path] = (), rate_model: str = "saturating",
        ) -> tuple[DecodeCosts, dict]:
    """Fit on the folder's decode table plus ``extra`` decode tables of the same GPU (their fixed-map rows only:
    :data:`FIXED_MAP_KERNELS`): one fit on every row, and one per model with enough rows (``by_model``; the
    routing of a model reads its own, :meth:`DecodeCosts.load`)."""
    import pandas as pd

    t = CostTables.load(tables_dir)
    if t.decode is None:
        raise ConfigError(f"{tables_dir}: no decode_attention.csv to fit")
    n_occ, _ = t.n_cta(int(t.meta.get("sm_count", 132)))
    num_sms = int(t.meta.get("sm_count", 132))
    df = t.decode
    for p in extra:
        e = pd.read_csv(p)
        df = pd.concat([df, e[e["kernel"].isin(FIXED_MAP_KERNELS)]], ignore_index=True)
    start = DecodeCosts.default(t.copy_bandwidth())
    copy = t.copy_bandwidth() or start.bw / 0.94
    cases = row_cases(df, n_occ, num_sms, max_rows)
    if len(cases) < 10:
        raise ConfigError(f"{tables_dir}/decode_attention.csv: only {len(cases)} usable decode rows "
                          f"(kernels {', '.join(KERNELS)})")
    costs, stats = _fit_cases(cases, n_occ, copy, start, rate_model, f"{tables_dir.name}/decode_attention.csv")
    by_model = {}
    for name in MODELS:
        sub = df[df["model"].astype(str) == name]
        mc = row_cases(sub, n_occ, num_sms, max_rows) if len(sub) else []
        if len(mc) < 10:
            continue
        c, st = _fit_cases(mc, n_occ, copy, costs, rate_model, f"{tables_dir.name}/decode_attention.csv, {name}")
        by_model[name] = {**{k: getattr(c, k) for k in NAMES}, "margin": c.margin, "rate_model": rate_model,
                          "source": c.source, "fit": st}
    return costs, {"n_occ": n_occ, "fit": stats, "by_model": by_model,
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                   "command": f"python -m tangram.sim.fit_decode {tables_dir} --rate-model {rate_model}"
                   + "".join(f" --extra {p}" for p in extra)}


def ratio_margins(rows: list[dict], costs: DecodeCosts, *, quantile: float = 90.0) -> tuple[tuple, dict]:
    """Per batch, the ``quantile`` of the error of the model's predicted candidate / static time ratio against the
    measured one (benchmarks/aot_ceiling.py rows of one model: ``ms`` per candidate name, timed interleaved), and
    the counts behind it. The predicted maps are :func:`tangram.planner.split_candidates` at the row's own lengths,
    as the benchmark launched them."""
    from tangram.kernels.bench.cases import layer_lens

    errs: dict[int, list[float]] = {}
    for i, r in enumerate(rows):
        try:
            m = get_model(str(r["model"]))
            batch, ctx, rho, hp, n_occ = int(r["batch"]), int(r["context"]), float(r["rho"]), int(r["hp"]), \
                int(r["n_occ"])
            ms, num_sms = r["ms"], int(r["num_sms"])
            B = _profile(m, rho, r.get("profile_seed", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"ratio margins: row {i}: missing or invalid field ({e})") from None
        perm = head_groups(B, hp)
        lens = layer_lens(B, perm, ctx)
        named = split_candidates(B, perm, hp, n_occ, batch, context=ctx, num_sms=num_sms, head_dim=m.head_dim,
                                 lens=lens)

        def t(S):
            return float(decode_layer_times(lens, S, hp, batch, n_occ, costs, gq=m.gqa_group, head_dim=m.head_dim,
                                            dtype_bytes=m.dtype_bytes).sum())
        t_static = t(named["static"])
        for k, S in named.items():
            if k == "static" or k not in ms:
                continue
            errs.setdefault(batch, []).append(abs(np.log(t_static / t(S)) - np.log(ms["static"] / ms[k])))
    if not errs:
        raise ConfigError("ratio margins: no rows with candidate timings")
    out = tuple((b, float(np.percentile(errs[b], quantile))) for b in sorted(errs))
    return out, {str(b): {"pairs": len(errs[b]), "median": float(np.median(errs[b])),
                          f"p{quantile:g}": float(np.percentile(errs[b], quantile))} for b in sorted(errs)}


def add_ratio_margins(tables_dir: Path, files: list[Path]) -> dict:
    """Write each measured model's ratio margins into ``decode_costs.json``'s ``by_model`` entry (no refit)."""
    path = tables_dir / DecodeCosts.FILENAME
    if not path.exists():
        raise ConfigError(f"{path}: no decode costs to add margins to (fit them first)")
    doc = json.loads(path.read_text())
    rows = []
    for f in files:
        try:
            v = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{f}: cannot read ({e})") from None
        if not isinstance(v, list):
            raise ConfigError(f"{f}: expected benchmarks/aot_ceiling.py's list of points")
        rows += v
    info = {}
    for name in sorted({str(r.get("model")) for r in rows}):
        costs = DecodeCosts.load(tables_dir, name)
        margins, stats = ratio_margins([r for r in rows if str(r.get("model")) == name], costs)
        entry = doc.setdefault("by_model", {}).setdefault(name, {})
        if not entry:
            raise ConfigError(f"{path}: no by_model entry for {name}: fit the decode costs on its rows first")
        entry["ratio_margins"] = [list(x) for x in margins]
        entry["ratio_margins_fit"] = {"files": [str(f) for f in files], "by_batch": stats,
                                      "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        info[name] = entry["ratio_margins_fit"]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return info


def _parser():
    p = Parser(prog="python -m tangram.sim.fit_decode", description=__doc__.splitlines()[0])
    p.add_argument("tables", nargs="?", default=str(TABLES_ROOT / "h100"), help="tables folder (default %(default)s)")
    p.add_argument("--max-rows", type=int, default=400, help="rows sampled for the fit (default %(default)s)")
    p.add_argument("--extra", nargs="*", default=[], help="more decode_attention.csv files of the same GPU "
                   "(their static, static-ragged and runtime-plan rows join the fit)")
    p.add_argument("--ratio-margins", nargs="+", default=None, metavar="FILE",
                   help="no refit: add per-batch routing margins from benchmarks/aot_ceiling.py's JSON files")
    p.add_argument("--rate-model", choices=DecodeCosts.RATE_MODELS, default="saturating",
                   help="how running CTAs share the bandwidth (tangram.planner.DecodeCosts; default %(default)s)")
    return p


@cli_main
def main(argv=None) -> int:
    a = parse(_parser(), argv)
    d = Path(a.tables)
    if a.ratio_margins:
        print(json.dumps(add_ratio_margins(d, [Path(x) for x in a.ratio_margins]), indent=1))
        print(f"wrote {d / DecodeCosts.FILENAME}")
        return 0
    old = {}
    if (d / DecodeCosts.FILENAME).exists():
        try:
            old = json.loads((d / DecodeCosts.FILENAME).read_text())
        except json.JSONDecodeError:
            old = {}
    had = sorted(k for k, v in (old.get("by_model") or {}).items() if isinstance(v, dict) and v.get("ratio_margins"))
    costs, info = fit(d, a.max_rows, [Path(x) for x in a.extra], a.rate_model)
    costs.to_json(d / DecodeCosts.FILENAME, info)
    if had:  # the margins measured how wrong the old fit's ratios were: a new fit needs its own
        files = sorted({f for k in had for f in old["by_model"][k].get("ratio_margins_fit", {}).get("files", [])})
        print(f"note: the ratio margins of {', '.join(had)} were fitted on the previous costs and are not kept; "
              f"re-run with --ratio-margins {' '.join(files) or 'FILE'}", file=sys.stderr)
    print(json.dumps({**{k: getattr(costs, k) for k in NAMES + ("margin", "rate_model")}, **info}, indent=1))
    print(f"wrote {d / DecodeCosts.FILENAME}")
    return 0


if __name__ == "__main__":
    main()

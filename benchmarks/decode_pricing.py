"""Decode pricing A/B: the fitted decode costs (``CostParams.decode_model="auto"``, the AOT routing's model) against
the capped wave model the simulator priced decode with before (``"capped"``), on the same step plans; and what the
change does to the engine-overhead fit.

1. Each config is replayed step by step (no fast-forward, no rescale cache) with the current pricing; every decode
   step's plan is priced by both models (a second cost model of the replica, ``decode_model="capped"``). Printed:
   the decode seconds of both, their ratio, per decode batch size, and the old decode time's share of busy time.
2. With ``--steps-csv`` (a ``tangram-fit-engine --steps-csv`` file of measured engine steps, priced by the old
   model), each step's ``pred_decode_attention`` is multiplied by the new/old ratio of its config and decode batch
   from (1) (an estimate: the engine's plans are not in the file), and the engine overhead is refitted by
   ``tangram.sim.engine_overhead.fit`` on the CPU: coefficients and per-config totals, as shipped vs refitted.

Run: ``python benchmarks/decode_pricing.py --trace TRACE --configs A.json B.json ... [--kv-pool-gib 1.3]
[--steps-csv reports/validation/h100_engine_fit_1633_2026-11-24/engine_steps.csv.gz]``
(reports/transfer/device_validation/README.md has the command it was run with).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd


def reprice(trace: str, config: str, kv_pool_gib: float, gpu: str) -> tuple[pd.DataFrame, float]:
    """(decode steps: kd, new seconds, old seconds) of one config's step-by-step replay, and its busy seconds."""
    from tangram.sim import run as simrun
    from tangram.sim.costmodel import CostModel, CostParams
    from tangram.spec import load

    spec = load(config, {"trace": trace, "kv_pool_bytes": int(kv_pool_gib * 2**30), "gpu": gpu})
    rows = []
    build = simrun.build_replica

    def build_ab(spec_, engine, idx):
        sched, cm = build(spec_, engine, idx)
        old = type(cm)(spec_.model, spec_.gpu, engine, sched.layout, sched.profile, tables=cm.tables,
                       params=dataclasses.replace(cm.params, decode_model="capped"), seed=cm.seed)
        execute = cm.execute

        def both(plan):
            if plan.num_decode:
                ctx = int(plan.decode_ctx.max())
                rows.append((plan.num_decode, cm._decode_attention(plan.decode_head_lens, ctx)[0],
                             old._decode_attention(plan.decode_head_lens, ctx)[0]))
            return execute(plan)
        cm.execute = both
        return sched, cm

    simrun.build_replica = build_ab
    try:
        summ, _ = simrun.simulate(spec.load_trace(), spec, spec.run_mode, fast_forward=False)
    finally:
        simrun.build_replica = build
    return pd.DataFrame(rows, columns=["kd", "new_s", "old_s"]), float(sum(summ["time_by_operator_s"].values()))


def refit(steps_csv: str, ratios: dict, tables: str | None) -> None:
    from tangram.sim import engine_overhead
    from tangram.sim.fit_engine import step_terms
    from tangram.sim.tables import tables_dir_for

    df = pd.read_csv(steps_csv)
    L = 32  # the file's model (Llama-3.1-8B, the validation configs')
    shipped = engine_overhead.load(tables or tables_dir_for("h100-80gb"), "llama-3.1-8b")

    def totals(ov, d):
        return {m: float(ov.step_s(step_terms(g), L, g["kd"], g["kp"], g["compress"], g["aot"], g["graphed"]).sum()
                         / g["measured_s"].sum() - 1) for m, g in d.groupby("mode", sort=False)}
    new = df.copy()
    f = [ratios[m].get(k, np.mean(list(ratios[m].values()))) if k > 0 and m in ratios else 1.0
         for m, k in zip(df["mode"], df["kd"])]
    new["pred_decode_attention"] = new["pred_decode_attention"] * np.asarray(f)
    ov, st = engine_overhead.fit(step_terms(new), new["measured_s"], L, new["kd"], new["kp"], new["compress"],
                                 new["aot"], new["graphed"])
    print(f"\nengine overhead refitted on {steps_csv} with the decode term re-priced (estimate):")
    for k, v in shipped.coefficients().items():
        print(f"  {k}: shipped {v:.4g}, refitted {ov.coefficients()[k]:.4g}")
    a, b, c = totals(shipped, df), totals(shipped, new), totals(ov, new)
    print("per-config total error of the measured steps: shipped fit, old pricing | shipped fit, new pricing | "
          "refit, new pricing")
    for m in a:
        print(f"  {m:22s} {a[m]:+.2%} | {b[m]:+.2%} | {c[m]:+.2%}")
    print(f"median |step error| of the refit: {st['median_abs_rel_err']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--kv-pool-gib", type=float, default=1.3)
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--steps-csv", help="measured engine steps (tangram-fit-engine --steps-csv) to refit on")
    ap.add_argument("--tables", help="tables folder whose engine_overhead.json is the shipped fit (default: h100)")
    a = ap.parse_args()
    ratios = {}
    for cfg in a.configs:
        name = Path(cfg).stem
        d, busy = reprice(a.trace, cfg, a.kv_pool_gib, a.gpu)
        by = d.groupby("kd")[["new_s", "old_s"]].sum()
        ratios[name] = (by["new_s"] / by["old_s"]).to_dict()
        print(f"{name:22s} {len(d)} decode steps (mean batch {d['kd'].mean():.1f}): old {d['old_s'].sum():.4f} s, "
              f"new {d['new_s'].sum():.4f} s, new/old {d['new_s'].sum() / d['old_s'].sum():.3f} (by batch: "
              + " ".join(f"{k}: {v:.3f}" for k, v in ratios[name].items())
              + f"); old decode / busy {d['old_s'].sum() / busy:.1%}", flush=True)
    if a.steps_csv:
        refit(a.steps_csv, ratios, a.tables)


if __name__ == "__main__":
    main()

"""Memory accounting: what one request mix costs under each page layout (paper Figure 8).

Runs the real scheduler and allocator on the requests (prefill only, no model),
so the numbers are those the engine and the simulator would reserve.

    tangram-mem --model llama-3.1-8b --tokens 100000 --rho 0.3 --hp 4
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import pandas as pd

from tangram.budgets import BudgetProfile, synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.errors import ConfigError
from tangram.cli import cli_main
from tangram.plan import StepResult
from tangram.scheduler import Scheduler

LAYOUTS = {
    "monolithic full": dict(mode="full"),
    "monolithic dynamic": dict(mode="dynamic"),
    "monolithic static (BR)": dict(mode="br"),
    "ragged adjacent": dict(mode="tangram", clustering=False),
    "ragged clustered": dict(mode="tangram", clustering=True),
}


def account(model_name: str, prompts: list[int], profile: BudgetProfile, *, rho: float, heads_per_group: int = 4,
            page_size: int = 16, chunk: int = 2048, alpha: float = 2.0, seed: int = 0,
            layouts: dict | None = None) -> pd.DataFrame:
    """Prefill every prompt (one session each) under each layout; report reserved/live bytes."""
    model = get_model(model_name)
    rows = []
    for name, kw in (layouts or LAYOUTS).items():
        eng = EngineConfig(rho=rho, heads_per_group=heads_per_group, page_size=page_size, chunk_size=chunk,
                           max_batched_tokens=max(chunk, 8192), alpha=alpha, **kw)
        # ample for any layout (every table of every request may hold all its tokens): the point is what gets reserved
        ample = len(prompts) * model.num_layers * model.num_kv_heads * (max(prompts) // page_size + 2)
        s = Scheduler(model, eng, profile, num_pages=ample)
        rng = np.random.default_rng(seed)
        for i, n in enumerate(prompts):
            s.add_request(i, f"s{i}", int(n), 1)
        while s.running or s.waiting:
            plan = s.schedule()
            rk = None
            if plan.retention == "global" and plan.num_prefill:
                r = s.layout.to_slots(profile.sample_retention(rng, plan.num_prefill))
                rk = np.minimum(plan.prefill_keep, np.ceil(r * plan.prefill_tokens[:, None, None] - 1e-9)).astype(int)
            s.update(plan, StepResult(plan.step, 0.0, realized_keep=rk))
        u = s.kv_usage()
        rows.append({"layout": name, "pages": u["pages_used"], "page_bytes": s.layout.page_bytes,
                     "bytes_reserved": u["bytes_reserved"], "bytes_live": u["bytes_live"],
                     "fragmentation": u["fragmentation"], "reclaim_pages": s.stats.pages_reclaimed})
    df = pd.DataFrame(rows)
    full = df.loc[df.layout == "monolithic full", "bytes_reserved"]
    if len(full):
        df["vs_full"] = df.bytes_reserved / float(full.iloc[0])
    return df


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tangram-mem", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[100_000], help="prompt tokens, one request each")
    ap.add_argument("--rho", type=float, default=0.3)
    ap.add_argument("--hp", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--profile", help="BudgetProfile file (default: synthetic profile, seed --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        raise SystemExit(2 if e.code else 0)
    model = get_model(a.model)
    if any(t <= 0 for t in a.tokens):
        raise ConfigError("--tokens must be positive")
    if a.profile:
        prof = BudgetProfile.load(a.profile)
        prof.check_model(model.num_layers, model.num_kv_heads, model.name)
    else:
        prof = synthetic_profile(model.num_layers, model.num_kv_heads, a.rho, alpha=a.alpha, seed=a.seed,
                                 model=model.name)
    df = account(a.model, a.tokens, prof, rho=a.rho, heads_per_group=a.hp, page_size=a.page_size, chunk=a.chunk,
                 alpha=a.alpha, seed=a.seed)
    src = a.profile or f"synthetic (seed {a.seed})"
    if a.json:
        print(json.dumps({"model": a.model, "tokens": a.tokens, "rho": a.rho, "hp": a.hp, "profile": src,
                          "layouts": df.to_dict(orient="records")}))
    else:
        print(f"{a.model}, requests {a.tokens} tokens, rho={a.rho}, H_p={a.hp}, alpha={a.alpha}, P={a.page_size}, "
              f"profile: {src}")
        show = df.assign(GiB_reserved=df.bytes_reserved / 2**30, GiB_live=df.bytes_live / 2**30)
        print(show[["layout", "pages", "GiB_reserved", "GiB_live", "fragmentation", "vs_full"]].to_string(
            index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    main()

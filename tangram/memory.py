"""Memory accounting: what one request mix costs under each page layout (paper Figure 8).

Runs the real scheduler and allocator on the requests (prefill only, no model),
so the numbers are those the engine and the simulator would reserve.

    tangram-mem --model llama-3.1-8b --tokens 100000 --rho 0.3 --hp 4
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from tangram.budgets import BudgetProfile
from tangram.cli import cli_main, from_cli, parse, spec_parser
from tangram.config import EngineConfig, get_model
from tangram.errors import ConfigError
from tangram.plan import StepResult
from tangram.scheduler import Scheduler

LAYOUTS = {
    "monolithic full": dict(mode="full"),
    "monolithic dynamic": dict(mode="dynamic"),
    "monolithic static (BR)": dict(mode="br"),
    "ragged adjacent": dict(mode="tangram", clustering=False),
    "ragged clustered": dict(mode="tangram", clustering=True),
}


# engine options that change what a layout reserves (the layouts set the mode and the switches themselves)
ENGINE_OPTIONS = ("page_size", "heads_per_group", "alpha", "rho", "chunk_size", "max_batched_tokens", "max_num_seqs",
                  "session_cache", "score_method", "budget_scope")


def account(model_name: str, prompts: list[int], profile: BudgetProfile, engine: EngineConfig, *, seed: int = 0,
            layouts: dict | None = None) -> pd.DataFrame:
    """Prefill every prompt (one session each) under each layout (``engine`` with the layout's mode and
    clustering); report reserved/live bytes."""
    model = get_model(model_name)
    page_size = engine.page_size
    rows = []
    for name, kw in (layouts or LAYOUTS).items():
        eng = engine.with_(max_batched_tokens=max(engine.chunk_size, engine.max_batched_tokens), **kw)
        # ample for any layout (every table of every request may hold all its tokens): the point is what gets reserved
        ample = len(prompts) * model.num_layers * model.num_kv_heads * (max(prompts) // page_size + 2)
        s = Scheduler(model, eng, profile, num_pages=ample)
        rng = np.random.default_rng(seed)
        for i, n in enumerate(prompts):
            rejected = s.add_request(i, f"s{i}", int(n), 1)
            if rejected:  # the scheduler refuses it at intake: zero pages would read as an answer
                raise ConfigError(f"a {int(n):,}-token prompt: {rejected[0].detail}")
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


def _parser():
    p = spec_parser("tangram-mem", __doc__, ("model", "profile", "seed", *ENGINE_OPTIONS))
    p.add_argument("--tokens", type=int, nargs="+", default=[100_000], help="prompt tokens, one request each")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = parse(_parser(), argv)
    spec = from_cli(a, modes=[m["mode"] for m in LAYOUTS.values()])
    e = spec.engine
    if any(t <= 0 for t in a.tokens):
        raise ConfigError("--tokens must be positive")
    too_long = [t for t in a.tokens if t + 1 > spec.model.max_context]
    if too_long:  # no request of that length can be served: an answer in pages would be made up
        raise ConfigError(f"--tokens {too_long[0]}: beyond {spec.model.name}'s context window of "
                          f"{spec.model.max_context:,} tokens (a prompt and its output token must fit: at most "
                          f"{spec.model.max_context - 1:,})")
    df = account(spec.model.name, a.tokens, spec.profile, e.with_(mode="tangram"), seed=spec.seed)
    src = spec.profile_label
    if a.json:
        print(json.dumps({"model": spec.model.name, "tokens": a.tokens, "rho": e.rho, "hp": e.heads_per_group,
                          "profile": src, "layouts": df.to_dict(orient="records")}))
    else:
        print(f"{spec.model.name}, requests {a.tokens} tokens, rho={e.rho}, H_p={e.heads_per_group}, "
              f"alpha={e.alpha}, P={e.page_size}, profile: {src}")
        show = df.assign(GiB_reserved=df.bytes_reserved / 2**30, GiB_live=df.bytes_live / 2**30)
        print(show[["layout", "pages", "GiB_reserved", "GiB_live", "fragmentation", "vs_full"]].to_string(
            index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    main()

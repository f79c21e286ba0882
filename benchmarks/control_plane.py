"""Host time of the shared control plane (scheduler + allocator) per step.

256 running requests x Llama-3.1-8B (32 layers x 8 KV heads), tangram mode, for
H_p in {1, 2, 4, 8}: median time of schedule() + update() over steady decode
steps (every request growing its tables by one token), and over mixed steps
(decodes plus one 2K prefill chunk of a newly admitted turn).

    python benchmarks/control_plane.py [--requests 256] [--steps 300]

Prints a table, then one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.plan import StepResult
from tangram.scheduler import Scheduler


def bench(hp: int, n_req: int, steps: int, ctx: int, mode: str = "tangram") -> dict:
    model = get_model("llama-3.1-8b")
    prof = synthetic_profile(model.num_layers, model.num_kv_heads, 0.25, seed=0, model=model.name)
    eng = EngineConfig(mode=mode, heads_per_group=hp, chunk_size=2048, max_batched_tokens=8192, max_num_seqs=n_req + 1)
    # room for every table to hold the context plus the decode steps: no preemption in the timed loop
    tables = model.num_layers * model.num_kv_heads if eng.ragged else 1
    s = Scheduler(model, eng, prof, num_pages=(n_req + 60) * tables * ((ctx + steps) // eng.page_size + 2))
    for i in range(n_req):
        s.add_request(i, f"s{i}", ctx, 100_000)  # long outputs: they stay in decode
    while any(not r.decoding for r in s.running) or s.waiting:
        p = s.schedule()
        s.update(p, StepResult(p.step, 0.0))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        p = s.schedule()
        s.update(p, StepResult(p.step, 0.0))
        times.append(time.perf_counter() - t0)
    assert p.num_decode == n_req
    mixed = []
    for j in range(min(steps, 50)):
        s.add_request(10**6 + j, f"m{j}", 2048, 1)
        t0 = time.perf_counter()
        p = s.schedule()
        s.update(p, StepResult(p.step, 0.0))
        mixed.append(time.perf_counter() - t0)
        assert p.num_prefill == 1
        s.end_session(f"m{j}")
    return {"hp": hp, "tables_per_request": s.layout.n_tables, "decode_step_ms": float(np.median(times) * 1e3),
            "decode_step_p90_ms": float(np.percentile(times, 90) * 1e3), "mixed_step_ms": float(np.median(mixed) * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()
    res = [bench(hp, a.requests, a.steps, a.context) for hp in (1, 2, 4, 8)]
    mono = bench(8, a.requests, a.steps, a.context, mode="full")
    mono["hp"] = "monolithic"
    for r in res + [mono]:
        print(f"H_p={r['hp']!s:>10}  tables/request={r['tables_per_request']:4d}  decode step {r['decode_step_ms']:.3f} ms "
              f"(p90 {r['decode_step_p90_ms']:.3f})  mixed step {r['mixed_step_ms']:.3f} ms")
    print(json.dumps({"benchmark": "control_plane", "requests": a.requests, "layers": 32, "kv_heads": 8,
                      "context": a.context, "results": res + [mono]}))


if __name__ == "__main__":
    main()

"""Host seconds a decode step spends outside the layer stack: the floor of a graph-replayed step's overhead.

python benchmarks/engine_host_overhead.py [--model llama-3.1-8b] [--modes full,tangram] [--out FILE.json]

A decode step replayed from a CUDA graph costs its kernels plus whatever the host does around the replay: the
shared scheduler's step (plan, block tables), gathering the step's token ids and positions, copying them into
the graph's static buffers, lm_head and sampling, the token copy back, and the simulated clock's bookkeeping.
This runs the real engine (scheduler, executor, ``cuda_graphs="emulate"``) on the CPU with the model's layer
and head structure (layers, query/KV heads, page tables) but tiny widths, times every decode-only step, and
subtracts the layer stack (the part a graph replay moves to the GPU), which leaves what a replay cannot hide.
The result holds for this machine's CPU; the simulator's ``graph_s`` (sim/engine_overhead.py) is fitted on the
GPU host, and this number is the lower end of the band ``benchmarks/engine_recipes.py`` prices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.engine.weights import load_model
from tangram.harness import Cluster
from tangram.traces.format import Trace, Turn


def measure(model_name: str, mode: str, graphs: str, sessions: int = 4, out_tokens: int = 48) -> dict:
    cfg = dataclasses.replace(get_model(model_name), head_dim=16, hidden=64, intermediate=64, vocab=512)
    model, _ = load_model(cfg, "random", dtype=torch.float32, device="cpu", seed=0)
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.25, alpha=2.0, seed=0, model=cfg.name)
    turns = []
    for s in range(sessions):
        turns += [Turn(f"{s}:0", str(s), 0, 0.0, 0.0, 400, out_tokens), Turn(f"{s}:1", str(s), 1, None, 0.0, 40,
                                                                              out_tokens)]
    eng = EngineConfig(mode=mode, chunk_size=512, max_batched_tokens=1024, kv_pool_bytes=2**28)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=1), ExecutorOptions(cuda_graphs=graphs))
    in_layers = [0.0]
    layers = exe._layers

    def timed_layers(*a):
        t = time.perf_counter()
        r = layers(*a)
        in_layers[0] += time.perf_counter() - t
        return r

    exe._layers = timed_layers  # the graph body looks it up on the instance too
    rows = []
    execute = exe.execute

    def timed_execute(plan):
        in_layers[0] = 0.0
        t = time.perf_counter()
        r = execute(plan)
        rows.append((plan.num_decode, plan.num_prefill, time.perf_counter() - t, in_layers[0], r.breakdown["host"]))
        return r

    exe.execute = timed_execute
    t = time.perf_counter()
    Cluster(Trace(turns), [(sched, exe)]).run()
    wall = time.perf_counter() - t
    a = np.array(rows)
    dec = a[a[:, 1] == 0]
    outside = dec[:, 2] - dec[:, 3]
    return {"model": model_name, "mode": mode, "cuda_graphs": graphs, "steps": len(a), "decode_steps": len(dec),
            "executor_outside_layers_ms_p50": 1e3 * float(np.median(outside)),
            "scheduler_ms_p50": 1e3 * float(np.median(dec[:, 4])),
            "loop_ms_per_step": 1e3 * (wall - a[:, 2].sum()) / len(a),
            "host_per_decode_step_ms": 1e3 * float(np.median(outside) + np.median(dec[:, 4]))
            + 1e3 * (wall - a[:, 2].sum()) / len(a)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--modes", default="full,tangram")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = [measure(a.model, m, "emulate") for m in a.modes.split(",")]
    for r in res:
        print(f"{r['model']} {r['mode']}: host per decode step {r['host_per_decode_step_ms']:.2f} ms "
              f"(executor outside the layers {r['executor_outside_layers_ms_p50']:.2f}, scheduler "
              f"{r['scheduler_ms_p50']:.2f}, event loop {r['loop_ms_per_step']:.2f}; medians over "
              f"{r['decode_steps']} decode steps)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

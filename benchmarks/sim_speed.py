"""Simulator speed: a 10,000-request multi-turn trace in tangram mode (target: < 60 s on the 2-core dev box).

Run: ``python benchmarks/sim_speed.py [--requests 10000] [--mode tangram] [--profile]``.
The last line of output is one JSON object (requests/s and scheduler steps/s simulated).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import numpy as np


def make_trace(n_requests: int, seed: int, category: str = "mixed", rate: float = 0.5):
    """Seeded SCBench-like sessions (the generator's default mix), trimmed to exactly n_requests turns."""
    from tangram.traces import Trace, generate

    n_sessions = max(1, n_requests // 4 + 1)  # turns ~ uniform 2..6: 4 per session on average
    tr = generate(n_sessions, category, seed=seed, rate=rate)
    sessions = tr.sessions()
    keep, n = [], 0
    for sid in sorted(sessions, key=lambda s: sessions[s][0].arrival_s):
        ts = sessions[sid]
        if n + len(ts) > n_requests:
            ts = ts[: n_requests - n]
        keep.extend(ts)
        n += len(ts)
        if n >= n_requests:
            break
    return Trace(keep, f"{tr.source} trimmed to {n_requests} requests")


def _patch_pool_free() -> None:
    """The proposed PagePool.free: duplicate ids found with a stamp array (O(n)) instead of np.unique (sort/hash)."""
    from tangram.paging import PagePool

    def free(self, ids):
        ids = np.asarray(ids, dtype=np.int32).ravel()
        if ids.size == 0:
            return
        stamp = getattr(self, "_stamp", None)
        if stamp is None:
            stamp = self._stamp = np.zeros(self.num_pages, dtype=np.int64)
        pos = np.arange(ids.size, dtype=np.int64)
        stamp[ids] = pos
        if not self._in_use[ids].all() or not np.array_equal(stamp[ids], pos):
            raise AssertionError("double free or free of a page that was never allocated")
        self._in_use[ids] = False
        self._free[self._n_free:self._n_free + ids.size] = ids
        self._n_free += ids.size
        self.total_frees += ids.size

    PagePool.free = free


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--mode", default="tangram")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--category", default="mixed", help="generator category: short, mid, long or mixed")
    ap.add_argument("--rate", type=float, default=0.5, help="session arrivals per second")
    ap.add_argument("--profile", action="store_true", help="print the top of a cProfile to stderr")
    ap.add_argument("--proposed-pool-free", action="store_true",
                    help="run with the O(n) double-free check proposed to the lead for tangram.paging.PagePool.free")
    a = ap.parse_args(argv)

    from tangram.config import EngineConfig, get_gpu, get_model
    from tangram.sim.run import simulate
    from tangram.spec import DeploymentSpec, default_profile

    if a.proposed_pool_free:
        _patch_pool_free()
    model, gpu = get_model(a.model), get_gpu(a.gpu)
    engine = EngineConfig(mode=a.mode)
    spec = DeploymentSpec(model, gpu, engine, default_profile(model, engine.rho, engine.alpha), seed=a.seed)
    trace = make_trace(a.requests, a.seed, a.category, a.rate)
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    summ, res = simulate(trace, spec)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    if prof:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    out = {"requests": len(trace.turns), "completed": summ["completed"], "rejected": summ["rejected"],
           "steps": res.steps, "simulated_s": round(res.end_s, 3), "wall_s": round(wall, 3),
           "requests_per_s": round(len(trace.turns) / wall, 1), "steps_per_s": round(res.steps / wall, 1),
           "mode": a.mode, "model": model.name, "gpu": gpu.name, "proposed_pool_free": a.proposed_pool_free,
           "category": a.category, "session_rate": a.rate}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

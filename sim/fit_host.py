"""Measure the host control-plane coefficients of the cost model on this CPU.

``python -m tangram.sim.fit_host [--out sim/tables/host_coeffs.json] [--steps N]``

Runs the real shared scheduler (the code the engine runs on its host) on a
synthetic multi-turn load for several modes and H_p, times every
``schedule()`` + ``update()`` with ``perf_counter``, and fits the per-step time
to the plan's counters by non-negative least squares. The dynamic mode's page
reclaim (``BlockTable.truncate``) and the FlashInfer-style per-layer plan
(``planner.runtime_plan``) are timed directly. The fitted coefficients are
written with the command, the CPU and the date so reports can cite them.
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import time
from pathlib import Path

import numpy as np

from tangram.cli import Parser, check_at_least, cli_main, output_file
from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.paging import BlockTable, KVLayout, PagePool
from tangram.planner import runtime_plan
from tangram.plan import StepResult
from tangram.scheduler import Scheduler

from .costmodel import HOST_COEFFS_PATH

FEATURES = ("step_s", "decode_row_s", "prefill_row_s", "decode_row_table_s", "prefill_row_table_s",
            "row_touched_s", "page_s", "admit_s", "evict_s", "preempt_s")


def _features(c: dict) -> list[float]:
    T = c.get("tables", 1)
    return [1.0, c.get("decode_rows", 0), c.get("prefill_rows", 0), c.get("decode_rows", 0) * T,
            c.get("prefill_rows", 0) * T, c.get("rows_touched", 0), c.get("pages_allocated", 0) + c.get("pages_freed", 0),
            c.get("admitted", 0), c.get("evicted", 0), c.get("preempted", 0)]


def _drive(mode: str, hp: int, steps: int, rng: np.random.Generator, model, profile) -> tuple[list, list]:
    """Run the scheduler alone on random multi-turn sessions; returns (feature rows, seconds)."""
    eng = EngineConfig(mode=mode, heads_per_group=hp, chunk_size=512, max_batched_tokens=2048)
    sched = Scheduler(model, eng, profile, pool_bytes=6 * 2**30)
    X, y = [], []
    rid, nxt_sess = 0, 0
    active: dict[str, int] = {}  # session -> turns left
    for _ in range(steps):
        while len(active) < 24:  # keep a steady population of sessions
            sid = f"s{nxt_sess}"
            nxt_sess += 1
            active[sid] = int(rng.integers(1, 4))
            sched.add_request(rid, sid, int(rng.integers(200, 6000)), int(rng.integers(8, 64)))
            rid += 1
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        realized = None
        if plan.retention == "global" and plan.num_prefill:
            r = sched.layout.to_slots(profile.sample_retention(rng, plan.num_prefill))
            realized = np.minimum(plan.prefill_keep, np.ceil(r * plan.prefill_tokens[:, None, None]).astype(np.int64))
        res = StepResult(plan.step, 0.0, {}, realized)
        t2 = time.perf_counter()
        events = sched.update(plan, res)
        t3 = time.perf_counter()
        X.append(_features(plan.counters))
        y.append((t1 - t0) + (t3 - t2))
        for ev in events:
            if ev.kind == "finished":
                sid = sched.requests[ev.rid].sid
                active[sid] -= 1
                if active[sid] <= 0:
                    del active[sid]
                    sched.end_session(sid)
                else:
                    sched.add_request(rid, sid, int(rng.integers(50, 400)), int(rng.integers(8, 64)))
                    rid += 1
    return X, y


def _time_truncate(model, profile, rng) -> tuple[float, float]:
    """Seconds per reclaimed page and per compressed row of BlockTable.truncate (the dynamic mode's reclaim)."""
    rows_x, pages_x, ts = [], [], []
    for i in range(120):
        # monolithic (few large pages) and ragged H_p=1 (many small pages) so the per-page slope is resolved
        eng = EngineConfig(mode="dynamic") if i % 2 else EngineConfig(mode="tangram", heads_per_group=1)
        lay = KVLayout.build(model, eng, profile.B)
        pool = PagePool(400_000, lay.page_bytes)
        bt = BlockTable(lay, pool, rows=16)
        k = int(rng.integers(1, 9))
        rows = np.array([bt.acquire_row() for _ in range(k)])
        full = np.broadcast_to(rng.integers(500, 4000, size=(k, 1)), (k, lay.n_tables)).astype(np.int64)
        bt.ensure(rows, full)
        keep = (full * rng.uniform(0.1, 0.9, size=(k, 1))).astype(np.int64)
        t0 = time.perf_counter()
        n = bt.truncate(rows, keep)
        ts.append(time.perf_counter() - t0)
        rows_x.append(k)
        pages_x.append(n)
    from scipy.optimize import nnls

    coef, _ = nnls(np.stack([rows_x, pages_x], axis=1).astype(float), np.array(ts))
    return float(coef[1]), float(coef[0])


def _time_runtime_plan(rng) -> float:
    items, ts = [], []
    for _ in range(20):
        R = int(rng.integers(1, 64))
        lens = rng.integers(1, 30000, size=(R, 32, 8))
        t0 = time.perf_counter()
        rp = runtime_plan(lens, 264)
        ts.append(time.perf_counter() - t0)
        items.append(rp.host_items)
    return float(np.sum(ts) / np.sum(items))


MIN_STEPS = 100  # per configuration: its first 20 (warm-up) are dropped, and the rest fit the features


def fit(steps: int = 1500, seed: int = 0) -> dict:
    from scipy.optimize import nnls

    rng = np.random.default_rng(seed)
    model = get_model("llama-3.1-8b")
    profile = synthetic_profile(model.num_layers, model.num_kv_heads, 0.25, model=model.name)
    X, y = [], []
    for mode, hp in [("full", 8), ("dynamic", 8), ("br", 8), ("tangram", 1), ("tangram", 2), ("tangram", 4),
                     ("tangram", 8)]:
        x, t = _drive(mode, hp, steps, rng, model, profile)
        X += x[20:]  # drop warm-up steps (allocation of the first arrays)
        y += t[20:]
    X, y = np.asarray(X, float), np.asarray(y, float)
    # robust fit: drop the slowest 2% of steps (other tenants of this shared CPU), then NNLS
    keep = y <= np.quantile(y, 0.98)
    coef, _ = nnls(X[keep], y[keep])
    pred = X[keep] @ coef
    r2 = 1 - ((y[keep] - pred) ** 2).sum() / ((y[keep] - y[keep].mean()) ** 2).sum()
    reclaim_page_s, compress_row_s = _time_truncate(model, profile, rng)
    coeffs = {k: float(v) for k, v in zip(FEATURES, coef)}
    coeffs.update(reclaim_page_s=reclaim_page_s, compress_row_s=compress_row_s,
                  runtime_plan_item_s=_time_runtime_plan(rng))
    return {"coefficients": coeffs, "fit": {"steps": int(keep.sum()), "r2": float(r2),
                                            "mean_step_s": float(y[keep].mean())}}


@cli_main
def main(argv=None) -> int:
    ap = Parser(prog="tangram-fit-host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HOST_COEFFS_PATH))
    ap.add_argument("--steps", type=int, default=1500, help="scheduler steps per (mode, H_p) configuration")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    check_at_least(("--steps", a.steps, MIN_STEPS), ("--seed", a.seed, 0))
    output_file(a.out)  # before the fit
    res = fit(a.steps, a.seed)
    res.update(command=f"python -m tangram.sim.fit_host --steps {a.steps} --seed {a.seed}",
               cpu=f"{platform.processor() or platform.machine()} ({platform.python_implementation()} "
                   f"{platform.python_version()}, numpy {np.__version__})",
               date=dt.date.today().isoformat())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    main()

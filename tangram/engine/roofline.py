"""Decode-step roofline: measured pure-decode step times of the real engine next to their bandwidth floor.

    python -m tangram.engine.roofline --out DIR [--config NAME=FILE.json ...] [--batches 1,8,32,64]
        [--contexts 2048,8192,32768] [--steps 15] [--profile-steps 3]
    (also ``tangram-bench --roofline --out DIR``)

For each configuration (a ``tangram-sim --config`` JSON: mode, H_p, alpha, split options; default: ``full`` and
``tangram`` at H_p 4, alpha 2) and each batch x context point, the engine's own executor runs pure-decode
steps on synthetic sessions whose KV pages are filled with random values: every row holds ``context`` logical
tokens, each head ``ceil(keep_ratio * context)`` of them (the scheduler's reservation), one token more each step.
Per point it reports

* ``wall_ms``: host time from one step's completion to the next's (host work, the input copy, the graph replay,
  lm_head and sampling, the token copy back), median over ``--steps`` steps: synchronous steps
  (:meth:`Executor.execute` end to end) by default, or with ``--async-steps`` the engine's asynchronous decode steps
  (each step launched before the previous one's tokens are read: ``launch`` / ``complete``, the harness's order);
  ``step_ms`` is the engine's own step time (``StepResult.duration_s``, CUDA events between completions when
  asynchronous); the profiler, events and host-timeline sections below always time synchronous steps
  (:meth:`Executor.execute`);
* ``gpu_ms`` / ``kernel_ms``: the device span of a step and the sum of its kernels, from ``torch.profiler`` on
  graph-replayed steps, with the kernel time split by operator (GEMMs, decode attention and its merge, the fused
  RoPE/KV write, norms, activation, lm_head/sampling, copies, other) and the idle time inside the span;
* ``events_*``: the same step eager with per-operator CUDA events (``ExecutorOptions.time_ops``);
* ``roofline_ms``: bytes a step must move (every weight read once: the layers' linear weights and lm_head, the
  embedding rows of the batch; every retained K/V read once; the new K/V written) over the device copy
  bandwidth measured in the same run (bytes read + written of a 2 GiB copy).

A point whose pages do not fit the memory left after the weights shares pages between rows ``b`` and ``b + R``
(``aliased`` rows): the kernels still read every byte from HBM (rows are launched in order, so an aliased page
is read again long after it left the 50 MB L2), only the pool is smaller. One mixed step per configuration
(the largest batch's decode rows plus one 512- and one 4096-token prefill chunk) shows what an eager mixed step
spends outside its kernels (the case for or against piecewise CUDA graphs). The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from tangram.cli import Parser, cli_main, output_dir
from tangram.planner import DECODE_ORDERS

CATEGORIES = (  # (name, kernel-name pattern), first match wins
    ("decode_attention", r"_decode_split_kernel"),
    ("decode_merge", r"_decode_merge_kernel"),
    ("rope_kv_write", r"_rope_qkv_kernel"),
    ("kv_write", r"index_put|indexing_backward|scatter_gather|index_select|IndexKernel|index_elementwise"),
    ("norm", r"_rms_norm_kernel|rms|norm"),
    ("activation", r"_silu_mul_kernel|silu"),
    ("prefill_attention", r"_prefill_(varlen|attn)_kernel"),
    ("compression", r"_snapkv|_select_scatter|_scatter_kernel|topk|sort|avg_pool|cumsum"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|Kernel2|splitK"),
    ("sampling", r"argmax|argMax|reduce_kernel.*(max|Max)|ArgMax"),
    ("copy", r"[Mm]emcpy|[Mm]emset|copy_kernel|CopyKernel|direct_copy"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise|catArray|CatArray|fill|embedding|Embedding"),
)


def categorize(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name):
            return cat
    return "other"


def weight_bytes(cfg, batch: int) -> int:
    """Weights one decode step reads: every layer's linear weights, lm_head, and the batch's embedding rows."""
    h, d, Hq, H, inter = cfg.hidden, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, cfg.intermediate
    per_layer = h * (Hq + 2 * H) * d + Hq * d * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, two norms
    return int((cfg.num_layers * per_layer + cfg.vocab * h + batch * h + h) * cfg.dtype_bytes)


def kv_bytes(cfg, lens: np.ndarray) -> int:
    """Retained K/V read by one step (``lens`` [rows, L, H] tokens after the step's write) plus the new K/V written."""
    tok = 2 * cfg.head_dim * cfg.dtype_bytes
    return int(lens.sum() * tok + lens.shape[0] * cfg.num_layers * cfg.num_kv_heads * tok)


def copy_bandwidth(torch, device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 30 copies of 2 GiB."""
    if device.type != "cuda":  # CPU smoke runs: a host copy, timed on the host
        a = torch.randn(2**24)
        b = torch.empty_like(a)
        t = time.perf_counter()
        b.copy_(a)
        return 2 * a.numel() * 4 / (time.perf_counter() - t)
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(30):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / float(np.median(ts))


class _Tokens:
    """A stand-in token stream: any position reads a fixed pseudo-random id; appends only count (the length tells an
    asynchronous step which rows' inputs are still on the device)."""

    def __init__(self, vocab: int, seed: int, length: int = 1 << 40):
        self.vocab, self.seed, self.n = vocab, seed, length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return (i * 2654435761 + self.seed) % self.vocab

    def __len__(self):
        return self.n

    def extend(self, x):
        self.n += len(x)

    def append(self, _):
        self.n += 1


class _Tables:
    """The block table the executor reads (``pages``, ``npages``), set directly instead of through the allocator."""

    def __init__(self, pages: np.ndarray, npages: np.ndarray):
        self.pages, self.npages = pages, npages

    def track_writes(self):  # the executor's device mirror: these tables never change after the first upload
        pass

    def take_writes(self):
        return np.zeros((0, 4), dtype=np.int64)


def point_tables(sched, batch: int, lens_max: np.ndarray, num_pages: int, rng, extra_rows: int = 0,
                 extra_lens: np.ndarray | None = None):
    """Pages for ``batch`` rows whose heads end at ``lens_max`` [L, H] tokens (plus ``extra_rows`` rows at
    ``extra_lens``): random distinct pages while the pool lasts, then rows wrap around (aliasing)."""
    lay = sched.layout
    P = lay.page_size
    tl = lay.table_lens(lens_max[None])[0]  # [T] tokens per table
    npg = -(-tl // P)
    rows = [npg] * batch
    if extra_rows:
        rows += [-(-lay.table_lens(extra_lens[None])[0] // P)] * extra_rows
    need = int(sum(r.sum() for r in rows))
    W = int(max(r.max() for r in rows))
    W = -(-W // 16) * 16
    perm = rng.permutation(num_pages).astype(np.int32)
    pages = np.full((len(rows), lay.n_tables, W), -1, dtype=np.int32)
    off, per_row = 0, int(rows[0].sum())
    aliased = need > num_pages
    fit_rows = batch if not aliased else max(1, num_pages // max(1, per_row))
    for r, n in enumerate(rows):
        if r < batch and aliased:
            off = (r % fit_rows) * per_row
        for t in range(lay.n_tables):
            k = int(n[t])
            pages[r, t, :k] = perm[(off + np.arange(k)) % num_pages]
            off += k
    return _Tables(pages, np.stack(rows).astype(np.int64)), aliased, (fit_rows if aliased else batch)


def build_config(name: str, path: str | None, model, args):
    """(EngineConfig, profile) of one named configuration."""
    from tangram.budgets import synthetic_profile
    from tangram.config import MODES, EngineConfig, default_heads_per_group

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if path is None and name not in MODES and name != "paper":
        raise SystemExit(f"error: --config {name}: a mode ({', '.join(MODES)}), 'paper' or NAME=FILE.json")
    # bare names: the paper's default configuration (H_p 4, alpha 2, rho 0.25) in that mode ('paper' = tangram);
    # H_p as every tool defaults it for a model whose KV heads 4 does not divide (SmolLM2's 3: 3)
    d = {"mode": name if name in MODES else "tangram", "heads_per_group": default_heads_per_group(model),
         "alpha": 2.0, "rho": 0.25}
    if path is not None:
        cfg = json.loads(Path(path).read_text())
        d.update({k: v for k, v in cfg.items() if k in fields and v is not None})
    d["cuda_graph_max_bs"] = max(args.batches)
    d["max_num_seqs"] = max(d.get("max_num_seqs", 256), max(args.batches))
    d["kv_pool_bytes"] = None
    eng = EngineConfig(**d)
    prof = synthetic_profile(model.num_layers, model.num_kv_heads, eng.rho, alpha=eng.alpha, seed=args.seed,
                             model=model.name)
    return eng, prof


def run_config(name, eng, prof, model, cfg, args, copy_bw, rng, log) -> tuple[list[dict], dict]:
    import torch

    from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
    from tangram.plan import StepPlan

    dev = args.device
    L, H = cfg.num_layers, cfg.num_kv_heads
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # blocks the caching allocator holds count as used in mem_get_info
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 2**31
    # the largest point's pages, at most what is free after a reserve for activations, graphs and logits
    probe = TimedScheduler(cfg, eng, prof, num_pages=1)
    ratio = probe.keep_ratio
    # tokens a point's rows grow by (timed, profiled, events, host timeline)
    grow = args.steps + 3 + args.profile_steps + 3 + 8 + 2 * HOST_STEPS + 2
    top = np.ceil(ratio * (max(args.contexts) + grow)).astype(np.int64)
    need_b = int(max(args.batches) * probe.layout.pages_for(probe.layout.table_lens(top[None])[0]).sum()
                 * probe.layout.page_bytes * 1.02) + 2**26
    pool_b = int(min(need_b, free - (args.reserve_gib * 2**30 if dev.type == "cuda" else 0)))
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=pool_b)
    fields = {f.name for f in dataclasses.fields(ExecutorOptions)}
    kw = dict(cuda_graphs="auto" if dev.type == "cuda" else "emulate",
              graph_max_context=max(args.contexts) + args.steps + 64)
    if args.async_steps:
        kw["async_steps"] = True
    if args.graph_layers is not None:
        kw["graph_layers"] = args.graph_layers
    if getattr(args, "decode_order", "request") != "request":
        kw["decode_order"] = args.decode_order
    if getattr(args, "decode_tile", None):
        from tangram.kernels.decode import DecodeConfig

        kw["decode_config"] = DecodeConfig(*map(int, args.decode_tile.split("x")))
    if "decode_costs" in fields and getattr(args, "routing", "costs") == "costs":  # regime routing by the GPU's costs
        from tangram.planner import DecodeCosts

        kw["decode_costs"] = DecodeCosts.for_gpu(args.gpu, cfg.name)
    exe = Executor(args.model_obj, sched, TokenSource(cfg.vocab, seed=args.seed), ExecutorOptions(**kw))
    streams: dict[int, _Tokens] = {}  # synthetic sessions: no scheduler requests behind the rows
    exe._stream = lambda rid: streams.get(rid) or _Tokens(cfg.vocab, rid)
    pool = exe.cache.pool
    step = max(1, pool.numel() // 16)
    for i in range(0, pool.numel(), step):  # random K/V everywhere (never time on zeros or NaN)
        pool.view(-1)[i:i + step].normal_()
    _sync(torch, dev)
    log(f"[{name}] pool {pool_b / 2**30:.1f} GiB ({sched.pool.num_pages} pages), H_p {sched.layout.heads_per_group}, "
        f"partition {eng.partition}")
    rows_out = []
    sn = [0]

    def plan_for(batch, lens, ctx, kp=0, pf=None):
        sn[0] += 1
        e = np.zeros(0, dtype=np.int64)
        p = StepPlan(step=sn[0], decode_ids=np.arange(batch, dtype=np.int64), decode_rows=np.arange(batch),
                     decode_ctx=np.full(batch, ctx, dtype=np.int64), decode_head_lens=lens.copy(),
                     prefill_ids=e, prefill_rows=e, prefill_start=e, prefill_tokens=e,
                     prefill_last=np.zeros(0, dtype=bool), prefill_head_lens=np.zeros((0, L, H), np.int64),
                     prefill_keep=np.zeros((0, L, H), np.int64), prefill_pages=np.zeros((0, 1), np.int64),
                     retention=sched.retention if hasattr(sched, "retention") else "static")
        if pf is not None:
            for k, v in pf.items():
                setattr(p, k, v)
        return p

    for batch in args.batches:
        for ctx in args.contexts:
            lens0 = np.minimum(ctx, np.ceil(ratio * ctx - 1e-9)).astype(np.int64)  # [L, H] slot order
            lens_end = lens0 + grow
            tabs, aliased, distinct = point_tables(sched, batch, lens_end, sched.pool.num_pages, rng)
            sched.bt = tabs
            lens = np.repeat(lens0[None], batch, axis=0)
            c = ctx
            streams.clear()
            streams.update({r: _Tokens(cfg.vocab, r, length=ctx + 1) for r in range(batch)})  # positions 0..ctx

            def nxt():
                nonlocal c
                lens[:] += 1
                c += 1
                return plan_for(batch, lens, c)
            _sync(torch, dev)
            times, durs, res = timed_steps(exe, nxt, args.steps, 3, args.async_steps)  # 3 warm-up steps (the first
            graphed = "engine_graph" in res.breakdown  # may capture this key's graph)
            prof_rows = profile_steps(exe, lambda: (lens.__iadd__(1), plan_for(batch, lens, c))[1], args.profile_steps)
            ev = events_split(exe, lambda: (lens.__iadd__(1), plan_for(batch, lens, c))[1], 2)
            ht = host_timeline(exe, lambda: (lens.__iadd__(1), plan_for(batch, lens, c))[1], HOST_STEPS)
            kvb = kv_bytes(cfg, lens)
            wb = weight_bytes(cfg, batch)
            roof = (kvb + wb) / copy_bw
            row = {"config": name, "mode": eng.mode, "hp": sched.layout.heads_per_group, "batch": batch, "context": ctx,
                   "graphed": graphed, "aliased": aliased, "distinct_rows": distinct, "weight_gb": wb / 1e9,
                   "kv_gb": kvb / 1e9, "roofline_ms": roof * 1e3, "wall_ms": float(np.median(times)) * 1e3,
                   "wall_p20_ms": float(np.percentile(times, 20)) * 1e3,
                   "wall_p80_ms": float(np.percentile(times, 80)) * 1e3, "step_ms": float(np.median(durs)) * 1e3,
                   "async_steps": bool(args.async_steps), "device_fed_rows": exe.device_fed, **prof_rows, **ev, **ht}
            row["of_roofline_wall"] = row["roofline_ms"] / row["wall_ms"]
            if row.get("gpu_ms"):
                row["of_roofline_gpu"] = row["roofline_ms"] / row["gpu_ms"]
            rows_out.append(row)
            log(f"[{name}] B={batch:3d} ctx={ctx:6d}: wall {row['wall_ms']:.2f} ms, gpu {row.get('gpu_ms', 0):.2f}, "
                f"kernels {row.get('kernel_ms', 0):.2f}, roofline {row['roofline_ms']:.2f} "
                f"({row['of_roofline_wall']:.0%} of wall){' aliased' if aliased else ''}")
    mixed = mixed_steps(exe, sched, cfg, eng, ratio, plan_for, rng, args, log, name)
    del exe, sched
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows_out, mixed


def timed_steps(exe, next_plan, n: int, warm: int, async_steps: bool) -> tuple[list, list, object]:
    """``n`` timed steps after ``warm`` untimed ones: (host seconds from the previous step's completion to each
    step's, the engine's step durations, the last result). Asynchronous: step i + 1 is launched before step i is
    completed (the harness's order), and one more step is launched and drained at the end."""
    times, durs = [], []
    if not async_steps:
        for i in range(n + warm):
            plan = next_plan()
            t = time.perf_counter()
            res = exe.execute(plan)
            if i >= warm:
                times.append(time.perf_counter() - t)
                durs.append(res.duration_s)
        return times, durs, res
    exe.launch(next_plan())
    t_prev = time.perf_counter()
    for i in range(n + warm):
        exe.launch(next_plan())
        res = exe.complete()
        t = time.perf_counter()
        if i >= warm:
            times.append(t - t_prev)
            durs.append(res.duration_s)
        t_prev = t
    exe.complete()
    return times, durs, res


def _sync(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def idle_before(starts: np.ndarray, ends: np.ndarray, cats: list[str]) -> dict[str, float]:
    """Idle time of one step (kernels sorted by start) charged to the kernel that starts after each gap: the gap
    is the time from the latest end of every earlier kernel to its start (overlapping kernels leave none)."""
    starts, ends = np.asarray(starts, np.float64), np.asarray(ends, np.float64)
    out: dict[str, float] = {}
    if starts.size < 2:
        return out
    before = np.maximum(0.0, starts[1:] - np.maximum.accumulate(ends)[:-1])
    for c, g in zip(cats[1:], before):
        out[c] = out.get(c, 0.0) + float(g)
    return out


def profile_steps(exe, next_plan, n: int) -> dict:
    """torch.profiler over ``n`` steps: per-step device span, kernel sum and idle, kernel time by category."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if n <= 0:
        return {}
    plans = [next_plan() for _ in range(n)]
    spans, cats, n_k = [], {}, 0
    if not torch.cuda.is_available():
        for p in plans:
            exe.execute(p)
        return {"profiler": "no CUDA device"}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for p in plans:
            exe.execute(p)
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not evs:
        return {"profiler": "no device events"}
    evs.sort(key=lambda e: e.time_range.start)
    # split into steps at gaps longer than any inside a step (the host sync between steps)
    starts = np.array([e.time_range.start for e in evs], dtype=np.float64)
    ends = np.array([e.time_range.end for e in evs], dtype=np.float64)
    gaps = starts[1:] - np.maximum.accumulate(ends)[:-1]
    cut = np.sort(np.argsort(gaps)[::-1][: n - 1]) + 1 if n > 1 and gaps.size >= n - 1 else np.array([], int)
    bounds = [0] + cut.tolist() + [len(evs)]
    busy = 0.0
    gaps_before = {}  # idle time inside a step ending at a kernel's start, by the category of that kernel
    cat_of = [categorize(e.name) for e in evs]
    for a, b in zip(bounds[:-1], bounds[1:]):
        s, e = starts[a:b], ends[a:b]
        spans.append(e.max() - s.min())
        for c, g in idle_before(s, e, cat_of[a:b]).items():
            gaps_before[c] = gaps_before.get(c, 0.0) + g
        # union of kernel intervals (overlap-safe)
        cur_s, cur_e, tot = s[0], e[0], 0.0
        for x, y in zip(s[1:], e[1:]):
            if x > cur_e:
                tot += cur_e - cur_s
                cur_s, cur_e = x, y
            else:
                cur_e = max(cur_e, y)
        busy += tot + (cur_e - cur_s)
    counts = {}
    for e, c in zip(evs, cat_of):
        cats[c] = cats.get(c, 0.0) + (e.time_range.end - e.time_range.start)
        counts[c] = counts.get(c, 0) + 1
        n_k += 1
    k = len(spans)
    out = {"gpu_ms": float(np.median(spans)) / 1e3, "kernel_ms": busy / k / 1e3,
           "idle_in_span_ms": (sum(spans) - busy) / k / 1e3, "kernels_per_step": n_k / k}
    out.update({f"k_{c}_ms": v / k / 1e3 for c, v in sorted(cats.items())})
    out.update({f"n_{c}": v / k for c, v in sorted(counts.items())})
    out.update({f"idle_before_{c}_ms": v / k / 1e3 for c, v in sorted(gaps_before.items())})
    # the longest gaps of the first step with the kernels around them, and the host ops that take the most time
    a, b = bounds[0], bounds[1]
    g = np.maximum(0.0, starts[a + 1:b] - np.maximum.accumulate(ends[a:b])[:-1])
    out["longest_gaps"] = [{"us": float(g[i]), "after": evs[a + i].name[:60], "before": evs[a + i + 1].name[:60],
                            "index": int(i + 1)} for i in np.argsort(g)[::-1][:8]]
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    out["host_top"] = [{"op": e.key[:60], "self_cpu_us_per_step": e.self_cpu_time_total / k, "calls_per_step": e.count / k}
                       for e in host[:12]]
    return out


HOST_STEPS = 5  # steps of host_timeline (it runs 2 n + 1)


def host_timeline(exe, next_plan, n: int) -> dict:
    """Where a graphed step's wall time goes, without a profiler: host time before the graph inputs are issued
    (gather, tables, upload), host time issuing the copies and replays, the GPU time of those copies and replays
    (CUDA events around them), and the rest of the step (waiting for the GPU, the token copy, bookkeeping); ms,
    means over ``n`` steps."""
    import torch

    g = exe.graphs
    if n <= 0 or g is None or not torch.cuda.is_available():
        return {}
    marks: list[tuple] = []
    run = g.run

    def timed_run(*a, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        out = run(*a, **kw)
        e1.record()
        marks.append((t0, time.perf_counter(), e0, e1))
        return out

    g.run = timed_run
    try:
        tot = np.zeros(5)
        k = 0
        for _ in range(n + 1):
            plan = next_plan()
            marks.clear()
            t = time.perf_counter()
            exe.execute(plan)
            t_end = time.perf_counter()
            if not marks or _ == 0:  # first: warm-up (a capture may land in it)
                continue
            t0, t1, e0, e1 = marks[0]
            tot += [t_end - t, t0 - t, t1 - t0, e0.elapsed_time(e1) / 1e3, t_end - t1]
            k += 1
        # the same steps under cProfile: the host functions that take the time (own time, per step)
        import cProfile
        import pstats

        pr = cProfile.Profile()
        plans = [next_plan() for _ in range(n)]
        pr.enable()
        for p in plans:
            exe.execute(p)
        pr.disable()
        st = pstats.Stats(pr)
        top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
        host_top = [{"fn": f"{Path(f).name}:{line}:{name}"[:80], "own_ms_per_step": v[2] / n * 1e3,
                     "cum_ms_per_step": v[3] / n * 1e3, "calls_per_step": v[1] / n} for (f, line, name), v in top]
    finally:
        del g.run  # the instance attribute; the class method shows through again
    if not k:
        return {}
    wall, pre, issue, gpu, rest = tot / k * 1e3
    return {"host_wall_ms": wall, "host_before_inputs_ms": pre, "host_issue_ms": issue, "gpu_replay_ms": gpu,
            "host_after_issue_ms": rest, "host_functions": host_top}


def events_split(exe, next_plan, n: int) -> dict:
    """The same steps eager with per-operator CUDA events (time_ops): seconds by operator, mean over n steps."""
    opts = exe.opts
    if n <= 0:
        return {}
    exe.opts = dataclasses.replace(opts, time_ops=True)
    try:
        exe.execute(next_plan())  # warm-up of the eager path
        tot: dict[str, float] = {}
        for _ in range(n):
            br = exe.execute(next_plan()).breakdown
            for k2, v in br.items():
                tot[k2] = tot.get(k2, 0.0) + v
    finally:
        exe.opts = opts
    return {f"events_{k2}_ms": v / n * 1e3 for k2, v in sorted(tot.items()) if k2 != "host"}


def mixed_steps(exe, sched, cfg, eng, ratio, plan_for, rng, args, log, name) -> dict:
    """Eager steps of the largest batch's decode rows plus one prefill chunk (``--mixed-chunks``, default 512 and 4096 tokens, over 8K cached
    tokens): wall time, device span and kernel time, i.e. what a piecewise graph could still remove."""

    batch, ctx = max(args.batches), min(8192, max(args.contexts))
    out = {}
    for c in args.mixed_chunks:
        cached = np.minimum(ctx, np.ceil(ratio * ctx - 1e-9)).astype(np.int64)
        keep = np.minimum(c, np.ceil(ratio * c - 1e-9)).astype(np.int64)
        lens0 = cached.copy()
        tabs, aliased, _ = point_tables(sched, batch, lens0 + 64, sched.pool.num_pages, rng, extra_rows=1,
                                        extra_lens=cached + keep + 16)
        sched.bt = tabs
        lens = np.repeat(lens0[None], batch, axis=0)
        pf = {"prefill_ids": np.array([batch + 10 ** 6]), "prefill_rows": np.array([batch]),
              "prefill_start": np.array([ctx]), "prefill_tokens": np.array([c]), "prefill_last": np.array([False]),
              "prefill_head_lens": cached[None].astype(np.int64), "prefill_keep": keep[None].astype(np.int64),
              "prefill_pages": tabs.npages[batch:batch + 1]}

        def nxt():
            lens[:] += 1
            return plan_for(batch, lens, ctx + 1, pf=pf)
        ts = []
        for i in range(5):
            t = time.perf_counter()
            exe.execute(nxt())
            ts.append(time.perf_counter() - t)
        if args.host_profile:
            host_profile(exe, nxt, args.host_profile, Path(args.out) / f"host_profile_{name}_chunk{c}.txt")
        pr = profile_steps(exe, nxt, 2)
        ev = events_split(exe, nxt, 1)
        r = {"wall_ms": float(np.median(ts[2:])) * 1e3, **pr, **ev}
        if r.get("gpu_ms"):
            r["host_bound_share"] = max(0.0, 1 - r["kernel_ms"] / r["wall_ms"])
        out[f"decode{batch}+chunk{c}"] = r
        log(f"[{name}] mixed B={batch} + chunk {c}: wall {r['wall_ms']:.2f} ms, gpu span {r.get('gpu_ms', 0):.2f}, "
            f"kernels {r.get('kernel_ms', 0):.2f} ms, compression {r.get('k_compression_ms', 0):.3f}, "
            f"prefill attention {r.get('k_prefill_attention_ms', 0):.3f}")
    return out


def host_profile(exe, next_plan, n: int, path: Path) -> None:
    """cProfile of ``n`` eager steps (host time by Python function, the device synchronised after each step), written
    to ``path`` sorted by own and by cumulative time: where a host-bound mixed step's milliseconds go."""
    import cProfile
    import io
    import pstats

    import torch

    plans = [next_plan() for _ in range(n)]
    cuda = torch.cuda.is_available()
    prof = cProfile.Profile()
    prof.enable()
    for p in plans:
        exe.execute(p)
        if cuda:
            torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    buf.write(f"# cProfile of {n} eager steps ({path.stem}), seconds over all {n}\n")
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    path.write_text(buf.getvalue())


def markdown(rows: list[dict], mixed: dict, copy_bw: float, meta: dict) -> str:
    lines = ["# Decode-step roofline", "", f"- device: {meta.get('device')}; copy bandwidth {copy_bw / 1e9:.0f} GB/s "
             "(read + written, measured in this run)", f"- command: `{meta.get('command')}`",
             f"- decode steps: {'asynchronous' if meta.get('async_steps') else 'synchronous'}", "",
             "| config | batch | context | roofline ms | wall ms | gpu ms | kernels ms | % of roofline (wall) | "
             "% (gpu) | GEMM | decode attn | merge | rope+KV write | norm | act | other kernels | idle in span | "
             "aliased |", "|" + "---|" * 18]
    for r in rows:
        ks = {c: r.get(f"k_{c}_ms", 0.0) for c, _ in CATEGORIES + (("other", ""),)}
        other = sum(v for c, v in ks.items() if c not in ("gemm", "decode_attention", "decode_merge",
                                                           "rope_kv_write", "norm", "activation"))
        lines.append(f"| {r['config']} | {r['batch']} | {r['context']} | {r['roofline_ms']:.2f} | {r['wall_ms']:.2f} | "
                     f"{r.get('gpu_ms', float('nan')):.2f} | {r.get('kernel_ms', float('nan')):.2f} | "
                     f"{r['of_roofline_wall']:.0%} | {r.get('of_roofline_gpu', float('nan')):.0%} | "
                     f"{ks['gemm']:.2f} | {ks['decode_attention']:.2f} | {ks['decode_merge']:.2f} | "
                     f"{ks['rope_kv_write'] + ks['kv_write']:.2f} | {ks['norm']:.2f} | {ks['activation']:.2f} | "
                     f"{other:.2f} | {r.get('idle_in_span_ms', float('nan')):.2f} | {'yes' if r['aliased'] else ''} |")
    cats = [c for c, _ in CATEGORIES + (("other", ""),) if any(f"idle_before_{c}_ms" in r for r in rows)]
    if cats:
        lines += ["", "## Idle inside the graph replay, by the kernel that waited (ms per step; launches per step)", "",
                  "Each gap between kernels is charged to the kernel that starts after it (its launch latency and the "
                  "drain of the one before).", "",
                  "| config | batch | context | " + " | ".join(cats) + " |", "|" + "---|" * (3 + len(cats))]
        for r in rows:
            lines.append(f"| {r['config']} | {r['batch']} | {r['context']} | " + " | ".join(
                f"{r.get(f'idle_before_{c}_ms', 0.0):.2f} ({r.get(f'n_{c}', 0):.0f})" for c in cats) + " |")
    if any("host_wall_ms" in r for r in rows):
        lines += ["", "## Host timeline of a graphed step (ms, no profiler; CUDA events around the replay)", "",
                  "| config | batch | context | step (host) | host before the inputs | host issuing copies + replays | "
                  "GPU copies + replays | host after issuing (wait, tokens, bookkeeping) |", "|" + "---|" * 8]
        for r in rows:
            if "host_wall_ms" in r:
                lines.append(f"| {r['config']} | {r['batch']} | {r['context']} | {r['host_wall_ms']:.2f} | "
                             f"{r['host_before_inputs_ms']:.2f} | {r['host_issue_ms']:.2f} | {r['gpu_replay_ms']:.2f} | "
                             f"{r['host_after_issue_ms']:.2f} |")
    if mixed:
        lines += ["", "## Mixed steps (eager): decode rows + one prefill chunk", "",
                  "| config | step | wall ms | gpu span ms | kernels ms | prefill attention ms | compression ms | "
                  "host-bound share |", "|---|---|---|---|---|---|---|---|"]
        for cfgname, d in mixed.items():
            for k, r in d.items():
                lines.append(f"| {cfgname} | {k} | {r['wall_ms']:.2f} | {r.get('gpu_ms', float('nan')):.2f} | "
                             f"{r.get('kernel_ms', float('nan')):.2f} | {r.get('k_prefill_attention_ms', 0):.3f} | "
                             f"{r.get('k_compression_ms', 0):.3f} | {r.get('host_bound_share', float('nan')):.0%} |")
    return "\n".join(lines) + "\n"


def _parser():
    p = Parser(prog="python -m tangram.engine.roofline", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (roofline.csv, roofline.json, roofline.md)")
    p.add_argument("--config", action="append", metavar="NAME[=FILE]",
                   help="a configuration: NAME=FILE (tangram-sim --config JSON), a bare mode name or 'paper' "
                        "(tangram; both with H_p 4, alpha 2, rho 0.25); repeatable (default: full, tangram)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset whose decode costs the split table reads")
    p.add_argument("--routing", choices=("costs", "alg1"), default="costs",
                   help="split maps: routed by the --gpu's decode costs (the engine's default), or Algorithm 1 capped "
                        "per context bucket alone (A/B knob)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--steps", type=int, default=15, help="timed steps per point")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler per point")
    p.add_argument("--reserve-gib", type=float, default=6.0, help="memory left free of the KV pool (GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill+decode steps")
    p.add_argument("--mixed-chunks", default="512,4096",
                   help="prefill chunk lengths of the mixed steps, comma-separated (default: 512,4096)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also run N mixed steps of each chunk under cProfile: host_profile_CONFIG_chunkC.txt")
    p.add_argument("--decode-tile", help="decode kernel tile BLOCK_NxWARPSxSTAGES (ExecutorOptions.decode_config; "
                   "default the shipped tile, tangram.kernels.decode.DEFAULT_CONFIG)")
    p.add_argument("--decode-order", choices=DECODE_ORDERS, default="request",
                   help="AOT decode launch order (ExecutorOptions.decode_order): request-major, or longest pieces "
                        "first (A/B knob)")
    p.add_argument("--graph-layers", type=int, help="layers per captured decode graph (ExecutorOptions.graph_layers; "
                   "0: one graph for the whole step)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (emulated graphs, no profiler)")
    p.add_argument("--num-layers", type=int, help="use only this many layers of the model (smoke runs)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                   help="BLAS library of the dense GEMMs (torch.backends.cuda.preferred_blas_library; an A/B knob: "
                        "the engine keeps torch's default)")
    p.add_argument("--async-steps", action=argparse.BooleanOptionalAction, default=False,
                   help="time asynchronous decode steps (ExecutorOptions.async_steps: the next step is launched "
                        "before the previous one's tokens are read); default: synchronous steps")
    return p


@cli_main
def main(argv=None) -> int:
    import torch

    from tangram.config import get_model
    from tangram.engine.weights import load_model

    a = _parser().parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.mixed_chunks = [int(x) for x in a.mixed_chunks.split(",")]
    if a.decode_tile and not (len(a.decode_tile.split("x")) == 3
                              and all(x.isdigit() and int(x) > 0 for x in a.decode_tile.split("x"))):
        print(f"error: --decode-tile: expected BLOCK_NxWARPSxSTAGES (e.g. 128x8x3), got {a.decode_tile!r}",
              file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: the roofline benchmark needs a CUDA GPU (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    out = output_dir(a.out)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    cfg = get_model(a.model)
    if a.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=a.num_layers)
    dev = a.device = torch.device(a.device)
    copy_bw = copy_bandwidth(torch, dev)
    log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + written)")
    model, _ = load_model(cfg, "random", dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32, device=dev,
                          seed=a.seed)
    a.model_obj = model
    rng = np.random.default_rng(a.seed)
    specs = a.config or ["full", "tangram"]
    rows, mixed = [], {}
    for spec in specs:
        name, _, path = spec.partition("=")
        eng, prof = build_config(name, path or None, cfg, a)
        r, mx = run_config(name, eng, prof, model, cfg, a, copy_bw, rng, log)
        rows += r
        if not a.no_mixed:
            mixed[name] = mx
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "copy_gbps": copy_bw / 1e9,
            "command": "python -m tangram.engine.roofline " + " ".join(argv if argv is not None else sys.argv[1:]),
            "torch": torch.__version__, "elapsed_s": time.time() - t0, "async_steps": bool(a.async_steps),
            "decode_tile": a.decode_tile or "default", "blas": a.blas, "decode_order": a.decode_order}
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / "roofline.csv", index=False)
    (out / "roofline.json").write_text(json.dumps({"meta": meta, "rows": rows, "mixed": mixed}, indent=1,
                                                  default=float))
    (out / "roofline.md").write_text(markdown(rows, mixed, copy_bw, meta))
    print(markdown(rows, mixed, copy_bw, meta))
    summary = {f"{r['config']}/B{r['batch']}/{r['context']}": round(r["of_roofline_wall"], 3) for r in rows}
    print(json.dumps({"copy_gbps": round(copy_bw / 1e9, 1), "of_roofline_wall": summary}, default=float))
    return 0


if __name__ == "__main__":
    main()

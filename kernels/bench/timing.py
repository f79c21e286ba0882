"""Timing helpers of the kernel benchmark: CUDA-graph replays timed with events, eager do_bench, host time."""
from __future__ import annotations

import subprocess
import time

import numpy as np
import torch

L2_BYTES = 50 * 2**20
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)



# ----------------------------------------------------------------------------- timing


def time_graph(fn, rep_ms: float = 10.0, max_iters: int = 300):
    """(median, p20, p80) ms of fn captured as one CUDA graph; eager do_bench if capture fails."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - some library launches cannot be captured
        torch.cuda.synchronize()
        log(f"graph capture failed ({type(e).__name__}: {str(e)[:80]}); eager timing")
        return time_eager(fn, rep_ms) + ("eager",)
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t, 1e-6) * 1e3
    n = int(min(max_iters, max(5, rep_ms / est)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = np.array([a.elapsed_time(b) for a, b in ev])
    del g
    return float(np.median(ts)), float(np.percentile(ts, 20)), float(np.percentile(ts, 80)), "graph"


def time_graph_calls(fn, calls: int = 20, rep_ms: float = 10.0):
    """(median, p20, p80) ms of one call of ``fn`` when ``calls`` of them run back to back inside one CUDA graph,
    as an engine's graph-replayed step runs its small kernels (a lone call would time the graph launch instead)."""
    med, p20, p80, *how = time_graph(lambda: [fn() for _ in range(calls)], rep_ms)
    return med / calls, p20 / calls, p80 / calls


def time_graphs(fns, rep_ms: float = 10.0, max_iters: int = 300):
    """:func:`time_graph` of several functions at once, their replays interleaved (a, b, a, b, ...) so clock or
    thermal drift between them cannot favour one: the like-with-like timer of a ratio. A list of (median, p20,
    p80, timer) in the order given; eager do_bench for all if any capture fails."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
            fn()
    torch.cuda.synchronize()
    graphs = []
    try:
        for fn in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs.append(g)
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        log(f"graph capture failed ({type(e).__name__}: {str(e)[:80]}); eager timing")
        return [time_eager(fn, rep_ms) + ("eager",) for fn in fns]
    t = time.perf_counter()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t, 1e-6) * 1e3
    n = int(min(max_iters, max(5, len(fns) * rep_ms / est)))
    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
          for _ in range(n)]
    for it in range(n):
        order = range(len(graphs)) if it % 2 == 0 else reversed(range(len(graphs)))
        for j in order:
            a, b = ev[it][j]
            a.record()
            graphs[j].replay()
            b.record()
    torch.cuda.synchronize()
    out = []
    for j in range(len(graphs)):
        ts = np.array([ev[it][j][0].elapsed_time(ev[it][j][1]) for it in range(n)])
        out.append((float(np.median(ts)), float(np.percentile(ts, 20)), float(np.percentile(ts, 80)), "graph"))
    del graphs
    return out


def kernel_launches(fn) -> float:
    """CUDA kernels one call of ``fn`` launches (torch.profiler; memsets and copies count), NaN if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return float(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    except Exception as e:  # noqa: BLE001
        log(f"kernel count unavailable: {e!r}")
        return float("nan")


def time_eager(fn, rep_ms: float = 15.0):
    import triton.testing as tt

    q = tt.do_bench(fn, warmup=5, rep=rep_ms, quantiles=[0.5, 0.2, 0.8], return_mode="median")
    return float(q[0]), float(q[1]), float(q[2])


def time_host(fn, reps: int = 7):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3



def driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return "unknown"



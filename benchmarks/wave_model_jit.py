"""Would a JIT compiler make the simulator's decode pricing cheap? A measured answer for the wave model.

The largest single piece of a replay's decode pricing is ``CostModel._lens_totals`` (each layer's bytes, the last
wave's CTA sizes, then :func:`tangram.planner.tail_layer_times`: per layer a sort of the last wave's CTAs and the
straggler sum). This captures its calls from a replay of the trace's first sessions, ports it to numba line for line
(numpy's pairwise summation reproduced, so the port must give the same seconds bit for bit), checks every captured
call against the numpy path and times both on the same calls, side by side in one process.

numba is not a dependency of Tangram: ``pip install numba`` first (the script says so and exits 2 without it).
Run: ``python benchmarks/wave_model_jit.py [TRACE] [--sessions 1500] [--calls 3000]``; the last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _port():
    import numba as nb

    @nb.njit(cache=False)  # cache=True breaks recursive functions (numba issue #6061): compiled per process
    def pairwise(a, lo, n):
        """numpy's pairwise_sum (umath loops_utils) over a[lo:lo + n]: what ndarray.sum does along a row."""
        if n < 8:
            res = 0.0
            for i in range(lo, lo + n):
                res += a[i]
            return res
        if n <= 128:
            r = np.empty(8)
            for j in range(8):
                r[j] = a[lo + j]
            i = 8
            while i < n - (n % 8):
                for j in range(8):
                    r[j] += a[lo + i + j]
                i += 8
            res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
            while i < n:
                res += a[lo + i]
                i += 1
            return res
        n2 = n // 2
        n2 -= n2 % 8
        return pairwise(a, lo, n2) + pairwise(a, lo + n2, n - n2)

    @nb.njit(cache=False)
    def lens_totals(flat, kd, l, H, L, offs, at, cut, tdst, w, grouped, tcnt, first, N, rates, tok_b, bw, fixed):
        layer = np.zeros(l, dtype=np.int64)
        for r in range(kd):
            for j in range(l):
                base = (r * l + j) * H
                for h in range(H):
                    layer[j] += flat[base + h]
        sub, diffs, per, out = np.zeros(l * w), np.empty(w), np.empty(l), np.empty(offs.size)
        for i in range(offs.size):
            o = offs[i]
            sub[:] = 0.0
            for j in range(at.size):
                sub[tdst[j]] = float(flat[at[j]] + o) / cut[j] * tok_b
            for j in range(l):
                total = float(layer[j] + o * (kd * H)) * tok_b
                row = sub[j * w:(j + 1) * w]
                if grouped:
                    cnt = tcnt[j]
                    body = (total - pairwise(row * cnt, 0, w)) / bw
                    order = np.argsort(row, kind="mergesort")
                    pos, prev = 0.0, 0.0
                    for q in range(w):
                        k = order[q]
                        diffs[q] = (row[k] - prev) * rates[min(int(pos) + first[j], N - 1)]
                        prev = row[k]
                        pos += cnt[k]
                else:
                    body = (total - pairwise(row, 0, w)) / bw
                    srt = np.sort(row)
                    prev = 0.0
                    for q in range(w):
                        diffs[q] = (srt[q] - prev) * rates[N - w + q]
                        prev = srt[q]
                per[j] = body + pairwise(diffs, 0, w) + fixed[j]
            out[i] = pairwise(per, 0, l) if l == L else per[0] * L
        return out

    @nb.njit(cache=False)
    def sort_rows(a):
        for j in range(a.shape[0]):
            a[j] = np.sort(a[j])
        return a

    return lens_totals, sort_rows


def capture(trace_path: str, sessions: int, calls: int):
    """The cost model and the first ``calls`` ``_lens_totals`` calls of a tangram replay (arguments and result)."""
    from tangram.cli import from_cli, parse
    from tangram.sim import costmodel
    from tangram.sim.cli import _parser
    from tangram.sim.run import simulate

    spec = from_cli(parse(_parser(), [trace_path, "--mode", "tangram"]))
    rec, inst = [], []
    orig = costmodel.CostModel._lens_totals

    def spy(self, *a):
        r = orig(self, *a)
        if len(rec) < calls:
            inst[:] = [self]
            rec.append((a, r))
        return r

    costmodel.CostModel._lens_totals = spy
    try:
        simulate(spec.load_trace().head(sessions), spec, "tangram", record_kv=False)
    finally:
        costmodel.CostModel._lens_totals = orig
    return inst[0], rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default="reports/traces/work/mooncake_12000.jsonl")
    ap.add_argument("--sessions", type=int, default=1500)
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args(argv)
    try:
        import numba
    except ImportError:
        print("error: numba is not installed (pip install numba): this benchmark times a numba port", file=sys.stderr)
        return 2
    from tangram.planner import _tail_rates, launch_fixed_times

    cm, rec = capture(a.trace, a.sessions, a.calls)
    jit, sort_rows = _port()
    c = cm.price_costs
    args = []
    for (lens0, offs, launch, n_partials, fixed, at, cut, L), _ in rec:
        fixed = launch_fixed_times(launch, c, gq=cm.gq, head_dim=cm.model.head_dim) if fixed is None else fixed
        kd, l, H = lens0.shape
        args.append((lens0.reshape(-1), kd, l, H, L, np.asarray(offs, dtype=np.int64), at, cut, launch.tdst,
                     launch.twidth, launch.grouped, launch.tcnt if launch.grouped else np.zeros((1, 1)), launch.first,
                     launch.n_occ, _tail_rates(launch.n_occ, float(c.bw), float(c.cta_bw), c.rate_model),
                     float(cm.tok_head_bytes), float(c.bw), fixed))
    differ = sum(not np.array_equal(jit(*x), r) for x, (_, r) in zip(args, rec))  # compiles on the first call
    t0 = time.perf_counter()
    for x, _ in rec:
        cm._lens_totals(*x)
    t_np = time.perf_counter() - t0
    t0 = time.perf_counter()
    for x in args:
        jit(*x)
    t_jit = time.perf_counter() - t0
    # the sort alone, on the widest captured tail: numpy's (SIMD) against numba's, [layers, width] row by row
    big = max(args, key=lambda x: x[2] * x[9])
    grid = np.random.default_rng(0).random((big[2], big[9]))
    sort_rows(grid.copy())
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        np.sort(grid, axis=-1)
    s_np = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        sort_rows(grid.copy())
    s_jit = (time.perf_counter() - t0) / reps
    res = {"calls": len(rec), "numba": numba.__version__, "numpy": np.__version__, "results_differ": differ,
           "grouped_calls": sum(bool(x[10]) for x in args),
           "numpy_us_per_call": round(t_np / len(rec) * 1e6, 1), "numba_us_per_call": round(t_jit / len(rec) * 1e6, 1),
           "sort_shape": [big[2], big[9]], "numpy_sort_us": round(s_np * 1e6, 1),
           "numba_sort_us": round(s_jit * 1e6, 1)}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

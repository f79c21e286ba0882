"""``tangram-bench``: replay a multi-turn trace through the real engine, one mode after another.

The trace is driven by the same harness as ``tangram-sim`` (:mod:`tangram.harness`):
first turns arrive open-loop at ``arrival_s``, later turns ``think_time_s`` after
the previous one finished. The clock is SimPy's virtual clock advanced by each
step's *measured* duration (GPU wall time + the scheduler's host time), so idle
gaps with nothing to run are skipped instead of slept through; latencies and
throughput are those of a server that ran the same steps back to back.
Writes the simulator's ``metrics.json`` / ``requests.csv`` schema plus ``report.md``.

After every mode a leak check asserts that every KV page is back in the pool
(all sessions ended); a leak exits with code 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path


from tangram.cli import cli_main, from_cli, output_dir, parse, refuse_replacing_inputs, spec_parser
from tangram.errors import ConfigError
from tangram.planner import DECODE_ORDERS

DEFAULT_OUT = "tangram-bench-out"
OUTPUT_FILES = ("metrics.json", "requests.csv", "report.md", "throughput.png", "probe.json")  # what it writes to --out
TABLE_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "preemptions", "session_evictions", "steps",
              "leak_ok"]


def _parser() -> argparse.ArgumentParser:
    p = spec_parser("tangram-bench", __doc__, ("deployment", "trace", "engine", "run", "output"),
                    defaults={"out": DEFAULT_OUT})
    p.add_argument("--time-ops", action="store_true", help="per-operator times with CUDA events (slower; every step "
                   "eager)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up (kernel compilation; only on "
                   "CUDA: a CPU run never warms up)")
    p.add_argument("--async-steps", action="store_true",
                   help="asynchronous decode steps: a graphed pure-decode step is planned and launched before the "
                        "previous one's tokens reach the host (ExecutorOptions.async_steps; one GPU only)")
    p.add_argument("--decode-order", choices=DECODE_ORDERS, default="request",
                   help="AOT decode launch order (ExecutorOptions.decode_order): request-major (what the shipped "
                        "decode costs were fitted on), the longest pieces first (faster on multi-wave batches: "
                        "reports/engine/roofline/README.md; the simulator prices request order), or paired (longest "
                        "first, and a graphed step's first wave balanced per SM)")
    p.add_argument("--probe", nargs="?", const="run", metavar="FILE",
                   help="record this machine's probe (tangram-probe, about 20 s; or a probe JSON) and the scales it "
                        "gives the shipped cost tables, in metrics.json and probe.json")
    p.add_argument("--no-plots", action="store_true")
    return p


def device_dtype(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, got {device!r}")
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype == "auto":
        dt = torch.bfloat16 if device == "cuda" else torch.float32
    elif dtype in table:
        dt = table[dtype]
    else:
        raise ConfigError(f"--dtype must be auto, bf16, fp16 or fp32, got {dtype!r}")
    return torch.device(device), dt


def trace_kv_bound_bytes(trace, model_cfg, engine) -> int:
    """KV bytes (at the model's dtype) a trace can never outgrow: every session's whole context resident and
    uncompressed at once, plus a chunk and a page (every table's partial last page) per session, twice over. A pool
    this large never evicts, preempts or reaches the admission watermark (1% of the pool), so any larger pool serves
    the trace identically (64 MiB more for block-table slack on tiny traces)."""
    tot = session_tokens(trace)
    tokens = sum(tot.values()) + len(tot) * (engine.chunk_size + engine.page_size)
    per_token = model_cfg.num_layers * model_cfg.num_kv_heads * 2 * model_cfg.head_dim * model_cfg.dtype_bytes
    return 2 * tokens * per_token + 2**26


def pool_bytes_for(model_cfg, gpu, engine, device, elem_bytes: int | None = None, trace=None) -> int:
    """The preset-derived KV pool (bytes at the model's dtype, as the layout counts pages), never more than the
    device has free now: on CUDA its free memory x ``gpu_memory_utilization`` minus the activation reserve, on the
    CPU half the memory available now (the host runs more than the engine). ``elem_bytes``: the pool's actual
    element size (4 when the engine runs in float32, as on the CPU), which the cap is measured in: a float32 pool
    sized from the GPU preset asked the CPU for 139 GB. On the CPU, given the ``trace``, also never more than
    :func:`trace_kv_bound_bytes` (the same run: the pool is NaN-filled at creation, and filling half a host's memory
    took 15 s of a 30 s smoke run on this 24 GiB machine, per mode)."""
    import os

    import torch

    from tangram.config import kv_pool_bytes

    b = kv_pool_bytes(model_cfg, gpu, engine)
    scale = (elem_bytes or model_cfg.dtype_bytes) / model_cfg.dtype_bytes
    if engine.kv_pool_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            b = min(b, int((free * engine.gpu_memory_utilization - engine.activation_reserve_bytes) / scale))
        elif device.type == "cpu":
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            b = min(b, int(avail * 0.5 / scale))
            if trace is not None:
                b = min(b, trace_kv_bound_bytes(trace, model_cfg, engine))
    if b <= 0:
        raise ConfigError("no memory left for the KV pool (give its size with --kv-pool-gib)")
    return b


def _mini_trace(engine):
    from tangram.traces.format import Trace, Turn

    c = engine.chunk_size
    turns = []
    for s in range(3):
        sid = f"warm{s}"
        turns.append(Turn(f"{sid}:0", sid, 0, 0.0, 0.0, int(c + c // 2 + 7 * s), 4))
        turns.append(Turn(f"{sid}:1", sid, 1, None, 0.0, 33 + s, 4))
    return Trace(turns)


def session_tokens(trace) -> dict[str, int]:
    """Each session's tokens: every turn's new prompt tokens and output (its whole context at the end)."""
    tot: dict[str, int] = {}
    for t in trace.turns:
        tot[t.session_id] = tot.get(t.session_id, 0) + t.new_tokens + t.output_tokens
    return tot


def max_session_tokens(trace) -> int:
    """The longest session's tokens: what one block table can hold at most."""
    return max(session_tokens(trace).values(), default=1)


class GcPauses:
    """Seconds the run spent in Python's garbage collector (a host stall inside whatever step it hit)."""

    def __init__(self):
        self.s, self.n, self._t = 0.0, 0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.s += time.perf_counter() - self._t
            self.n += 1

    def __enter__(self):
        import gc

        gc.collect()
        gc.freeze()  # the model, pool and tables are long-lived: later collections need not scan them
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self)
        gc.unfreeze()


class TritonCompiles:
    """Triton kernels compiled while the clock runs (a new specialisation of an integer argument or pointer
    alignment costs a compile inside some step): kernel, seconds, and which arguments' classes ("== 1",
    "divisible by 16", pointer alignment) differ from the nearest compile of the same kernel before the run
    (the warm-up's), from Triton's JIT hooks. Enter it before the warm-up and call :meth:`start` with the clock."""

    def __init__(self):
        self.items: list[dict] = []  # compiles after start()
        self.before: dict[str, list[dict]] = {}  # kernel -> argument classes of each compile before start()
        self._t0: dict = {}
        self._prev = None
        self.running = True  # without start(): every compile counts (the hooks only cover the run)

    def start(self) -> None:
        self.items, self.running = [], True

    @staticmethod
    def classes(compile: dict) -> dict[str, str]:
        """Argument name -> its specialisation class: type, ``=value`` for a constant, ``/16`` when Triton
        assumed divisibility by 16 (integers) or 16-byte alignment (pointers)."""
        sig = compile.get("signature") or {}
        names = list(sig)
        const = {k[0] if isinstance(k, tuple) else k: v for k, v in (compile.get("constants") or {}).items()}
        attrs = (compile.get("configs") or [{}])[0] or {}
        div = {k[0] if isinstance(k, tuple) else k for k, v in attrs.items()
               if any("divisibility" in str(a) for a in v)}
        out = {}
        for i, n in enumerate(names):
            c = str(sig[n])  # a constexpr (declared, or an integer Triton specialised to 1) shows its value
            if i in const or n in const:
                c += f"={const.get(i, const.get(n))}"
            if i in div:
                c += "/16"
            out[n] = c
        return out

    def _before(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self._t0[id(key)] = time.perf_counter()
        return None  # falsy: compile as usual

    def _after(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        t0 = self._t0.pop(id(key), None)
        cls = self.classes(compile or {})
        if not self.running:
            self.before.setdefault(fn.name, []).append(cls)
            return None
        item = {"kernel": fn.name, "signature": repr, "s": None if t0 is None else time.perf_counter() - t0}
        prior = self.before.get(fn.name)
        if prior:  # the arguments whose class differs from the closest earlier compile
            near = min(prior, key=lambda p: sum(p.get(k) != v for k, v in cls.items()))
            item["differs"] = {k: f"{near.get(k)} -> {v}" for k, v in cls.items() if near.get(k) != v}
        elif cls:
            item["differs"] = "no compile of this kernel before the run"
        self.items.append(item)
        return None

    def summary(self, keep: int = 20) -> dict:
        return {"count": len(self.items), "seconds": sum(i["s"] or 0.0 for i in self.items),
                "first": self.items[:keep]}

    def __enter__(self):
        from triton import knobs

        rt = knobs.runtime
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev


def run_mode(trace, spec, mode: str, model, *, device, seed: int = 0, sampling=None, time_ops: bool = False,
             tokenizer=None, progress=None, warmup: bool = True, dynamic_keep: str = "topk",
             wrap=None, cuda_graphs: str = "auto", async_steps: bool = False,
             decode_order: str = "request") -> tuple[dict, object, dict]:
    """Serve the trace in one mode; returns (summary, ClusterResult, leak check).

    ``wrap(executor) -> executor-like`` interposes on every step (the engine-overhead calibration records
    each step's plan and measured time through it). Decode graphs are captured before the clock starts."""
    with TritonCompiles() as tc:  # from the warm-up on: in-run compiles are compared with the warm-up's
        tc.running = False
        return _run_mode(trace, spec, mode, model, tc, device=device, seed=seed, sampling=sampling,
                         time_ops=time_ops, tokenizer=tokenizer, progress=progress, warmup=warmup,
                         dynamic_keep=dynamic_keep, wrap=wrap, cuda_graphs=cuda_graphs, async_steps=async_steps,
                         decode_order=decode_order)


def _run_mode(trace, spec, mode, model, tc, *, device, seed, sampling, time_ops, tokenizer, progress, warmup,
              dynamic_keep, wrap, cuda_graphs, async_steps=False, decode_order="request"):
    import torch

    from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
    from tangram.engine.sampling import SamplingParams
    from tangram.harness import Cluster, summarize

    engine = spec.engine.with_(mode=mode)
    pool_b = pool_bytes_for(spec.model, spec.gpu, engine, device, next(model.parameters()).element_size(), trace)
    max_ctx = max_session_tokens(trace)
    opts = ExecutorOptions(sampling=sampling or SamplingParams(seed=seed), time_ops=time_ops,
                           dynamic_keep=dynamic_keep, cuda_graphs=cuda_graphs, graph_max_context=max_ctx,
                           async_steps=async_steps, decode_order=decode_order,
                           decode_costs=routing_costs(spec))
    # the warm-up compiles the Triton kernels and fills their caches; on the CPU nothing compiles (the kernels' torch
    # references, or the interpreter), and the mini trace's chunk-size prompts cost minutes of float64 attention
    if warmup and torch.device(device).type == "cuda":
        ws = TimedScheduler(spec.model, engine, spec.profile, pool_bytes=pool_b)
        wx = Executor(model, ws, TokenSource(spec.model.vocab, seed + 7), opts)
        Cluster(_mini_trace(engine), [(ws, wx)], spec.router, record_kv=False).run()
        n_occ = wx.n_occ
        del wx, ws  # the caching allocator keeps their blocks, so the measured run does not cudaMalloc them again
        import gc

        gc.collect()  # the executor and its decode graphs form a cycle (graph body -> executor): free them now
        opts = dataclasses.replace(opts, n_occ=n_occ)
    sched = TimedScheduler(spec.model, engine, spec.profile, pool_bytes=pool_b)
    exe = Executor(model, sched, TokenSource.from_trace(trace, spec.model.vocab, seed, tokenizer), opts)
    if not time_ops:
        # a session has one turn in flight at a time, so no decode batch is larger than the session count
        exe.capture_graphs(max_ctx, max_batch=len({t.session_id for t in trace.turns}))
    g0 = dataclasses.replace(exe.graphs.stats) if exe.graphs is not None else None
    with GcPauses() as gcp:
        tc.start()
        t = time.perf_counter()
        res = Cluster(trace, [(sched, wrap(exe) if wrap is not None else exe)], spec.router,
                      progress=progress).run()
        wall = time.perf_counter() - t
    leak = leak_check(sched)
    summ = summarize(res, engine, [exe])
    summ.update({"wall_s": wall, "kv_pool_bytes": pool_b, "kv_pool_pages": sched.pool.num_pages,
                 "leak_check": leak, "leak_ok": leak["ok"],
                 "dynamic_keep": dynamic_keep if engine.retention == "global" else None, "peak_kv_gib": summ["peak_kv_bytes"] / 2**30,
                 "gc_pauses": {"count": gcp.n, "seconds": gcp.s}, "triton_compiles_in_run": tc.summary()})
    if exe.graphs is not None:
        gs = exe.graphs.stats
        summ["cuda_graphs"] = {"emulated": exe.graphs.emulate, "max_batch": engine.graph_max_batch,
                               "captured_before_run": g0.captures, "capture_before_run_s": g0.capture_s,
                               "captured_in_run": gs.captures - g0.captures,
                               "capture_in_run_s": gs.capture_s - g0.capture_s,
                               "replays": gs.replays, "regrows": gs.regrows,
                               "keys": [list(k) for k in dict.fromkeys(gs.keys)]}
    else:
        summ["cuda_graphs"] = None
    del exe
    import gc

    gc.collect()  # the executor <-> decode graphs cycle holds the KV pool until collected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summ, res, leak


def leak_check(sched) -> dict:
    """Every page back in the pool once every session ended; rows of the block table all free. The shared-prefix
    cache's pages, held by no row once every session ended, are evicted first (counted as prefix_cache_pages)."""
    cached = sched.clear_prefix_cache()
    used = int(sched.pool.n_used)
    table = int(sched.bt.npages.sum())
    open_sessions = sorted(sid for sid, s in sched.sessions.items() if s.parked is not None or s.busy)
    ok = used == 0 and table == 0 and not open_sessions and not sched.running
    out = {"ok": bool(ok), "pages_in_use": used, "pages_in_tables": table, "pages_total": int(sched.pool.num_pages),
           "open_sessions": open_sessions[:10], "running": len(sched.running)}
    if sched.stats.prefix_turns:
        out["prefix_cache_pages"] = cached
    return out


def run(args, *, tp_rank0: bool = False) -> dict:
    """The bench; with ``--tp N`` (N > 1) it launches N processes (tangram.engine.tp) and this runs on rank 0
    (``tp_rank0``), serving each mode through :func:`tangram.engine.tp.run_mode_tp`."""
    import torch
    from tqdm import tqdm

    from tangram.engine.sampling import SamplingParams
    from tangram.engine.weights import load_model
    from tangram.metrics import records_frame, write_metrics, write_requests_csv

    spec = from_cli(args)
    if spec.engine.tp > 1 and getattr(args, "async_steps", False):
        raise ConfigError("--async-steps: tensor-parallel steps are synchronous (use --tp 1)")
    if spec.engine.tp > 1 and getattr(args, "decode_order", "request") != "request":
        raise ConfigError(f"--decode-order {args.decode_order}: tensor-parallel ranks launch in request order "
                          "(use --tp 1)")
    if spec.engine.tp > 1 and not tp_rank0:
        from tangram.engine.tp import run_bench

        return run_bench(args, spec)
    out = output_dir(spec.out)  # before any work: an unwritable --out must not throw a finished run away
    refuse_replacing_inputs([out / n for n in OUTPUT_FILES], "--out",
                            {"the trace": spec.trace, "the --config file": getattr(args, "config", None)})
    trace, modes = spec.load_trace(), spec.mode_list
    device, dtype = device_dtype(spec.device, spec.dtype)
    seed = spec.seed
    mode_runner = run_mode
    extra = {"async_steps": True} if args.async_steps else {}
    if getattr(args, "decode_order", "request") != "request":
        extra["decode_order"] = args.decode_order
    if tp_rank0:  # the full model on the CPU, sharded per mode onto this rank's device
        from tangram.engine.tp import run_mode_tp as mode_runner
    model, info = load_model(spec.model, spec.weights, dtype=dtype, device="cpu" if tp_rank0 else device, seed=seed)
    if model.cfg.num_layers != spec.model.num_layers or model.cfg.num_kv_heads != spec.model.num_kv_heads:
        raise ConfigError(f"weights {spec.weights} do not have {spec.model.name}'s shape")
    tokenizer = None
    if info.get("gguf_path") and any(t.text for t in trace.turns):
        from tangram.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(info["gguf_path"])
    sampling = SamplingParams(spec.temperature, spec.top_p, seed)
    dyn = spec.dynamic_keep
    if dyn == "auto":
        dyn = "profile" if info.get("source") == "random" else "topk"
    probe_rec = record_probe(args.probe, spec, device, out) if args.probe else None
    total = len(trace.turns) * len(modes)
    bar = tqdm(total=total, desc="tangram-bench", unit="req", file=sys.stderr, leave=False, disable=None)
    metrics, frames, leaks = {}, [], {}
    for mode in modes:
        bar.set_postfix_str(mode)
        summ, res, leak = mode_runner(trace, spec, mode, model, device=device, seed=seed, sampling=sampling,
                                   time_ops=args.time_ops, tokenizer=tokenizer, progress=bar.update,
                                   warmup=not args.no_warmup, dynamic_keep=dyn, **extra)
        metrics[mode] = summ
        frames.append(records_frame(res.records, mode=mode))
        leaks[mode] = leak
    bar.close()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if tp_rank0:
        dev_name = f"{spec.engine.tp} x {dev_name}"
    common = {"trace": str(spec.trace_path), "model": spec.model.name, "weights": info.get("source"),
              "device": dev_name, "dtype": str(dtype).replace("torch.", ""), "gpu_preset": spec.gpu.name,
              "seed": seed, "profile": spec.profile_label, "sampling": dataclasses.asdict(sampling), "clock": "virtual, advanced by measured step durations; idle gaps skipped",
              "dynamic_keep": dyn, "async_steps": bool(args.async_steps),
              "decode_order": getattr(args, "decode_order", "request")}
    if probe_rec is not None:
        common["probe"] = probe_rec
    for m in metrics.values():
        m["run"] = common
    out.mkdir(parents=True, exist_ok=True)
    write_metrics(out / "metrics.json", metrics)
    write_requests_csv(out / "requests.csv", frames)
    write_report(out, metrics, common, argv=getattr(args, "_argv", None), plots=not args.no_plots)
    _print_table(metrics)
    for mode, lk in leaks.items():
        print(f"leak check {mode}: {'ok' if lk['ok'] else 'LEAK'} ({lk['pages_in_use']} of {lk['pages_total']} "
              f"pages in use after the run)")
        for r in lk.get("ranks", ()):
            print(f"  rank {r['rank']}: {r['pages_in_use']} of {r['pages_total']} rank pages in use "
                  f"(peak {r['pages_peak']})")
    print(f"wrote {out}/metrics.json, requests.csv, report.md")
    return metrics


def routing_costs(spec):
    """The decode costs the engine's AOT routing chooses split maps with: the simulator's for the same spec, so it
    launches the maps the simulator prices. Tables already resolved (``tangram-validate --probe`` rescales them to
    the machine): that set's (``CostTables.decode_costs``, transfer and probe applied); else the GPU's own, a
    pinned folder's, or transferred ones (``DecodeCosts.for_gpu``, found by path: the engine does not import the
    simulator)."""
    from tangram.planner import DecodeCosts

    t = spec.tables
    if hasattr(t, "decode_costs"):
        return t.decode_costs(spec.model.name)
    return DecodeCosts.for_gpu(spec.gpu.name, spec.model.name, None if t in (None, "auto") else t)


def record_probe(arg: str, spec, device, out: Path) -> dict:
    """Run (``arg == "run"``) or read the machine probe; what it measured and the scales it gives the tables that
    would price this run (``tangram.sim.transfer.rescale``). The probe JSON is written to ``out/probe.json``."""
    from tangram.sim.probe import load_probe, run_probe, save_probe
    from tangram.sim.tables import resolve as resolve_tables

    if arg == "run":
        probe = run_probe([spec.model], device=device.type, command="tangram-bench --probe")
    else:
        probe = load_probe(arg)
    path = save_probe(probe, out / "probe.json")
    t = resolve_tables(spec.tables, spec.gpu, probe)
    last = t.provenance[-1] if t.provenance else {}
    rec = {"file": str(path), "device": probe["device"].get("name"), "elapsed_s": probe.get("elapsed_s"),
           "copy_gbps": (probe.get("copy") or {}).get("gbps"), "skipped": probe.get("skipped", []),
           "tables": str(t.directory) if t.directory is not None else None,
           "scales": last.get("scales"), "label": last.get("label")}
    print(f"probe: {rec['label']}", flush=True)
    return rec


def write_report(out: Path, metrics: dict, common: dict, *, argv=None, plots: bool = True) -> Path:
    from tangram.metrics import markdown_table, plot_throughput

    lines = ["# tangram-bench report", ""]
    if argv is not None:
        lines += ["Command: `tangram-bench " + " ".join(argv) + "`", ""]
    for k in ("trace", "model", "weights", "device", "dtype", "profile", "clock", "dynamic_keep"):
        lines.append(f"- {k}: {common.get(k)}")
    if common.get("probe"):
        pr = common["probe"]
        lines.append(f"- machine probe ({pr['file']}, {pr['elapsed_s']:.1f} s): {pr['label']}")
    lines += ["", "## Results", "", markdown_table(metrics, TABLE_COLS), ""]
    base = metrics.get("full", {}).get("throughput_rps")
    if base:
        lines += ["Throughput relative to `full`: " + ", ".join(
            f"{m} {v['throughput_rps'] / base:.2f}x" for m, v in metrics.items() if v.get("throughput_rps")), ""]
    lines += ["## Leak check", ""]
    for m, v in metrics.items():
        lk = v["leak_check"]
        lines.append(f"- {m}: {'ok' if lk['ok'] else 'LEAK'}: {lk['pages_in_use']} of {lk['pages_total']} pages in "
                     f"use after the run, {lk['running']} running")
    tps = {m: v["tp"] for m, v in metrics.items() if v.get("tp")}
    if tps:
        lines += ["", "## Tensor parallelism (per rank)", "",
                  "| mode | tp | placement | KV pages peak per rank | pages max/mean | step s per rank | "
                  "operators s per rank (--time-ops; collectives and GEMMs excluded) | max/mean |", "|---" * 8 + "|"]
        for m, t in tps.items():
            comp = t.get("rank_compute_s")
            cells = [m, t["tp"], t["placement"], " ".join(str(x) for x in t["rank_pages_peak"]),
                     f"{t['pages_peak_max_over_mean']:.3f}", " ".join(f"{x:.3f}" for x in t["rank_step_s"]),
                     " ".join(f"{x:.3f}" for x in comp) if comp else "-",
                     f"{t['step_time_imbalance']:.3f}" if comp else "-"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        for m, v in metrics.items():
            for r in v["leak_check"].get("ranks", ()):
                lines.append(f"- {m} rank {r['rank']}: {r['pages_in_use']} of {r['pages_total']} rank pages in use "
                             f"after the run")
    rej = {m: v.get("rejected_reasons", {}) for m, v in metrics.items() if v.get("rejected_reasons")}
    if rej:
        lines += ["", "## Rejections", ""] + [f"- {m}: {r}" for m, r in rej.items()]
    ops = sorted({k for v in metrics.values() for k in v.get("time_by_operator_s", {})})
    if ops:
        lines += ["", "## Time by operator (s, summed over steps)", "",
                  "| mode | " + " | ".join(ops) + " |", "|---" * (len(ops) + 1) + "|"]
        for m, v in metrics.items():
            t = v.get("time_by_operator_s", {})
            lines.append(f"| {m} | " + " | ".join(f"{t.get(o, 0.0):.3f}" for o in ops) + " |")
    if plots:
        try:
            lines += ["", f"![throughput]({plot_throughput(out / 'throughput.png', metrics).name})"]
        except Exception as e:  # plotting is optional; the numbers are in the table
            lines += ["", f"(plot skipped: {e})"]
    p = out / "report.md"
    p.write_text("\n".join(lines) + "\n")
    return p


def _print_table(metrics: dict) -> None:
    import pandas as pd

    df = pd.DataFrame({m: {c: v.get(c) for c in TABLE_COLS} for m, v in metrics.items()}).T
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(df.to_string())


@cli_main
def main(argv=None) -> int:
    metrics = run(parse(_parser(), argv))
    return 0 if all(m["leak_ok"] for m in metrics.values()) else 1


if __name__ == "__main__":
    main()

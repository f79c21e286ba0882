"""``tangram-probe``: a short measurement of the machine at hand, against which the shipped cost tables are rescaled.

H100s of one pool ran the same engine work up to 16% apart (reports/validation/README.md, session 6), so tables
measured on one machine misprice another. The probe times a few points that are also points of the shipped
tables, each the way ``tangram.kernels.bench`` timed it, so that probe / table is a ratio of like to like:

* ``copy``: a 2 GiB device-to-device copy (4 GiB read + written), ``triton.testing.do_bench`` median: the HBM
  bandwidth that the element-wise kernels scale with (meta.json ``copy_gbps``);
* ``gemm``: ``torch.matmul`` of the model's five GEMM shapes (qkv, o, gate_up, down, lm_head) at 1, 16, 128, 512,
  2048 and 8192 tokens, do_bench median with L2 flushed between calls (gemm.csv): few tokens stream the weights
  (bandwidth-bound), many are tensor-core bound, and the ratio is interpolated in tokens between them;
* ``decode``: the engine's AOT decode kernel (``tangram_aot``, rho 1, H_p = H) at B = 1 x 1K tokens (its launch
  floor) and B = 64 x 8K tokens (its streaming rate), a CUDA graph of ``n_calls`` layer calls on distinct random
  pages replayed and timed with events (decode_attention.csv);
* ``prefill``: the prefill attention kernel at a 2048-token chunk over 8K cached tokens (prefill_attention.csv).

On an H100 the whole probe took 13.2 s with a cold Triton cache and 6.4 s warm (17 and 9.5 s of wall time with
the imports; reports/transfer/h100_probe_check); points left when ``budget_s`` runs
out are skipped and listed, and their tables stay unscaled. Without a GPU (``--device cpu``) it times tiny GEMMs
and a small copy on the CPU with ``time.perf_counter`` (a protocol check: CPU numbers rescale nothing meaningfully)
and skips the kernels. The JSON (:func:`check_probe` is its schema) records the device, software and the command.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError, InputError
from tangram.cli import Parser, cli_main, output_file, parse

KIND = "tangram-probe"
VERSION = 1
GEMM_TOKENS = (1, 16, 128, 512, 2048, 8192)
GEMM_REP_MS = 40.0  # do_bench's rep: milliseconds of repeated calls per GEMM point
# GEMM and prefill points are timed this many times, the median kept: one do_bench median once read 0.102 ms for a
# GEMM whose neighbours in tokens read 0.023 and 0.091 (an H100 of 2026-11-27), a 2.8x factor the rescale applied
POINT_REPEATS = 3
TINY_TOKENS = (1, 4)
TINY_MAX_WEIGHT = 4 * 2**20  # elements: a tiny (CPU) probe skips larger GEMM weights
COPY_BYTES = 2 * 2**30  # one buffer; read + written = 4 GiB, as kernels/bench.py's copy_bandwidth
DECODE_POINTS = ((1, 1024), (64, 8192))  # (batch, context), rho 1.0, H_p = H
DECODE_WAVES = 4.0  # the AOT waves of the shipped decode sweep (meta.json aot_waves)
PREFILL_POINT = (2048, 8192)  # (chunk, cached tokens per head before compression)
PAGE = 16
L2_BYTES = 50 * 2**20  # kernels/bench.py: a decode replay moves > 4x this


def gemm_shapes(model) -> dict[str, tuple[int, int]]:
    """(n, k) of each GEMM of a layer, and the lm_head (the cost model's ``gemm_shapes``)."""
    h, d, Hq, H = model.hidden, model.head_dim, model.num_q_heads, model.num_kv_heads
    return {"qkv": ((Hq + 2 * H) * d, h), "o": (h, Hq * d), "gate_up": (2 * model.intermediate, h),
            "down": (h, model.intermediate), "lm_head": (model.vocab, h)}


def decode_n_calls(model, batch: int, context: int) -> int:
    """Layer calls per graph replay, as kernels/bench.py's decode_point: enough distinct pages to exceed 4x L2."""
    per_layer = batch * model.num_kv_heads * context * 2 * model.head_dim * 2
    return int(min(2 * model.num_layers, max(1, math.ceil(4 * L2_BYTES / max(per_layer, 1)))))


# ----------------------------------------------------------------------------- timers


class CudaTimers:
    """The kernels bench's own timers (do_bench median; CUDA-graph replays for decode) on the current GPU."""

    def __init__(self):
        import torch

        self.torch = torch
        self.dev = torch.device("cuda")
        self._arena = None

    def gemm(self, n: int, k: int, tokens: int) -> float:
        from tangram.kernels.bench import time_eager

        t = self.torch
        w = t.randn(n, k, device=self.dev, dtype=t.bfloat16) * 0.02
        x = t.randn(tokens, k, device=self.dev, dtype=t.bfloat16)
        # kernels/bench.py times 10 ms of calls: one sample of an 11 ms lm_head, whose median then moved 3-5%
        # between two probes of one H100 (reports/transfer/h100_probe_check); 40 ms gives the large shapes a few
        return float(np.median([time_eager(lambda: t.matmul(x, w.t()), GEMM_REP_MS)[0]
                                for _ in range(POINT_REPEATS)]))

    def copy(self, nbytes: int) -> float:
        from tangram.kernels.bench import time_eager

        a = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.dev)
        a.random_()
        b = self.torch.empty_like(a)
        ms = time_eager(lambda: b.copy_(a), 50)[0]
        del a, b
        self.torch.cuda.empty_cache()
        return ms

    def decode(self, model, batch: int, context: int, n_calls: int) -> tuple[float, int]:
        """ms per layer call of the tangram_aot kernel under Algorithm 1's map at :data:`DECODE_WAVES` (what the
        engine's split table builds for this batch and context bucket without routing); returns (ms, bytes per
        call)."""
        from tangram.budgets import constant_profile
        from tangram.kernels import decode as dec
        from tangram.kernels.bench.cases import Arena, DecodeCase
        from tangram.kernels.bench.timing import time_graph
        from tangram.planner import aot_bucket_split_map, decode_context_bucket, pow2_bucket

        H = model.num_kv_heads
        if self._arena is None:
            need = 2 * max(b * H * c * 2 * model.head_dim * 2 * decode_n_calls(model, b, c) for b, c in DECODE_POINTS)
            self._arena = Arena(int(min(need + 2**30, 0.5 * self.torch.cuda.mem_get_info()[0])), self.dev)
        B1 = constant_profile(model.num_layers, H, 1.0).B
        case = DecodeCase(self._arena, model, batch, context, 1.0, H, 0, PAGE, B1, n_calls)
        n_occ = 2 * self.torch.cuda.get_device_properties(self.dev).multi_processor_count
        for _ in range(2):  # the occupancy needs the compiled kernel: launch once, then rebuild if it differs
            S = aot_bucket_split_map(B1, case.perm, H, n_occ, pow2_bucket(batch), waves=DECODE_WAVES,
                                     context=decode_context_bucket(context))
            fn = case.launcher([dec.schedule_from_split_map(S[l], H, self.dev) for l in case.layers],
                               dec.DEFAULT_CONFIG)
            fn()
            self.torch.cuda.synchronize()
            real = dec.decode_n_cta(dec.kernel_resources(dec.DEFAULT_CONFIG), dec.device_limits(self.dev))
            if real == n_occ:
                break
            n_occ = real
        med = time_graph(fn)[0]
        return med / n_calls, int(case.bytes)

    def prefill(self, model, chunk: int, cached: int) -> tuple[float, int]:
        """ms of one layer's prefill attention (kernels/bench.py's prefill_sweep set-up); returns (ms, cached
        tokens summed over the layer's heads)."""
        from tangram.budgets import head_groups, synthetic_profile
        from tangram.kernels import prefill as pre
        from tangram.kernels.bench import time_eager

        t, dev = self.torch, self.dev
        H, Hq, d = model.num_kv_heads, model.num_q_heads, model.head_dim
        Hp = 4 if H % 4 == 0 else 1
        G = H // Hp
        prof = synthetic_profile(model.num_layers, H, 0.25, seed=0)
        perm = head_groups(prof.B, Hp)[0]
        lens0 = np.ceil(prof.B[0][perm] * cached - 1e-9).astype(np.int32)
        maxp = int(-(-(lens0.reshape(G, Hp).max(1).max() + chunk) // PAGE)) + 1
        pool = t.randn(G * maxp + 4, 2, Hp, PAGE, d, device=dev, dtype=t.bfloat16)
        bt = t.randperm(pool.shape[0], device=dev)[:G * maxp].view(G, maxp).to(t.int32)
        s2h = t.from_numpy(perm.astype(np.int32)).to(dev)
        q = t.randn(chunk, Hq, d, device=dev, dtype=t.bfloat16)
        kn = t.randn(chunk, H, d, device=dev, dtype=t.bfloat16)
        vn = t.randn(chunk, H, d, device=dev, dtype=t.bfloat16)
        lens = t.from_numpy(lens0).to(dev)

        def run():
            return pre.prefill_attention(q, kn, vn, pool, bt, lens, s2h, page_size=PAGE, heads_per_group=Hp)
        run()
        ms = float(np.median([time_eager(run)[0] for _ in range(POINT_REPEATS)]))
        del pool
        return ms, int(lens0.sum())

    def close(self):
        self._arena = None  # the engine that runs next gets the memory back
        self.torch.cuda.empty_cache()

    def warm(self):
        t = self.torch
        a = t.randn(256, 256, device=self.dev, dtype=t.bfloat16)
        (a @ a).sum().item()  # cuBLAS handle and context creation stay out of the first timing


class CpuTimers:
    """Tiny shapes on the CPU, ``time.perf_counter`` median of repeats after a warm-up: a protocol check."""

    def __init__(self, reps: int = 7):
        import torch

        self.torch, self.reps = torch, reps

    def _median_ms(self, fn) -> float:
        fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    def gemm(self, n: int, k: int, tokens: int) -> float:
        t = self.torch
        w = t.randn(n, k, dtype=t.float32) * 0.02
        x = t.randn(tokens, k, dtype=t.float32)
        return self._median_ms(lambda: t.matmul(x, w.t()))

    def copy(self, nbytes: int) -> float:
        a = self.torch.randint(0, 255, (nbytes,), dtype=self.torch.uint8)
        b = self.torch.empty_like(a)
        return self._median_ms(lambda: b.copy_(a))

    def warm(self):
        pass


# ----------------------------------------------------------------------------- the probe


def _device_facts(device: str) -> dict:
    import torch

    facts = {"torch": torch.__version__, "python": platform.python_version(),
             "host_cpu": _cpu_model(), "host_cpu_count": os.cpu_count()}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        facts.update(name=p.name, sm_count=p.multi_processor_count, memory_bytes=int(p.total_memory),
                     l2_bytes=getattr(p, "L2_cache_size", None), cuda=torch.version.cuda, driver=_driver())
    else:
        facts.update(name="cpu", sm_count=None, memory_bytes=None)
    return facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _driver() -> str:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - provenance only
        return "unknown"


def run_probe(models, *, device: str = "auto", budget_s: float = 30.0, tiny: bool = False, timers=None,
              command: str | None = None, progress=None) -> dict:
    """Measure the probe points of ``models`` (ModelConfigs) and return the probe JSON as a dict.

    ``timers``: an object with ``gemm(n, k, tokens)``, ``copy(bytes)`` (ms) and optionally
    ``decode(model, batch, context, n_calls) -> (ms, bytes)`` and ``prefill(model, chunk, cached) -> (ms,
    cached_tokens)``; default the CUDA timers on a GPU, the CPU ones otherwise. ``tiny``: CPU-sized points only
    (GEMMs at 1 and 4 tokens, a 16 MiB copy, no kernels). Points left when ``budget_s`` is spent are skipped."""
    t0 = time.perf_counter()
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, got {device!r}")
    if timers is None:
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("tangram-probe --device cuda: no CUDA device here")
            timers = CudaTimers()
        else:
            timers = CpuTimers()
            tiny = True
    facts = _device_facts(device) if not hasattr(timers, "facts") else timers.facts
    deadline = t0 + budget_s
    out = {"kind": KIND, "version": VERSION, "device": facts,
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": command or "tangram-probe", "budget_s": budget_s, "tiny": bool(tiny),
           "models": [m.name for m in models],
           "timer": "cuda: triton.testing.do_bench median (kernels/bench.py time_eager) for copy, the median of "
                    f"{POINT_REPEATS} such for GEMM and prefill; "
                    "CUDA-graph replays timed with events (time_graph) for decode" if device == "cuda" else
                    "cpu: time.perf_counter median of 7 repeats after one warm-up",
           "copy": None, "gemm": [], "decode": [], "prefill": [], "skipped": [], "phase_s": {}}
    timers.warm()
    tick = time.perf_counter()
    nbytes = (16 * 2**20) if tiny else COPY_BYTES
    ms = timers.copy(nbytes)
    out["copy"] = {"bytes": 2 * nbytes, "median_ms": ms, "gbps": 2 * nbytes / (ms * 1e-3) / 1e9}
    out["phase_s"]["copy"] = time.perf_counter() - tick
    tick = time.perf_counter()
    toks = TINY_TOKENS if tiny else GEMM_TOKENS
    for m in models:
        for op, (n, k) in gemm_shapes(m).items():
            if tiny and n * k > TINY_MAX_WEIGHT:
                out["skipped"].append(f"gemm {m.name} {op}: {n}x{k} weight too large for a tiny probe")
                continue
            for tk in toks:
                if time.perf_counter() > deadline:
                    out["skipped"].append(f"gemm {m.name} {op} {tk} tokens: budget spent")
                    continue
                out["gemm"].append({"model": m.name, "op": op, "n": n, "k": k, "tokens": tk,
                                    "median_ms": float(timers.gemm(n, k, tk))})
                if progress:
                    progress(1)
    out["phase_s"]["gemm"] = time.perf_counter() - tick
    tick = time.perf_counter()
    for m in models:
        for b, c in DECODE_POINTS:
            if tiny or not hasattr(timers, "decode"):
                out["skipped"].append(f"decode {m.name} B={b} ctx={c}: " + ("tiny probe" if tiny else "no timer"))
                continue
            if time.perf_counter() > deadline:
                out["skipped"].append(f"decode {m.name} B={b} ctx={c}: budget spent")
                continue
            n_calls = decode_n_calls(m, b, c)
            try:
                ms, nb = timers.decode(m, b, c, n_calls)
            except Exception as e:  # noqa: BLE001 - a kernel that fails here leaves its class unscaled, named
                out["skipped"].append(f"decode {m.name} B={b} ctx={c}: failed: {type(e).__name__}: {e}"[:300])
                continue
            out["decode"].append({"model": m.name, "kernel": "tangram_aot", "batch": b, "context": c, "rho": 1.0,
                                  "heads_per_group": m.num_kv_heads, "waves": DECODE_WAVES, "n_calls": n_calls,
                                  "bytes": int(nb), "median_ms": float(ms)})
    out["phase_s"]["decode"] = time.perf_counter() - tick
    tick = time.perf_counter()
    for m in models:
        c, cached = PREFILL_POINT
        if tiny or not hasattr(timers, "prefill"):
            out["skipped"].append(f"prefill {m.name} chunk={c} cached={cached}: " + ("tiny probe" if tiny else "no timer"))
            continue
        if time.perf_counter() > deadline:
            out["skipped"].append(f"prefill {m.name} chunk={c} cached={cached}: budget spent")
            continue
        try:
            ms, ntok = timers.prefill(m, c, cached)
        except Exception as e:  # noqa: BLE001 - as decode
            out["skipped"].append(f"prefill {m.name} chunk={c} cached={cached}: failed: {type(e).__name__}: {e}"[:300])
            continue
        out["prefill"].append({"model": m.name, "chunk": c, "cached": cached, "cached_tokens": int(ntok),
                               "attention_ms": float(ms)})
    out["phase_s"]["prefill"] = time.perf_counter() - tick
    if hasattr(timers, "close"):
        timers.close()
    out["elapsed_s"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- the JSON and its checks


def _num(path, field, v, *, integer=False, lo=0.0, hi=None, lo_open=True):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and integer:
        ok = float(v) == int(v)
    if ok:
        ok = (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        what = "an integer" if integer else "a number"
        rng = f" > {lo:g}" if lo_open else f" >= {lo:g}"
        if hi is not None:
            rng += f" and <= {hi:g}"
        raise InputError(path, None, field, f"must be {what}{rng}, got {v!r}")


_ITEMS = {
    "gemm": {"model": str, "op": str, "n": "int", "k": "int", "tokens": "int", "median_ms": "pos"},
    "decode": {"model": str, "batch": "int", "context": "int", "rho": "ratio", "heads_per_group": "int",
               "n_calls": "int", "bytes": "int", "median_ms": "pos"},
    "prefill": {"model": str, "chunk": "int", "cached": "int0", "attention_ms": "pos"},
}


def check_probe(d, path: str = "<probe>") -> dict:
    """Validate a probe JSON object; raise InputError naming the file and the first bad field."""
    if not isinstance(d, dict):
        raise InputError(path, None, None, "expected a JSON object (a tangram-probe result)")
    if d.get("kind") != KIND:
        raise InputError(path, None, "kind", f"must be {KIND!r} (the output of tangram-probe), got {d.get('kind')!r}")
    if d.get("version") != VERSION:
        raise InputError(path, None, "version", f"unsupported probe version {d.get('version')!r} (this code reads "
                                                f"{VERSION})")
    dev = d.get("device")
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str):
        raise InputError(path, None, "device.name", "missing: the probed device's name")
    cp = d.get("copy")
    if cp is not None:
        if not isinstance(cp, dict):
            raise InputError(path, None, "copy", "must be an object {bytes, median_ms, gbps} or null")
        _num(path, "copy.bytes", cp.get("bytes"), integer=True)
        _num(path, "copy.gbps", cp.get("gbps"))
    for cls, fields in _ITEMS.items():
        items = d.get(cls, [])
        if not isinstance(items, list):
            raise InputError(path, None, cls, "must be a list of measured points")
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                raise InputError(path, None, f"{cls}[{i}]", "must be an object")
            for f, kind in fields.items():
                name = f"{cls}[{i}].{f}"
                v = it.get(f)
                if kind is str:
                    if not isinstance(v, str) or not v:
                        raise InputError(path, None, name, f"must be a non-empty string, got {v!r}")
                elif kind == "int":
                    _num(path, name, v, integer=True)
                elif kind == "int0":
                    _num(path, name, v, integer=True, lo_open=False)
                elif kind == "ratio":
                    _num(path, name, v, hi=1.0)
                else:
                    _num(path, name, v)
    if not (cp or d.get("gemm") or d.get("decode") or d.get("prefill")):
        raise InputError(path, None, "gemm", "the probe measured nothing (no copy, gemm, decode or prefill point)")
    return d


def load_probe(path: str | Path) -> dict:
    """Read and check a probe JSON file; bad input is one line naming the file and the field."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(str(p), None, None, "probe file not found") from None
    except json.JSONDecodeError as e:
        raise InputError(str(p), e.lineno, None, f"invalid JSON: {e.msg}") from None
    check_probe(d, str(p))
    d["_path"] = str(p)
    return d


def save_probe(probe: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({k: v for k, v in probe.items() if not k.startswith("_")}, indent=1, sort_keys=True)
                 + "\n")
    return p


def summary_lines(probe: dict, tables=None) -> list[str]:
    """What was measured and, against ``tables`` (CostTables), the scales the rescale would apply."""
    lines = [f"probe of {probe['device'].get('name')} ({probe.get('elapsed_s', 0):.1f} s): "
             f"copy {probe['copy']['gbps']:.0f} GB/s, {len(probe['gemm'])} GEMM, {len(probe['decode'])} decode, "
             f"{len(probe['prefill'])} prefill points" if probe.get("copy") else "probe: no copy point"]
    if probe.get("skipped"):
        lines.append(f"skipped: {'; '.join(probe['skipped'][:6])}" + (" ..." if len(probe["skipped"]) > 6 else ""))
    if tables is not None and tables.directory is not None:
        from tangram.sim.transfer import rescale

        r = rescale(tables, probe)
        lines.append(r.provenance[-1]["label"])
    return lines


# ----------------------------------------------------------------------------- CLI


def _parser():
    p = Parser(prog="tangram-probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="model preset(s) whose shapes to probe, comma list "
                                                          "(default %(default)s)")
    p.add_argument("--out", default="probe.json", help="probe JSON to write (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=30.0, help="stop measuring after this many seconds")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto | cuda | cpu (cpu: tiny shapes, a protocol check)")
    p.add_argument("--tables", default="auto", help="tables folder to compare with (default: the device's family)")
    return p


def run(a) -> dict:
    from tangram.config import get_gpu, get_model, gpu_for_device_name
    from tangram.sim.tables import resolve

    if not a.budget_s > 0:
        raise ConfigError(f"--budget-s must be > 0, got {a.budget_s}")
    output_file(a.out)  # before the measurement: a probe that cannot be written is lost
    models = [get_model(x.strip()) for x in a.model.split(",") if x.strip()]
    probe = run_probe(models, device=a.device, budget_s=a.budget_s,
                      command="tangram-probe " + " ".join(getattr(a, "_argv", [])))
    path = save_probe(probe, a.out)
    gpu = gpu_for_device_name(probe["device"].get("name")) or get_gpu("h100-80gb")
    tables = resolve(a.tables if a.tables != "none" else None, gpu)
    for line in summary_lines(probe, tables):
        print(line)
    print(f"wrote {path}")
    return probe


@cli_main
def main(argv=None) -> int:
    run(parse(_parser(), argv))
    return 0


if __name__ == "__main__":
    main()


__all__ = ["run_probe", "check_probe", "load_probe", "save_probe", "gemm_shapes", "decode_n_calls", "KIND", "VERSION"]

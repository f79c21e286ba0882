"""GPU microbenchmarks: checks every kernel against its reference, times them, writes the calibration tables.

    python -m tangram.kernels.bench [--model llama-3.1-8b,smollm2-135m] [--quick] [--out DIR]
        [--sections checks,headline,decode,prefill,gemm,elementwise] [--sweep-hps 1,4]

Runs in one call on one GPU. Order: device facts (copy bandwidth), tile choice, correctness on realistic shapes
(:mod:`.checks`), the headline comparisons (:mod:`.headline`: uniform full-KV vs FlashInfer; skewed rho = 0.25
AOT vs baselines), then the sweeps (:mod:`.sweeps`: decode, prefill + compression, GEMMs, element-wise) under a
wall-clock budget so a partial run still leaves complete files; every table row is flushed as soon as it is
measured (:mod:`.tables`). The AOT split table reads the GPU's decode costs (``--decode-costs``), so the sweep
measures the split maps the engine launches, regime choice included.

Timing (:mod:`.timing`): decode launches are captured in a CUDA graph (host launch cost out of the kernel time)
and replayed; one replay runs ``n_calls`` layer-calls on distinct random pages so the data moved per replay
exceeds 4x L2. Host planning is timed apart with ``time.perf_counter`` and reported as ``plan_ms`` per
layer-call; ``total_ms = median_ms + plan_ms``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from tangram.config import get_model
from tangram.errors import ConfigError
from tangram.cli import Parser, cli_main, output_dir
from tangram.kernels import decode as dec
from tangram.planner import DecodeCosts, tables_dir

from .cases import Arena, FlashInferPeer
from .checks import Checks
from .headline import Headline
from .sweeps import Sweeps
from .tables import DECODE_FIELDS, Table
from .timing import T0, driver_version, log, time_eager

SECTIONS = ("checks", "headline", "decode", "prefill", "gemm", "elementwise")


class Bench(Checks, Headline, Sweeps):
    def __init__(self, args):
        self.args = args
        self.dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(self.dev)
        self.props = props
        self.num_sms = props.multi_processor_count
        self.out = output_dir(args.out)
        self.deadline = T0 + args.budget_s
        self.meta = {
            "gpu_name": props.name, "sm_count": self.num_sms, "l2_bytes": getattr(props, "L2_cache_size", None),
            "memory_bytes": props.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__, "driver": driver_version(), "python": platform.python_version(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m tangram.kernels.bench " + " ".join(sys.argv[1:]), "quick": args.quick,
            "checks": {}, "headline": {}, "notes": [],
        }
        self.common = {"gpu": props.name, "torch": torch.__version__, "triton": self.meta["triton"],
                       "driver": self.meta["driver"]}
        self.fi = None
        self.config = dec.DEFAULT_CONFIG
        self.n_occ = None
        self.waves = 1.0
        d = args.decode_costs
        if d == "auto":
            fam = props.name.lower().replace("nvidia", "").strip().split()[0] if props.name else "h100"
            d = tables_dir(fam)
        self.costs_dir = None if d in (None, "none") else d
        self.decode_costs = None if self.costs_dir is None else DecodeCosts.load(self.costs_dir)
        self._costs_by_model: dict = {}
        self.meta["decode_costs"] = None if self.decode_costs is None else asdict(self.decode_costs)

    def split_kwargs(self, m) -> dict:
        """The regime choice's inputs, as the engine passes them (AotSplitTable)."""
        if self.costs_dir is not None and m.name not in self._costs_by_model:  # the model's own fit, if any
            c = self._costs_by_model[m.name] = DecodeCosts.load(self.costs_dir, m.name)
            self.meta.setdefault("decode_costs_by_model", {})[m.name] = asdict(c)
        return dict(costs=self._costs_by_model.get(m.name, self.decode_costs), gq=m.gqa_group, head_dim=m.head_dim, dtype_bytes=m.dtype_bytes,
                    num_sms=self.num_sms)

    def time_left(self):
        return self.deadline - time.time()

    def save_meta(self):
        (self.out / "meta.json").write_text(json.dumps(self.meta, indent=1, default=str))

    # -- device facts
    def copy_bandwidth(self):
        n = 2 * 2**30
        a = torch.empty(n, dtype=torch.uint8, device=self.dev)
        a.random_()
        b = torch.empty_like(a)
        med, p20, p80 = time_eager(lambda: b.copy_(a), 50)
        gbps = 2 * n / (med * 1e-3) / 1e9
        self.meta["copy_gbps"] = gbps
        self.meta["copy_bytes"] = 2 * n
        log(f"device copy bandwidth: {gbps:.0f} GB/s (read+write of {n / 2**30:.0f} GiB, median {med:.3f} ms)")
        del a, b
        torch.cuda.empty_cache()

    def try_flashinfer(self):
        try:
            self.fi = FlashInferPeer(self.dev)
            self.meta["flashinfer"] = self.fi.version
            log(f"flashinfer {self.fi.version} imported from {self.fi.fi.__file__}")
        except Exception as e:  # noqa: BLE001
            self.meta["notes"].append(f"flashinfer unavailable: {e!r}")
            log(f"flashinfer unavailable: {e!r}")

    def run(self):
        sections = set(self.args.sections.split(","))
        models = [get_model(x) for x in self.args.model.split(",")]
        log(f"GPU {self.props.name}, {self.num_sms} SMs; models {[m.name for m in models]}; "
            f"budget {self.args.budget_s}s; sections {sorted(sections)}")
        self.copy_bandwidth()
        self.try_flashinfer()
        free = torch.cuda.mem_get_info()[0]
        arena = Arena(int(min(self.args.arena_gb * 2**30, 0.6 * free)), self.dev)
        self.meta["arena_bytes"] = arena.n * 2
        log(f"arena {arena.n * 2 / 2**30:.1f} GiB")
        self.choose_config(arena)
        if "checks" in sections:
            try:
                self.checks()
            except Exception as e:  # noqa: BLE001
                self.meta["checks"]["error"] = repr(e)
                log("checks raised:\n" + traceback.format_exc())
        dtab = Table(self.out / "decode_attention.csv", DECODE_FIELDS, self.common)
        tables_cache: dict = {}
        if "headline" in sections:
            try:
                self.headline(arena, dtab, tables_cache)
            except Exception as e:  # noqa: BLE001 - keep the sweeps going; the log has the traceback
                self.meta["headline"]["error"] = repr(e)
                log("headline raised:\n" + traceback.format_exc())
        if "decode" in sections:
            left = self.time_left()
            self.decode_sweep(arena, dtab, tables_cache, models, time.time() + left - self.args.tail_s)
        del arena
        torch.cuda.empty_cache()
        if "prefill" in sections:
            self.prefill_sweep(models, time.time() + 0.6 * self.time_left())
        if "gemm" in sections:
            self.gemm_sweep(models, time.time() + 0.65 * self.time_left())
        if "elementwise" in sections:
            self.elementwise_sweep(models, self.deadline)
        self.meta["rows"] = {"decode_attention": dtab.n}
        self.meta["elapsed_s"] = time.time() - T0
        self.meta["aot_vs_static"] = aot_vs_static(self.out / "decode_attention.csv")
        self.meta["aot_vs_static_total"] = aot_vs_static(self.out / "decode_attention.csv", "total_ms")
        self.save_meta()
        self.summary()

    def summary(self):
        hl = self.meta["headline"]
        print("\n==== summary ====")
        print(f"device {self.meta['gpu_name']}, copy {self.meta.get('copy_gbps', 0):.0f} GB/s, "
              f"N_CTA {self.n_occ}, config {asdict(self.config)}")
        for k, v in self.meta["checks"].items():
            print(f"check {k}: {v}")
        for k, v in hl.items():
            print(f"{k}: {json.dumps(v) if isinstance(v, dict) else v}")
        print(json.dumps({"aot_vs_static": self.meta.get("aot_vs_static")}, default=float))


def aot_vs_static(path: Path, col: str = "median_ms", baseline: str = "static_split_ragged") -> dict | None:
    """AOT vs the static split at every (model, batch, context, rho) point, per H_p and at the best H_p: kernel
    time (``median_ms``, the graph-replayed launches; the engine looks its split maps up at capture) or
    ``total_ms`` (plus the host planning per layer-call). ``baseline``: ``static_split_ragged`` (FlashDecoding's
    split on the same ragged pool and page tables at the same H_p, timed interleaved with the AOT launches: the
    split choice alone), falling back to ``static_split`` (the monolithic pool, one per point) where a table has
    no ragged rows."""
    import pandas as pd

    if not Path(path).exists():
        return None
    df = pd.read_csv(path)
    if df.empty:
        return None
    keys = ["model", "batch", "context", "rho"]
    aot = df[df["kernel"] == "tangram_aot"]
    mono = df[df["kernel"] == "static_split"].groupby(keys)[col].min()
    rag = df[df["kernel"] == baseline].groupby(keys + ["heads_per_group"])[col].min()
    if aot.empty or (mono.empty and rag.empty):
        return None
    per_hp = aot.groupby(keys + ["heads_per_group"])[col].min().reset_index()

    def base(r):
        k = tuple(r[x] for x in keys)
        v = rag.get(k + (r["heads_per_group"],), np.nan) if not rag.empty else np.nan
        return mono.get(k, np.nan) if np.isnan(v) else v
    per_hp["ratio"] = per_hp.apply(lambda r: base(r) / r[col], axis=1)
    per_hp["ratio_mono"] = per_hp.apply(lambda r: mono.get(tuple(r[k] for k in keys), np.nan) / r[col], axis=1)
    per_hp = per_hp.dropna(subset=["ratio"])
    if per_hp.empty:
        return None
    best = per_hp.groupby(keys)["ratio"].max()
    worst = per_hp.loc[per_hp["ratio"].idxmin()]
    mono_r = per_hp.dropna(subset=["ratio_mono"]).groupby(keys)["ratio_mono"].max()
    return {"baseline": baseline if not rag.empty else "static_split", "points": int(best.size),
            "min_best_hp": float(best.min()), "min_any_hp": float(per_hp["ratio"].min()),
            "worst_point": {k: (v.item() if hasattr(v, "item") else v) for k, v in worst.items()},
            "below_0.98_best_hp": int((best < 0.98).sum()), "below_0.98_any_hp": int((per_hp["ratio"] < 0.98).sum()),
            "min_by_hp": {int(h): float(g["ratio"].min()) for h, g in per_hp.groupby("heads_per_group")},
            "vs_monolithic_static": {"points": int(mono_r.size),
                                     "min_best_hp": float(mono_r.min()) if mono_r.size else None,
                                     "below_0.98_best_hp": int((mono_r < 0.98).sum())}}


@cli_main
def main(argv=None) -> int:
    ap = Parser(prog="python -m tangram.kernels.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b,smollm2-135m", help="comma-separated model presets")
    ap.add_argument("--quick", action="store_true", help="smoke run: few shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder for tables")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for the whole run")
    ap.add_argument("--tail-s", type=float, default=75.0, help="seconds kept for prefill, GEMM, elementwise")
    ap.add_argument("--arena-gb", type=float, default=40.0, help="random KV arena size (GiB)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of %s" % ",".join(SECTIONS))
    ap.add_argument("--sweep-batches", default="1,4,16,64,256")
    ap.add_argument("--sweep-contexts", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--sweep-rhos", default="0.25,0.5,1.0")
    ap.add_argument("--sweep-hps", default="1,4", help="H_p values of the AOT rows in the decode sweep")
    ap.add_argument("--aot-orders", default="request", choices=("request", "request,lpt"),
                    help="launch orders of the AOT rows in the decode sweep: request (the rows the decode-cost fit "
                         "reads) and, with lpt, the same maps longest piece first (kernel tangram_aot_lpt)")
    ap.add_argument("--decode-costs", default="auto",
                    help="tables folder whose decode_costs.json the AOT regime choice reads (auto: the device's; "
                         "none: Algorithm 1 capped per context)")
    ap.add_argument("--tile", default="auto", help="decode tile: auto (the fastest at uniform B16 / 8K), engine "
                    "(tangram.kernels.decode.DEFAULT_CONFIG, what the engine launches) or BLOCKxWARPSxSTAGES")
    args = ap.parse_args(argv)
    if args.tile not in ("auto", "engine"):
        parts = args.tile.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"--tile: expected auto, engine or BLOCKxWARPSxSTAGES (e.g. 128x8x3), got {args.tile!r}")
    for name in args.model.split(","):
        get_model(name)
    bad = set(args.sections.split(",")) - set(SECTIONS)
    if bad:
        raise ConfigError(f"--sections: unknown {sorted(bad)} (choose from {', '.join(SECTIONS)})")
    if not torch.cuda.is_available():
        raise ConfigError("tangram.kernels.bench needs a CUDA GPU (the CPU tests are tests/test_kernels.py)")
    Bench(args).run()
    return 0


__all__ = ["Bench", "main", "aot_vs_static"]

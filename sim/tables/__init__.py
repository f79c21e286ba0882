"""Cost tables: kernel times measured on a GPU (written by ``tangram-kernels-bench``), the fitted engine overhead
and host coefficients (``tangram.sim.fit_engine``, ``tangram.sim.fit_host``), and their interpolants.

Each operator is priced from its table when one exists for the GPU and the
model's shapes, otherwise from the analytic roofline of the GPU preset; the
label of the source travels into every report (``cost_model_source``).
Interpolation is in log-log space (times of GPU kernels are close to power
laws in their size) with scipy, extrapolating by the nearest measured point's
throughput so a shape outside the sweep never prices at zero.

Tables describe the machine they were measured on. :func:`resolve` carries them to the GPU being priced: a GPU
model without its own folder gets another family's tables transferred by datasheet, and a probe JSON of the
machine at hand rescales them (``tangram.sim.transfer``); ``CostTables.provenance`` says what was applied and
every report repeats it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tangram.errors import InputError
# one list of the kernel tables and transfer sources, shared with the engine's DecodeCosts.for_gpu (no sim import there)
from tangram.planner import TABLE_FILES, TRANSFER_SOURCES, has_kernel_tables, kernel_tables_dir  # noqa: F401

TABLES_ROOT = Path(__file__).resolve().parent
# the probe of the machine a folder's engine_overhead.json was fitted on (``tangram-fit-engine --probe``): when
# present, a probe of another machine is compared with it instead of with the tables themselves
REFERENCE_PROBE = "reference_probe.json"


def tables_dir_for(gpu_name: str) -> Path:
    """``h100-80gb`` -> ``sim/tables/h100``: tables are per GPU family, not per memory size."""
    return TABLES_ROOT / gpu_name.lower().split("-")[0]


def _read_csv(path: Path, required: tuple[str, ...]):
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except Exception as e:  # pandas raises many parser error types
        raise InputError(str(path), None, None, f"not a readable cost table CSV ({type(e).__name__}: {e})") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise InputError(str(path), None, missing[0], "missing column in cost table")
    for c in required:
        if df[c].dtype == object and c not in ("op", "kernel", "model", "gpu", "dtype"):
            bad = df[c][pd.to_numeric(df[c], errors="coerce").isna()]
            if len(bad):
                raise InputError(str(path), int(bad.index[0]) + 2, c, f"not a number: {bad.iloc[0]!r}")
    return df


class LogInterp1D:
    """Piecewise-linear interpolation of log(time) over log(size); flat throughput beyond the ends.

    ``monotone``: a smaller call never costs more than a larger one of the same operator (a GEMM of M rows can
    always run as one of M' > M rows), so each point is lowered to the cheapest time at any larger size. A
    measured point above that envelope is a stall of the timing run, not a property of the kernel: the H100 table
    of 2026-11-23 has the M = 1 qkv GEMM at 0.249 ms against 0.029 ms at M = 4, which alone priced a batch-1
    decode step of Llama-3.1-8B 7 ms too high.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, monotone: bool = False):
        from scipy.interpolate import interp1d

        x, y = np.asarray(x, float), np.asarray(y, float)
        keep = (x > 0) & (y > 0)
        x, y = x[keep], y[keep]
        order = np.argsort(x)
        x, y = x[order], y[order]
        ux, inv = np.unique(x, return_inverse=True)  # average repeated sizes (medians of repeated runs)
        uy = np.exp(np.bincount(inv, np.log(y)) / np.bincount(inv))
        if monotone:
            uy = np.minimum.accumulate(uy[::-1])[::-1]
        self.x0, self.x1, self.y0, self.y1 = ux[0], ux[-1], uy[0], uy[-1]
        self.n = ux.size
        self._f = interp1d(np.log(ux), np.log(uy), assume_sorted=True) if ux.size > 1 else None

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, float)
        if self._f is None:
            return self.y0 * x / self.x0
        xc = np.clip(x, self.x0, self.x1)
        y = np.exp(self._f(np.log(np.maximum(xc, 1e-30))))
        # beyond the sweep: same time per unit of size as the nearest end (small sizes: latency floor)
        return np.where(x > self.x1, self.y1 * x / self.x1, y)


@dataclass
class CostTables:
    """What was found for one GPU: parsed tables plus meta.json; empty when nothing was measured.

    ``directory`` is the folder the tables were read from (its engine_overhead.json prices the engine around the
    kernels); ``provenance`` lists what was applied to them since (a datasheet transfer, a probe rescale), so a
    transferred set never passes for a measured one. Treat an instance as immutable: loads are cached and shared.
    """

    directory: Path | None
    meta: dict = field(default_factory=dict)
    decode: object = None  # pandas frames or None
    prefill: object = None
    gemm: object = None
    elementwise: object = None
    provenance: list = field(default_factory=list)  # dicts: {"kind": "transfer" | "probe", "label": ..., ...}
    reference_probe: dict | None = None  # the probe these tables' engine overhead was fitted against, if recorded
    reference_probe_source: str | None = None
    # provenance steps already applied to the folder's files when it was read (a folder written by write_tables):
    # the steps after them were applied in memory, and decode_costs() applies them to decode_costs.json
    loaded_steps: int = 0
    # interpolants built from the frames, per (kind, model shape, op): every replica of a cluster asks for the same
    # ones (a 256-replica probe built each 256 times). Not copied by derive(): new frames, new interpolants
    _interps: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _interp(self, key: tuple, build):
        if key not in self._interps:
            self._interps[key] = build()
        return self._interps[key]

    @property
    def label(self) -> str:
        """How these tables came to describe the GPU being priced ("" when measured on it as they are)."""
        return "; then ".join(p["label"] for p in self.provenance)

    @property
    def fingerprint(self) -> str:
        """Folder plus what was applied to it: a cache key that tells a transferred set from its source."""
        h = hashlib.sha1(json.dumps(self.provenance, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return f"{self.directory}|{h}"

    def derive(self, **changes) -> "CostTables":
        """A copy with some frames/meta replaced (frames are shared, never modified in place)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(cls, directory: str | Path | None) -> "CostTables":
        if directory is None:
            return cls(None)
        d = Path(directory)
        if not d.is_dir():
            return cls(None)
        files = TABLE_FILES + ("meta.json", REFERENCE_PROBE, "decode_costs.json")
        key = (str(d.resolve()), tuple((f, (d / f).stat().st_mtime_ns) for f in files if (d / f).exists()))
        hit = _LOADED.get(key)
        if hit is None:
            hit = _LOADED[key] = cls._load(d)
        return hit

    @classmethod
    def _load(cls, d: Path) -> "CostTables":
        meta = {}
        mp = d / "meta.json"
        if mp.exists():
            try:
                meta = json.loads(mp.read_text())
            except json.JSONDecodeError as e:
                raise InputError(str(mp), e.lineno, None, f"invalid JSON: {e.msg}") from None
        # a folder written by tangram.sim.transfer.write_tables keeps what was applied to its tables
        prov = meta.get("provenance")
        t = cls(d, meta, provenance=list(prov) if isinstance(prov, list) else [])
        t.loaded_steps = len(t.provenance)
        rp = d / REFERENCE_PROBE
        if rp.exists():
            from tangram.sim.probe import load_probe

            t.reference_probe, t.reference_probe_source = load_probe(rp), str(rp)
        if (d / "decode_attention.csv").exists():
            t.decode = _read_csv(d / "decode_attention.csv", ("kernel", "bytes", "median_ms"))
        if (d / "prefill_attention.csv").exists():
            t.prefill = _read_csv(d / "prefill_attention.csv", ("chunk", "cached", "attention_ms"))
        if (d / "gemm.csv").exists():
            t.gemm = _read_csv(d / "gemm.csv", ("op", "tokens", "n", "k", "median_ms"))
        if (d / "elementwise.csv").exists():
            t.elementwise = _read_csv(d / "elementwise.csv", ("op", "tokens", "median_ms"))
        return t

    # ------------------------------------------------------------------ meta
    def gpu(self):
        """The GPU preset these tables describe: the transfer's target, else the one meta.json's device name
        names (None when neither says)."""
        from tangram.config import get_gpu, gpu_for_device_name

        for p in reversed(self.provenance):
            if p.get("kind") == "transfer":
                return get_gpu(p["to"])
        return gpu_for_device_name(self.meta.get("gpu_name"))

    def n_cta(self, num_sms: int) -> tuple[int, str]:
        """Decode CTAs resident at once: meta.json's occupancy when measured, else 2 per SM."""
        m = self.meta
        for key in ("n_cta", "decode_n_cta"):
            if isinstance(m.get(key), (int, float)) and m[key] >= 1:
                return int(m[key]), f"meta.json:{key}"
        dk = m.get("decode_kernel")
        if isinstance(dk, dict) and isinstance(dk.get("n_cta"), (int, float)) and dk["n_cta"] >= 1:
            return int(dk["n_cta"]), "meta.json:decode_kernel.n_cta (measured occupancy)"
        for key in ("ctas_per_sm", "decode_ctas_per_sm"):
            if isinstance(m.get(key), (int, float)) and m[key] >= 1:
                return int(m[key] * num_sms), f"meta.json:{key}"
        return 2 * num_sms, "default: 2 CTAs per SM"

    def copy_bandwidth(self) -> float | None:
        for key in ("copy_gbps", "measured_copy_gbps", "copy_bandwidth_gbps"):
            v = self.meta.get(key)
            if isinstance(v, (int, float)) and v > 0:
                return float(v) * 1e9
        return None

    # ------------------------------------------------------------------ decode-launch costs
    @property
    def has_decode_costs(self) -> bool:
        """Whether the folder has a fitted ``decode_costs.json`` (the decode price's model; else the fallback)."""
        from tangram.planner import DecodeCosts

        return self.directory is not None and (self.directory / DecodeCosts.FILENAME).is_file()

    def decode_costs(self, model: str | None = None):
        """The folder's :class:`tangram.planner.DecodeCosts` (``DecodeCosts.load``: the fit, else defaults) carried
        by every transfer and probe rescale applied to these tables since they were read (:func:`decode_factors`),
        so the routing and the decode price move with the decode rows; None without a folder."""
        from tangram.planner import DecodeCosts

        if self.directory is None:
            return None
        c = DecodeCosts.load(self.directory, model)
        for step in self.provenance[self.loaded_steps:]:
            c = scale_decode_costs(c, step, model)
        return c

    # ------------------------------------------------------------------ per-operator fits
    @staticmethod
    def _model_rows(df, model):
        """Rows measured for this model's shapes (by name, else by head counts), else None."""
        if df is None or len(df) == 0:
            return None
        if "model" in df.columns:
            m = df[df["model"].astype(str).str.lower() == model.name]
            if len(m):
                return m
        if {"num_q_heads", "num_kv_heads", "head_dim"} <= set(df.columns):
            m = df[(df["num_q_heads"] == model.num_q_heads) & (df["num_kv_heads"] == model.num_kv_heads)
                   & (df["head_dim"] == model.head_dim)]
            if len(m):
                return m
        return None

    def decode_fit(self, model) -> tuple[float, float, str] | None:
        """(launch_s, bytes_per_s) of a balanced decode call: least squares of time = a + bytes / BW.

        Fitted on the balanced kernels (tangram_aot on uniform or any lengths,
        flashinfer) so the straggler structure is left to the wave model.
        """
        rows = self._model_rows(self.decode, model)
        if rows is None:
            return None
        rows = rows[rows["kernel"].isin(["tangram_aot", "flashinfer"])]
        if len(rows) < 2:
            return None
        x = rows["bytes"].to_numpy(float)
        y = rows["median_ms"].to_numpy(float) * 1e-3
        A = np.stack([np.ones_like(x), x], axis=1)
        # relative least squares: small calls (microseconds) weigh as much as large ones (milliseconds)
        (a, inv_bw), *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)
        if inv_bw <= 0:
            return None
        return max(0.0, float(a)), 1.0 / float(inv_bw), \
            f"table:decode_attention.csv ({len(rows)} rows, relative LSQ fit a+bytes/BW)"

    def gemm_interp(self, model, op: str, n: int, k: int) -> LogInterp1D | None:
        return self._interp(("gemm", model.name, op, n, k), lambda: self._gemm_interp(model, op, n, k))

    def _gemm_interp(self, model, op: str, n: int, k: int) -> LogInterp1D | None:
        df = self.gemm
        if df is None:
            return None
        rows = df[(df["op"] == op) & (df["n"] == n) & (df["k"] == k)]
        if "model" in df.columns and (rows["model"].astype(str).str.lower() == model.name).any():
            rows = rows[rows["model"].astype(str).str.lower() == model.name]
        if len(rows) == 0:
            return None
        return LogInterp1D(rows["tokens"].to_numpy(), rows["median_ms"].to_numpy() * 1e-3, monotone=True)

    def elementwise_interp(self, model, op: str) -> LogInterp1D | None:
        return self._interp(("elementwise", model.name, model.hidden, op), lambda: self._elementwise_interp(model, op))

    def _elementwise_interp(self, model, op: str) -> LogInterp1D | None:
        df = self.elementwise
        if df is None:
            return None
        rows = df[df["op"] == op]
        if "impl" in df.columns and (rows["impl"] == "fused").any():  # the engine's fused kernels, when measured
            rows = rows[rows["impl"] == "fused"]
        if "model" in df.columns and (rows["model"].astype(str).str.lower() == model.name).any():
            rows = rows[rows["model"].astype(str).str.lower() == model.name]
        if "hidden" in df.columns and (rows["hidden"] == model.hidden).any() and op != "silu_mul":
            rows = rows[rows["hidden"] == model.hidden]
        if len(rows) == 0:
            return None
        return LogInterp1D(rows["tokens"].to_numpy(), rows["median_ms"].to_numpy() * 1e-3, monotone=True)

    def prefill_interp(self, model):
        """2-D interpolant of per-layer chunk attention time over (chunk, retained cached tokens of the layer); one
        per model shape, shared by every cost model on these tables (its memo of whole calls is exact whoever
        asks: :meth:`PrefillInterp.__call__`)."""
        key = ("prefill", model.name, model.num_q_heads, model.num_kv_heads, model.head_dim)
        return self._interp(key, lambda: self._prefill_interp(model))

    def _prefill_interp(self, model):
        rows = self._model_rows(self.prefill, model)
        if rows is None or len(rows) < 1:
            return None
        return PrefillInterp(rows, model.num_kv_heads)


def decode_factors(step: dict, model: str | None) -> dict[str, float]:
    """How one provenance step moves the decode-launch costs (:meth:`tangram.planner.DecodeCosts.scaled`'s
    factors), by the rules that step applied to the decode rows:

    * ``transfer`` (datasheet): bandwidth x the transfer's bandwidth ratio; the fixed latencies and a lone CTA's
      rate are kept (:meth:`tangram.planner.DecodeCosts.transferred`);
    * ``probe``: the decode rows were multiplied by the probe's time ratio, interpolated in log bytes between its
      small point (B = 1, 1K tokens: launch and latency bound) and its large one (B = 64, 8K: streaming) and flat
      beyond; so the fixed latencies scale by the ratio at the small end, a lone CTA's rate (latency bound) by
      its inverse, and the bandwidth by the inverse of the ratio at the large end. The model's own points, else
      the geometric mean over the probed models (as the rows of an unprobed model). A probe s times slower than
      the reference everywhere multiplies every decode time by s."""
    if step.get("kind") == "transfer":
        return {"bandwidth": float(step["bandwidth_ratio"])}
    if step.get("kind") == "probe":
        dec = (step.get("scales") or {}).get("decode") or {}
        pts = [dec[model]] if model in dec else list(dec.values())
        if not pts:
            return {}
        from tangram.sim.transfer import ratio_curve  # the rows' own curve (transfer imports this module)

        ends = np.log([ratio_curve(p["bytes"], p["time_ratio"])(np.array([1.0, 1e30])) for p in pts])
        lo, hi = (float(x) for x in np.exp(ends.mean(axis=0)))
        return {"latency": lo, "cta_rate": 1.0 / lo, "bandwidth": 1.0 / hi}
    return {}


def scale_decode_costs(costs, step: dict, model: str | None):
    """``costs`` moved by one provenance step (:func:`decode_factors`), its source saying so."""
    f = decode_factors(step, model)
    if not f:
        return costs
    if step.get("kind") == "transfer":
        return costs.transferred(f["bandwidth"], f"transferred from {step.get('from')} to {step.get('to')} by "
                                                 f"datasheet")
    note = (f"probe of {step.get('device', '?')}: bandwidth x{f['bandwidth']:.4g}, latencies x{f['latency']:.4g}, "
            f"CTA rate x{f['cta_rate']:.4g}")
    return costs.scaled(**f, note=note)


_LOADED: dict = {}  # (folder, file mtimes) -> CostTables
_RESOLVED: dict = {}  # (tables fingerprint, GPU, probe digest) -> CostTables


def resolve(tables, gpu, probe: dict | str | Path | None = None) -> CostTables:
    """The cost tables that price ``gpu``: ``tables`` is "auto" (the GPU family's folder), a folder, None (none:
    roofline only) or a CostTables. Tables measured on another GPU model (no folder for this family, or a folder
    whose meta.json names another device) are transferred by datasheet (``tangram.sim.transfer.transfer``);
    ``probe`` (a probe dict or JSON file of the machine at hand) then rescales them
    (``tangram.sim.transfer.rescale``). Results are cached; callers must not modify them."""
    if isinstance(tables, CostTables):
        t = tables
    elif tables is None:
        t = CostTables(None)
    elif isinstance(tables, str) and tables == "auto":
        t = CostTables.load(kernel_tables_dir(gpu.name))
    else:
        t = CostTables.load(tables)
    probe_d = None
    if probe is not None:
        from tangram.sim.probe import load_probe

        probe_d = probe if isinstance(probe, dict) else load_probe(probe)
    if t.directory is None and probe_d is None:
        return t
    pkey = None if probe_d is None else hashlib.sha1(json.dumps(probe_d, sort_keys=True).encode()).hexdigest()
    key = (t.fingerprint, gpu.name, pkey)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    src = t.gpu()
    out = t
    if t.directory is not None and src is not None and src.family != gpu.family:
        from tangram.sim.transfer import transfer

        out = transfer(out, src, gpu)
    if probe_d is not None:
        from tangram.sim.transfer import rescale

        out = rescale(out, probe_d, source=probe if not isinstance(probe, dict) else probe_d.get("_path"))
    _RESOLVED[key] = out
    return out


class PrefillInterp:
    """Per-layer prefill times over (chunk c, cached tokens x summed over the layer's KV heads).

    Linear in log space inside the measured hull (scipy ``LinearNDInterpolator``); outside it the
    nearest measured point scaled by attention work ``c (x + H c / 2)``. ``cached_tokens`` (retained,
    summed over heads) is used when the table has it, else ``cached x H``.
    """

    def __init__(self, rows, num_kv_heads: int):
        from scipy.interpolate import LinearNDInterpolator

        self.H = num_kv_heads
        self.cols = [c for c in ("attention_ms", "score_ms", "select_ms", "select_dynamic_ms", "scatter_ms")
                     if c in rows.columns]
        c = rows["chunk"].to_numpy(float)
        n = rows["cached_tokens"].to_numpy(float) if "cached_tokens" in rows.columns else \
            rows["cached"].to_numpy(float) * num_kv_heads
        self.pts = np.stack([np.log(c), np.log1p(n)], axis=1)
        self.work = c * (n + num_kv_heads * c / 2)
        self.vals = {k: np.maximum(rows[k].to_numpy(float), 1e-6) * 1e-3 for k in self.cols}
        # outside the hull: each measured point's values [points, cols] and chunk, and which column is attention
        # (scaled by the work; the compression kernels by the chunk, at least 1)
        self._vmat = np.stack([self.vals[k] for k in self.cols], axis=1)
        self._is_att = np.array([k == "attention_ms" for k in self.cols])
        self._pt_chunk = np.exp(self.pts[:, 0])
        self._memo: dict[tuple, dict[str, np.ndarray]] = {}
        # one interpolant over every column: one simplex search per query instead of one per column (the same
        # barycentric weights, so the same values), and the nearest point only where a query leaves the hull
        self._lin = None
        if len(rows) >= 3 and np.linalg.matrix_rank(self.pts - self.pts.mean(0)) == 2:
            self._lin = LinearNDInterpolator(self.pts, np.stack([np.log(self.vals[k]) for k in self.cols], axis=1))

    def __call__(self, chunk: np.ndarray, cached: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds per layer call for chunks of ``chunk`` tokens over ``cached`` retained tokens of the layer
        (read-only arrays; the last few thousand calls are kept: a replay prices the same chunks again when a run
        of steps is cut short and planned again, ~30% of calls). A whole call is kept, never a query on its own:
        scipy's simplex walk starts from the previous query's simplex, so a query on a simplex edge may differ in
        its last bit from the same query in another batch."""
        chunk, cached = np.asarray(chunk, float), np.asarray(cached, float)
        key = (chunk.shape, chunk.tobytes(), cached.tobytes())
        hit = self._memo.get(key)
        if hit is None:
            hit = self._eval(chunk, cached)
            for v in hit.values():
                v.flags.writeable = False
            if len(self._memo) >= 4096:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = hit
        return hit

    def _eval(self, chunk: np.ndarray, cached: np.ndarray) -> dict[str, np.ndarray]:
        q = np.empty((chunk.size, 2))  # (filled column by column: np.stack's own overhead was a third of a call)
        q[:, 0] = np.log(np.maximum(chunk, 1))
        q[:, 1] = np.log1p(cached)
        lin = self._lin(q) if self._lin is not None else None  # [n, cols], NaN outside the hull
        if lin is not None and np.isfinite(lin).all():  # every query inside (the usual case): one exp, then columns
            e = np.exp(lin.T)
            return {k: e[i] for i, k in enumerate(self.cols)}
        inside = np.isfinite(lin).all(axis=1) if lin is not None else np.zeros(chunk.size, dtype=bool)
        # the nearest measured point, for the queries outside the hull only (a query is inside for every column
        # or for none): by brute force over the table's few points, every column at once (a k-d tree query and a
        # loop over the columns cost ~8x more: a quarter of a Mooncake replay's queries leave the hull)
        out_ = np.flatnonzero(~inside)
        ch, qo = chunk[out_], q[out_]
        idx = np.square(qo[:, None, :] - self.pts[None, :, :]).sum(axis=2).argmin(axis=1)
        scale = np.where(self._is_att, (ch * (cached[out_] + self.H * ch / 2) / self.work[idx])[:, None],
                         np.maximum(ch / self._pt_chunk[idx], 1.0)[:, None])
        v = self._vmat[idx] * scale
        if lin is None:
            return {k: v[:, i].copy() for i, k in enumerate(self.cols)}
        w = np.exp(np.where(inside[:, None], lin, 0.0))
        w[out_] = v
        return {k: w[:, i].copy() for i, k in enumerate(self.cols)}

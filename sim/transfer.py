"""Cost tables on a machine they were not measured on: rescaled by a probe, or transferred by datasheet.

Two pure functions of (tables, something small), each returning new :class:`~tangram.sim.tables.CostTables`
whose ``provenance`` says what was done (every report repeats it):

``rescale(tables, probe)`` -- the same GPU model, another machine (H100s of one pool ran the same work up to 16%
apart). The probe (``tangram.sim.probe``) timed points that are points of the tables; per operator class:

* GEMM rows scale by the probe's ratio at their own shape (n, k), interpolated in log tokens between the probed
  token counts (1 ... 8192) and flat beyond: few tokens stream the weights, many are tensor-core bound, and a
  machine can differ in either. A shape the probe did not time takes the geometric mean of the probed shapes'
  ratios at its token count.
* element-wise rows (memory-bound) scale their bytes' part (at the op's best rate, at most the time above the
  op's latency floor) by the copy-bandwidth ratio.
* decode-attention rows scale by the decode points' ratio, interpolated in log bytes between the small point
  (B = 1, 1K tokens: the launch floor) and the large one (B = 64, 8K tokens: the streaming rate).
* prefill-attention rows scale their time above the model's floor by the prefill point's ratio of the same
  (without a prefill point: by the GEMMs' ratio at the most tokens probed, also tensor-core bound).
* compression's scoring/selection/scatter (flat over an 8x range of chunk sizes in the H100 table: latency
  floors), the engine overhead's issue/sync seconds and the host coefficients are unchanged: the probe does not
  measure them.

The reference the probe is compared with is the recorded probe of the machine the folder's engine overhead was
fitted on (``reference_probe.json``, written by ``tangram-fit-engine --probe``) where it has the same point, else
the tables themselves: the table's priced value at the point (the GEMM's monotone envelope, the decode/prefill row
of that point, meta.json's copy bandwidth). So a probe equal to the reference leaves every table unchanged, and a
probe of a machine s times slower everywhere multiplies every probed class by s.

``transfer(tables, source, target)`` -- another GPU model, from the datasheet figures of the two presets
(:class:`tangram.config.GPUConfig`): bandwidth ratio ``r_b`` and dense bf16 ratio ``r_f``. Each measured time t
is split into a latency floor f (kept) and the rest ``e = t - f``, and e is split into a bandwidth and a compute
part by a roofline with the operator's efficiencies fitted on the source (the best bytes/s and FLOP/s any of the
op's rows achieved above the floor): with ``tb = bytes / rate_b`` and ``tf = flops / rate_f`` of the row,
``t' = t + w * (max(tb / r_b, tf / r_f) / max(tb, tf) - 1)`` with ``w = min(e, max(tb, tf))``: the roofline part
scales, the rest (floor, launch gaps, a stalled measurement) is kept; a row on its roofline has ``w = e``. Per
class:

* GEMM: bytes ``(nk + mk + mn) x 2``, FLOPs ``2mnk``; floor = the file's fastest GEMM (a call with no work to
  speak of; 6.7 us on the shipped H100 tables, smollm2's o-projection at 4 tokens).
* element-wise: memory-bound, bytes from the table's GB/s column, the rate at the op's largest size; floor = the
  op's time at its smallest size (per model and width): a 4-token RoPE (ten small launches) stays, an 8K-token
  RMSNorm speeds up by ``r_b``.
* decode attention: memory-bound, ``tb`` = bytes at the bandwidth of the model's balanced-call fit
  (``a + bytes / BW``); floor = its intercept ``a``, so the fitted bandwidth scales by ``r_b`` and ``a`` stays.
* prefill attention: roofline of FLOPs ``4 d g (c x cached + H c^2 / 2)`` and bytes (cached K/V + the chunk's
  q/k/v/o); floor = the model's fastest row. Compression's scoring, top-k and scatter are kept: on the source
  they are latency floors (flat over an 8x range of chunk sizes, their work a few microseconds).
* resident CTAs of the decode kernel (the wave size): re-derived from the kernel's registers and shared memory
  (meta.json) and the target's per-SM limits, times its SMs.
* meta.json's copy bandwidth scales by ``r_b``; the engine overhead (kernel scales, issue and sync seconds) and
  the host coefficients are carried over unchanged.

Assumptions (docs/simulator.md lists them with their consequences): each kernel reaches the same fraction of the
datasheet bandwidth and FLOP rate on the target as on the source, at every size; latency floors (launch, the
kernel's prologue) do not depend on the GPU; the same kernels run (Triton compiles for the target with the same
tile sizes and register/shared-memory use; cuBLAS picks comparable GEMM kernels); the L2 size does not matter
(the tables were timed with L2 flushed or with data > 4x L2); the engine's host side (Python issue, CUDA-graph
replay) runs on a host like the source's. A transfer to the source's own figures is the identity.
"""
from __future__ import annotations

import copy as _copy
import json
from pathlib import Path

import numpy as np

from tangram.config import GPUConfig, MODELS, get_gpu
from tangram.errors import ConfigError

from .probe import check_probe
from .tables import CostTables

BF16 = 2


# ----------------------------------------------------------------------------- helpers


def ratio_curve(x, r):
    """f(q): ratios ``r`` at sizes ``x``, piecewise linear in log-log between them and flat beyond (repeated
    sizes averaged in log)."""
    x = np.asarray(x, float)
    lr = np.log(np.asarray(r, float))
    ux, inv = np.unique(x, return_inverse=True)
    ulr = np.bincount(inv, lr) / np.bincount(inv)
    lx = np.log(ux)

    def f(q):
        return np.exp(np.interp(np.log(np.maximum(np.asarray(q, float), 1e-30)), lx, ulr))
    return f


def roofline_factor(tb, tf, rb: float, rf: float) -> np.ndarray:
    """How much a kernel's time above its floor changes when bandwidth grows ``rb``-fold and compute ``rf``-fold:
    max(tb / rb, tf / rf) / max(tb, tf) (1 where the row has neither part)."""
    tb, tf = np.asarray(tb, float), np.asarray(tf, float)
    den = np.maximum(tb, tf)
    safe = np.where(den > 0, den, 1.0)
    return np.where(den > 0, np.maximum(tb / rb, tf / rf) / safe, 1.0)


def _keys(df, cols) -> np.ndarray:
    cols = [c for c in cols if c in df.columns]
    if not cols:
        return np.zeros(len(df), dtype=object)
    return df[cols].astype(str).agg("|".join, axis=1).to_numpy()


def _scale_col(df, col, factor):
    if col in df.columns:
        v = df[col].to_numpy(float)
        df[col] = np.where(np.isfinite(v), v * factor, v)


def _factor(old_s: np.ndarray, new_s: np.ndarray) -> np.ndarray:
    old_s = np.asarray(old_s, float)
    return np.where(old_s > 0, np.asarray(new_s, float) / np.where(old_s > 0, old_s, 1.0), 1.0)


def _retime(df, col: str, factor: np.ndarray, rate_cols=(), inverse_cols=()):
    """Multiply the times of ``col`` by ``factor``; spread columns (p20/p80) follow, rate columns (GB/s, TFLOP/s)
    take its inverse. Scaling by factors (never converting units) keeps a factor of 1 an exact identity."""
    _scale_col(df, col, factor)
    for c in rate_cols:
        _scale_col(df, c, factor)
    for c in inverse_cols:
        _scale_col(df, c, 1.0 / np.asarray(factor, float))


def _model(name):
    return MODELS.get(str(name).lower())


# ----------------------------------------------------------------------------- work of each row


def gemm_work(df) -> tuple[np.ndarray, np.ndarray]:
    m = df["tokens"].to_numpy(float)
    n, k = df["n"].to_numpy(float), df["k"].to_numpy(float)
    return (n * k + m * k + m * n) * BF16, 2.0 * m * n * k


def prefill_work(df) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and FLOPs of each prefill-attention row from its model's shape (rows of an unknown model: FLOPs from
    the table's attn_tflops, no bytes)."""
    byts, flops = np.zeros(len(df)), np.zeros(len(df))
    names = df["model"].astype(str).to_numpy() if "model" in df.columns else np.array([""] * len(df))
    for name in np.unique(names):
        i = names == name
        m = _model(name)
        sub = df[i]
        c = sub["chunk"].to_numpy(float)
        if m is None:
            if "attn_tflops" in sub.columns and "attention_ms" in sub.columns:
                flops[i] = sub["attn_tflops"].to_numpy(float) * 1e12 * sub["attention_ms"].to_numpy(float) * 1e-3
            continue
        H, Hq, d = m.num_kv_heads, m.num_q_heads, m.head_dim
        ntok = sub["cached_tokens"].to_numpy(float) if "cached_tokens" in sub.columns else \
            sub["cached"].to_numpy(float) * H
        flops[i] = 4.0 * d * (Hq // H) * (c * ntok + H * c * c / 2)
        byts[i] = (ntok * 2 * d + c * (2 * Hq + 2 * H) * d) * BF16
    return byts, flops


# ----------------------------------------------------------------------------- source fits


class RooflineFit:
    """Per group of rows (one operator of one model): the latency floor and the best achieved bytes/s and FLOP/s
    above it, fitted on the source tables; applied to those rows or to probe points of the same group."""

    def __init__(self, keys, t_s, byts, flops, floor, largest: bool = False):
        """``largest``: take each group's rates at its row with the most bytes instead of the best over its rows
        (a purely memory-bound op, whose small rows sit within noise of the floor and would inflate the best)."""
        self.floor = floor  # scalar or {key: seconds}
        self.rate_b, self.rate_f = {}, {}
        e = np.maximum(t_s - self._floor(keys), 0.0)
        ok = e > 0
        for key in np.unique(keys):
            i = (keys == key) & ok
            if largest and i.any():
                i = np.flatnonzero(i)[[int(np.argmax(byts[i]))]]
            self.rate_b[key] = float(np.max(byts[i] / e[i])) if i.any() and byts[i].max() > 0 else 0.0
            self.rate_f[key] = float(np.max(flops[i] / e[i])) if i.any() and flops[i].max() > 0 else 0.0

    def _floor(self, keys):
        if isinstance(self.floor, dict):
            return np.array([self.floor.get(k, 0.0) for k in keys])
        return np.full(len(keys), float(self.floor))

    def apply(self, keys, t_s, byts, flops, rb, rf, fallback: tuple[float, float]) -> np.ndarray:
        """New seconds: the roofline part of each row, ``w = min(t - floor, max(tb, tf))`` at this group's
        efficiencies, scales by the roofline factor; the rest (the floor, launch gaps, a stalled measurement) is
        kept. Rows on their roofline have ``w = t - floor``."""
        f = np.minimum(self._floor(keys), t_s)
        e = t_s - f
        rb_ = np.array([self.rate_b.get(k, fallback[0]) for k in keys])
        rf_ = np.array([self.rate_f.get(k, fallback[1]) for k in keys])
        tb = np.where(rb_ > 0, byts / np.where(rb_ > 0, rb_, 1.0), 0.0)
        tf = np.where(rf_ > 0, flops / np.where(rf_ > 0, rf_, 1.0), 0.0)
        R = roofline_factor(tb, tf, rb, rf)
        return t_s + np.minimum(e, np.maximum(tb, tf)) * (R - 1.0)

    def efficiencies(self, bw: float, peak: float) -> dict:
        return {k: {"bandwidth": self.rate_b[k] / bw, "compute": self.rate_f[k] / peak} for k in self.rate_b}


def _group_min(keys, t_s) -> dict:
    return {k: float(t_s[keys == k].min()) for k in np.unique(keys)}


def _decode_floors(tables: CostTables, keys) -> dict:
    """Per model: (floor, bandwidth): the intercept and bandwidth of the balanced-call fit (the cost model's
    ``a + bytes / BW``; the floor no higher than the fastest row), else (the fastest row, None)."""
    df = tables.decode
    out = {}
    for k in np.unique(keys):
        m = _model(k)
        fit = tables.decode_fit(m) if m is not None else None
        rows = df[_keys(df, ["model"]) == k] if "model" in df.columns else df
        tmin = float(rows["median_ms"].min()) * 1e-3
        out[k] = (min(fit[0], tmin), fit[1]) if fit is not None else (tmin, None)
    return out


# ----------------------------------------------------------------------------- occupancy


def blocks_per_sm(n_regs: int, shared_bytes: int, num_warps: int, *, regs_per_sm: int, smem_per_sm: int,
                  max_threads_per_sm: int, max_blocks_per_sm: int, smem_reserved_per_block: int = 1024,
                  reg_alloc_unit: int = 256) -> int:
    """Resident CTAs per SM (``tangram.kernels.decode.occupancy_blocks_per_sm``, here without torch so the
    simulator does not import it; tests/test_transfer.py checks the two agree)."""
    by_threads = max_threads_per_sm // (32 * num_warps)
    regs_per_warp = -(-max(n_regs, 1) * 32 // reg_alloc_unit) * reg_alloc_unit
    by_regs = (regs_per_sm // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (shared_bytes + smem_reserved_per_block)
    return max(1, min(by_threads, by_regs, by_smem, max_blocks_per_sm))


def _transfer_meta(meta: dict, source: GPUConfig, target: GPUConfig, rb: float) -> tuple[dict, dict]:
    m = _copy.deepcopy(meta)
    note = {}
    if isinstance(m.get("copy_gbps"), (int, float)):
        m["copy_gbps"] = m["copy_gbps"] * rb
    dk = m.get("decode_kernel")
    if isinstance(dk, dict) and all(isinstance(dk.get(f), (int, float)) for f in ("n_regs", "shared_bytes",
                                                                                  "num_warps")):
        lim = dict(dk.get("limits") or {})
        lim.update(num_sms=target.num_sms, regs_per_sm=target.regs_per_sm, smem_per_sm=target.smem_per_sm,
                   max_threads_per_sm=target.max_threads_per_sm, max_blocks_per_sm=target.max_blocks_per_sm)
        bps = blocks_per_sm(int(dk["n_regs"]), int(dk["shared_bytes"]), int(dk["num_warps"]),
                            regs_per_sm=lim["regs_per_sm"], smem_per_sm=lim["smem_per_sm"],
                            max_threads_per_sm=lim["max_threads_per_sm"], max_blocks_per_sm=lim["max_blocks_per_sm"],
                            smem_reserved_per_block=int(lim.get("smem_reserved_per_block", 1024)),
                            reg_alloc_unit=int(lim.get("reg_alloc_unit", 256)))
        note = {"n_cta_source": dk.get("n_cta"), "n_cta": bps * target.num_sms, "blocks_per_sm": bps}
        dk.update(limits=lim, blocks_per_sm=bps, n_cta=bps * target.num_sms)
    for key in ("n_cta", "decode_n_cta"):  # an occupancy given directly: same CTAs per SM, the target's SMs
        if isinstance(m.get(key), (int, float)):
            per_sm = m[key] / max(1, m.get("sm_count") or source.num_sms)
            m[key] = max(1, int(round(per_sm * target.num_sms)))
            note = {"n_cta_source": meta[key], "n_cta": m[key]}
    m.update(gpu_name=f"{target.name} (datasheet transfer)", sm_count=target.num_sms,
             memory_bytes=target.memory_bytes, l2_bytes=target.l2_bytes,
             transferred_from={"gpu_name": meta.get("gpu_name"), "date": meta.get("date"),
                               "command": meta.get("command")})
    for k in ("headline", "checks"):  # measurements of the source machine, not of the target
        m.pop(k, None)
    return m, note


# ----------------------------------------------------------------------------- datasheet transfer


def transfer(tables: CostTables, source: GPUConfig | str, target: GPUConfig | str) -> CostTables:
    """The tables of ``source`` carried to ``target`` by the ratios of their datasheet figures (module docstring)."""
    source = get_gpu(source) if isinstance(source, str) else source
    target = get_gpu(target) if isinstance(target, str) else target
    if tables.directory is None:
        raise ConfigError("transfer: no tables to transfer")
    rb, rf = target.mem_bandwidth / source.mem_bandwidth, target.bf16_flops / source.bf16_flops
    fits = {}
    out = {}
    if tables.gemm is not None and len(tables.gemm):
        fits["gemm"] = _gemm_fit(tables.gemm)
        out["gemm"] = _gemm_apply(tables.gemm, fits["gemm"], rb, rf, source)
    if tables.elementwise is not None and len(tables.elementwise):
        fits["elementwise"] = _elem_fit(tables.elementwise)
        out["elementwise"] = _elem_apply(tables.elementwise, fits["elementwise"], rb)
    if tables.decode is not None and len(tables.decode):
        fits["decode"] = _decode_fit(tables)
        out["decode"] = _decode_apply(tables.decode, fits["decode"], rb)
    if tables.prefill is not None and len(tables.prefill):
        fits["prefill"] = _prefill_fit(tables.prefill)
        out["prefill"] = _prefill_apply(tables.prefill, fits["prefill"], rb, rf, source)
    meta, occ = _transfer_meta(tables.meta, source, target, rb)
    label = (f"transferred from {source.family} by datasheet ({source.name} -> {target.name}: memory bandwidth "
             f"x{rb:.3g}, dense bf16 x{rf:.3g}" + (f", resident decode CTAs {occ['n_cta_source']} -> {occ['n_cta']}"
                                                    if occ else "") + "; latency floors kept)")
    eff = {}
    if "gemm" in fits:
        eff["gemm"] = fits["gemm"].efficiencies(source.mem_bandwidth, source.bf16_flops)
    if "prefill" in fits:
        eff["prefill_attention"] = fits["prefill"]["attention"].efficiencies(source.mem_bandwidth, source.bf16_flops)
    prov = {"kind": "transfer", "from": source.name, "to": target.name, "label": label,
            "bandwidth_ratio": rb, "compute_ratio": rf, "occupancy": occ,
            "floors_s": {"gemm": fits["gemm"].floor if "gemm" in fits else None},
            "source_efficiencies": eff, "rules": "tangram.sim.transfer (docs/simulator.md, 'Tables on another GPU')"}
    ref = None
    if tables.reference_probe is not None:
        ref = transfer_probe(tables.reference_probe, fits, rb, rf, source)
    return tables.derive(meta=meta, provenance=list(tables.provenance) + [prov], reference_probe=ref,
                         reference_probe_source=None if ref is None else
                         f"{tables.reference_probe_source} (transferred to {target.name})", **out)


def _gemm_keys(df):
    return _keys(df, ["model", "op", "n", "k"])


def _gemm_fit(df) -> RooflineFit:
    t = df["median_ms"].to_numpy(float) * 1e-3
    b, f = gemm_work(df)
    return RooflineFit(_gemm_keys(df), t, b, f, floor=float(t.min()))


def _gemm_apply(df, fit: RooflineFit, rb, rf, source: GPUConfig):
    df = df.copy()
    t = df["median_ms"].to_numpy(float) * 1e-3
    b, f = gemm_work(df)
    new = fit.apply(_gemm_keys(df), t, b, f, rb, rf, (source.mem_bandwidth, source.bf16_flops))
    _retime(df, "median_ms", _factor(t, new), rate_cols=("p20_ms", "p80_ms"), inverse_cols=("tflops",))
    return df


def _elem_keys(df):
    return _keys(df, ["model", "op", "hidden"])


def _elem_bytes(df) -> np.ndarray | None:
    """Bytes each element-wise row moved, from the table's own GB/s column (kernels/bench.py counts them)."""
    if "gbps" not in df.columns:
        return None
    b = df["gbps"].to_numpy(float) * 1e9 * df["median_ms"].to_numpy(float) * 1e-3
    return b if np.all(np.isfinite(b)) else None


def _elem_fit(df):
    """Per (model, op, width): the op's time at its smallest size as the floor, and the bytes/s above it at its
    largest size."""
    keys, t = _elem_keys(df), df["median_ms"].to_numpy(float) * 1e-3
    floors = _group_min(keys, t)
    b = _elem_bytes(df)
    return floors if b is None else RooflineFit(keys, t, b, np.zeros_like(b), floor=floors, largest=True)


def _floor_scaled(t_s, floors, keys, factor):
    f = np.minimum(np.array([floors.get(k, 0.0) for k in keys]), t_s)
    return t_s + (t_s - f) * (factor - 1.0)


def _elem_apply(df, fit, rb):
    """Memory-bound: the bytes' part of each row (at the op's best rate, at most its time above the floor)
    scales by 1 / rb; the launch-bound rest (a 4-token RoPE is ten small launches) stays. A table without a GB/s
    column scales the whole time above the floor."""
    df = df.copy()
    t = df["median_ms"].to_numpy(float) * 1e-3
    keys = _elem_keys(df)
    b = _elem_bytes(df)
    if isinstance(fit, RooflineFit) and b is not None:
        new = fit.apply(keys, t, b, np.zeros_like(b), rb, 1.0, (0.0, 0.0))
    else:
        new = _floor_scaled(t, fit.floor if isinstance(fit, RooflineFit) else fit, keys, 1.0 / rb)
    _retime(df, "median_ms", _factor(t, new), rate_cols=("p20_ms", "p80_ms"), inverse_cols=("gbps",))
    return df


def _decode_fit(tables: CostTables) -> dict:
    return _decode_floors(tables, _keys(tables.decode, ["model"]))


def _decode_apply(df, fits: dict, rb):
    """Memory-bound: each row's bytes at the model's fitted bandwidth (at most its time above the intercept)
    scale by 1 / rb; the intercept and what a row spends beyond its bytes (a straggler CTA, bound by memory
    latency rather than bandwidth) stay."""
    df = df.copy()
    t = df["median_ms"].to_numpy(float) * 1e-3
    keys = _keys(df, ["model"])
    floor = np.minimum(np.array([fits.get(k, (0.0, None))[0] for k in keys]), t)
    bw = np.array([fits.get(k, (0.0, None))[1] or np.nan for k in keys], float)
    e = t - floor
    tb = df["bytes"].to_numpy(float) / bw if "bytes" in df.columns else np.full(len(df), np.nan)
    w = np.where(np.isfinite(tb), np.minimum(e, tb), e)
    new = t + w * (1.0 / rb - 1.0)
    _retime(df, "median_ms", _factor(t, new), rate_cols=("p20_ms", "p80_ms"), inverse_cols=("achieved_gbps",))
    if "total_ms" in df.columns and "plan_ms" in df.columns:
        plan = df["plan_ms"].to_numpy(float)
        df["total_ms"] = df["median_ms"].to_numpy(float) + np.where(np.isfinite(plan), plan, 0.0)
    return df


def _prefill_fit(df) -> dict:
    keys = _keys(df, ["model"])
    t = df["attention_ms"].to_numpy(float) * 1e-3
    b, f = prefill_work(df)
    return {"attention": RooflineFit(keys, t, b, f, floor=_group_min(keys, t))}


def _prefill_apply(df, fit: dict, rb, rf, source: GPUConfig):
    df = df.copy()
    keys = _keys(df, ["model"])
    t = df["attention_ms"].to_numpy(float) * 1e-3
    b, f = prefill_work(df)
    new = fit["attention"].apply(keys, t, b, f, rb, rf, (source.mem_bandwidth, source.bf16_flops))
    old_ms = df["attention_ms"].to_numpy(float)
    _retime(df, "attention_ms", _factor(t, new), inverse_cols=("attn_tflops",))
    # score/select/scatter stay: latency floors (flat over an 8x range of chunk sizes on the source)
    if "total_ms" in df.columns:
        df["total_ms"] = df["total_ms"].to_numpy(float) + (df["attention_ms"].to_numpy(float) - old_ms)
    return df


def transfer_probe(probe: dict, fits: dict, rb, rf, source: GPUConfig) -> dict:
    """A recorded reference probe carried by the same rules as the tables (what it would read on the target)."""
    import pandas as pd

    p = _copy.deepcopy(probe)
    if p.get("copy"):
        p["copy"]["gbps"] *= rb
        p["copy"]["median_ms"] = p["copy"].get("median_ms", 0.0) / rb
    if p.get("gemm") and "gemm" in fits:
        df = pd.DataFrame(p["gemm"])
        new = _gemm_apply(df, fits["gemm"], rb, rf, source)
        for it, v in zip(p["gemm"], new["median_ms"]):
            it["median_ms"] = float(v)
    if p.get("decode") and "decode" in fits:
        df = _decode_apply(pd.DataFrame(p["decode"]), fits["decode"], rb)
        for it, v in zip(p["decode"], df["median_ms"]):
            it["median_ms"] = float(v)
    if p.get("prefill") and "prefill" in fits:
        df = pd.DataFrame(p["prefill"])
        new = _prefill_apply(df, {"attention": fits["prefill"]["attention"]}, rb, rf, source)
        for it, v in zip(p["prefill"], new["attention_ms"]):
            it["attention_ms"] = float(v)
    return p


# ----------------------------------------------------------------------------- probe rescale


def _envelope(y: np.ndarray) -> np.ndarray:
    """Monotone envelope over increasing sizes (the tables' LogInterp1D(monotone=True) rule)."""
    return np.minimum.accumulate(np.asarray(y, float)[::-1])[::-1]


def _gemm_reference(tables: CostTables, model: str, op: str, n: int, k: int, tokens: np.ndarray):
    from .tables import LogInterp1D

    df = tables.gemm
    if df is None:
        return None
    rows = df[(df["op"] == op) & (df["n"] == n) & (df["k"] == k)]
    if "model" in df.columns and (rows["model"].astype(str).str.lower() == model).any():
        rows = rows[rows["model"].astype(str).str.lower() == model]
    if len(rows) == 0:
        return None
    f = LogInterp1D(rows["tokens"].to_numpy(), rows["median_ms"].to_numpy() * 1e-3, monotone=True)
    return np.asarray(f(tokens), float) * 1e3


def _match_rows(df, item: dict, cols: tuple) -> object:
    sel = np.ones(len(df), bool)
    for c in cols:
        if c not in df.columns:
            return df.iloc[0:0]
        v = df[c]
        sel &= (v.astype(str).str.lower() == str(item[c]).lower()).to_numpy() if c in ("model", "kernel") else \
            np.isclose(v.to_numpy(float), float(item[c]))
    return df[sel]


def _recorded(ref_probe: dict | None, cls: str, item: dict, cols: tuple):
    if not ref_probe:
        return None
    for it in ref_probe.get(cls, []):
        if all(str(it.get(c)).lower() == str(item.get(c)).lower() if isinstance(item.get(c), str)
               else it.get(c) is not None and np.isclose(float(it[c]), float(item[c])) for c in cols):
            return it
    return None


def reference_of(tables: CostTables, probe: dict) -> dict:
    """For each probe point, the value the reference machine has there, and where it comes from."""
    rp = tables.reference_probe
    out = {"gemm": {}, "decode": [], "prefill": [], "copy": None}
    series: dict = {}
    for it in probe.get("gemm", []):
        series.setdefault((it["model"], it["op"], int(it["n"]), int(it["k"])), []).append(it)
    for key, items in series.items():
        items = sorted(items, key=lambda x: x["tokens"])
        toks = np.array([x["tokens"] for x in items], float)
        rec = [_recorded(rp, "gemm", x, ("model", "op", "n", "k", "tokens")) for x in items]
        if all(r is not None for r in rec):
            ref, src = _envelope([r["median_ms"] for r in rec]), "recorded reference probe"
        else:
            ref, src = _gemm_reference(tables, *key, toks), "gemm.csv (monotone envelope)"
        out["gemm"][key] = (toks, _envelope([x["median_ms"] for x in items]), ref, src)
    cp = probe.get("copy")
    if cp:
        rc = (rp or {}).get("copy")
        if rc and int(rc.get("bytes", 0)) == int(cp["bytes"]):
            out["copy"] = (float(rc["gbps"]), "recorded reference probe")
        elif isinstance(tables.meta.get("copy_gbps"), (int, float)):
            out["copy"] = (float(tables.meta["copy_gbps"]), "meta.json copy_gbps")
    dcols = ("model", "batch", "context", "rho", "heads_per_group")
    for it in probe.get("decode", []):
        rec = _recorded(rp, "decode", it, dcols)
        ref, src = (float(rec["median_ms"]), "recorded reference probe") if rec is not None else (None, None)
        if ref is None and tables.decode is not None:
            rows = _match_rows(tables.decode, {**it, "kernel": it.get("kernel", "tangram_aot")}, ("kernel",) + dcols)
            if "waves" in rows.columns and "waves" in it and np.isclose(rows["waves"].to_numpy(float),
                                                                        float(it["waves"])).any():
                rows = rows[np.isclose(rows["waves"].to_numpy(float), float(it["waves"]))]
            if len(rows):
                ref, src = float(np.median(rows["median_ms"].to_numpy(float))), f"decode_attention.csv ({len(rows)} rows)"
        out["decode"].append((it, ref, src))
    pcols = ("model", "chunk", "cached")
    for it in probe.get("prefill", []):
        rec = _recorded(rp, "prefill", it, pcols)
        ref, src = (float(rec["attention_ms"]), "recorded reference probe") if rec is not None else (None, None)
        if ref is None and tables.prefill is not None:
            rows = _match_rows(tables.prefill, it, pcols)
            if len(rows):
                ref, src = float(np.median(rows["attention_ms"].to_numpy(float))), \
                    f"prefill_attention.csv ({len(rows)} rows)"
        out["prefill"].append((it, ref, src))
    return out


def _pooled(curves: list, x: np.ndarray) -> np.ndarray:
    if not curves:
        return np.ones_like(np.asarray(x, float))
    return np.exp(np.mean([np.log(f(x)) for f in curves], axis=0))


def rescale(tables: CostTables, probe: dict, *, source: str | None = None) -> CostTables:
    """The tables rescaled to the probed machine (module docstring); identity when the probe reads what the
    reference reads."""
    check_probe(probe, source or probe.get("_path") or "<probe>")
    ref = reference_of(tables, probe)
    scales: dict = {}
    unchanged = ["compression scoring/selection/scatter (latency floors)", "engine overhead", "host coefficients"]
    out = {}
    meta = _copy.deepcopy(tables.meta)

    # GEMMs: ratio curves over tokens per probed shape
    curves, by_shape = [], {}
    gs = {}
    for (model, op, n, k), (toks, pm, rm, src) in ref["gemm"].items():
        if rm is None:
            continue
        r = pm / rm
        f = ratio_curve(toks, r)
        curves.append(f)
        by_shape[(n, k)] = f
        gs[f"{model} {op} {n}x{k}"] = {"tokens": toks.astype(int).tolist(), "time_ratio": r.tolist(),
                                       "reference": src}
    if gs:
        scales["gemm"] = gs
    if tables.gemm is not None and curves:
        df = tables.gemm.copy()
        tok = df["tokens"].to_numpy(float)
        r = _pooled(curves, tok)
        matched = np.zeros(len(df), bool)
        for (n, k), f in by_shape.items():
            i = ((df["n"] == n) & (df["k"] == k)).to_numpy()
            r[i], matched[i] = f(tok[i]), True
        if (~matched).any():
            scales["gemm_unprobed_shapes"] = "geometric mean of the probed shapes' ratios at the same tokens " \
                                             f"({int((~matched).sum())} rows)"
        _retime(df, "median_ms", r, rate_cols=("p20_ms", "p80_ms"), inverse_cols=("tflops",))
        out["gemm"] = df
    elif tables.gemm is not None:
        unchanged.append("GEMMs (no probed GEMM matched the tables)")

    # copy bandwidth -> element-wise rows above their floors
    if ref["copy"] is not None:
        ref_gbps, src = ref["copy"]
        rb = float(probe["copy"]["gbps"]) / ref_gbps
        scales["copy_bandwidth"] = {"ratio": rb, "probe_gbps": float(probe["copy"]["gbps"]), "reference_gbps": ref_gbps,
                                    "reference": src}
        if isinstance(meta.get("copy_gbps"), (int, float)):
            meta["copy_gbps"] = meta["copy_gbps"] * rb
        if tables.elementwise is not None:
            out["elementwise"] = _elem_apply(tables.elementwise, _elem_fit(tables.elementwise), rb)
    else:
        unchanged.append("element-wise ops (no copy point or no reference copy bandwidth)")

    # decode: ratio over bytes, per model
    dpts: dict = {}
    for it, rv, src in ref["decode"]:
        if rv is not None:
            dpts.setdefault(it["model"], []).append((float(it["bytes"]), float(it["median_ms"]) / rv, src))
    if dpts and tables.decode is not None:
        dcurves = {m: ratio_curve([p[0] for p in v], [p[1] for p in v]) for m, v in dpts.items()}
        scales["decode"] = {m: {"bytes": [int(p[0]) for p in v], "time_ratio": [p[1] for p in v], "reference": v[0][2]}
                            for m, v in dpts.items()}
        df = tables.decode.copy()
        x = df["bytes"].to_numpy(float)
        models = _keys(df, ["model"])
        r = _pooled(list(dcurves.values()), x)
        for m, f in dcurves.items():
            i = models == m
            r[i] = f(x[i])
        _retime(df, "median_ms", r, rate_cols=("p20_ms", "p80_ms"), inverse_cols=("achieved_gbps",))
        if "total_ms" in df.columns and "plan_ms" in df.columns:
            plan = df["plan_ms"].to_numpy(float)
            df["total_ms"] = df["median_ms"].to_numpy(float) + np.where(np.isfinite(plan), plan, 0.0)
        out["decode"] = df
    elif tables.decode is not None:
        unchanged.append("decode attention (no decode point matched the tables)")

    # prefill attention above the model's floor
    if tables.prefill is not None and len(tables.prefill):
        keys = _keys(tables.prefill, ["model"])
        floors = _group_min(keys, tables.prefill["attention_ms"].to_numpy(float) * 1e-3)
        pr = {}
        for it, rv, src in ref["prefill"]:
            if rv is None:
                continue
            f = floors.get(str(it["model"]), 0.0) * 1e3
            pm = float(it["attention_ms"])
            ratio = (pm - f) / (rv - f) if rv - f > 1e-9 and pm - f > 0 else pm / rv
            pr[str(it["model"])] = {"chunk": it["chunk"], "cached": it["cached"], "time_ratio": pm / rv,
                                    "above_floor_ratio": ratio, "floor_ms": f, "reference": src}
        how = "prefill point"
        if not pr and curves:
            top = max(int(max(v[0])) for v in ref["gemm"].values() if v[2] is not None)
            g = float(_pooled(curves, np.array([top]))[0])
            pr = {"*": {"above_floor_ratio": g, "from": f"GEMM ratio at {top} tokens (no prefill point)"}}
            how = f"GEMM ratio at {top} tokens"
        if pr:
            default = float(np.exp(np.mean([np.log(v["above_floor_ratio"]) for v in pr.values()])))
            fac = np.array([pr.get(k, {}).get("above_floor_ratio", default) for k in keys])
            df = tables.prefill.copy()
            t = df["attention_ms"].to_numpy(float) * 1e-3
            new = _floor_scaled(t, floors, keys, fac)
            old_ms = df["attention_ms"].to_numpy(float)
            _retime(df, "attention_ms", _factor(t, new), inverse_cols=("attn_tflops",))
            if "total_ms" in df.columns:  # the measured total of the chunk: its attention part moves
                df["total_ms"] = df["total_ms"].to_numpy(float) + (df["attention_ms"].to_numpy(float) - old_ms)
            out["prefill"] = df
            scales["prefill_attention"] = pr
            scales["prefill_attention_how"] = how
        else:
            unchanged.append("prefill attention (no prefill point and no GEMM ratio)")

    dev = probe.get("device", {}).get("name", "?")
    label = f"rescaled by the probe of {dev}" + (f" ({source})" if source else "") + ": " + _scale_summary(scales)
    prov = {"kind": "probe", "file": source, "device": dev, "date": probe.get("date"), "label": label,
            "scales": scales, "unchanged": unchanged}
    meta["probe"] = {"device": dev, "date": probe.get("date"), "file": source}
    clean = {k: v for k, v in probe.items() if not k.startswith("_")}
    return tables.derive(meta=meta, provenance=list(tables.provenance) + [prov], reference_probe=clean,
                         reference_probe_source=source, **out)


def _scale_summary(s: dict) -> str:
    parts = []
    if "gemm" in s:
        r = [x for v in s["gemm"].values() for x in v["time_ratio"]]
        parts.append(f"GEMM time x{min(r):.3f}-{max(r):.3f}")
    if "copy_bandwidth" in s:
        parts.append(f"copy bandwidth x{s['copy_bandwidth']['ratio']:.3f}")
    if "decode" in s:
        r = [x for v in s["decode"].values() for x in v["time_ratio"]]
        parts.append(f"decode time x{min(r):.3f}-{max(r):.3f}")
    if "prefill_attention" in s:
        r = [v["above_floor_ratio"] for v in s["prefill_attention"].values()]
        parts.append(f"prefill time above floor x{min(r):.3f}-{max(r):.3f} ({s.get('prefill_attention_how')})")
    return ", ".join(parts) or "nothing matched the tables"


# ----------------------------------------------------------------------------- writing a table set


def write_tables(tables: CostTables, out: str | Path) -> Path:
    """A CostTables as a folder (``--tables`` reads it back, provenance included); the source's engine overhead
    is copied, since it is carried over unchanged."""
    import shutil

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name, df in (("decode_attention.csv", tables.decode), ("prefill_attention.csv", tables.prefill),
                     ("gemm.csv", tables.gemm), ("elementwise.csv", tables.elementwise)):
        if df is not None:
            df.to_csv(d / name, index=False)
    meta = dict(tables.meta, provenance=tables.provenance)
    (d / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if tables.reference_probe is not None:
        (d / "reference_probe.json").write_text(json.dumps(tables.reference_probe, indent=1, sort_keys=True) + "\n")
    if tables.directory is not None and (tables.directory / "engine_overhead.json").exists() and \
            tables.directory.resolve() != d.resolve():
        shutil.copy(tables.directory / "engine_overhead.json", d / "engine_overhead.json")
    if tables.has_decode_costs:  # the decode-launch costs moved as the decode rows were (read back as they are)
        _write_decode_costs(tables, d / "decode_costs.json")
    return d


def _write_decode_costs(tables: CostTables, path: Path) -> None:
    """The folder's decode_costs.json with the top-level costs and every model's carried by the steps applied
    since it was read (``CostTables.decode_costs``); the fit statistics are kept (they describe the source)."""
    from .tables import scale_decode_costs

    src = json.loads((tables.directory / "decode_costs.json").read_text())
    from tangram.planner import DecodeCosts

    def moved(entry: dict, model: str | None) -> dict:
        c = DecodeCosts.load(tables.directory, model)
        for step in tables.provenance[tables.loaded_steps:]:
            c = scale_decode_costs(c, step, model)
        return {**entry, **{k: getattr(c, k) for k in ("bw", "cta_bw", "cta_s", "launch_s", "merge_s")},
                "source": entry.get("source", "") + "".join(
                    f"; {p['label']}" for p in tables.provenance[tables.loaded_steps:])}

    out = moved(src, None)
    if isinstance(src.get("by_model"), dict):
        out["by_model"] = {m: moved(v, m) for m, v in src["by_model"].items()}
    path.write_text(json.dumps(out, indent=1) + "\n")


__all__ = ["transfer", "rescale", "reference_of", "ratio_curve", "roofline_factor", "blocks_per_sm", "write_tables",
           "transfer_probe"]

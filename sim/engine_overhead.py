"""What the real engine spends on a step beyond its kernels: launches issued from Python, copies, the sync.

The kernel tables price operators back to back, as a CUDA-graph engine would run them. Our engine
(:mod:`tangram.engine.executor`) issues every kernel eagerly from Python, so a small decode step is bound by
the host issuing ~a dozen launches per layer, not by the GPU. Issue and execution overlap (launches are
asynchronous), so a step takes

    exec_s = max(sum_t scale_t * kernel_t, issue_s) + sync_s
    issue_s = L * (layer_s + (decode_layer_s + aot_decode_layer_s * [aot]) * [kd > 0]
                   + (prefill_chunk_layer_s + compress_chunk_layer_s * [compress]) * kp) + row_s * (kd + kp)

and a decode step replayed from a CUDA graph (``EngineConfig.decode_graphed``) takes
``graph_scale * sum_t kernel_t + graph_s`` (the row term takes ``min(kd + kp, rows_max)`` rows, ``rows_max`` the
most rows of an eager step the fit saw: not extrapolated, see :class:`EngineOverhead`),
with ``kernel_t`` the cost model's own prediction for each kernel term t of the step (dense GEMMs and
element-wise ops, prefill attention, compression, decode attention) and ``scale_t`` (``kernel_scale`` for the
dense term, ``prefill_scale``, ``compress_scale``, ``decode_scale``) the ratio between that term inside the
engine and in the microbenchmarks. The terms need their own scales: the operator tables time each kernel
alone, so a small launch-bound kernel (compression's scoring, selection and scatter) is priced at its launch
latency, which the engine hides behind the GEMMs it issues next (measured per operator on the H100: compression
0.15-0.3x its table time, dense GEMMs 1.2-1.4x, reports/validation/README.md); one shared scale mispriced steps
whose mix differs from the calibration's (a 4096-token chunk). ``kd``/``kp`` are the step's decode rows and
prefill chunks, ``aot`` whether decode reads the AOT split table (per-layer lookups), and ``sync_s`` the per-step
tail (embedding/logits/sampling launches, the host copy of the sampled tokens, bookkeeping). The coefficients are
fitted (``scipy.optimize.least_squares``, errors weighted by 1/sqrt(measured), all >= 0) to every step of engine
runs on the GPU by ``python -m tangram.sim.fit_engine``, which writes them to ``engine_overhead.json`` in
the GPU's calibration folder, per model, with provenance. They describe this engine on that machine (its host
CPU included). A weak prior (:data:`SCALE_PRIOR`) holds each scale at 1 unless the steps say otherwise, so a scale
the steps cannot tell from a constant stays the tables' own and transfers with them to another GPU.

Opt-in terms (:data:`EXTRA`, fitted only when asked for, 0 otherwise): a graphed step adds ``graph_row_s * kd +
graph_table_row_s * kd * tables`` and an eager one ``table_token_s * prefill_tokens * tables``, ``tables`` the page
tables per row (``KVLayout.n_tables``). They fit the recorded H100 calibrations' steps better but did not make the
fit transfer better to the other measured machines, so the shipped fit does without them
(reports/transfer/device_validation/README.md, "Opt-in terms").
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError

FILENAME = "engine_overhead.json"
VERSION = 2
# The kernel terms a step's kernel time is split into: the cost model's breakdown keys each sums, and the
# executor's operators (timed with --time-ops) that carry it.
TERM_KEYS = {"dense": (("gemm", "elementwise"), ("dense", "lm_head_sampling", "kv_write")),
             "prefill_attention": (("prefill_attention",), ("prefill_attention",)),
             "compression": (("compression",), ("compression",)),
             "decode_attention": (("decode_attention",), ("decode_attention",))}
TERMS = tuple(TERM_KEYS)
COEFFS = ("layer_s", "decode_layer_s", "aot_decode_layer_s", "prefill_chunk_layer_s", "compress_chunk_layer_s",
          "row_s", "sync_s", "graph_s", "graph_row_s", "graph_table_row_s", "table_token_s", "kernel_scale", "prefill_scale", "compress_scale", "decode_scale",
          "graph_scale")
ONE_OFF = 2.0  # a step this many times slower than its fitted time is a one-off, left out of the fit
# Weight of the prior that pulls each scale toward 1 (the tables' own time), per step, in the units of the weighted
# residuals (~ relative step error): a scale moves away from 1 only where the steps pay for it. Without it a term
# whose table time hardly varies across the fitted steps (a calibration trace's graphed decode steps: ~constant
# weight streaming) is not identifiable from the constant beside it, and the fit traded them freely (H100,
# 2026-11-24: graph_scale 0.18 + graph_s 5.2 ms), which prices another GPU's faster kernels as barely faster.
SCALE_PRIOR = 0.02
_PER_LAYER = 5  # the first five coefficients are per layer
_SECONDS = 11  # ... and the first eleven are seconds; the rest are scales
# Terms a fit leaves at 0 unless asked for (``fit(extra=...)``, ``tangram-fit-engine --extra-terms``): added after the
# 2026-11-25 fits, they did not earn a place in the shipped fit (reports/transfer/device_validation/README.md)
EXTRA = ("graph_row_s", "graph_table_row_s", "table_token_s")
# seconds per (row x page table) and per (prefill token x page table): unknowns in these fractions of the median step
_PER_TABLE = {"graph_table_row_s": 1e-2, "table_token_s": 1e-6}
_TERM_SCALE = {"dense": "kernel_scale", "prefill_attention": "prefill_scale", "compression": "compress_scale",
               "decode_attention": "decode_scale"}


@dataclass(frozen=True)
class EngineOverhead:
    layer_s: float
    decode_layer_s: float
    aot_decode_layer_s: float
    prefill_chunk_layer_s: float
    compress_chunk_layer_s: float
    row_s: float
    sync_s: float
    graph_s: float  # a graph-replayed decode step: kernels back to back plus this (input copies, lm_head, sync)
    kernel_scale: float = 1.0  # eager steps: the dense (GEMM + element-wise) term's table time -> engine time
    # per-term scales of eager steps (None: kernel_scale, as in files fitted before the terms were split)
    prefill_scale: float | None = None
    compress_scale: float | None = None
    decode_scale: float | None = None
    graph_scale: float | None = None  # a graphed step's kernels (no Python launch between them)
    source: str = ""
    # The most rows (kd + kp) of an eager step the fit saw; the row term is flat beyond it (None: not recorded, as in
    # files fitted before it was, priced linearly). The engine issues no launch per row (its eager step is
    # vectorised over rows), so row_s is whatever per-row host work the fitted steps' few rows show; extrapolated
    # linearly it is not a measurement. The H100 fit of 2026-11-24 saw eager steps of at most 5 rows (its decode-only
    # steps were all graphed) and its objective hardly moves between row_s 0 and 1.76 ms, yet 1.76 ms x 65 rows
    # priced an eager decode step of 65 rows at ~10x the graphed 64-row step and a mixed step of 64 decode rows +
    # a 512-token chunk at 142-153 ms, where the engine measured 35-85 ms (reports/engine/roofline, "Mixed steps").
    rows_max: float | None = None
    # A graphed decode step's per-row host work (its rows' inputs gathered, uploaded and their samples recorded in
    # Python, which the GPU waits through when the step is a few ms), and per (row x page table) (the rows' block
    # tables gathered into the graph's static buffer: ``tables`` per row, 1 for a monolithic page). 0: not fitted
    # (files fitted before these terms).
    graph_row_s: float = 0.0
    graph_table_row_s: float = 0.0
    # An eager step's work per (prefill token x page table) that no kernel term carries (the chunk's kept tokens
    # written into each of its rows' tables: at H_p 1 a row has 256 tables), added after the issue/kernel overlap.
    table_token_s: float = 0.0

    def __post_init__(self):
        for k in ("prefill_scale", "compress_scale", "decode_scale", "graph_scale"):
            if getattr(self, k) is None:
                object.__setattr__(self, k, self.kernel_scale)

    def issue_s(self, num_layers: int, kd, kp, compress, aot=False) -> np.ndarray:
        kd, kp = np.asarray(kd, dtype=np.float64), np.asarray(kp, dtype=np.float64)
        per_layer = (self.layer_s + (self.decode_layer_s + self.aot_decode_layer_s * np.asarray(aot, float)) * (kd > 0)
                     + (self.prefill_chunk_layer_s + self.compress_chunk_layer_s * np.asarray(compress, float)) * kp)
        rows = kd + kp
        if self.rows_max is not None:
            rows = np.minimum(rows, self.rows_max)
        return num_layers * per_layer + self.row_s * rows

    def step_s(self, kernels, num_layers: int, kd, kp, compress, aot=False, graphed=False, tables=1, ptokens=0):
        """Executor seconds of a step whose kernels take ``kernels`` seconds by the tables: a mapping of
        :data:`TERMS` to seconds (arrays broadcast), or one total priced as the dense term. ``graphed``: a decode
        step replayed from a CUDA graph, whose launches are not issued from Python. ``tables``: page tables per
        row (``KVLayout.n_tables``: layers x groups with ragged paging, else 1); ``ptokens``: prefill tokens."""
        if not isinstance(kernels, dict):
            kernels = {"dense": kernels}
        unknown = set(kernels) - set(TERMS)
        if unknown:
            raise ConfigError(f"engine overhead: unknown kernel terms {sorted(unknown)} (known: {TERMS})")
        if (type(kd) is int and type(kp) is int and type(tables) is int and type(ptokens) is int
                and all(type(v) is float for v in kernels.values())):
            return self._step_s_one(kernels, num_layers, kd, kp, compress, aot, graphed, tables, ptokens)
        k = sum(getattr(self, _TERM_SCALE[t]) * np.asarray(v, dtype=np.float64) for t, v in kernels.items())
        g = self.graph_scale * sum(np.asarray(v, dtype=np.float64) for v in kernels.values())
        tables = np.asarray(tables, np.float64)
        eager = (np.maximum(k, self.issue_s(num_layers, kd, kp, compress, aot)) + self.sync_s
                 + self.table_token_s * (np.asarray(ptokens, np.float64) * tables))
        kd = np.asarray(kd, dtype=np.float64)
        g = g + self.graph_s + self.graph_row_s * kd + self.graph_table_row_s * (kd * tables)
        return np.where(np.asarray(graphed, bool), g, eager)

    def _step_s_one(self, kernels: dict, num_layers: int, kd: int, kp: int, compress, aot, graphed,
                    tables: int = 1, ptokens: int = 0) -> float:
        """:meth:`step_s` of one step (Python floats: numpy's per-call overhead was most of a step's pricing), the
        same operations in the same order, so the same value bit for bit."""
        if bool(graphed):
            return (self.graph_scale * sum(kernels.values()) + self.graph_s + self.graph_row_s * float(kd)
                    + self.graph_table_row_s * (float(kd) * float(tables)))
        k = sum(getattr(self, _TERM_SCALE[t]) * v for t, v in kernels.items())
        per_layer = (self.layer_s + (self.decode_layer_s + self.aot_decode_layer_s * float(bool(aot))) * (kd > 0)
                     + (self.prefill_chunk_layer_s + self.compress_chunk_layer_s * float(bool(compress))) * float(kp))
        rows = float(kd + kp)
        if self.rows_max is not None:
            rows = min(rows, float(self.rows_max))
        issue = num_layers * per_layer + self.row_s * rows
        return max(k, issue) + self.sync_s + self.table_token_s * (float(ptokens) * float(tables))

    def coefficients(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in COEFFS}


def fit(kernels, measured_s, num_layers: int, kd, kp, compress, aot=False,
        graphed=False, tables=1, ptokens=0, fixed: dict | None = None,
        extra: tuple = ()) -> tuple[EngineOverhead, dict]:
    """Least-squares fit of the coefficients to measured executor seconds per step; returns the fit stats.
    ``kernels``: per-step table seconds, a mapping of :data:`TERMS` or one total (the dense term); ``tables``: each
    step's page tables per row, ``ptokens`` its prefill tokens. ``extra``: which of :data:`EXTRA` to fit (the others
    are held at 0). ``fixed``: coefficients held at the values given (a fit made elsewhere given only some terms),
    the others fitted.

    Coefficients no step informs (no graphed step: ``graph_s``, ``graph_scale``; no eager one: the issue terms;
    a term that is zero in every eager step: its scale) keep their start value and are reported in
    ``stats["unfitted"]``; an unfitted ``graph_s`` is set to ``sync_s``, an unfitted scale to ``kernel_scale``."""
    from scipy.optimize import least_squares

    if not isinstance(kernels, dict):
        kernels = {"dense": kernels}
    measured_s = np.asarray(measured_s, float)
    kernels = {t: np.broadcast_to(np.asarray(v, float), measured_s.shape) for t, v in kernels.items()}
    total = sum(kernels.values())
    kd, kp, compress = np.asarray(kd), np.asarray(kp), np.asarray(compress, bool)
    aot = np.broadcast_to(np.asarray(aot, bool), kd.shape)
    graphed = np.broadcast_to(np.asarray(graphed, bool), kd.shape)
    tables = np.broadcast_to(np.asarray(tables, np.int64), kd.shape)
    ptokens = np.broadcast_to(np.asarray(ptokens, np.int64), kd.shape)
    if set(extra) - set(EXTRA):
        raise ConfigError(f"engine overhead fit: unknown extra terms {sorted(set(extra) - set(EXTRA))} (known: "
                          f"{', '.join(EXTRA)})")
    fixed = {**{c: 0.0 for c in EXTRA if c not in extra}, **(fixed or {})}
    if set(fixed) - set(COEFFS):
        raise ConfigError(f"engine overhead fit: unknown fixed coefficients {sorted(set(fixed) - set(COEFFS))}")
    free = np.array([c not in fixed for c in COEFFS])
    if measured_s.size < free.sum() * 4:
        raise ConfigError(f"engine overhead fit: {measured_s.size} steps are too few for {free.sum()} coefficients")
    if not (np.all(measured_s > 0) and all(np.all(v >= 0) for v in kernels.values())):
        raise ConfigError("engine overhead fit: measured step times must be > 0 and predicted kernel times >= 0")
    scale = float(np.median(measured_s))

    # unknowns in units of the median step (per-layer ones also divided by L) so all are O(0.01..1)
    unit = np.array([scale / max(num_layers, 1)] * _PER_LAYER + [scale] * (_SECONDS - _PER_LAYER)
                    + [1.0] * (len(COEFFS) - _SECONDS))
    for c, u in _PER_TABLE.items():
        unit[COEFFS.index(c)] = scale * u
    x_fixed = np.array([fixed.get(c, 0.0) for c in COEFFS]) / unit

    # Errors weighted between relative and absolute (divided by sqrt(measured x median)): the many short decode
    # steps all count, and the long prefill steps, which dominate a run's total time, are not drowned out.
    w = 1.0 / np.sqrt(measured_s * scale)

    x0 = np.array([0.05] * _SECONDS + [1.0] * (len(COEFFS) - _SECONDS))
    lo = np.array([0.0] * _SECONDS + [0.05] * (len(COEFFS) - _SECONDS))
    hi = np.array([np.inf] * _SECONDS + [4.0] * (len(COEFFS) - _SECONDS))
    keep = np.ones(measured_s.size, bool)

    def coeffs(xf):
        x = x_fixed.copy()
        x[free] = xf
        return EngineOverhead(**dict(zip(COEFFS, x * unit)))

    for _ in range(2):
        sub = {t: v[keep] for t, v in kernels.items()}
        f = (kd[keep], kp[keep], compress[keep], aot[keep], graphed[keep], tables[keep], ptokens[keep])

        prior = SCALE_PRIOR * np.sqrt(keep.sum())

        def resid(xf, sub=sub, f=f, prior=prior):
            data = (coeffs(xf).step_s(sub, num_layers, *f) - measured_s[keep]) * w[keep]
            return np.concatenate([data, prior * (xf[free[:_SECONDS].sum():] - 1.0)])

        sol = least_squares(resid, x0[free], bounds=(lo[free], hi[free]), x_scale="jac")
        ov = coeffs(sol.x)
        # A step over ONE_OFF x its fitted time paid a one-off (a first-use library or allocator call on a new
        # shape): it is left out of a second fit and reported, so a few such steps do not inflate every step.
        slow = measured_s > ONE_OFF * ov.step_s(kernels, num_layers, kd, kp, compress, aot, graphed, tables, ptokens)
        if not slow.any() or np.array_equal(~slow, keep):
            break
        keep = ~slow
    unfitted, fix = [], {}
    graph_extra = [c for c in ("graph_row_s", "graph_table_row_s") if c not in fixed]
    if not graphed.any():
        unfitted += ["graph_s", *graph_extra, "graph_scale"]
        fix.update(graph_s=ov.sync_s, graph_scale=ov.kernel_scale, **{c: 0.0 for c in graph_extra})
    if graphed.all():
        unfitted += [c for c in COEFFS[:_SECONDS] if c not in fixed and c not in ("graph_s", *graph_extra)] \
            + ["kernel_scale"]
    else:
        eager = ~graphed
        for t, c in _TERM_SCALE.items():
            if t != "dense" and not np.any(kernels.get(t, np.zeros(1)) * eager > 0):
                unfitted.append(c)
                fix[c] = ov.kernel_scale
    if not graphed.all():  # the row term is not extrapolated beyond the rows the eager steps had
        fix["rows_max"] = float((kd + kp)[~graphed].max())
    if fix:
        ov = dataclasses.replace(ov, **fix)
    pred = ov.step_s(kernels, num_layers, kd, kp, compress, aot, graphed, tables, ptokens)
    err = pred / measured_s - 1.0
    base = total / measured_s - 1.0
    stats = {"steps": int(measured_s.size), "median_abs_rel_err": float(np.median(np.abs(err))),
             "p90_abs_rel_err": float(np.quantile(np.abs(err), 0.9)),
             "total_rel_err": float(pred.sum() / measured_s.sum() - 1),
             "total_rel_err_without_one_offs": float(pred[keep].sum() / measured_s[keep].sum() - 1),
             "kernels_only_total_rel_err": float(total.sum() / measured_s.sum() - 1),
             "kernels_only_median_abs_rel_err": float(np.median(np.abs(base))),
             "converged": bool(sol.success), "unfitted": unfitted, "graphed_steps": int(graphed.sum()),
             "terms": sorted(kernels), "one_off_steps": int((~keep).sum()),
             "one_off_excess_s": float((measured_s - pred)[~keep].sum()),
             "eager_rows_max": ov.rows_max, "extra_terms": sorted(extra),
             "held": sorted(c for c in fixed if c not in EXTRA or c in extra)}
    return ov, stats


def load(directory: str | Path | None, model: str) -> EngineOverhead | None:
    """The fitted overhead of ``model`` from ``DIR/engine_overhead.json``, or None when there is none."""
    if directory is None:
        return None
    p = Path(directory) / FILENAME
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
        entry = d["models"].get(model)
        if entry is None:
            return None
        c = dict(entry["coefficients"])
        note = ""
        if "graph_s" not in c:  # fitted before the engine captured decode graphs
            c["graph_s"] = c["sync_s"]
            note = "; graph_s not fitted (an eager-engine fit): graph replays priced as kernels + sync_s"
        elif "graph_s" in entry.get("fit", {}).get("unfitted", []):
            note = "; graph_s not fitted (no graphed step in the fit): set to sync_s"
        vals = {k: float(c[k]) if k in c else None for k in COEFFS}
        vals["kernel_scale"] = 1.0 if vals["kernel_scale"] is None else vals["kernel_scale"]
        for k in COEFFS[:_SECONDS]:
            vals[k] = 0.0 if vals[k] is None else vals[k]
        if "prefill_scale" not in c:
            note += "; one kernel_scale for every term (fitted before the terms were split)"
        rows_max = entry.get("fit", {}).get("eager_rows_max")
        if rows_max is None and vals["row_s"] > 0:
            note += "; row term priced linearly at any row count (the fit's largest eager step not recorded)"
        vals["rows_max"] = None if rows_max is None else float(rows_max)
        return EngineOverhead(**vals,
                              source=f"fitted: {p.parent.name}/{FILENAME} ({entry.get('fit', {}).get('steps', '?')} "
                                     f"steps, {entry.get('device', '?')}; {entry.get('command', '')}){note}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{p}: not a valid engine overhead file ({type(e).__name__}: {e})") from None


def save(directory: str | Path, model: str, ov: EngineOverhead, stats: dict, provenance: dict) -> Path:
    """Write (or update, keeping other models) ``DIR/engine_overhead.json``."""
    p = Path(directory) / FILENAME
    p.parent.mkdir(parents=True, exist_ok=True)
    d = {"version": VERSION, "models": {}}
    if p.exists():
        d = json.loads(p.read_text())
        d.setdefault("models", {})
    d["version"] = VERSION
    d["formula"] = ("eager: exec_s = max(kernel_scale*dense + prefill_scale*prefill_attention + compress_scale*"
                    "compression + decode_scale*decode_attention, L*(layer_s + (decode_layer_s + "
                    "aot_decode_layer_s*[aot])*[kd>0] + (prefill_chunk_layer_s + compress_chunk_layer_s*[compress])*kp)"
                    " + row_s*(kd+kp)) + sync_s + table_token_s*prefill_tokens*tables; graphed decode step: exec_s = graph_scale*(dense + decode_attention)"
                    " + graph_s + graph_row_s*kd + graph_table_row_s*kd*tables (tables: page tables per row)")
    d["models"][model] = {"coefficients": ov.coefficients(), "fit": stats, **provenance}
    p.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
    return p


__all__ = ["EngineOverhead", "fit", "load", "save", "FILENAME", "COEFFS", "EXTRA", "TERMS", "TERM_KEYS"]

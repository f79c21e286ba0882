"""What the real engine spends on a step beyond its kernels: launches issued from Python, copies, the sync.

The kernel tables price operators back to back, as a CUDA-graph engine would run them. Our engine
(:mod:`tangram.engine.executor`) issues every kernel eagerly from Python, so a small decode step is bound by
the host issuing ~a dozen launches per layer, not by the GPU. Issue and execution overlap (launches are
asynchronous), so a step takes

    exec_s = max(kernel_scale * kernel_s, issue_s) + sync_s
    issue_s = L * (layer_s + (decode_layer_s + aot_decode_layer_s * [aot]) * [kd > 0]
                   + (prefill_chunk_layer_s + compress_chunk_layer_s * [compress]) * kp) + row_s * (kd + kp)

and a decode step replayed from a CUDA graph (``EngineConfig.decode_graphed``) takes
``kernel_scale * kernel_s + graph_s``,
with ``kernel_s`` the cost model's own kernel prediction for the step (``kernel_scale`` absorbs a uniform
difference between the kernels inside the engine and in the microbenchmarks), ``kd``/``kp`` its decode rows and
prefill chunks, ``aot`` whether decode reads the AOT split table (per-layer lookups), and ``sync_s`` the per-step tail (embedding/logits/sampling launches, the host copy of the
sampled tokens, bookkeeping). The nine coefficients are fitted (``scipy.optimize.least_squares``, errors
weighted by 1/sqrt(measured), all >= 0) to every step of an engine run on the GPU by ``python -m
tangram.sim.calibrate_engine``, which writes them to ``engine_overhead.json`` in the GPU's calibration
folder, per model, with provenance. They describe this engine on that machine (its host CPU included).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError

FILENAME = "engine_overhead.json"
VERSION = 1
COEFFS = ("layer_s", "decode_layer_s", "aot_decode_layer_s", "prefill_chunk_layer_s", "compress_chunk_layer_s",
          "row_s", "sync_s", "graph_s", "kernel_scale")
_PER_LAYER = 5  # the first five coefficients are per layer


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
    kernel_scale: float = 1.0
    source: str = ""

    def issue_s(self, num_layers: int, kd, kp, compress, aot=False) -> np.ndarray:
        kd, kp = np.asarray(kd, dtype=np.float64), np.asarray(kp, dtype=np.float64)
        per_layer = (self.layer_s + (self.decode_layer_s + self.aot_decode_layer_s * np.asarray(aot, float)) * (kd > 0)
                     + (self.prefill_chunk_layer_s + self.compress_chunk_layer_s * np.asarray(compress, float)) * kp)
        return num_layers * per_layer + self.row_s * (kd + kp)

    def step_s(self, kernel_s, num_layers: int, kd, kp, compress, aot=False, graphed=False):
        """Executor seconds of a step whose kernels alone take ``kernel_s`` (``graphed``: a decode step replayed
        from a CUDA graph, whose launches are not issued from Python)."""
        k = self.kernel_scale * np.asarray(kernel_s, dtype=np.float64)
        eager = np.maximum(k, self.issue_s(num_layers, kd, kp, compress, aot)) + self.sync_s
        return np.where(np.asarray(graphed, bool), k + self.graph_s, eager)

    def coefficients(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in COEFFS}


def fit(kernel_s, measured_s, num_layers: int, kd, kp, compress, aot=False,
        graphed=False) -> tuple[EngineOverhead, dict]:
    """Least-squares fit of the nine coefficients to measured executor seconds per step; returns the fit stats.

    Coefficients no step informs (no graphed step: ``graph_s``; no eager one: the issue terms) keep their
    start value and are reported in ``stats["unfitted"]``; an unfitted ``graph_s`` is set to ``sync_s``."""
    from scipy.optimize import least_squares

    kernel_s, measured_s = np.asarray(kernel_s, float), np.asarray(measured_s, float)
    kd, kp, compress = np.asarray(kd), np.asarray(kp), np.asarray(compress, bool)
    aot = np.broadcast_to(np.asarray(aot, bool), kd.shape)
    graphed = np.broadcast_to(np.asarray(graphed, bool), kd.shape)
    if kernel_s.size < len(COEFFS) * 4:
        raise ConfigError(f"engine overhead fit: {kernel_s.size} steps are too few for {len(COEFFS)} coefficients")
    if not (np.all(measured_s > 0) and np.all(kernel_s >= 0)):
        raise ConfigError("engine overhead fit: measured step times must be > 0 and predicted kernel times >= 0")
    scale = float(np.median(measured_s))

    # unknowns in units of the median step (per-layer ones also divided by L) so all are O(0.01..1)
    unit = np.array([scale / max(num_layers, 1)] * _PER_LAYER + [scale] * 3 + [1.0])

    # Errors weighted between relative and absolute (divided by sqrt(measured x median)): the many short decode
    # steps all count, and the long prefill steps, which dominate a run's total time, are not drowned out.
    w = 1.0 / np.sqrt(measured_s * scale)

    def resid(x):
        return (EngineOverhead(*(x * unit)).step_s(kernel_s, num_layers, kd, kp, compress, aot, graphed)
                - measured_s) * w

    x0 = np.array([0.05] * (len(COEFFS) - 1) + [1.0])
    lo, hi = np.zeros(len(COEFFS)), np.array([np.inf] * (len(COEFFS) - 1) + [4.0])
    lo[-1] = 0.25
    sol = least_squares(resid, x0, bounds=(lo, hi), x_scale="jac")
    ov = EngineOverhead(*(sol.x * unit))
    unfitted = []
    if not graphed.any():
        unfitted.append("graph_s")
        ov = dataclasses.replace(ov, graph_s=ov.sync_s)
    if graphed.all():
        unfitted += [c for c in COEFFS if c not in ("graph_s", "kernel_scale")]
    pred = ov.step_s(kernel_s, num_layers, kd, kp, compress, aot, graphed)
    err = pred / measured_s - 1.0
    base = kernel_s / measured_s - 1.0
    stats = {"steps": int(kernel_s.size), "median_abs_rel_err": float(np.median(np.abs(err))),
             "p90_abs_rel_err": float(np.quantile(np.abs(err), 0.9)),
             "total_rel_err": float(pred.sum() / measured_s.sum() - 1),
             "kernels_only_total_rel_err": float(kernel_s.sum() / measured_s.sum() - 1),
             "kernels_only_median_abs_rel_err": float(np.median(np.abs(base))),
             "converged": bool(sol.success), "unfitted": unfitted, "graphed_steps": int(graphed.sum())}
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
        return EngineOverhead(**{k: float(c.get(k, 1.0 if k == "kernel_scale" else 0.0)) for k in COEFFS},
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
    d["formula"] = ("eager: exec_s = max(kernel_scale*kernel_s, L*(layer_s + (decode_layer_s + "
                    "aot_decode_layer_s*[aot])*[kd>0] + (prefill_chunk_layer_s + compress_chunk_layer_s*[compress])*kp)"
                    " + row_s*(kd+kp)) + sync_s; graphed decode step: exec_s = kernel_scale*kernel_s + graph_s")
    d["models"][model] = {"coefficients": ov.coefficients(), "fit": stats, **provenance}
    p.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
    return p


__all__ = ["EngineOverhead", "fit", "load", "save", "FILENAME", "COEFFS"]

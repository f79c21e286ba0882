"""Per-request records, summaries and report files shared by the GPU engine and the simulator.

The schemas here are the contract that makes a validation run a join on
request ids: ``requests.csv`` has the same columns whether the timestamps
came from a GPU or from the cost model, and ``metrics.json`` is written with
sorted keys and floats rounded to a fixed number of significant digits so that
the same inputs give byte-identical files.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable

import numpy as np

SIG_DIGITS = 6


@dataclass
class RequestRecord:
    """One trace request (a turn). Times in seconds from the start of the run; None when it never happened."""

    request_id: str
    rid: int
    session_id: str
    turn: int
    new_tokens: int
    output_tokens: int
    status: str = "pending"  # finished | rejected
    reason: str = ""
    replica: int = -1
    prefill_tokens: int = 0  # tokens actually prefilled (new tokens, plus history when recomputed after migration)
    cached_tokens: int = 0  # of those, served from the shared-prefix cache instead (summed over attempts)
    arrival_s: float | None = None  # when the turn became ready (arrival or previous finish + think time)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None or self.arrival_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.finish_s is None or self.arrival_s is None:
            return None
        return self.finish_s - self.arrival_s


REQUEST_COLUMNS = [f.name for f in fields(RequestRecord)] + ["ttft_s", "tpot_s", "e2e_s"]


def rnd(x):
    """Round to SIG_DIGITS significant digits (None/NaN/inf -> None) so files are byte-stable."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{SIG_DIGITS}g}")


def _clean(obj):
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (str,)) or obj is None:
        return obj
    if isinstance(obj, np.ndarray):
        return [_clean(v) for v in obj.tolist()]
    return rnd(obj)


def _pct(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if x.size else None


def latency_summary(records: Iterable[RequestRecord]) -> dict:
    """Throughput and latency percentiles over finished requests; counts over all of them."""
    recs = list(records)
    done = [r for r in recs if r.status == "finished"]
    ttft = np.array([r.ttft_s for r in done if r.ttft_s is not None])
    tpot = np.array([r.tpot_s for r in done if r.tpot_s is not None])
    e2e = np.array([r.e2e_s for r in done if r.e2e_s is not None])
    t0 = min((r.arrival_s for r in recs if r.arrival_s is not None), default=0.0)
    t1 = max((r.finish_s for r in done), default=t0)
    span = t1 - t0
    out_tok = sum(r.output_tokens for r in done)
    reasons: dict[str, int] = {}
    for r in recs:
        if r.status == "rejected":
            key = r.reason.split(" (")[0] if r.reason.startswith("turn needs") else r.reason
            key = "turn larger than the KV pool" if key.startswith("turn needs") else key
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "requests": len(recs), "completed": len(done), "rejected": sum(r.status == "rejected" for r in recs),
        "rejected_reasons": dict(sorted(reasons.items())),
        "makespan_s": span,
        "throughput_rps": len(done) / span if span > 0 else 0.0,
        "output_tokens_per_s": out_tok / span if span > 0 else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "ttft_mean_s": float(ttft.mean()) if ttft.size else None,
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "preemptions": sum(r.preemptions for r in recs),
    }


def time_weighted_mean(t: np.ndarray, v: np.ndarray, t_end: float | None = None) -> float:
    """Mean of a step function that holds v[i] from t[i] to t[i+1] (to t_end for the last sample)."""
    t, v = np.asarray(t, float), np.asarray(v, float)
    if t.size == 0:
        return 0.0
    end = t[-1] if t_end is None else max(t_end, t[-1])
    dt = np.diff(np.r_[t, end])
    total = dt.sum()
    return float((v * dt).sum() / total) if total > 0 else float(v.mean())


# --------------------------------------------------------------------------- files


def write_metrics(path: str | Path, metrics: dict) -> Path:
    """metrics.json: sorted keys, rounded floats, no wall-clock values (byte-identical for equal inputs)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(metrics), indent=1, sort_keys=True) + "\n")
    return p


def records_frame(records: Iterable[RequestRecord], **const):
    import pandas as pd

    rows = []
    names = [f.name for f in fields(RequestRecord)]
    for r in records:  # asdict's deep copies, without them: every field is a str, int, float or None
        d = {k: getattr(r, k) for k in names}
        d.update(ttft_s=r.ttft_s, tpot_s=r.tpot_s, e2e_s=r.e2e_s)
        rows.append(d)
    df = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    for i, (k, v) in enumerate(const.items()):
        df.insert(i, k, v)
    return df


def write_requests_csv(path: str | Path, frames) -> Path:
    """requests.csv: one row per (run, trace request), rejected ones with their reason."""
    import pandas as pd

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    df = pd.concat(list(frames), ignore_index=True) if not isinstance(frames, pd.DataFrame) else frames
    df.to_csv(p, index=False, float_format=f"%.{SIG_DIGITS}g")
    return p


# --------------------------------------------------------------------------- report


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(path: Path, metrics: dict, key: str = "throughput_rps", label: str = "requests/s") -> Path:
    plt = _plt()
    modes = list(metrics)
    vals = [metrics[m].get(key) or 0.0 for m in modes]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(modes, vals, color="tab:blue")
    ax.set_ylabel(label)
    ax.set_title(key)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(path: Path, per_mode_records: dict) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    drawn = [False, False]
    for mode, recs in per_mode_records.items():
        for i, (ax, attr) in enumerate(zip(axes, ("ttft_s", "tpot_s"))):
            x = np.sort([getattr(r, attr) for r in recs if r.status == "finished" and getattr(r, attr) is not None])
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=mode)
                drawn[i] = True
    empty = ("no request finished", "no finished request decoded a second token")
    for ax, attr, done, why in zip(axes, ("TTFT (s)", "TPOT (s)"), drawn, empty):
        if not done:  # an empty panel says why rather than look like a plotting failure
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.35")
        ax.set_xscale("log")
        ax.set_xlabel(attr)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv_over_time(path: Path, per_mode_series: dict) -> Path:
    """per_mode_series: mode -> (t, bytes_reserved, bytes_live) of replica 0."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (mode, (t, res, live)) in enumerate(per_mode_series.items()):
        c = f"C{i}"
        ax.plot(t, np.asarray(res) / 2**30, color=c, label=f"{mode} reserved")
        ax.plot(t, np.asarray(live) / 2**30, color=c, ls=":", lw=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV GiB (solid: reserved, dotted: live)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_capacity(path: Path, curves: dict, slo: dict) -> Path:
    """curves: mode -> list of (offered_rps, ttft_p99_s, ok[, stopped early])."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for mode, pts in curves.items():
        pts = sorted(pts)
        if not pts:
            continue
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(x, [v if v is not None else np.nan for v in y], marker="o", ms=3, label=mode)
    if "ttft_p99" in slo:
        ax.axhline(slo["ttft_p99"], color="k", ls="--", lw=0.8, label="SLO ttft_p99")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(metrics: dict, cols: list[str]) -> str:
    head = "| mode | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    rows = []
    for mode, m in metrics.items():
        cells = []
        for c in cols:
            v = m.get(c)
            cells.append("" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"

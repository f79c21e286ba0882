"""Predicted against measured throughput, over one ``tangram-validate`` call or pooled over several.

One device call holds only a few repeats; a config's measured throughput spreads 5-30% between runs (a first run
that compiles a Triton specialisation inside the timed loop is the worst), so ``tangram-validate --pool DIR...``
compares each prediction with the mean over every run of every call (same trace and configs). Also reported: the
same with runs that spent more than ``compile_s`` seconds in Triton compiles left out (the simulator prices
kernels, not their JIT), and, over several calls, each call's own mean (each call runs on whichever machine it is
lent). ``predicted_from`` prices every call with one folder's predictions (a call validated under an older
calibration, same trace and configs). ``rel_err`` and ``kendall_tau`` are the ones ``tangram-validate`` reports a
single call with.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from tangram.errors import InputError


def rel_err(pred, meas):
    """(predicted - measured) / measured; None when either is missing or the measurement is 0."""
    if pred is None or meas is None or not meas:
        return None
    return (pred - meas) / meas


def kendall_tau(pred, meas) -> float | None:
    """Kendall's tau of predicted vs measured throughput across configs (None below two configs or when every
    value of one side ties, where it is undefined)."""
    from scipy.stats import kendalltau

    if len(pred) < 2:
        return None
    tau = float(kendalltau(np.asarray(pred, float), np.asarray(meas, float)).statistic)
    return None if np.isnan(tau) else tau


def _validation_json(d: str) -> tuple[str, dict]:
    p = Path(d) / "validation.json"
    try:
        j = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(str(p), None, None, "not found: pass folders written by tangram-validate") from None
    except json.JSONDecodeError as e:
        raise InputError(str(p), e.lineno, None, f"invalid JSON: {e.msg}") from None
    if not isinstance(j, dict) or not isinstance(j.get("runs"), dict):
        raise InputError(str(p), None, "runs", "no per-run metrics; it was written by a tangram-validate before "
                                              "they were kept")
    return str(p), j["runs"]


def _number(p: str, field: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise InputError(p, None, field, f"expected a finite number, got {v!r}")
    return float(v)


def _predictions(p: str, runs: dict) -> dict[str, float]:
    out = {}
    for name, r in runs.items():
        try:
            out[name] = _number(p, f"runs.{name}.predicted.throughput_rps", r["predicted"]["throughput_rps"])
        except (KeyError, TypeError):
            raise InputError(p, None, f"runs.{name}.predicted.throughput_rps", "missing") from None
    return out


def _call_names(dirs: list[str]) -> list[str]:
    """Each folder's label in the tables: its name, or the path as given where two folders share a name."""
    names = [Path(d).name for d in dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, dirs)]


def load_runs(dirs: list[str], predicted_from: str | None = None) -> pd.DataFrame:
    """One row per engine run: config, call (folder name), run, predicted and measured throughput, compile s."""
    rows, preds = [], {}
    fixed = _predictions(*_validation_json(predicted_from)) if predicted_from else None
    for d, call in zip(dirs, _call_names(dirs)):
        p, runs = _validation_json(d)
        for name, pred in _predictions(p, runs).items():
            if fixed is not None:
                if name not in fixed:
                    raise InputError(p, None, f"runs.{name}", f"config has no prediction in {predicted_from}")
                pred = fixed[name]
            if name in preds and not np.isclose(preds[name], pred, rtol=1e-9):
                raise InputError(p, None, f"runs.{name}", f"predicted {pred} here but {preds[name]} in an earlier "
                                 "folder; pool only calls with the same trace, configs and calibration")
            preds[name] = pred
            measured = runs[name].get("measured")
            if not isinstance(measured, list):
                raise InputError(p, None, f"runs.{name}.measured", "expected a list of engine runs")
            for i, m in enumerate(measured):
                f = f"runs.{name}.measured[{i}]"
                if not isinstance(m, dict) or "throughput_rps" not in m:
                    raise InputError(p, None, f"{f}.throughput_rps", "missing")
                comp = m.get("triton_compiles_in_run") or {}
                rows.append({"config": name, "call": call, "run": i, "pred": pred,
                             "meas": _number(p, f"{f}.throughput_rps", m["throughput_rps"]),
                             "compile_s": _number(p, f"{f}.triton_compiles_in_run.seconds",
                                                  comp.get("seconds", 0.0))})
    return pd.DataFrame(rows, columns=["config", "call", "run", "pred", "meas", "compile_s"])


def pooled_table(df: pd.DataFrame) -> tuple[pd.DataFrame, float | None]:
    """Per config: prediction, mean/min/max of the measured runs, relative error (NaN where the mean is 0); and
    Kendall's tau of the predictions against the means."""
    g = df.groupby("config", sort=False).agg(pred=("pred", "first"), meas=("meas", "mean"), n=("meas", "size"),
                                              meas_min=("meas", "min"), meas_max=("meas", "max"))
    g["relerr"] = np.array([rel_err(p, m) for p, m in zip(g["pred"], g["meas"])], dtype=float)
    return g, kendall_tau(g["pred"], g["meas"])


def _pct(x: float) -> str:
    return "-" if np.isnan(x) else f"{100 * x:+.1f}%"


def pool_report(dirs: list[str], *, compile_s: float = 0.05, predicted_from: str | None = None,
                command: str = "") -> tuple[str, dict]:
    """The pooled report (Markdown) and its numbers."""
    df = load_runs(dirs, predicted_from)
    if df.empty:
        raise InputError(str(Path(dirs[0]) / "validation.json"), None, "runs", "no engine runs to pool")
    lines = ["# Pooled validation runs", "", f"Command: `{command}`", "",
             "relative error = (predicted - mean measured) / mean measured; throughput in req/s", ""]
    out = {}
    for key, title, sub in (("all", "All runs", df),
                            ("no_compiles", f"Runs without Triton compiles in the timed loop (> {compile_s} s left "
                                            "out)", df[df["compile_s"] <= compile_s])):
        if sub.empty:
            lines += [f"## {title}", "", "(no runs)", ""]
            continue
        g, tau = pooled_table(sub)
        lines += [f"## {title}", "", "| config | predicted | measured (mean) | runs | min | max | rel. error |",
                  "|---|---|---|---|---|---|---|"]
        for c, r in g.iterrows():
            lines.append(f"| {c} | {r['pred']:.3f} | {r['meas']:.3f} | {int(r['n'])} | {r['meas_min']:.3f} | "
                         f"{r['meas_max']:.3f} | {_pct(r['relerr'])} |")
        worst = float(g["relerr"].abs().max())
        tau_s = "n/a" if tau is None else f"{tau:.3f}"
        lines += ["", f"Kendall tau = {tau_s}; largest |error| {100 * worst:.1f}% "
                      f"({'within' if worst <= 0.10 else 'outside'} 10%)", ""]
        out[key] = {"kendall_tau_throughput": tau, "max_abs_rel_err": worst,
                    "configs": {c: {k: float(v) for k, v in r.items()} for c, r in g.iterrows()}}
    if df["call"].nunique() > 1:  # each call ran on whatever machine it got: the spread between machines
        calls = list(dict.fromkeys(df["call"]))
        lines += ["## Per call", "", "| config | predicted | " + " | ".join(f"{c} measured (error)" for c in calls)
                  + " |", "|---" * (len(calls) + 2) + "|"]
        per = {c: pooled_table(df[df["call"] == c]) for c in calls}
        for name in dict.fromkeys(df["config"]):
            cells = [f"{per[c][0].loc[name, 'meas']:.3f} ({_pct(per[c][0].loc[name, 'relerr'])})"
                     if name in per[c][0].index else "-" for c in calls]
            lines.append(f"| {name} | {df.loc[df['config'] == name, 'pred'].iloc[0]:.3f} | " + " | ".join(cells)
                         + " |")
        lines += ["| Kendall tau | | " + " | ".join("n/a" if per[c][1] is None else f"{per[c][1]:.3f}" for c in calls)
                  + " |", "| largest abs. error | | " + " | ".join(
                      f"{100 * per[c][0]['relerr'].abs().max():.1f}%" for c in calls) + " |", ""]
        out["per_call"] = {c: {"kendall_tau_throughput": per[c][1],
                               "max_abs_rel_err": float(per[c][0]["relerr"].abs().max())} for c in calls}
    lines += ["## Every run", "", "| config | call | run | measured | compile s |", "|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r['config']} | {r['call']} | {r['run']} | {r['meas']:.3f} | {r['compile_s']:.2f} |")
    return "\n".join(lines) + "\n", out

"""Measured accuracy tables: the file ``tangram-accuracy`` writes, and accuracy at any kept share for planning.

A table is one JSON file per model (shipped: ``tangram/profiles/data/accuracy_<model>.json``)::

    {"format": "tangram-accuracy-table", "version": 1, "model": "smollm2-135m",
     "provenance": {"command": ..., "date": ..., "git_commit": ..., "weights": ..., ...},
     "tasks": {"passkey": {"context_tokens": 512, "samples": 100, ...}, ...},
     "rows": [{"task": "passkey" | "mean" | "kl_text", "metric": "accuracy" | "kl",
               "policy": "full" | "uniform" | "dynamic" | "tangram", "scorer": "ada-snapkv" | null,
               "scope": "per-layer" | "cross-layer" | "uniform" | null, "rho": 0.25, "alpha": 2.0 | null,
               "matched_to": null | "tangram a=2 per-layer", "kv_share": 0.351, "value": 0.93,
               "ci_low": 0.86, "ci_high": 0.97, "ci_method": "wilson", "n": 100}, ...]}

``kv_share`` is the kept share of the context's KV (bytes relative to the full cache, every head having the
same size). A policy's curve for one scorer and scope is every row of it (targets and memory-matched
controls alike) plus the full cache at 1.0; :meth:`AccuracyTable.at` interpolates it monotonically (scipy's
PCHIP, no overshoot) and refuses to extrapolate below the smallest measured share (by more than
``SHARE_SLACK``: a measured share sits slightly above its target because heads keep ceil(rho T) tokens).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError, InputError

TABLE_FORMAT = "tangram-accuracy-table"
TABLE_VERSION = 1
# A measured share sits a little above its target (every head keeps ceil(rho T) tokens): a query this far below
# the smallest measured share takes that point's value instead of being refused.
SHARE_SLACK = 0.01
_ROW_FIELDS = {"task": str, "metric": str, "policy": str, "kv_share": float, "value": float}


@dataclass(frozen=True)
class Estimate:
    value: float | None  # accuracy (or KL) at the kept share; None when not measured there
    full: float | None  # the full cache's value of the same task/metric
    kv_share: float
    source: str  # what the number stands on (table, policy, scorer, scope, interpolation) or why it is missing

    @property
    def relative(self) -> float | None:
        if self.value is None or not self.full:
            return None
        return self.value / self.full


class AccuracyTable:
    def __init__(self, model: str, rows: list[dict], provenance: dict | None = None, tasks: dict | None = None,
                 path: str | None = None):
        self.model, self.rows = model, rows
        self.provenance, self.tasks, self.path = provenance or {}, tasks or {}, path

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "model": self.model,
                "provenance": self.provenance, "tasks": self.tasks, "rows": self.rows}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> "AccuracyTable":
        p = Path(path)
        if not p.is_file():
            raise InputError(str(p), None, None, "accuracy table not found")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InputError(str(p), e.lineno, None, f"invalid JSON: {e.msg}") from None
        if not isinstance(d, dict) or d.get("format") != TABLE_FORMAT:
            raise InputError(str(p), None, "format", f"not a {TABLE_FORMAT} file")
        if not isinstance(d.get("version"), int) or d["version"] > TABLE_VERSION:
            raise InputError(str(p), None, "version", f"version {d.get('version')!r} is not supported "
                                                       f"(this tangram reads up to {TABLE_VERSION})")
        if not isinstance(d.get("model"), str) or not isinstance(d.get("rows"), list):
            raise InputError(str(p), None, "model" if not isinstance(d.get("model"), str) else "rows",
                             "missing or of the wrong type")
        for i, r in enumerate(d["rows"]):
            for f, ty in _ROW_FIELDS.items():
                v = r.get(f) if isinstance(r, dict) else None
                ok = isinstance(v, (int, float)) and np.isfinite(v) if ty is float else isinstance(v, ty)
                if not ok:
                    raise InputError(str(p), None, f"rows[{i}].{f}", f"missing or not a {ty.__name__}")
        return cls(d["model"], d["rows"], d.get("provenance", {}), d.get("tasks", {}), str(p))

    @staticmethod
    def shipped_path(model: str) -> Path:
        return Path(str(resources.files("tangram.profiles") / "data" / f"accuracy_{model}.json"))

    @classmethod
    def shipped(cls, model: str) -> "AccuracyTable | None":
        p = cls.shipped_path(model)
        return cls.load(p) if p.is_file() else None

    @classmethod
    def resolve(cls, spec: str) -> "AccuracyTable":
        """A path to a table file, or the name of a model whose table is shipped."""
        if Path(spec).suffix == ".json" or Path(spec).exists():
            return cls.load(spec)
        t = cls.shipped(spec)
        if t is None:
            raise ConfigError(f"no accuracy table for model {spec!r} is shipped "
                              f"(looked for {cls.shipped_path(spec).name}); give a table file path")
        return t

    def with_scorer_from(self, other: "AccuracyTable", scorer: str) -> "AccuracyTable":
        """This table with every row of ``scorer`` replaced by ``other``'s (a re-measurement of that scorer on
        the same model, tasks and lengths, e.g. after a fix); the replacement is recorded in the provenance."""
        if other.model != self.model:
            raise ConfigError(f"{other.path}: measured on {other.model}, not {self.model}")
        mine = {t: v.get("context_tokens") for t, v in self.tasks.items()}
        theirs = {t: v.get("context_tokens") for t, v in other.tasks.items()}
        if mine != theirs:
            raise ConfigError(f"{other.path}: tasks and lengths {theirs} differ from {self.path}'s {mine}")
        new = [r for r in other.rows if r.get("scorer") == scorer]
        if not new:
            raise ConfigError(f"{other.path} has no rows of scorer {scorer!r}")
        rows = [r for r in self.rows if r.get("scorer") != scorer] + new
        prov = dict(self.provenance)
        prov["replaced"] = list(prov.get("replaced", [])) + [
            {"scorer": scorer, "rows": len(new), "from": other.path,
             **{k: other.provenance.get(k) for k in ("command", "date", "git_commit")}}]
        return AccuracyTable(self.model, rows, prov, self.tasks, self.path)

    # ------------------------------------------------------------------ queries
    def scorers(self) -> list[str]:
        return sorted({r["scorer"] for r in self.rows if r.get("scorer")})

    def scopes(self, scorer: str | None = None) -> list[str]:
        return sorted({r["scope"] for r in self.rows if r.get("scope") and (scorer is None or r["scorer"] == scorer)})

    def full(self, metric: str = "accuracy", task: str = "mean") -> float | None:
        v = [r["value"] for r in self.rows if r["policy"] == "full" and r["metric"] == metric and r["task"] == task]
        return float(v[0]) if v else None

    def points(self, policy: str, scorer: str | None, scope: str | None, metric: str = "accuracy",
               task: str = "mean") -> tuple[np.ndarray, np.ndarray]:
        """Measured (kv_share, value) of a policy's curve, duplicates averaged, with the full cache at 1.0."""
        xs, ys = [], []
        for r in self.rows:
            if r["metric"] != metric or r["task"] != task:
                continue
            if r["policy"] == "full" or (r["policy"] == policy and r.get("scorer") == scorer
                                         and r.get("scope") == scope):
                xs.append(1.0 if r["policy"] == "full" else float(r["kv_share"]))
                ys.append(float(r["value"]))
        if not xs:
            return np.zeros(0), np.zeros(0)
        _, inv = np.unique(np.round(xs, 6), return_inverse=True)  # shares equal to 6 digits are one point
        n = np.bincount(inv)
        return np.bincount(inv, weights=xs) / n, np.bincount(inv, weights=ys) / n

    def at(self, kv_share: float, policy: str, scorer: str | None = None, scope: str | None = None,
           metric: str = "accuracy", task: str = "mean") -> Estimate:
        """Value at a kept share, interpolated along the policy's measured curve (PCHIP)."""
        full = self.full(metric, task)
        s = float(kv_share)
        where = f"{self.model} table, {policy}" + (f" {scorer}" if scorer else "") + (f" {scope}" if scope else "")
        if policy == "full" or s >= 1.0 - 1e-9:
            return Estimate(full, full, 1.0, f"{self.model} table, full cache")
        x, y = self.points(policy, scorer, scope, metric, task)
        if x.size < 2:
            return Estimate(None, full, s, f"not measured: no {metric} rows for {where} ({task})")
        if s < x[0] - SHARE_SLACK:
            return Estimate(None, full, s, f"not measured: kv share {s:.3f} below the measured range "
                                           f"({x[0]:.3f}-1) of {where}")
        from scipy.interpolate import PchipInterpolator
        v = float(PchipInterpolator(x, y)(max(s, x[0])))
        exact = bool(np.any(np.abs(x - s) < 1e-6))
        return Estimate(v, full, s, where + (" (measured)" if exact else f" (interpolated over {x.size} points)"))


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


# --------------------------------------------------------------------------- planning


def mode_kv_share(mode: str, profile, alpha: float, rho: float) -> float:
    """Kept share of the context's tokens a serving mode keeps: 1 (full), rho (uniform, dynamic) or the mean
    static budget B(alpha) (br, br+rp, tangram: every head keeps ceil(B C) per chunk whatever the paging)."""
    if mode == "full":
        return 1.0
    if mode in ("uniform", "dynamic"):
        return float(rho)
    return float(profile.with_alpha(alpha).B.mean())


def mode_policy(mode: str) -> str:
    return {"full": "full", "uniform": "uniform", "dynamic": "dynamic"}.get(mode, "tangram")


@dataclass
class AccuracyModel:
    """Accuracy of serving configurations from a measured table, for the simulator and the tuner.

    ``scorer``/``scope`` select the curves (default: the profile's method and scope). A table measured on
    another model than the one planned for is only used when asked for (``borrowed``), and says so."""

    table: AccuracyTable
    scorer: str
    scope: str
    task: str = "mean"
    borrowed: bool = False

    @classmethod
    def for_run(cls, model_name: str, profile, table_spec: str | None = None, task: str = "mean"
                ) -> tuple["AccuracyModel | None", str]:
        """(model or None, one line saying what the accuracy numbers stand on or why there are none)."""
        if table_spec:
            table = AccuracyTable.resolve(table_spec)
        else:
            table = AccuracyTable.shipped(model_name)
            if table is None:
                return None, (f"accuracy not measured for {model_name} (no shipped table; --accuracy-table "
                              "TABLE_OR_MODEL borrows one, labelled)")
        borrowed = table.model != model_name
        scorers = table.scorers()
        method = getattr(profile, "method", None)
        scorer = method if method in scorers else (scorers[0] if scorers else None)
        if scorer is None:
            return None, f"accuracy table {table.path} has no compressed-mode rows"
        scope = str(getattr(profile, "provenance", {}).get("scope", "per-layer"))
        if scope not in table.scopes(scorer):
            scope = "per-layer"
        if task != "mean" and task not in table.tasks:
            raise ConfigError(f"accuracy task {task!r} is not in {table.path} (tasks: {', '.join(table.tasks)})")
        label = (f"accuracy measured on {table.model}" + (" (borrowed for " + model_name + ")" if borrowed else "")
                 + f", {scorer} {scope}, task {task}"
                 + ("" if method == scorer else f" (profile method {method!r} not in the table)")
                 + f"; table {table.path}")
        return cls(table, scorer, scope, task, borrowed), label

    def estimate(self, mode: str, profile, alpha: float, rho: float) -> Estimate:
        policy = mode_policy(mode)
        share = mode_kv_share(mode, profile, alpha, rho)
        scope = "uniform" if policy == "uniform" else self.scope
        return self.table.at(share, policy, None if policy == "full" else self.scorer, None if policy == "full"
                             else scope, "accuracy", self.task)


def main(argv: list[str] | None = None) -> int:
    """``python -m tangram.profiles.accuracy replace-scorer BASE OTHER SCORER [-o OUT]``: BASE with SCORER's rows
    taken from OTHER (written to OUT, default BASE)."""
    from tangram.cli import Parser

    p = Parser(prog="python -m tangram.profiles.accuracy", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replace-scorer")
    r.add_argument("base")
    r.add_argument("other")
    r.add_argument("scorer")
    r.add_argument("-o", "--out")
    a = p.parse_args(argv)
    try:
        t = AccuracyTable.load(a.base).with_scorer_from(AccuracyTable.load(a.other), a.scorer)
    except (ConfigError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = t.save(a.out or a.base)
    print(f"wrote {out}: {a.scorer} rows from {a.other}")
    return 0



__all__ = ["AccuracyTable", "AccuracyModel", "Estimate", "TABLE_FORMAT", "TABLE_VERSION", "mode_kv_share",
           "mode_policy"]


if __name__ == "__main__":
    sys.exit(main())

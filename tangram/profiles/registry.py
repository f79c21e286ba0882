"""Shipped budget profiles: (model, method, scope, rho) -> the calibrated file in ``tangram/profiles/data``.

Files are named ``<model>_<method>_<scope>_rho<rho>.npz`` (``{rho:g}``); each
carries its provenance (command, samples, date). Whoever resolves a run's
default profile asks :func:`default_profile` (or :func:`default_profile_path`)
so engine and simulator runs of a model with shipped profiles use a real
calibration, and others a labelled synthetic one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tangram.budgets import METHODS, SCOPES, BudgetProfile, synthetic_profile, uniform_profile

DATA_DIR = Path(__file__).parent / "data"
_NAME = re.compile(r"^(?P<model>[a-z0-9.\-]+?)_(?P<method>" + "|".join(map(re.escape, METHODS)) + r")_(?P<scope>"
                   + "|".join(map(re.escape, SCOPES)) + r")_rho(?P<rho>[0-9.]+)\.npz$")


@dataclass(frozen=True)
class ShippedProfile:
    model: str
    method: str
    scope: str
    rho: float
    path: Path


def profile_filename(model: str, method: str, scope: str, rho: float) -> str:
    return f"{model}_{method}_{scope}_rho{rho:g}.npz"


def shipped_profiles(data_dir: Path | None = None) -> list[ShippedProfile]:
    """Every profile file in the data folder whose name follows the registry's pattern, sorted."""
    out = []
    for p in sorted(Path(data_dir or DATA_DIR).glob("*.npz")):
        m = _NAME.match(p.name)
        if m:
            out.append(ShippedProfile(m["model"], m["method"], m["scope"], float(m["rho"]), p))
    return out


def default_profile_path(model: str, method: str = "ada-snapkv", scope: str = "per-layer", rho: float = 0.25,
                         data_dir: Path | None = None) -> Path | None:
    """The shipped profile calibrated for exactly this model, method, scope and rho, or None."""
    for s in shipped_profiles(data_dir):
        if (s.model, s.method, s.scope) == (model.lower(), method, scope) and abs(s.rho - rho) < 1e-9:
            return s.path
    return None


def default_profile(model, rho: float, alpha: float, seed: int = 0, method: str = "ada-snapkv",
                    scope: str = "per-layer") -> tuple[BudgetProfile, str]:
    """(profile, label) for a run that names none: the uniform scope's constant budgets, else the shipped
    calibration of (model, method, scope, rho), else a synthetic profile that says so."""
    L, H = model.num_layers, model.num_kv_heads
    if scope == "uniform":
        return (uniform_profile(L, H, rho, method, model.name),
                f"uniform scope: every head keeps its layer's target ({method}, rho {rho:g}); no calibration")
    path = default_profile_path(model.name, method, scope, rho)
    if path is not None:
        return BudgetProfile.load(path), f"{path.name} (shipped calibration: {method}, {scope}, rho {rho:g})"
    return (synthetic_profile(L, H, rho, alpha=alpha, seed=seed, model=model.name),
            f"synthetic (tangram.budgets.synthetic_profile, seed {seed}, rho {rho:g}; no shipped profile for "
            f"{model.name} {method} {scope} rho {rho:g})")


def summary_table(data_dir: Path | None = None) -> str:
    """Markdown table of the shipped profiles (``python -m tangram.profiles.registry``)."""
    rows = ["| file | method | scope | rho | prompts | retention samples | mean B | min B | max B | mean sigma | "
            "layer means of mu | date |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in shipped_profiles(data_dir):
        p = BudgetProfile.load(s.path)
        lm = p.mu.mean(axis=1)
        B = p.B
        rows.append(f"| {s.path.name} | {p.method} | {p.scope} | {p.rho:g} | {p.provenance.get('samples')} | "
                    f"{p.n_samples} | {B.mean():.3f} | {B.min():.3f} | {B.max():.3f} | {p.sigma.mean():.3f} | "
                    f"{lm.min():.3f}..{lm.max():.3f} | {str(p.provenance.get('date', ''))[:10]} |")
    return "\n".join(rows)


__all__ = ["DATA_DIR", "ShippedProfile", "profile_filename", "shipped_profiles", "default_profile_path",
           "default_profile", "summary_table"]


if __name__ == "__main__":
    print(summary_table())

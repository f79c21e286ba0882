"""What a trial measures: sustained load under the SLO (simulator) and a fidelity cost (calibration statistics).

Fidelity cost (docs/tuning.md): draw ``n`` inputs' per-head retention ratios
``r[n, L, H]`` from the profile as a global top-k method would realise them
(``BudgetProfile.sample_retention``, fixed seed) and compare with the static
budgets ``B(alpha) = min(1, mu + alpha * sigma)`` (eq. 5). A draw with
``r > B`` overflows: the head needed more tokens than reserved. The cost is the
overflow rate weighted by retained attention, with the retention ratio as the
proxy for a head's retained attention mass:

    overflow(alpha) = sum(r * [r > B]) / sum(r)

Also reported: the unweighted rate ``mean([r > B])`` and the lost share
``sum(max(0, r - B)) / sum(r)`` (the retained tokens the budget cut off).

Measured accuracy: with an accuracy table (``tangram.profiles.accuracy``), every trial also records the task
accuracy measured at its configuration's kept share (the mean static budget ``B(alpha)``; tangram keeps
``ceil(B C)`` tokens per head whatever H_p is), interpolated along the table's tangram curve for the profile's
scorer and scope, and that accuracy relative to the full cache's (``accuracy_rel``), which
``--accuracy-floor`` constrains.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from tangram.budgets import BudgetProfile, budget_ratios
from tangram.config import GPUConfig, ModelConfig
from tangram.harness.capacity import DEFAULT_TOL

from .space import SearchSpace


# a draw that sits on B overflows it only by rounding (budgets._rescale_layer_mean is exact): a margin of 1e-5
# of a head's tokens, below one token for any context under 100K, keeps rounding from counting as overflow
OVERFLOW_TOL = 1e-5


class Fidelity:
    """Overflow statistics of static budgets for any alpha, from one fixed set of retention draws."""

    def __init__(self, profile: BudgetProfile, n: int = 256, seed: int = 0):
        self.profile = profile
        self.r = profile.sample_retention(np.random.default_rng(seed), n)  # [n, L, H]
        self.total = float(self.r.sum())

    def __call__(self, alpha: float) -> dict:
        B = budget_ratios(self.profile.mu, self.profile.sigma, float(alpha))[None]
        over = self.r > B + OVERFLOW_TOL
        return {"overflow": float((self.r * over).sum() / self.total),
                "overflow_unweighted": float(over.mean()),
                "lost_share": float(((self.r - B) * over).sum() / self.total)}


@dataclass
class Evaluator:
    """Runs one trial's configuration through the simulator; pure function of (params, fixed inputs, seed)."""

    model: ModelConfig
    gpu: GPUConfig
    space: SearchSpace
    profile: BudgetProfile
    trace: object
    slo: dict
    seed: int = 0
    tables: object = "auto"
    objective: str = "capacity"  # "capacity": capacity search; "fast": one simulation at fast_rate_scale
    fast_rate_scale: float = 1.0
    capacity_start: float = 0.25
    capacity_iters: int = 5
    capacity_tol: float = DEFAULT_TOL
    overflow_samples: int = 256
    accuracy: object = None  # tangram.profiles.accuracy.AccuracyModel, or None when not measured
    _fid: dict = field(default_factory=dict, repr=False)
    _profiles: dict = field(default_factory=dict, repr=False)

    def profile_for(self, params: dict) -> tuple[BudgetProfile, str | None]:
        """The budget profile a trial prices with: the study's, unless the space searches the operating point
        (rho, scorer, scope), where each point takes the shipped calibration of exactly that point (or a synthetic
        profile, labelled: tangram.profiles.registry.default_profile). Returns (profile, label or None)."""
        from .space import OPERATING_POINT

        if not any(n in self.space.searched for n in OPERATING_POINT):
            return self.profile, None
        e = self.space.engine(params)
        key = (e.rho, e.score_method, e.budget_scope)
        if key not in self._profiles:
            from tangram.profiles.registry import default_profile

            self._profiles[key] = default_profile(self.model, e.rho, 2.0, self.seed, e.score_method, e.budget_scope)
        return self._profiles[key]

    def fidelity(self, params: dict) -> Fidelity:
        prof, _ = self.profile_for(params)
        if id(prof) not in self._fid:
            self._fid[id(prof)] = Fidelity(prof, self.overflow_samples, self.seed)
        return self._fid[id(prof)]

    def spec(self, params: dict):
        from tangram.spec import DeploymentSpec

        return DeploymentSpec(self.model, self.gpu, self.space.engine(params), self.profile_for(params)[0], 1,
                              "session-affinity", self.seed, self.tables)

    def __call__(self, params: dict) -> dict:
        from tangram.harness import meets_slo, offered_rps
        from tangram.sim.run import capacity_search, simulate

        spec = self.spec(params)
        out = dict(self.fidelity(params)(params["alpha"]))
        label = self.profile_for(params)[1]
        if label is not None:
            out["profile"] = label
        out.update(self.accuracy_of(params))
        mode = spec.engine.mode
        if self.objective == "fast":
            summ, _ = simulate(self.trace.scaled(self.fast_rate_scale), spec, mode, record_kv=False)
            ok = meets_slo(summ, self.slo)
            out.update(load_rps=float(summ["throughput_rps"]) if ok else 0.0, meets_slo=bool(ok),
                       throughput_rps=float(summ["throughput_rps"]), ttft_p99_s=summ.get("ttft_p99_s"),
                       tpot_p99_s=summ.get("tpot_p99_s"), sims=1)
        else:
            cap = capacity_search(self.trace, spec, mode, self.slo, iters=self.capacity_iters, tol=self.capacity_tol,
                                  start=self.capacity_start)
            # a trace too small to saturate has no limit to find: its trials record the highest load tested (a
            # lower bound) and saturated=False, which the report counts and warns about
            sat = bool(cap["saturated"])
            load = cap["max_rate_rps"] if sat else cap.get("lower_bound_rps")
            out.update(load_rps=float(load or 0.0), max_rate_scale=cap["max_rate_scale"], sims=len(cap["probes"]),
                       saturated=sat, bracket_rps=cap["bracket_rps"], offered_rps=offered_rps(self.trace))
            if cap.get("note"):
                out["capacity_note"] = cap["note"]
        tp = spec.engine.tp
        if len(self.space.tp) > 1:  # replicas of different GPU counts compete: the objective is load per GPU
            out["replica_load_rps"], out["load_rps"] = out["load_rps"], out["load_rps"] / tp
        out["gpus_per_replica"] = tp
        for k, v in list(out.items()):
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out

    def accuracy_of(self, params: dict) -> dict:
        """Measured accuracy at the configuration's kept share (None values when the table has none)."""
        if self.accuracy is None:
            return {"accuracy": None, "accuracy_rel": None, "kv_share": None}
        e = self.space.engine(params)
        prof, label = self.profile_for(params)
        acc, mode = self.accuracy, e.mode
        if label is not None:  # a searched operating point: that scorer's and scope's curve
            if label.startswith("synthetic") or e.score_method not in acc.table.scorers():
                return {"accuracy": None, "accuracy_rel": None, "kv_share": None}  # nothing measured there
            acc = dataclasses.replace(acc, scorer=e.score_method, scope=e.budget_scope)
            if e.budget_scope == "uniform":
                mode = "uniform"  # constant budgets: the table's uniform curve
        est = acc.estimate(mode, prof, e.alpha, e.rho)
        return {"accuracy": est.value, "accuracy_rel": est.relative, "kv_share": est.kv_share,
                "accuracy_full": est.full}

"""The tuner's search space: which EngineConfig fields a trial may change, and how.

One table (``SearchSpace``) drives the Optuna suggestions, the exhaustive grid
of the search-efficiency benchmark and the validation of enqueued configs, so
the sampler and the grid search exactly the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tangram.config import EngineConfig, ModelConfig, divisors
from tangram.errors import ConfigError

OPERATING_POINT = ("rho", "score_method", "budget_scope")  # EngineConfig fields that choose the budget profile
# the paper's default operating point (H_p = 4, alpha = 2, every other field at EngineConfig's default)
PAPER_DEFAULT = {"heads_per_group": 4, "alpha": 2.0}
_ENGINE = EngineConfig()  # the defaults of the fields a study does not search


@dataclass(frozen=True)
class SearchSpace:
    """Discrete choices per field; ``alpha`` is continuous on [alpha_lo, alpha_hi] unless ``alpha_step`` is set."""

    heads_per_group: tuple[int, ...]
    alpha_lo: float = 0.0
    alpha_hi: float = 4.0
    alpha_step: float | None = None
    clustering: tuple[bool, ...] = (True, False)
    n_cta_scale: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0)
    split_rounding: tuple[str, ...] = ("round", "ceil")
    page_size: tuple[int, ...] = (8, 16, 32, 64)
    chunk_size: tuple[int, ...] = (512, 1024, 2048, 4096)
    max_batched_tokens: tuple[int, ...] = (4096, 8192, 16384)
    fixed: dict = field(default_factory=dict)  # EngineConfig fields every trial shares (mode, rho, ...)
    # tensor parallelism (issue 16): searched only when given more than one choice (a single choice goes to
    # ``fixed``), so studies without it keep their parameter names; ``num_kv_heads`` rules out H_p that do not
    # divide a rank's heads (such a draw is pruned)
    tp: tuple[int, ...] = (_ENGINE.tp,)
    placement: tuple[str, ...] = (_ENGINE.placement,)
    num_kv_heads: int = 0
    # the compression operating point (issue 15): target ratio, scorer and budget scope, searched only when given
    # more than one choice; each draw prices with the profile calibrated for it (Evaluator.profile_for) and states
    # the accuracy measured there, so an accuracy floor can pick a point that keeps enough
    rho: tuple[float, ...] = (_ENGINE.rho,)
    score_method: tuple[str, ...] = (_ENGINE.score_method,)
    budget_scope: tuple[str, ...] = (_ENGINE.budget_scope,)

    @classmethod
    def for_model(cls, model: ModelConfig, tp: tuple[int, ...] = (_ENGINE.tp,),
                  placement: tuple[str, ...] = (_ENGINE.placement,), rho: tuple[float, ...] = (_ENGINE.rho,),
                  score_method: tuple[str, ...] = (_ENGINE.score_method,),
                  budget_scope: tuple[str, ...] = (_ENGINE.budget_scope,), **kw) -> "SearchSpace":
        """H_p choices: the divisors of a rank's KV heads at the smallest TP degree searched."""
        from tangram.placement import check_tp

        tp, placement = tuple(sorted(set(int(t) for t in tp))), tuple(dict.fromkeys(placement))
        for t in tp:
            check_tp(model.num_kv_heads, t)
        fixed = dict(kw.pop("fixed", {}))
        rho = tuple(sorted(set(float(r) for r in rho)))
        score_method, budget_scope = tuple(dict.fromkeys(score_method)), tuple(dict.fromkeys(budget_scope))
        for name, v in (("tp", tp), ("placement", placement), ("rho", rho), ("score_method", score_method),
                        ("budget_scope", budget_scope)):
            if len(v) == 1 and v[0] != getattr(_ENGINE, name):
                fixed[name] = v[0]
        return cls(heads_per_group=tuple(divisors(model.num_kv_heads // tp[0])), tp=tp, placement=placement,
                   num_kv_heads=model.num_kv_heads, fixed=fixed, rho=rho, score_method=score_method,
                   budget_scope=budget_scope, **kw)

    @property
    def searched(self) -> tuple[str, ...]:
        """The categorical fields a trial draws (tp and placement only when they have a choice)."""
        extra = tuple(n for n in ("tp", "placement") + OPERATING_POINT if len(getattr(self, n)) > 1)
        return ("clustering", "n_cta_scale", "split_rounding", "page_size", "chunk_size", "max_batched_tokens") + extra

    def suggest(self, trial) -> dict:
        """Draw one configuration through an Optuna trial (categorical fields as categoricals)."""
        p = {"heads_per_group": trial.suggest_categorical("heads_per_group", list(self.heads_per_group))}
        p["alpha"] = trial.suggest_float("alpha", self.alpha_lo, self.alpha_hi, step=self.alpha_step)
        for name in self.searched:
            p[name] = trial.suggest_categorical(name, list(getattr(self, name)))
        if any(n in p for n in OPERATING_POINT):
            from tangram.budgets import check_method_scope

            try:
                check_method_scope(p.get("score_method", self.fixed.get("score_method", _ENGINE.score_method)),
                                   p.get("budget_scope", self.fixed.get("budget_scope", _ENGINE.budget_scope)))
            except ConfigError as e:
                import optuna

                raise optuna.TrialPruned(str(e)) from None
        tp = p.get("tp", self.fixed.get("tp", _ENGINE.tp))
        if self.num_kv_heads and (self.num_kv_heads // tp) % p["heads_per_group"]:
            import optuna

            raise optuna.TrialPruned(f"H_p={p['heads_per_group']} does not divide the {self.num_kv_heads // tp} "
                                     f"KV heads of a rank at tp={tp}")
        return p

    def engine(self, params: dict) -> EngineConfig:
        """The EngineConfig a parameter dict stands for (fixed fields first, then the trial's)."""
        try:
            return EngineConfig.from_dict({**self.fixed, **params})
        except TypeError as e:
            raise ConfigError(f"bad engine option: {e}") from None

    def contains(self, params: dict) -> bool:
        """Whether an enqueued configuration lies inside the space (Optuna would warn and re-sample otherwise)."""
        for name in ("heads_per_group",) + self.searched:
            if name in ("tp", "placement") + OPERATING_POINT and name not in params:  # drawn by the sampler when enqueued without
                continue
            if params[name] not in getattr(self, name):
                return False
        a = float(params["alpha"])
        if not (self.alpha_lo - 1e-12 <= a <= self.alpha_hi + 1e-12):
            return False
        if self.alpha_step:
            k = (a - self.alpha_lo) / self.alpha_step
            return abs(k - round(k)) < 1e-9
        return True

    def distributions(self) -> dict:
        """Optuna distributions of the space (used to build a GridSampler over the same names)."""
        import optuna.distributions as od

        d = {"heads_per_group": od.CategoricalDistribution(list(self.heads_per_group)),
             "alpha": od.FloatDistribution(self.alpha_lo, self.alpha_hi, step=self.alpha_step)}
        for name in self.searched:
            d[name] = od.CategoricalDistribution(list(getattr(self, name)))
        return d


def paper_default_params(space: "SearchSpace | None" = None) -> dict:
    """The paper's default configuration as a full trial parameter dict. In a space whose H_p choices lack the
    paper's 4 (a model with 3 KV heads, say), the largest choice below it (else the smallest) stands in."""
    e = EngineConfig()
    hp = PAPER_DEFAULT["heads_per_group"]
    if space is not None and hp not in space.heads_per_group:
        below = [h for h in space.heads_per_group if h <= hp]
        hp = max(below) if below else min(space.heads_per_group)
    out = {"heads_per_group": hp, "alpha": PAPER_DEFAULT["alpha"],
           "clustering": e.clustering, "n_cta_scale": e.n_cta_scale, "split_rounding": e.split_rounding,
           "page_size": e.page_size, "chunk_size": e.chunk_size, "max_batched_tokens": e.max_batched_tokens}
    # a searched operating point: the engine's default where the space has it (the paper's rho 0.25, Ada-SnapKV
    # per-layer), else the space's first choice
    for name in OPERATING_POINT:
        if space is not None and name in space.searched:
            choices = getattr(space, name)
            out[name] = getattr(e, name) if getattr(e, name) in choices else choices[0]
    return out

"""Per-head KV budgets: calibration (paper eq. 5), head grouping, profile files.

A profile is the static blueprint every other module reads: the scheduler
reserves ``ceil(B[l,h] * C)`` tokens per head for a chunk of ``C`` tokens, the
allocator sizes each head group's page table by the group's largest budget,
and the planner splits decode work in proportion to group budgets.
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError, InputError

PROFILE_FORMAT_VERSION = 1

# Scoring methods a profile can be calibrated for (their scorers: tangram.kernels.scoring) and the budget scopes.
METHODS = ("ada-snapkv", "pyramidkv", "keydiff", "tova", "streaming-llm", "expected-attention", "kvzip")
# per-layer: one threshold per layer (Ada-KV's layer-wide top-k; every layer keeps its target on average);
# cross-layer: one threshold over every layer and head (strong layers take budget from weak ones; only the
# total keeps rho); uniform: no threshold, every head keeps its layer's target (no calibration needed).
SCOPES = ("per-layer", "cross-layer", "uniform")
PYRAMID_BETA = 20.0


def check_method_scope(method: str, scope: str) -> None:
    """One-line errors for a method or scope name we do not know, and for combinations that mean nothing."""
    if method not in METHODS:
        raise ConfigError(f"unknown scoring method {method!r}; choose from {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise ConfigError(f"unknown budget scope {scope!r}; choose from {', '.join(SCOPES)}")
    if method == "pyramidkv" and scope == "cross-layer":
        raise ConfigError("pyramidkv fixes each layer's budget by its pyramid schedule; a cross-layer threshold "
                          "would ignore it (use scope per-layer or uniform, or method ada-snapkv for cross-layer)")


def pyramid_ratios(num_layers: int, rho: float, beta: float = PYRAMID_BETA) -> np.ndarray:
    """PyramidKV's per-layer kept share [L] (Cai et al. 2024; kvpress ``PyramidKVPress.get_layer_budget``).

    Linear from the bottom layer's ``r_max`` down to the top layer's ``r_min = rho / beta`` with
    ``r_max = 2 rho - r_min``, so the mean over layers is exactly ``rho``; when ``r_max`` would exceed 1 it is
    capped at 1 and ``r_min = 2 rho - 1``. This is kvpress's formula in shares of the chunk, with its observation
    window term left out (our SnapKV keeps its window inside the budget) and without its fall-back to flat
    SnapKV when the top layer's budget is smaller than the window."""
    if not (0 < rho <= 1):
        raise ConfigError(f"rho must be in (0, 1], got {rho}")
    if beta < 1:
        raise ConfigError(f"pyramid beta must be >= 1, got {beta}")
    lo = rho / beta
    hi = 2 * rho - lo
    if hi > 1.0:
        hi, lo = 1.0, 2 * rho - 1.0
    if num_layers == 1:
        return np.array([rho])
    return hi - (hi - lo) * np.arange(num_layers) / (num_layers - 1)


def layer_targets(method: str, scope: str, num_layers: int, rho: float) -> np.ndarray | None:
    """Kept share each layer aims at [L] (per-layer and uniform scopes), or None (cross-layer: only the total is
    fixed). Every method aims at rho in every layer except PyramidKV, whose schedule sets it per layer."""
    if scope == "cross-layer":
        return None
    if method == "pyramidkv":
        return pyramid_ratios(num_layers, rho)
    return np.full(num_layers, float(rho))


@dataclass
class BudgetProfile:
    mu: np.ndarray  # [L, H] mean per-head retention ratio
    sigma: np.ndarray  # [L, H] std of the per-head retention ratio
    alpha: float
    rho: float  # target global retention ratio the samples were taken at
    method: str
    model: str
    provenance: dict = field(default_factory=dict)
    n_samples: int = 0
    scope: str = "per-layer"  # the budget scope the retention samples were taken under (SCOPES)
    # chunk_retention's last draws, {(seed, key, start): [L, H]}: a replay draws a third of its chunks again soon after
    _drawn: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _targets: tuple | None = field(default=None, init=False, repr=False, compare=False)  # _retention's, kept

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ConfigError(f"unknown budget scope {self.scope!r}; choose from {', '.join(SCOPES)}")
        self.mu = np.asarray(self.mu, dtype=np.float64)
        self.sigma = np.asarray(self.sigma, dtype=np.float64)
        if self.mu.ndim != 2 or self.mu.shape != self.sigma.shape:
            raise ConfigError(f"profile mu/sigma must both be [L, H], got {self.mu.shape} and {self.sigma.shape}")
        if np.any(~np.isfinite(self.mu)) or np.any(~np.isfinite(self.sigma)) or np.any(self.sigma < 0):
            raise ConfigError("profile mu/sigma must be finite and sigma >= 0")

    @property
    def shape(self) -> tuple[int, int]:
        return self.mu.shape  # type: ignore[return-value]

    @property
    def B(self) -> np.ndarray:
        """Budget ratios in (0, 1]: eq. 5, B = min(1, mu + alpha * sigma)."""
        return budget_ratios(self.mu, self.sigma, self.alpha)

    def with_alpha(self, alpha: float) -> "BudgetProfile":
        return BudgetProfile(self.mu, self.sigma, float(alpha), self.rho, self.method, self.model,
                             dict(self.provenance), self.n_samples, self.scope)

    def check_model(self, num_layers: int, num_kv_heads: int, model_name: str | None = None) -> None:
        if self.shape != (num_layers, num_kv_heads):
            who = f" {model_name}" if model_name else ""
            raise ConfigError(
                f"profile shape {self.shape[0]}x{self.shape[1]} (layers x KV heads) does not match model{who} "
                f"({num_layers}x{num_kv_heads})")

    @property
    def synthetic(self) -> bool:
        return bool(self.provenance.get("synthetic", False))

    # ------------------------------------------------------------------ realised retention
    def sample_retention(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        """Draw per-input retention ratios [n, L, H] as a global top-k method would realise them.

        Each head's ratio is drawn around its calibrated mean with its calibrated
        spread, clipped to (0, 1], then rescaled so what the method's threshold
        fixes holds exactly: per-layer scope, each layer keeps its target
        (``rho``; PyramidKV's schedule) since a layer-wide top-k fixes the
        layer's sum; cross-layer scope, the whole [L, H] keeps ``rho``.
        Used by the simulator to price the ``dynamic`` mode's reclaim and the
        overflow rate of static budgets.
        """
        return self._retention(rng.standard_normal((n,) + self.shape))

    def _retention(self, z: np.ndarray) -> np.ndarray:
        r = np.clip(self.mu + self.sigma * z, 1e-4, 1.0)
        # the rescale's targets depend on the profile alone: kept (the dynamic mode draws every prefill chunk)
        key = (self.method, self.scope, self.shape, float(self.rho))
        c = self._targets
        if c is None or c[0] != key:
            targets = layer_targets(self.method, self.scope, self.shape[0], self.rho)
            if targets is None:  # cross-layer: one threshold fixes only the total
                c = (key, True, self.rho, _rescale_need(self.rho, int(np.prod(self.shape))))
            else:
                c = (key, False, targets[:, None], _rescale_need(targets[:, None], self.shape[1]))
            self._targets = c
        _, flat, rho, need = c
        if flat:
            return _rescale_layer_mean(r.reshape(r.shape[0], -1), rho, need).reshape(r.shape)
        return _rescale_layer_mean(r, rho, need)

    def chunk_retention(self, seed: int, rids, starts) -> np.ndarray:
        """Realised retention [n, L, H] of prefill chunks, one draw per (key, chunk start); the key is a request id,
        or a shared-prefix chain's content id (``tangram.prefix_cache.chain_hashes``).

        Common random numbers: the simulator and the engine draw a chunk's retention from the same stream, so a
        ``dynamic`` run's reclaim, and with it its preemptions, match between them (separate streams gave the
        simulator 15 preemptions where the engine had 7 on the validation trace, a 10% throughput miss)."""
        rids, starts = np.asarray(rids, dtype=np.int64), np.asarray(starts, dtype=np.int64)
        keys = [(int(seed), rid, st) for rid, st in zip(rids.tolist(), starts.tolist())]  # a row per chunk
        drawn = self._drawn
        new = [k for k in dict.fromkeys(keys) if k not in drawn]
        if new:  # (each row's ratios depend on its own draw alone: rows drawn together or apart are the same)
            r = self._retention(np.stack([np.random.default_rng(list(k)).standard_normal(self.shape) for k in new]))
            for k, x in zip(new, r):
                drawn[k] = x
        out = np.stack([drawn[k] for k in keys]) if keys else np.zeros((0,) + self.shape)
        while len(drawn) > 1024:  # the oldest first (the repeats come within a few hundred chunks)
            del drawn[next(iter(drawn))]
        return out

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": "tangram-budget-profile", "version": PROFILE_FORMAT_VERSION, "alpha": self.alpha,
            "rho": self.rho, "method": self.method, "model": self.model, "n_samples": self.n_samples,
            "scope": self.scope, "provenance": self.provenance,
        }
        if path.suffix == ".json":
            meta.update(mu=self.mu.tolist(), sigma=self.sigma.tolist(), B=self.B.tolist())
            path.write_text(json.dumps(meta, indent=1))
        else:
            with open(path, "wb") as f:
                np.savez_compressed(f, mu=self.mu, sigma=self.sigma, B=self.B, meta=np.array(json.dumps(meta)))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "BudgetProfile":
        path = Path(path)
        if not path.exists():
            raise InputError(str(path), None, None, "profile file not found")
        try:
            if path.suffix == ".json":
                meta = json.loads(path.read_text())
                mu, sigma = np.asarray(meta["mu"], float), np.asarray(meta["sigma"], float)
            else:
                with np.load(path, allow_pickle=False) as z:
                    meta = json.loads(str(z["meta"]))
                    mu, sigma = z["mu"], z["sigma"]
        except (KeyError, ValueError, OSError, json.JSONDecodeError) as e:
            raise InputError(str(path), None, None, f"not a readable budget profile ({e})") from None
        if meta.get("format") != "tangram-budget-profile":
            raise InputError(str(path), None, "format", "not a tangram budget profile")
        if int(meta.get("version", -1)) > PROFILE_FORMAT_VERSION:
            raise InputError(str(path), None, "version",
                             f"profile version {meta.get('version')} is newer than this tangram ({PROFILE_FORMAT_VERSION})")
        try:
            return cls(mu, sigma, float(meta["alpha"]), float(meta["rho"]), str(meta["method"]), str(meta["model"]),
                       dict(meta.get("provenance", {})), int(meta.get("n_samples", 0)),
                       str(meta.get("scope", "per-layer")))  # files before scopes existed were per-layer
        except ConfigError as e:
            raise InputError(str(path), None, None, str(e)) from None


def budget_ratios(mu: np.ndarray, sigma: np.ndarray, alpha: float) -> np.ndarray:
    b = np.minimum(1.0, mu + alpha * sigma)
    # A head that the samples never kept still needs a token per chunk: keep B > 0.
    return np.maximum(b, 1e-6)


def calibrate(retention_samples: np.ndarray, alpha: float, *, rho: float | None = None, method: str = "unknown",
              model: str = "unknown", provenance: dict | None = None, scope: str = "per-layer") -> BudgetProfile:
    """Fit mu, sigma over samples [n, L, H] of per-head retention ratios and apply eq. 5."""
    r = np.asarray(retention_samples, dtype=np.float64)
    if r.ndim != 3 or r.shape[0] < 1:
        raise ConfigError(f"retention samples must be [n, L, H] with n >= 1, got shape {r.shape}")
    if np.any((r < 0) | (r > 1)) or np.any(~np.isfinite(r)):
        raise ConfigError("retention samples must be ratios in [0, 1]")
    mu = r.mean(axis=0)
    sigma = r.std(axis=0, ddof=1) if r.shape[0] > 1 else np.zeros_like(mu)
    if rho is None:
        rho = float(mu.mean())
    prov = {"calibrated_at": _dt.date.today().isoformat(), **(provenance or {})}
    return BudgetProfile(mu, sigma, float(alpha), float(rho), method, model, prov, int(r.shape[0]), scope)


def uniform_profile(num_layers: int, num_kv_heads: int, rho: float, method: str = "ada-snapkv",
                    model: str = "unknown") -> BudgetProfile:
    """The uniform scope as a profile: every head of layer l keeps the layer's target (rho; PyramidKV's
    schedule), with no spread, so it needs no calibration and any alpha gives the same budgets."""
    mu = np.repeat(layer_targets(method, "uniform", num_layers, rho)[:, None], num_kv_heads, axis=1)
    return BudgetProfile(mu, np.zeros_like(mu), 0.0, float(rho), method, model,
                         {"synthetic": False, "generator": "tangram.budgets.uniform_profile"}, 0, "uniform")


def constant_profile(num_layers: int, num_kv_heads: int, ratio: float, model: str = "unknown") -> BudgetProfile:
    """Every head keeps ``ratio``: the ``full`` (1.0) and ``uniform`` (rho) policies as a profile."""
    mu = np.full((num_layers, num_kv_heads), float(ratio))
    return BudgetProfile(mu, np.zeros_like(mu), 0.0, float(ratio), "constant", model, {"synthetic": False})


# --------------------------------------------------------------------------- grouping


def check_group_size(num_kv_heads: int, heads_per_group: int) -> int:
    if heads_per_group <= 0 or num_kv_heads % heads_per_group:
        raise ConfigError(
            f"heads per group H_p={heads_per_group} must divide the number of KV heads H={num_kv_heads} "
            f"(valid: {', '.join(str(d) for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0)})")
    return num_kv_heads // heads_per_group


def head_groups(B: np.ndarray, heads_per_group: int, clustered: bool = True) -> np.ndarray:
    """Permutation perm[L, H]: group i of layer l is perm[l, i*H_p:(i+1)*H_p].

    Clustered (budget-aware, paper section 4.2.2): heads sorted by budget, then
    H_p consecutive heads per group. Adjacent: heads in index order.
    """
    B = np.asarray(B)
    L, H = B.shape
    check_group_size(H, heads_per_group)
    if not clustered:
        return np.tile(np.arange(H), (L, 1))
    return np.argsort(B, axis=1, kind="stable")


def group_budgets(B: np.ndarray, perm: np.ndarray, heads_per_group: int) -> np.ndarray:
    """Largest budget of each group [L, G]: the group's page table is sized by it."""
    Bp = np.take_along_axis(np.asarray(B), perm, axis=1)
    L, H = Bp.shape
    return Bp.reshape(L, H // heads_per_group, heads_per_group).max(axis=2)


def group_sums(B: np.ndarray, perm: np.ndarray, heads_per_group: int) -> np.ndarray:
    """Aggregated budget Phi[L, G] of each group (Algorithm 1, line 9)."""
    Bp = np.take_along_axis(np.asarray(B), perm, axis=1)
    L, H = Bp.shape
    return Bp.reshape(L, H // heads_per_group, heads_per_group).sum(axis=2)


# --------------------------------------------------------------------------- synthetic profiles


def _rescale_layer_mean(r: np.ndarray, rho, need: np.ndarray | None = None) -> np.ndarray:
    """Scale ratios so the mean over the last axis is rho (a scalar, or an array broadcasting against
    ``r.shape[:-1] + (1,)``) while staying in (0, 1]: ``min(1, s r)`` with the exact multiplier s.

    The mean of ``min(1, s r)`` over H heads is concave and piecewise linear in s: the least over k of
    ``(k + s S_k) / H``, the k largest ratios saturated and ``S_k`` the sum of the others. So the smallest s
    reaching rho is the largest over k < H rho of ``(H rho - k) / S_k``: one sort and one cumulative sum, where a
    bisection took 30 rounds of numpy calls (the simulator's dynamic mode runs this for every prefill step, on
    arrays small enough that each call's overhead is its cost) and stopped ~1e-6 short of exact.
    """
    if need is None:
        need = _rescale_need(rho, r.shape[-1])
    rest = np.cumsum(np.sort(r, axis=-1), axis=-1)  # [..., j]: the j + 1 smallest, S_k for k = H - 1 - j
    s = np.divide(need, rest, out=np.zeros(np.broadcast_shapes(need.shape, rest.shape)),
                  where=(need > 0) & (rest > 0)).max(axis=-1, keepdims=True)
    return np.clip(r * s, 1e-4, 1.0)


def _rescale_need(rho, H: int) -> np.ndarray:
    """``H rho - k`` for k = H - 1 .. 0, [..., H] (:func:`_rescale_layer_mean`, whose ``rho`` it takes)."""
    return H * np.asarray(rho, dtype=np.float64) - np.arange(H - 1, -1, -1)


def synthetic_profile(num_layers: int, num_kv_heads: int, rho: float, *, alpha: float = 2.0, seed: int = 0,
                      skew: tuple[float, float] = (0.8, 2.0), noise: float = 0.15, n_samples: int = 50,
                      model: str = "unknown") -> BudgetProfile:
    """A labelled-synthetic profile for model shapes with no real calibration.

    Per layer ``l`` a skew ``s_l ~ U(skew)`` spreads head means on the logit scale
    (``logit mu_h ~ N(c_l, s_l)``, ``c_l`` set so the layer keeps ``rho``), the
    shape real profiles show: a few retrieval heads near 1, many local heads low.
    ``n_samples`` inputs are drawn with relative spread ``noise`` and renormalised
    per layer to ``rho`` (as global top-k does), then calibrated with eq. 5 like
    real samples are.
    """
    if not (0 < rho <= 1):
        raise ConfigError(f"rho must be in (0, 1], got {rho}")
    rng = np.random.default_rng(seed)
    s = rng.uniform(skew[0], skew[1], size=(num_layers, 1))
    z = rng.standard_normal((num_layers, num_kv_heads)) * s
    mu0 = _rescale_layer_mean(1.0 / (1.0 + np.exp(-z)), rho)
    spread = noise * np.sqrt(mu0 * (1.0 - mu0) + 1e-4)
    samples = mu0[None] + spread[None] * rng.standard_normal((n_samples, num_layers, num_kv_heads))
    samples = _rescale_layer_mean(np.clip(samples, 1e-4, 1.0), rho)
    prov = {"synthetic": True, "generator": "tangram.budgets.synthetic_profile", "seed": seed, "skew": list(skew),
            "noise": noise}
    return calibrate(samples, alpha, rho=rho, method="synthetic", model=model, provenance=prov)


def drawn_keep(profile: BudgetProfile, layout, seed: int, plan) -> np.ndarray:
    """Tokens each slot keeps of the step's prefill chunks under a global top-k (``dynamic``), drawn from the
    profile: [kp, L, H] in slot order, at most the plan's upper bound. Shared by the engine (``dynamic_keep=
    'profile'``) and the cost model, so both realise the same counts for the same chunk. The draw is keyed by
    ``plan.draw_keys`` (the request, or the shared-prefix chain of a chunk inside one, so that identical prefixes
    realise identical keeps and can share their pages) and the chunk's start."""
    r = layout.to_slots(profile.chunk_retention(seed, plan.draw_keys, plan.prefill_start))
    c = np.asarray(plan.prefill_tokens, dtype=np.float64)[:, None, None]
    return np.minimum(plan.prefill_keep, np.ceil(r * c - 1e-9).astype(np.int64))

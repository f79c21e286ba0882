"""The deployment spec: what a run serves (model, GPU, engine config, budget profile) and how it is replayed
(replicas, router, seed, cost tables), and its resolution from a ``--config`` file plus command-line flags."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tangram.budgets import BudgetProfile
from tangram.config import MODE_ALIASES, MODES, EngineConfig, GPUConfig, ModelConfig, get_gpu, get_model
from tangram.errors import ConfigError, InputError
from tangram.harness.cluster import ROUTERS
from tangram.harness.slo import DEFAULT_SLO, parse_slo
from tangram.placement import check_tp

# keys of a --config JSON that are not EngineConfig fields
RUN_KEYS = {"model", "gpu", "trace", "rate_scale", "replicas", "router", "seed", "profile", "modes", "mode",
            "tables", "calibration", "slo", "target_rate", "engine_overhead", "weights", "out", "probe",
            "accuracy_table"}


@dataclass
class DeploymentSpec:
    """Everything a deployment needs besides the trace and the mode."""

    model: ModelConfig
    gpu: GPUConfig
    engine: EngineConfig
    profile: BudgetProfile
    replicas: int = 1
    router: str = "session-affinity"
    seed: int = 0
    tables: object = "auto"  # cost tables folder for the simulator ("auto": the GPU's; None: roofline only)
    engine_overhead: bool = True  # the simulator prices the eager engine's fitted per-step overhead
    probe: str | None = None  # a tangram-probe JSON of the machine at hand: the simulator rescales its tables to it


def default_profile(model: ModelConfig, rho: float, alpha: float, seed: int = 0, method: str = "ada-snapkv",
                    scope: str = "per-layer") -> BudgetProfile:
    """The profile of a run that names none: the shipped calibration of (model, method, scope, rho) when there is
    one, the uniform scope's constant budgets, else a synthetic profile (:func:`default_profile_labelled`)."""
    return default_profile_labelled(model, rho, alpha, seed, method, scope)[0]


def default_profile_labelled(model: ModelConfig, rho: float, alpha: float, seed: int = 0,
                             method: str = "ada-snapkv", scope: str = "per-layer") -> tuple[BudgetProfile, str]:
    """(profile, label for reports) of :func:`default_profile` (:func:`tangram.profiles.registry.default_profile`,
    a torch-free lookup of the shipped data files)."""
    from tangram.profiles.registry import default_profile as resolve

    return resolve(model, rho, alpha, seed, method, scope)


def adopt_profile_method(engine: EngineConfig, profile: BudgetProfile, named: dict, path: str) -> EngineConfig:
    """A calibrated profile names the method and scope it was taken under; the run adopts them, and a config
    that names different ones is an error (its budgets would not be that method's)."""
    from tangram.budgets import METHODS

    if profile.method not in METHODS:  # synthetic or constant profiles belong to no method
        return engine
    for field, val in (("score_method", profile.method), ("budget_scope", profile.scope)):
        if field in named and named[field] != val:
            raise InputError(path, None, field, f"profile calibrated for {val!r}, but the config asks for "
                                                f"{named[field]!r}")
    return engine.with_(score_method=profile.method, budget_scope=profile.scope)


def _load_config(path: str) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(path, None, None, "config file not found") from None
    except json.JSONDecodeError as e:
        raise InputError(path, e.lineno, None, f"invalid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise InputError(path, None, None, "expected a JSON object of options")
    return d


def parse_modes(values) -> list[str]:
    if not values:
        return list(MODES)
    out = []
    for v in values:
        for m in str(v).split(","):
            m = m.strip().lower()
            if not m:
                continue
            m = MODE_ALIASES.get(m, m)
            if m not in MODES:
                raise ConfigError(f"--mode: unknown mode {m!r}; choose from {', '.join(MODES)}")
            if m not in out:
                out.append(m)
    return out


def resolve(args, default_out: str) -> dict:
    """Merge --config (lowest), then command-line flags, into everything a run needs."""
    from tangram.traces import default_trace_path, load_trace

    cfg = _load_config(args.config) if args.config else {}
    eng_d = {k: v for k, v in cfg.items() if k not in RUN_KEYS}
    flag_map = {"rho": "rho", "hp": "heads_per_group", "alpha": "alpha", "page_size": "page_size",
                "chunk": "chunk_size", "max_batched_tokens": "max_batched_tokens", "tp": "tp",
                "placement": "placement"}
    for a, f in flag_map.items():
        if getattr(args, a, None) is not None:
            eng_d[f] = getattr(args, a)
    try:
        engine = EngineConfig.from_dict(eng_d)
    except TypeError as e:
        raise ConfigError(f"bad engine option: {e}") from None
    except ConfigError as e:
        if args.config:
            raise InputError(args.config, None, None, str(e)) from None
        raise
    model = get_model(args.model or cfg.get("model", "llama-3.1-8b"))
    gpu = get_gpu(args.gpu or cfg.get("gpu", "h100-80gb"))
    if engine.ragged_paging or engine.mode in ("br+rp", "tangram") or any(m in ("br+rp", "tangram") for m in parse_modes(args.mode)):
        if model.num_kv_heads % engine.heads_per_group:
            raise ConfigError(f"--hp {engine.heads_per_group} must divide {model.name}'s {model.num_kv_heads} KV heads")
    if engine.tp > 1:  # equal KV heads per rank, whole head groups per rank (tangram.placement.check_tp)
        ragged = engine.ragged_paging or engine.mode in ("br+rp", "tangram") or \
            any(m in ("br+rp", "tangram") for m in parse_modes(args.mode))
        check_tp(model.num_kv_heads, engine.tp, engine.heads_per_group if ragged else None)
        for what, v in (("query heads", model.num_q_heads), ("intermediate size", model.intermediate),
                        ("vocabulary", model.vocab)):
            if v % engine.tp:
                raise ConfigError(f"--tp {engine.tp} must divide {model.name}'s {what} ({v})")
    seed = args.seed if args.seed is not None else int(cfg.get("seed", 0))
    prof_path = args.profile or cfg.get("profile")
    if prof_path:
        profile = BudgetProfile.load(prof_path)
        try:
            profile.check_model(model.num_layers, model.num_kv_heads, model.name)
        except ConfigError as e:
            raise InputError(str(prof_path), None, None, str(e)) from None
        engine = adopt_profile_method(engine, profile, eng_d, str(prof_path))
        profile_label = str(prof_path)
    else:
        profile, profile_label = default_profile_labelled(model, engine.rho, engine.alpha, seed, engine.score_method,
                                                          engine.budget_scope)
    trace_path = args.trace or cfg.get("trace") or str(default_trace_path())
    trace = load_trace(trace_path)
    rate_scale = args.rate_scale if args.rate_scale is not None else cfg.get("rate_scale")
    if rate_scale is not None:
        trace = trace.scaled(float(rate_scale))
    replicas = args.replicas if args.replicas is not None else int(cfg.get("replicas", 1))
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    router = args.router or cfg.get("router", "session-affinity")
    if router not in ROUTERS:
        raise ConfigError(f"unknown router {router!r}")
    modes = parse_modes(args.mode or cfg.get("modes") or ([cfg["mode"]] if "mode" in cfg else None))
    slo_text = args.slo or cfg.get("slo")
    slo_default = bool(args.capacity and not slo_text)  # the capacity search's documented default SLO
    slo = parse_slo(DEFAULT_SLO if slo_default else slo_text) if slo_text or slo_default else None
    target = args.target_rate if args.target_rate is not None else cfg.get("target_rate")
    if target is not None and not (math.isfinite(float(target)) and float(target) > 0):
        raise ConfigError(f"--target-rate must be > 0 requests/s, got {target}")
    # "calibration" is the config key's name before the tables were renamed (one release of grace)
    tables = args.tables or cfg.get("tables") or cfg.get("calibration") or "auto"
    if str(tables).lower() == "none":  # roofline only, whatever tables are installed
        tables = None
    elif tables != "auto" and not Path(tables).is_dir():
        raise ConfigError(f"--tables: {tables} is not a folder of cost tables")
    eo = cfg.get("engine_overhead", True) if getattr(args, "engine_overhead", None) is None else args.engine_overhead
    if not isinstance(eo, bool):
        raise ConfigError(f"engine_overhead must be true or false, got {eo!r}")
    probe = getattr(args, "probe", None) or cfg.get("probe")
    if probe is not None and not Path(probe).is_file():
        raise ConfigError(f"--probe: {probe} is not a file (a tangram-probe JSON)")
    spec = DeploymentSpec(model, gpu, engine, profile, replicas, router, seed, tables, eo, probe)
    return {"spec": spec, "trace": trace, "trace_path": trace_path, "modes": modes, "slo": slo, "slo_default": slo_default,
            "target_rate": float(target) if target is not None else None, "profile_label": profile_label,
            "out": Path(args.out or cfg.get("out", default_out)), "config": cfg}

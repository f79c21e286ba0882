"""The deployment spec: what a run serves (model, GPU, engine config, budget profile), on what (trace, rate scale,
modes, SLO) and how it is replayed or run (replicas, router, seed, cost tables, weights, device, ...).

Every command-line tool builds its configuration with :func:`load`: a ``--config`` JSON file, then the options
given on the command line (:mod:`tangram.cli` generates the flags from this class's and
:class:`~tangram.config.EngineConfig`'s option fields: one declaration, one default, one help text per option).
The config file is flat, the spec's options and EngineConfig's fields side by side (``{"model": "llama-3.1-8b",
"mode": "tangram", "heads_per_group": 2}``), as ``tangram-tune`` writes its best configuration.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tangram.budgets import BudgetProfile
from tangram.config import (MODE_ALIASES, MODES, EngineConfig, GPUConfig, ModelConfig, default_heads_per_group, get_gpu,
                            get_model)
from tangram.errors import ConfigError, InputError
from tangram.harness.capacity import DEFAULT_TOL
from tangram.harness.cluster import ROUTERS
from tangram.harness.slo import parse_slo
from tangram.options import Spec, check, finish, option, options_of
from tangram.placement import check_tp
from tangram.traces.detect import TRACE_FORMATS

RAGGED_MODES = ("br+rp", "tangram")


def parse_modes(values) -> list[str]:
    """``"full,tangram"`` or ``["full", "br+rp,tangram"]`` -> the distinct modes in order (aliases resolved); none
    given (None, or an empty list): every mode. Values that name no mode (``--mode ''``, ``--mode ,``) are an error,
    not "every mode": the user asked for something, and running all six silently would not be it."""
    if values is None or (isinstance(values, (list, tuple)) and not values):
        return list(MODES)
    out: list[str] = []
    for v in [values] if isinstance(values, str) else values:
        if not isinstance(v, str):
            raise ConfigError(f"--mode: expected mode names, got {json.dumps(v)}")
        for m in v.split(","):
            m = m.strip().lower()
            if not m:
                continue
            m = MODE_ALIASES.get(m, m)
            if m not in MODES:
                raise ConfigError(f"--mode: unknown mode {m!r}; choose from {', '.join(MODES)}")
            if m not in out:
                out.append(m)
    if not out:
        given = values if isinstance(values, str) else ",".join(values)
        raise ConfigError(f"--mode: {given!r} names no mode; choose from {', '.join(MODES)}")
    return out


def _non_negative_seed(v: int) -> int:
    if v < 0:  # numpy's generators take none below 0 (it was a traceback from inside the profile's draw)
        raise ConfigError(f"--seed: expected an integer >= 0, got {v}")
    return v


def _tables(v: str):
    if v.lower() == "none":  # roofline only, whatever tables are installed
        return None
    if v != "auto" and not Path(v).is_dir():
        raise ConfigError(f"--tables: {v} is not a folder of cost tables")
    return v


def _probe(v: str) -> str:
    if not Path(v).is_file():
        raise ConfigError(f"--probe: {v} is not a file (a tangram-probe JSON)")
    return v


def _slo(v: str) -> str:
    parse_slo(v)  # checked here, kept as text (reports and tuned configs quote it)
    return v


def _window(v: str) -> str:
    from tangram.traces.format import parse_window

    parse_window(v)  # checked here, kept as text (reports quote it)
    return v


@dataclass
class DeploymentSpec:
    """One deployment and how to run it. Built by :func:`load` (every CLI) or directly (tests, the tuner).

    A field with a docstring is an option (:mod:`tangram.options`): a config-file key and a flag of the tools
    that take its group."""

    model: ModelConfig = option(group="deployment", input=str, parse=get_model, input_default="llama-3.1-8b")
    """model preset (tangram.config.MODELS)"""
    gpu: GPUConfig = option(group="deployment", input=str, parse=get_gpu, input_default="h100-80gb")
    """GPU preset: its memory sizes the KV pool, its family picks the simulator's cost tables"""
    engine: EngineConfig  # its fields are options of their own (tangram.config.EngineConfig)
    profile: BudgetProfile = option(group="deployment", input=str, optional=True, input_default=None, metavar="FILE",
                                    show="the shipped calibration of the model, score method, budget scope and rho "
                                         "(tangram.profiles.registry), else a synthetic profile (labelled)")
    """budget profile file (.npz/.json)"""
    replicas: int = option(1, group="replay")
    """engine replicas serving the trace"""
    router: str = option("session-affinity", group="replay", choices=ROUTERS)
    """which replica serves a turn"""
    seed: int = option(0, group="deployment", parse=_non_negative_seed)
    """seed of every random draw: the cost model's, the synthetic profile's, the engine's weights, prompt ids and
    sampling"""
    tables: object = option("auto", group="sim", input=str, optional=False, parse=_tables, aliases=("--calibration",),
                            keys=("calibration",), metavar="DIR")
    """cost tables folder of the simulator ('auto': sim/tables/<gpu>/; 'none': roofline only)"""
    engine_overhead: bool = option(True, group="sim")
    """price the eager engine's fitted per-step issue/sync overhead (engine_overhead.json of the tables folder);
    --no-engine-overhead prices kernels back to back (a CUDA-graph engine)"""
    probe: str | None = option(None, group="sim", parse=_probe, metavar="FILE")
    """rescale the cost tables to the machine a tangram-probe JSON was measured on"""
    trace: str | None = option(None, group="trace", metavar="TRACE", show="the bundled default trace")
    """multi-turn JSONL trace"""
    trace_format: str = option("auto", group="trace", choices=TRACE_FORMATS)
    """format of the trace file: detected (auto), ours, or a public format read through tangram-trace import's
    importer with its defaults (a note on stderr says so)"""
    trace_window: str | None = option(None, group="trace", parse=_window, metavar="START:DURATION")
    """replay only the sessions whose first turn arrives in this window of the trace's time, e.g. 86400:3600 or
    1d:1h (units s, m, h, d), arrivals shifted to start at 0 (applied before --rate-scale): a slice of a long
    public trace at its own rate"""
    rate_scale: float | None = option(None, group="trace")
    """multiply the trace's session arrival rate"""
    modes: tuple | None = option(None, group="deployment", flag="--mode", keys=("mode",), input=(str, list),
                                 parse=lambda v: tuple(parse_modes(v)), repeat=True, metavar="MODE",
                                 show="all: " + ",".join(MODES))
    """serving mode(s), repeatable or a comma list"""
    slo: str | None = option(None, group="sim", parse=_slo,
                             show="none; a capacity search uses tangram.harness.slo.DEFAULT_SLO")
    """service-level objective, e.g. 'ttft_p99=2s,tpot_p99=0.1s'"""
    capacity_tol: float = option(DEFAULT_TOL, group="sim", metavar="TOL")
    """precision of a capacity search: it ends when a load that met the SLO and one that missed it are within
    1 + TOL (0.08: the answer's bracket is 8% wide); 0.2 answers within 20% with fewer replays, 0.02 within 2% with
    more"""
    target_rate: float | None = option(None, group="sim")
    """requests/s to provision for (a capacity search then finds the replicas needed, by simulating the cluster)"""
    accuracy_table: str | None = option(None, group="sim", metavar="TABLE_OR_MODEL",
                                        show="the model's own; another model's is labelled borrowed")
    """measured accuracy table file (tangram-accuracy), or a model whose shipped table to use"""
    weights: str = option("auto", group="run")
    """engine weights: random | PATH.gguf | HF safetensors dir | auto (the packaged SmolLM2 GGUF for smollm2-135m,
    seeded random weights otherwise)"""
    device: str = option("auto", group="run", choices=("auto", "cuda", "cpu"))
    """engine device"""
    dtype: str = option("auto", group="run", choices=("auto", "bf16", "fp16", "fp32"))
    """engine dtype (auto: bf16 on a GPU, fp32 on the CPU)"""
    dynamic_keep: str = option("auto", group="run", choices=("auto", "topk", "profile"))
    """dynamic mode's per-head keep in the engine: topk (global top-k of the scores), profile (drawn from the
    budget profile; for random weights, whose scores have no head structure) or auto (profile with random weights,
    else topk)"""
    temperature: float = option(0.0, group="run")
    """sampling temperature (0 = greedy)"""
    top_p: float = option(1.0, group="run")
    """nucleus sampling threshold, in (0, 1]"""
    out: str | None = option(None, group="output", metavar="DIR", show="the tool's")
    """output folder"""
    profile_label: str = ""  # what reports call the profile (its file, or how the default was chosen)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")
        for n, ok, what in _RANGES:  # (NaN fails each)
            v = getattr(self, n)
            if v is not None and not ok(v):
                raise ConfigError(f"{OPTIONS[n].flag} {what}, got {v}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def mode_list(self) -> list[str]:
        """The modes to run: the given ones, else all."""
        return list(self.modes) if self.modes else list(MODES)

    @property
    def run_mode(self) -> str:
        """The one mode a config runs in (the engine's): its only mode if it names one, else the engine config's."""
        return self.modes[0] if self.modes and len(self.modes) == 1 else self.engine.mode

    @property
    def trace_path(self) -> str:
        from tangram.traces import default_trace_path

        return self.trace or str(default_trace_path())

    def load_trace(self):
        """The trace, read and validated, cut to ``trace_window`` and its session arrivals scaled by
        ``rate_scale``."""
        from tangram.traces.detect import read_trace

        trace = read_trace(self.trace_path, self.trace_format).windowed(self.trace_window)
        return trace.scaled(float(self.rate_scale)) if self.rate_scale is not None else trace

    def slo_targets(self, default: str | None = None) -> dict | None:
        """The SLO as {metric: seconds} (``default`` when the spec names none), or None."""
        text = self.slo or default
        return parse_slo(text) if text else None


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




# --------------------------------------------------------------------------- the loader

SPEC_OPTIONS: tuple[Spec, ...] = options_of(DeploymentSpec)
ENGINE_OPTIONS: tuple[Spec, ...] = options_of(EngineConfig)
OPTIONS: dict[str, Spec] = {s.name: s for s in SPEC_OPTIONS + ENGINE_OPTIONS}
KEYS: dict[str, str] = {k: s.name for s in OPTIONS.values() for k in (s.name, *s.opt.keys)}  # file key -> option
assert len(OPTIONS) == len(SPEC_OPTIONS) + len(ENGINE_OPTIONS), "a spec option shadows an engine option"


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
         defaults: Mapping[str, Any] | None = None) -> DeploymentSpec:
    """The spec of a config file (or none) with ``overrides`` on top: field defaults < ``defaults`` (a tool's own,
    e.g. tangram-sim's output folder) < the file < ``overrides`` (the command line's options).

    Keys are option names (old config-file names work: ``calibration``, ``mode``); values are JSON-like (a model's
    name, not its ModelConfig). Every value is type-checked; a bad one is an error naming the file, line and key,
    or the option."""
    given: dict[str, Any] = {}
    where: dict[str, str] = {}
    keyed: dict[str, tuple[str, int | None]] = {}  # option -> (the file's key, its line), for errors found later
    for src, items in (("default", defaults), ("option", overrides)):
        for key, value in (items or {}).items():
            name = KEYS.get(key)
            if name is None:
                raise ConfigError(f"unknown option {key!r}")
            try:
                given[name] = check(OPTIONS[name], value, text=False)
            except ConfigError as e:
                raise ConfigError(f"{OPTIONS[name].flag}: {e}") from None
            where[name] = src
        if src == "default" and path is not None:  # the file lies between a tool's defaults and the command line
            for key, (value, line) in _read_config(str(path)).items():
                name = KEYS.get(key)
                if name is None:
                    raise InputError(str(path), line, key, "unknown option (options: docs/configuration.md)")
                if where.get(name) == "file":
                    raise InputError(str(path), line, key, f"{name} given twice (by another of its keys)")
                try:
                    given[name] = check(OPTIONS[name], value, text=False)
                except ConfigError as e:
                    raise InputError(str(path), line, key, str(e)) from None
                where[name] = "file"
                keyed[name] = (key, line)
    if path is not None:
        _check_file_paths(str(path), given, where, keyed)
    try:
        return _build(given, where, str(path) if path is not None else None, keyed)
    except InputError:
        raise
    except ConfigError as e:
        if path is not None:
            raise InputError(str(path), None, None, str(e)) from None
        raise


_RANGES = (("rate_scale", lambda v: v > 0, "must be > 0"), ("target_rate", lambda v: v > 0, "must be > 0"),
           ("capacity_tol", lambda v: 0.005 <= v <= 1, "must be in [0.005, 1] (the bracket's relative width)"))


def _build(given: dict, where: dict, path: str | None, keyed: dict | None = None) -> DeploymentSpec:
    def blame(name: str, what: str, cli: str | None = None) -> ConfigError:
        """An error in option ``name``'s value: named as the config file's key at its line when the file gave it
        (a file's user never typed ``--hp``), else as the command line's flag (``cli``: the whole message)."""
        if where.get(name) == "file" and path is not None and keyed and name in keyed:
            key, line = keyed[name]
            return InputError(path, line, key, what)
        return ConfigError(cli or f"{OPTIONS[name].flag}: {what}")

    vals = {}
    for n, v in given.items():
        try:
            vals[n] = finish(OPTIONS[n], v)
        except InputError:
            raise
        except ConfigError as e:
            msg = str(e)
            flag = OPTIONS[n].flag
            raise blame(n, msg[len(flag) + 2:] if msg.startswith(flag + ": ") else msg) from None
    eng = {s.name: vals[s.name] for s in ENGINE_OPTIONS if s.name in vals}
    modes = vals.get("modes")
    if modes and len(modes) == 1:  # a config of one mode: the engine serves in it
        eng["mode"] = modes[0]
    kw = {s.name: vals[s.name] for s in SPEC_OPTIONS if s.name in vals}
    for n, ok, what in _RANGES:  # (DeploymentSpec checks them too; here a file's value is blamed on its key)
        v = kw.get(n)
        if v is not None and not ok(v):
            raise blame(n, f"{what}, got {v}", f"{OPTIONS[n].flag} {what}, got {v}")
    model = kw.pop("model", None) or get_model(OPTIONS["model"].default)
    if "heads_per_group" not in eng:  # the default H_p, or the largest divisor below it of a rank's KV heads
        eng["heads_per_group"] = default_heads_per_group(model, eng.get("tp", 1))  # SmolLM2: 3; Llama at tp 8: 1
    engine = EngineConfig(**eng)
    gpu = kw.pop("gpu", None) or get_gpu(OPTIONS["gpu"].default)
    ragged = engine.ragged_paging or any(m in RAGGED_MODES for m in (modes or MODES))
    if ragged and model.num_kv_heads % engine.heads_per_group:
        what = f"{engine.heads_per_group} must divide {model.name}'s {model.num_kv_heads} KV heads"
        raise blame("heads_per_group", what, f"--hp {what}")
    if engine.tp > 1:  # equal KV heads per rank, whole head groups per rank (tangram.placement.check_tp)
        try:
            check_tp(model.num_kv_heads, engine.tp, engine.heads_per_group if ragged else None)
        except ConfigError as e:
            raise blame("tp", str(e), str(e)) from None
        for what, v in (("query heads", model.num_q_heads), ("intermediate size", model.intermediate),
                        ("vocabulary", model.vocab)):
            if v % engine.tp:
                msg = f"{engine.tp} must divide {model.name}'s {what} ({v})"
                raise blame("tp", msg, f"--tp {msg}")
    prof_path = kw.pop("profile", None)
    if prof_path:
        profile = BudgetProfile.load(prof_path)
        try:
            profile.check_model(model.num_layers, model.num_kv_heads, model.name)
        except ConfigError as e:
            raise InputError(str(prof_path), None, None, str(e)) from None
        named = {n: given[n] for n in ("score_method", "budget_scope") if n in given and where[n] != "default"}
        engine = adopt_profile_method(engine, profile, named, path or str(prof_path))
        label = str(prof_path)
    else:
        profile, label = default_profile_labelled(model, engine.rho, engine.alpha, kw.get("seed", 0),
                                                  engine.score_method, engine.budget_scope)
    return DeploymentSpec(model, gpu, engine, profile, **kw, profile_label=label)


PATH_OPTIONS = ("trace", "profile", "tables", "probe", "accuracy_table", "weights")  # options that may name a file


def _check_file_paths(path: str, given: dict, where: dict, keyed: dict) -> None:
    """A relative path in a config file is read from the working directory, as the same flag on the command line
    is. When it is missing there but present beside the config file (the config was written for its own folder),
    say so at the key's line rather than fail later with a bare "no such file"."""
    base = Path(path).parent
    for name in PATH_OPTIONS:
        v = given.get(name)
        if where.get(name) != "file" or not isinstance(v, str) or not v or Path(v).is_absolute() or Path(v).exists():
            continue
        beside = base / v
        if beside.exists():
            key, line = keyed[name]
            raise InputError(path, line, key, f"{v!r} is not in the working directory ({Path.cwd()}); relative paths "
                                              f"in a config file are read from there, as on the command line: it is "
                                              f"beside the config file, so write {os.path.normpath(beside)!r} or "
                                              f"run from {str(base)!r}")


def _read_config(path: str) -> dict[str, tuple[Any, int | None]]:
    """A config file's keys -> (value, line of the key)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(path, None, None, "config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(path, None, None, f"cannot read the config file ({e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(path, e.lineno, None, f"invalid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise InputError(path, None, None, "expected a JSON object of options")
    lines = text.splitlines()
    out = {}
    for key, value in d.items():
        pat = re.compile(r'"' + re.escape(json.dumps(key)[1:-1]) + r'"\s*:')
        out[key] = (value, next((i + 1 for i, ln in enumerate(lines) if pat.search(ln)), None))
    return out

"""Configuration dataclasses and presets for models, GPUs and the serving engine.

Model shapes are the published architecture figures; GPU figures are datasheet
values (marked ``source="datasheet"``) and are only a fallback: the simulator
prefers calibration tables measured on the device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tangram.budgets import METHODS, SCOPES, check_method_scope
from tangram.errors import ConfigError
from tangram.options import option
from tangram.planner import pow2_bucket

# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3-style: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rms_eps: float = 1e-5
    qk_norm: bool = False  # Qwen3
    qkv_bias: bool = False  # Qwen2.5
    tie_embeddings: bool = False
    max_context: int = 131072

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name}: num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def kv_bytes_per_token(self) -> int:
        """Full (uncompressed) KV bytes one token occupies over all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def param_count(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.num_q_heads * d + 2 * h * self.num_kv_heads * d + self.num_q_heads * d * h
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h
        emb = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def weight_bytes(self) -> int:
        return self.param_count() * self.dtype_bytes


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in [
        ModelConfig("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256, rope_theta=500000.0,
                    rope_scaling=_LLAMA3_SCALING, max_context=131072),
        ModelConfig("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256, rope_theta=500000.0,
                    rope_scaling=_LLAMA3_SCALING, max_context=131072),
        ModelConfig("qwen3-4b", 36, 32, 8, 128, 2560, 9728, 151936, rope_theta=1000000.0, rms_eps=1e-6,
                    qk_norm=True, tie_embeddings=True, max_context=131072),
        ModelConfig("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064, rope_theta=1000000.0, rms_eps=1e-6,
                    qkv_bias=True, max_context=131072),
        ModelConfig("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, rope_theta=100000.0,
                    tie_embeddings=True, max_context=8192),
    ]
}

# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPUConfig:
    """Datasheet figures of a GPU model. The cost tables of one model are carried to another by the ratios of
    these figures (``tangram.sim.transfer``), so every figure the transfer reads is here: memory bandwidth and
    dense bf16 rate scale the bandwidth and compute parts of each measured kernel time, and the per-SM limits
    with ``num_sms`` re-derive the decode kernel's resident CTAs (occupancy x SMs)."""

    name: str
    memory_bytes: int
    mem_bandwidth: float  # bytes/s
    num_sms: int
    bf16_flops: float  # dense tensor-core FLOP/s
    l2_bytes: int
    source: str = "datasheet"
    # per-SM limits of the occupancy calculation (tangram.kernels.decode.DeviceLimits); Hopper's by default
    smem_per_sm: int = 233472  # shared memory a block can use per SM (228 KiB on Hopper)
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    # NVLink bandwidth per direction between two GPUs of one host (bytes/s): tensor parallelism's all-reduce
    nvlink_bandwidth: float = 450e9

    @property
    def family(self) -> str:
        """``h100-80gb`` -> ``h100``: cost tables are per GPU family (sim/tables/<family>/), not per memory size."""
        return self.name.lower().split("-")[0]


GIB = 1024**3
GPUS: dict[str, GPUConfig] = {
    g.name: g
    for g in [
        # NVIDIA H100 SXM5 80GB datasheet: 80 GB HBM3, 3.35 TB/s, 132 SMs, 989 TFLOP/s dense bf16, 50 MB L2,
        # NVLink 4 900 GB/s bidirectional (450 GB/s per direction; the H200 alike);
        # compute capability 9.0: 228 KiB of shared memory per SM for blocks (what torch reports on the H100 of
        # sim/tables/h100/meta.json), 64K registers, 2048 threads and 32 blocks per SM (the H200 alike).
        GPUConfig("h100-80gb", 80 * 10**9, 3.35e12, 132, 989e12, 50 * 2**20),
        # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 132 SMs, 989 TFLOP/s dense bf16, 60 MB L2.
        GPUConfig("h200", 141 * 10**9, 4.8e12, 132, 989e12, 60 * 2**20),
        # NVIDIA A100 SXM4 80GB datasheet: 80 GB HBM2e, 2.039 TB/s, 108 SMs, 312 TFLOP/s dense bf16, 40 MB L2;
        # CUDA programming guide (compute capability 8.0): 164 KiB of shared memory per SM for blocks, 64K
        # registers, 2048 threads and 32 blocks per SM.
        # NVLink 3: 600 GB/s bidirectional.
        GPUConfig("a100-80gb", 80 * 10**9, 2.039e12, 108, 312e12, 40 * 2**20, smem_per_sm=167936,
                  nvlink_bandwidth=300e9),
    ]
}

# --------------------------------------------------------------------------- engine

MODES = ("full", "uniform", "dynamic", "br", "br+rp", "tangram")
MODE_ALIASES = {"br+rp+aot": "tangram", "vllm": "full", "br_rp": "br+rp"}
# The cumulative ablation of the paper's Figure 10, in order: the vLLM full-KV baseline, then Budget
# Reservation, then Ragged Paging, then AOT load balancing (= tangram). ``dynamic`` (the non-uniform method run
# as published: over-allocate, compress, reclaim) is the comparison of Figure 11, not a step of this chain.
ABLATION_MODES = ("full", "br", "br+rp", "tangram")
# tensor parallelism's KV-head placements (tangram.placement): the Megatron split, budget-balanced head groups
PLACEMENTS = ("contiguous", "balanced")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine replica serves: memory layout, retention policy, batching.

    ``mode`` picks a row of the design brief's mode table; the switches it
    implies are resolved by :meth:`resolved` so ablations can also be built
    by hand (e.g. tangram without clustering).
    """

    mode: str = "tangram"  # not an option: the deployment spec's ``modes`` (--mode) picks it
    page_size: int = 16
    """tokens per KV page"""
    heads_per_group: int = option(4, aliases=("--hp",))
    """heads per group H_p of ragged paging (must divide the KV heads of a rank; when not given, a tool uses 4 or the
    largest divisor below it of a rank's KV heads: 3 for SmolLM2's 3, 1 for Llama-3.1-8B's 8 at --tp 8)"""
    alpha: float = 2.0
    """safety margin of the static budgets, B = min(1, mu + alpha * sigma) (eq. 5)"""
    rho: float = 0.25
    """target global retention ratio of the compression method, in (0, 1]"""
    chunk_size: int = option(2048, aliases=("--chunk",))
    """prefill chunk size in tokens"""
    max_batched_tokens: int = 8192
    """token budget of one step"""
    max_num_seqs: int = 256
    """most requests running at once"""
    gpu_memory_utilization: float = 0.90
    """share of GPU memory the engine may use"""
    activation_reserve_bytes: int = 2 * GIB
    """bytes of GPU memory kept for activations"""
    kv_pool_bytes: int | None = option(None, scaled=(("--kv-pool-gib", float(GIB), "GIB"),),
                                       show="derived from GPU memory")
    """KV pool size in bytes, overriding the derivation from GPU memory (--kv-pool-gib: in GiB)"""
    # switches (None = implied by mode)
    budget_reservation: bool | None = option(None, show="by mode")
    """Budget Reservation: reserve a turn's exact post-compression pages at admission"""
    ragged_paging: bool | None = option(None, show="by mode")
    """Ragged Paging: one page table per (layer, head group)"""
    aot_balancing: bool | None = option(None, show="by mode")
    """AOT load balancing: decode by the static split map"""
    clustering: bool = True
    """budget-aware clustering of heads into groups (else adjacent heads)"""
    decode_partition: str | None = option(None, choices=("static", "runtime", "aot"),
                                          show="by mode: aot for tangram, else static")
    """how decode work is split into CTAs"""
    split_rounding: str = option("round", choices=("round", "ceil"))
    """Algorithm 1 rounding: round (the paper) or ceil"""
    n_cta_scale: float = 1.0
    """multiplies the occupancy-derived N_CTA"""
    session_cache: bool = True
    """keep a session's compressed KV resident between turns"""
    cuda_graph_max_bs: int = 64
    """pure-decode steps of up to this many requests (rounded up to a power of two) replay a captured CUDA graph
    in the engine and are priced as graph replays by the simulator; 0 = every step eager"""
    score_method: str = option("ada-snapkv", choices=METHODS)
    """compression method the engine scores chunks with (tangram.kernels.scoring); the default profile is the
    one calibrated for it"""
    budget_scope: str = option("per-layer", choices=SCOPES)
    """budget scope the method runs under: per-layer (each layer's top-k over its heads), cross-layer (one top-k
    over all layers of a chunk) or uniform (each head's top-k)"""
    tp: int = 1
    """tensor-parallel GPUs per replica (issue 16), each holding H/tp KV heads of every layer and 1/tp of the
    weights (must divide the model's KV heads, query heads, intermediate size and vocabulary; H_p must divide a
    rank's heads); --replicas and --target-rate count replicas of tp GPUs"""
    placement: str = option("balanced", choices=PLACEMENTS)
    """which KV heads each rank holds under tp > 1 (tangram.placement): contiguous (the Megatron split) or
    balanced (budget-balanced head groups per rank)"""

    def __post_init__(self) -> None:
        mode = MODE_ALIASES.get(self.mode, self.mode)
        if mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        object.__setattr__(self, "mode", mode)
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")
        if self.heads_per_group <= 0:
            raise ConfigError(f"heads_per_group must be positive, got {self.heads_per_group}")
        if not (0.0 < self.rho <= 1.0):
            raise ConfigError(f"rho must be in (0, 1], got {self.rho}")
        if self.alpha < 0:
            raise ConfigError(f"alpha must be >= 0, got {self.alpha}")
        if self.chunk_size <= 0 or self.max_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("chunk_size, max_batched_tokens and max_num_seqs must be positive")
        if self.max_batched_tokens < self.chunk_size:  # as vLLM: a step's token budget holds at least one chunk
            raise ConfigError(f"max_batched_tokens ({self.max_batched_tokens}) must be >= chunk_size "
                              f"({self.chunk_size}): a step's token budget must hold one whole prefill chunk")
        if self.split_rounding not in ("round", "ceil"):
            raise ConfigError(f"split_rounding must be 'round' or 'ceil', got {self.split_rounding!r}")
        if self.decode_partition not in (None, "static", "runtime", "aot"):
            raise ConfigError(f"decode_partition must be static, runtime or aot, got {self.decode_partition!r}")
        if self.cuda_graph_max_bs < 0:
            raise ConfigError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.kv_pool_bytes is not None and self.kv_pool_bytes <= 0:
            raise ConfigError(f"kv_pool_bytes must be > 0, got {self.kv_pool_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.activation_reserve_bytes < 0:
            raise ConfigError(f"activation_reserve_bytes must be >= 0, got {self.activation_reserve_bytes}")
        if not self.n_cta_scale > 0:
            raise ConfigError(f"n_cta_scale must be > 0, got {self.n_cta_scale}")
        check_method_scope(self.score_method, self.budget_scope)
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp (tensor-parallel degree) must be an integer >= 1, got {self.tp!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement must be {' or '.join(PLACEMENTS)}, got {self.placement!r}")

    # -- resolved switches
    @property
    def retention(self) -> str:
        """Which tokens each head keeps: full | uniform | global (dynamic top-k) | static (per-head budget)."""
        return {"full": "full", "uniform": "uniform", "dynamic": "global"}.get(self.mode, "static")

    @property
    def reserve_exact(self) -> bool:
        if self.budget_reservation is not None:
            return self.budget_reservation
        return self.mode != "dynamic"

    @property
    def ragged(self) -> bool:
        if self.ragged_paging is not None:
            return self.ragged_paging
        return self.mode in ("br+rp", "tangram")

    @property
    def partition(self) -> str:
        if self.decode_partition is not None:
            return self.decode_partition
        if self.aot_balancing is not None:
            return "aot" if self.aot_balancing else "static"
        return "aot" if self.mode == "tangram" else "static"

    @property
    def graph_max_batch(self) -> int:
        """Largest captured decode batch bucket (0: no graphs). The runtime partition plans on the host every
        step, so it is never captured."""
        n = min(self.cuda_graph_max_bs, self.max_num_seqs)
        if n <= 0 or self.partition == "runtime":
            return 0
        return pow2_bucket(n)

    def decode_graphed(self, num_decode, num_prefill):
        """Whether a step with these rows replays a decode graph (vectorised over arrays of steps)."""
        if type(num_decode) is int and type(num_prefill) is int:  # one step: no numpy (priced ~30K times a replay)
            return num_prefill == 0 and 0 < num_decode <= self.graph_max_batch
        kd, kp = np.asarray(num_decode), np.asarray(num_prefill)
        return (kp == 0) & (kd > 0) & (kd <= self.graph_max_batch)

    def with_(self, **kw: Any) -> "EngineConfig":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**d)


def kv_pool_bytes(model: ModelConfig, gpu: GPUConfig, engine: EngineConfig) -> int:
    """Bytes left for the KV cache on one GPU: a share of device memory minus its weights and activations. Under
    tensor parallelism a GPU holds ``1/tp`` of the weights (every matrix is sharded: q/k/v and gate/up by
    column, o and down by row, the embedding and lm_head by vocabulary), and this is one rank's pool."""
    if engine.kv_pool_bytes is not None:
        return int(engine.kv_pool_bytes)
    w = model.weight_bytes() / engine.tp
    free = gpu.memory_bytes * engine.gpu_memory_utilization - w - engine.activation_reserve_bytes
    if free <= 0:
        tp = f" / tp {engine.tp}" if engine.tp > 1 else ""
        # the fewest GPUs whose shards leave KV memory, among the degrees that split the model's KV heads
        fits = [d for d in divisors(model.num_kv_heads) if d > engine.tp and gpu.memory_bytes
                * engine.gpu_memory_utilization - model.weight_bytes() / d - engine.activation_reserve_bytes > 0]
        hint = f"; --tp {fits[0]} leaves some" if fits else ""
        raise ConfigError(
            f"model {model.name} ({model.weight_bytes() / GIB:.1f} GiB of weights{tp}) leaves no KV memory on "
            f"{gpu.name}{hint}")
    return int(free)


def get_model(name: str) -> ModelConfig:
    key = name.lower()
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
    return MODELS[key]


def get_gpu(name: str) -> GPUConfig:
    key = name.lower()
    aliases = {"h100": "h100-80gb", "a100": "a100-80gb", "h200-141gb": "h200"}
    key = aliases.get(key, key)
    if key not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
    return GPUS[key]


def gpu_for_device_name(device_name: str | None) -> GPUConfig | None:
    """The preset of a device as torch or nvidia-smi names it (``NVIDIA H100 80GB HBM3`` -> ``h100-80gb``), by
    the family in its name; None when no preset's family appears in it. Only SXM parts have presets, so an
    ``H100 PCIe`` (2.0 TB/s, 114 SMs) also maps to ``h100-80gb``: name the preset yourself for such a part."""
    if not device_name:
        return None
    words = device_name.lower().replace("-", " ").split()
    for g in GPUS.values():
        if g.family in words:
            return g
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def default_heads_per_group(model: ModelConfig, tp: int = 1) -> int:
    """H_p when none is given: EngineConfig's default (4), or the largest divisor below it of a rank's KV heads
    (SmolLM2's 3 KV heads: 3; Llama-3.1-8B at tp 8: 1). A tp that does not divide the heads is left to the checks
    that report it; the model's own heads decide then."""
    hp0 = EngineConfig.__dataclass_fields__["heads_per_group"].default
    heads = model.num_kv_heads // tp if tp >= 1 and model.num_kv_heads % tp == 0 else model.num_kv_heads
    return max(d for d in range(1, hp0 + 1) if heads % d == 0)


__all__ = [
    "ModelConfig", "GPUConfig", "EngineConfig", "MODELS", "GPUS", "MODES", "ABLATION_MODES", "PLACEMENTS",
    "get_model", "get_gpu", "gpu_for_device_name", "kv_pool_bytes", "divisors", "ceil_div",
    "default_heads_per_group",
]

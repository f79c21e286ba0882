"""Weight loaders: GGUF (llama.cpp files via the ``gguf`` package), HF safetensors directories, seeded random.

All loaders return a state dict in Hugging Face Llama naming (see
:mod:`tangram.engine.model`). Nothing is fetched from a model hub.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch

from tangram.config import ModelConfig, get_model
from tangram.errors import ConfigError, InputError
from tangram.tokenizer import smollm2_gguf_path  # noqa: F401  (where --weights auto looks)
from tangram.engine.model import Transformer, rope_inv_freq

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` (HF rotate-half layout -> interleaved pairs).

    llama.cpp stores rows of q/k as (head, pair, 2) where HF has (head, 2, half).
    """
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(reader) -> dict:
    meta = {}
    for k, f in reader.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        try:
            meta[k] = f.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            pass
    return meta


def config_from_gguf(meta: dict, path: str, name: str | None = None) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise InputError(path, None, "general.architecture", f"unsupported architecture {arch!r} (llama, qwen2, qwen3)")

    def g(key, default=None):
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise InputError(path, None, full, "missing from GGUF metadata")
        return meta.get(full, default)

    hidden, nq = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", 0)) or hidden // nq
    vocab = int(g("vocab_size", 0)) or None
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "llama3" or f"{arch}.rope.scaling.factor" in meta:
        scaling = {"rope_type": "llama3", "factor": float(g("rope.scaling.factor")),
                   "low_freq_factor": float(g("rope.scaling.low_freq_factor", 1.0)),
                   "high_freq_factor": float(g("rope.scaling.high_freq_factor", 4.0)),
                   "original_max_position_embeddings": int(g("rope.scaling.original_context_length", 8192))}
    return ModelConfig(
        name=name or str(meta.get("general.name", "gguf")), num_layers=int(g("block_count")), num_q_heads=nq,
        num_kv_heads=int(g("attention.head_count_kv", nq)), head_dim=head_dim, hidden=hidden,
        intermediate=int(g("feed_forward_length")), vocab=vocab or 0,
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2",
        max_context=int(g("context_length", 8192)))


_CHECKED_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden", "intermediate", "vocab",
                   "rope_theta", "qk_norm", "qkv_bias")


def cross_check(found: ModelConfig, preset: ModelConfig, path: str) -> None:
    """The file must describe the preset's architecture; a mismatch is a user error, not a crash later."""
    for f in _CHECKED_FIELDS:
        a, b = getattr(found, f), getattr(preset, f)
        if f == "vocab" and not a:
            continue
        ok = math.isclose(a, b, rel_tol=1e-6) if isinstance(b, float) else a == b
        if not ok:
            raise InputError(path, None, f, f"file has {a}, preset {preset.name} has {b}")
    if abs(found.rms_eps - preset.rms_eps) > 1e-3 * preset.rms_eps:
        raise InputError(path, None, "rms_eps", f"file has {found.rms_eps}, preset {preset.name} has {preset.rms_eps}")


def load_gguf(path: str | Path, preset: ModelConfig | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Dequantise a GGUF file to float32 tensors in HF naming; returns (config, state dict, metadata)."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    if not path.exists():
        raise InputError(str(path), None, None, "weights file not found")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad input file
        raise InputError(str(path), None, None, f"not a readable GGUF file ({e})") from None
    meta = gguf_metadata(reader)
    found = config_from_gguf(meta, str(path), preset.name if preset else None)
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
        if t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from metadata
            name = f"model.layers.{int(idx)}.{_GGUF_LAYER_NAMES[rest]}"
            # only the llama converter permutes q/k; qwen2/qwen3 GGUFs keep the HF layout
            if meta["general.architecture"] == "llama" and rest in ("attn_q.weight", "attn_q.bias"):
                w = unpermute_rotary(w, found.num_q_heads)
            elif meta["general.architecture"] == "llama" and rest in ("attn_k.weight", "attn_k.bias"):
                w = unpermute_rotary(w, found.num_kv_heads)
        else:
            continue
        sd[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    if not found.vocab:
        found = dataclasses.replace(found, vocab=int(sd["model.embed_tokens.weight"].shape[0]))
    tied = "lm_head.weight" not in sd
    found = dataclasses.replace(found, tie_embeddings=tied)
    if preset is not None:
        cross_check(found, preset, str(path))
        found = dataclasses.replace(preset, tie_embeddings=tied, max_context=found.max_context)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return found, sd, meta


def _read_safetensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
        return load_file(str(f))
    except ImportError:
        return _read_safetensors_plain(f)


def _read_safetensors_plain(f: Path) -> dict[str, torch.Tensor]:
    """Torch-only reader for the safetensors layout (8-byte header length, JSON header, raw data)."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32}
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = bytearray(raw[base + a:base + b])
        t = torch.frombuffer(buf, dtype=dtypes[info["dtype"]]) if b > a else torch.empty(0, dtype=dtypes[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def config_from_hf(cfg: dict, path: str, name: str | None = None) -> ModelConfig:
    try:
        nq = int(cfg["num_attention_heads"])
        mt = cfg.get("model_type", "llama")
        return ModelConfig(
            name=name or str(cfg.get("_name_or_path") or mt), num_layers=int(cfg["num_hidden_layers"]), num_q_heads=nq,
            num_kv_heads=int(cfg.get("num_key_value_heads", nq)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // nq), hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=cfg.get("rope_scaling"), rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            qk_norm=mt == "qwen3", qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context=int(cfg.get("max_position_embeddings", 8192)))
    except KeyError as e:
        raise InputError(path, None, str(e.args[0]), "missing from config.json") from None


def load_safetensors_dir(path: str | Path, preset: ModelConfig | None = None) -> tuple[ModelConfig, dict, dict]:
    """An HF model directory: config.json plus one or more *.safetensors shards."""
    path = Path(path)
    cj = path / "config.json"
    if not cj.exists():
        raise InputError(str(cj), None, None, "config.json not found in the weights directory")
    try:
        hf = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise InputError(str(cj), e.lineno, None, f"invalid JSON ({e.msg})") from None
    found = config_from_hf(hf, str(cj), preset.name if preset else None)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(str(path), None, None, "no *.safetensors files in the weights directory")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read_safetensors(f))
    sd = {k: v.float() for k, v in sd.items()}
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    if preset is not None:
        cross_check(found, preset, str(cj))
        found = dataclasses.replace(preset, tie_embeddings=found.tie_embeddings)
    return found, sd, hf


def random_state_dict(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded weights with GPT-2-style scaled init (residual projections / sqrt(2L)) so activations stay finite."""
    gen = torch.Generator(device=device).manual_seed(seed)
    std, res_std = 0.02, 0.02 / math.sqrt(2 * cfg.num_layers)
    sd: dict[str, torch.Tensor] = {}

    def normal(*shape, s=std):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * s).to(dtype)

    h, d, L = cfg.hidden, cfg.head_dim, cfg.num_layers
    sd["model.embed_tokens.weight"] = normal(cfg.vocab, h, s=1.0 / math.sqrt(h) if cfg.tie_embeddings else std)
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(cfg.num_q_heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = normal(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.v_proj.weight"] = normal(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_q_heads * d, s=res_std)
        if cfg.qkv_bias:
            for n, m in (("q", cfg.num_q_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                sd[p + f"self_attn.{n}_proj.bias"] = normal(m * d)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
            sd[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
        sd[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate, h)
        sd[p + "mlp.up_proj.weight"] = normal(cfg.intermediate, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, cfg.intermediate, s=res_std)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
    sd["model.norm.weight"] = torch.ones(h, dtype=dtype, device=device)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if cfg.tie_embeddings else normal(cfg.vocab, h)
    return sd


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """Instantiate on the meta device, then assign the weights (no double allocation for large presets)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    if state_dict is None:
        state_dict = random_state_dict(cfg, dtype=dtype, device=device)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"weights do not fit model {cfg.name}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # to_empty left the buffer uninitialised
    return model.eval()


def load_model(model: str | ModelConfig, weights: str = "auto", *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0) -> tuple[Transformer, dict]:
    """Resolve ``--model``/``--weights`` into a model. weights: auto | random | PATH(.gguf | HF dir).

    ``auto`` means the packaged SmolLM2 GGUF for smollm2-135m and seeded random
    weights (labelled) for the other presets. Returns (model, info) where info
    holds the source and, for GGUF, the metadata (for the tokenizer).
    """
    preset = get_model(model) if isinstance(model, str) else model
    src = weights
    if weights == "auto":
        src = str(smollm2_gguf_path()) if preset.name == "smollm2-135m" else "random"
    if src == "random":
        return build_model(preset, random_state_dict(preset, seed, dtype, device), dtype, device), \
            {"source": "random", "seed": seed, "synthetic": True}
    p = Path(src)
    if p.is_dir():
        cfg, sd, hf = load_safetensors_dir(p, preset)
        return build_model(cfg, sd, dtype, device), {"source": str(p), "hf_config": hf}
    if p.suffix == ".gguf" or (p.exists() and p.read_bytes()[:4] == b"GGUF"):
        cfg, sd, meta = load_gguf(p, preset)
        return build_model(cfg, sd, dtype, device), {"source": str(p), "gguf_path": str(p), "gguf_meta": meta}
    raise InputError(str(p), None, "--weights", "not found, or neither a .gguf file nor an HF safetensors directory")


__all__ = ["smollm2_gguf_path", "load_gguf", "load_safetensors_dir", "random_state_dict", "build_model", "load_model",
           "unpermute_rotary", "config_from_gguf", "config_from_hf", "cross_check"]

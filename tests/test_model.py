"""The model against transformers' float32 implementations (SmolLM2 GGUF weights, and tiny random presets)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tangram.config import get_model
from tangram.engine.model import AttnEvent, Session, TorchAttention
from tangram.engine.weights import build_model, load_gguf, random_state_dict, smollm2_gguf_path, unpermute_rotary

transformers = pytest.importorskip("transformers")


def hf_reference(cfg, sd):
    """The matching transformers model in float32 with eager attention, loaded with the same tensors."""
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_q_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
                  max_position_embeddings=cfg.max_context, tie_word_embeddings=cfg.tie_embeddings)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.qk_norm:
        hcfg, cls = transformers.Qwen3Config(**common, rope_parameters=rope), transformers.Qwen3ForCausalLM
    elif cfg.qkv_bias:
        hcfg, cls = transformers.Qwen2Config(**common, rope_parameters=rope), transformers.Qwen2ForCausalLM
    else:
        hcfg, cls = transformers.LlamaConfig(**common, rope_parameters=rope), transformers.LlamaForCausalLM
    hcfg._attn_implementation = "eager"
    ref = cls(hcfg).float().eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return ref


def compare_decode(model, ref, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Worst per-step relative error max|a-b|/max|b| over prefill and ``steps`` greedy decode steps."""
    from transformers import DynamicCache
    sess = Session(model)
    cache = DynamicCache()
    errs, toks = [], []
    with torch.inference_mode():
        ours = sess.forward(prompt)
        theirs = ref(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0]
        errs.append(float((ours - theirs).abs().max() / theirs.abs().max()))
        for i in range(steps):
            tok = int(theirs[-1].argmax())
            toks.append(tok)
            ours = sess.forward([tok])
            theirs = ref(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                         position_ids=torch.tensor([[len(prompt) + i]])).logits[0]
            errs.append(float((ours - theirs).abs().max() / theirs.abs().max()))
    return max(errs), toks


@pytest.fixture(scope="module")
def smollm2():
    cfg, sd, meta = load_gguf(smollm2_gguf_path(), get_model("smollm2-135m"))
    return cfg, sd, meta


def test_gguf_metadata_and_names(smollm2):
    cfg, sd, meta = smollm2
    assert cfg.name == "smollm2-135m" and cfg.tie_embeddings
    assert meta["llama.attention.head_count_kv"] == 3
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5))

    def permute(weights, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
            .reshape(weights.shape)

    assert np.array_equal(unpermute_rotary(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_smollm2_gguf_matches_transformers_multiturn(smollm2):
    """Acceptance: fp32 logits within 1e-3 relative error over a multi-turn chat prompt, prefill + 32 decode steps."""
    from tangram.tokenizer import load_tokenizer
    cfg, sd, _ = smollm2
    torch.manual_seed(0)
    model = build_model(cfg, sd)
    ref = hf_reference(cfg, sd)
    tok = load_tokenizer()
    msgs = [{"role": "user", "content": "My locker code is 4417. Remember it."},
            {"role": "assistant", "content": "Sure, your locker code is 4417."},
            {"role": "user", "content": "What is my locker code, and what is the capital of France?"}]
    prompt = tok.apply_chat(msgs)
    assert prompt.count(tok.token_id("<|im_start|>")) == 5  # default system turn + 3 messages + generation prompt
    err, toks = compare_decode(model, ref, prompt, steps=32)
    assert err < 1e-3, err
    answer = tok.decode(toks)
    assert "4417" in answer or "Paris" in answer, answer  # real weights in the right layout give sense


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-4b", "qwen2.5-7b", "smollm2-135m", "llama-3.1-70b"])
def test_tiny_presets_match_transformers(preset):
    """Each preset's features (llama3 rope scaling, qk-norm, qkv bias, tied embeddings, GQA) at toy size."""
    base = get_model(preset)
    cfg = dataclasses.replace(base, num_layers=2, hidden=64, intermediate=96, vocab=211, head_dim=16,
                              num_q_heads=4 if base.gqa_group < 4 else 8, num_kv_heads=2 if base.gqa_group < 4 else 1)
    sd = random_state_dict(cfg, seed=int(torch.randint(0, 10_000, ())))
    if cfg.qk_norm:  # exercise the norm weights, not just ones
        for k in sd:
            if k.endswith(("q_norm.weight", "k_norm.weight")):
                sd[k] = 1 + 0.1 * torch.randn_like(sd[k])
    model = build_model(cfg, sd)
    ref = hf_reference(cfg, sd)
    prompt = torch.randint(0, cfg.vocab, (12,)).tolist()
    err, _ = compare_decode(model, ref, prompt, steps=4)
    assert err < 1e-4, err


def test_rope_scaling_changes_long_positions():
    cfg = get_model("llama-3.1-8b")
    from tangram.engine.model import rope_inv_freq
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    scaled = rope_inv_freq(cfg)
    assert torch.allclose(plain[:4], scaled[:4])  # high frequencies untouched
    assert torch.allclose(plain[-1] / 8, scaled[-1])  # low frequencies divided by factor


def test_random_weights_stay_finite_deep():
    cfg = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=48, hidden=128, intermediate=256, vocab=300,
                              head_dim=32, num_q_heads=4, num_kv_heads=1)
    model = build_model(cfg, random_state_dict(cfg, seed=3))
    logits = Session(model).forward(torch.randint(0, 300, (64,)).tolist())
    assert torch.isfinite(logits).all() and logits.std() > 1e-3


def test_eviction_equals_cache_without_evicted_tokens():
    """Masking tokens out gives the same output as a cache that never held them (keys keep their positions)."""
    cfg = dataclasses.replace(get_model("qwen3-4b"), num_layers=2, hidden=64, intermediate=96, vocab=97, head_dim=16,
                              num_q_heads=4, num_kv_heads=2)
    model = build_model(cfg, random_state_dict(cfg, seed=1))
    prompt = torch.randint(0, 97, (20,)).tolist()
    a = Session(model)
    a.forward(prompt)
    keep = torch.rand(cfg.num_layers, 1, cfg.num_kv_heads, 20) < 0.5
    keep[..., -1] = True
    for l in range(cfg.num_layers):
        a.backend.evict(l, 0, keep[l])
    out_masked = a.forward([5, 6])
    # reference: per head, attention over only the kept tokens, via explicit index selection
    b = Session(model)
    b.forward(prompt)
    for l in range(cfg.num_layers):
        bk = b.backend
        for h in range(cfg.num_kv_heads):
            drop = ~keep[l, 0, h]
            bk.k[l][0, h, drop] = 1e4  # poison evicted keys: must not matter if they are masked
            bk.v[l][0, h, drop] = -1e4
        bk.keep[l] = keep[l].clone()
    out_poisoned = b.forward([5, 6])
    assert torch.isfinite(out_poisoned).all()
    assert torch.allclose(out_masked, out_poisoned, atol=1e-5)
    assert a.backend.kept_counts().shape == (cfg.num_layers, 1, cfg.num_kv_heads)


def test_observer_sees_new_tokens_and_truncate_rolls_back():
    cfg = dataclasses.replace(get_model("smollm2-135m"), num_layers=2, hidden=48, intermediate=64, vocab=50,
                              head_dim=16, num_q_heads=3, num_kv_heads=1)
    model = build_model(cfg, random_state_dict(cfg, seed=2))
    seen: list[AttnEvent] = []
    sess = Session(model, TorchAttention(cfg, observers=[seen.append]))
    full = sess.forward(list(range(10)))
    assert [e.new_start for e in seen] == [0, 0] and seen[0].k.shape[2] == 10
    sess.forward([1, 2, 3])
    assert seen[-1].new_start == 10 and seen[-1].q.shape[2] == 3
    sess.backend.truncate(10)
    assert sess.length == 10
    again = sess.forward([1, 2, 3])
    fresh = Session(model)
    fresh.forward(list(range(10)))
    assert torch.allclose(again, fresh.forward([1, 2, 3]), atol=1e-6)
    assert torch.isfinite(full).all()

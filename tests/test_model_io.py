"""Tokenizer from the GGUF vocabulary, safetensors loader, and user errors from the loaders."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.config import get_model
from tangram.engine.model import Session
from tangram.tokenizer import CHATML_TEMPLATE, _chatml, load_tokenizer
from tangram.engine.weights import (build_model, load_model, load_safetensors_dir, random_state_dict,
                                    _read_safetensors_plain)
from tangram.errors import InputError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_roundtrip_and_known_ids(tok):
    text = "Key 7f3a-19: value 42!\n    def f(x):\treturn x ** 2  # café ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 49152 and tok.bos_id == 1 and tok.eos_id == 2
    # SmolLM2's pre-tokenizer splits digits one by one
    assert len(tok.encode("12345")) == 5


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"), max_codepoint=0x3FFFF), max_size=60))
def test_roundtrip_any_text(tok, text):
    # SmolLM2's vocabulary has no token for 21 of the 256 bytes (a few C0 controls, UTF-8 lead bytes >= 0xF1 and
    # invalid ones), exactly like the upstream tokenizer.json, so such text cannot round-trip by construction.
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_special_tokens(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
    text = tok.render_chat(msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(start) == 5 and ids.count(end) == 4 and end == tok.eos_id
    # the jinja2 rendering and the fallback renderer agree
    assert _chatml(msgs, True, tok.chat_template) == text
    assert _chatml(msgs, False, CHATML_TEMPLATE) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)


def _tiny_cfg():
    return dataclasses.replace(get_model("qwen2.5-7b"), name="tiny", num_layers=2, hidden=32, intermediate=48,
                               vocab=64, head_dim=8, num_q_heads=4, num_kv_heads=2, max_context=256)


def _write_hf_dir(path, cfg, sd):
    from safetensors.torch import save_file
    hf = {"model_type": "qwen2", "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_q_heads,
          "num_key_value_heads": cfg.num_kv_heads, "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
          "vocab_size": cfg.vocab, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
          "tie_word_embeddings": False, "max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))


def test_safetensors_dir_roundtrip(tmp_path):
    pytest.importorskip("safetensors")
    cfg = _tiny_cfg()
    sd = random_state_dict(cfg, seed=int(torch.randint(0, 1000, ())))
    _write_hf_dir(tmp_path, cfg, sd)
    found, sd2, _ = load_safetensors_dir(tmp_path)
    assert found.qkv_bias and found.num_kv_heads == 2 and not found.tie_embeddings
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    plain = _read_safetensors_plain(tmp_path / "model.safetensors")
    assert all(torch.equal(sd[k], plain[k]) for k in sd)
    toks = torch.randint(0, cfg.vocab, (7,)).tolist()
    a = Session(build_model(cfg, sd)).forward(toks)
    b = Session(build_model(found, sd2)).forward(toks)
    assert torch.equal(a, b)


def test_preset_mismatch_is_a_user_error(tmp_path):
    pytest.importorskip("safetensors")
    cfg = _tiny_cfg()
    _write_hf_dir(tmp_path, cfg, random_state_dict(cfg))
    with pytest.raises(InputError, match="num_layers"):
        load_safetensors_dir(tmp_path, get_model("qwen2.5-7b"))
    with pytest.raises(InputError, match="not found"):
        load_model("smollm2-135m", str(tmp_path / "nope.gguf"))


def test_random_weights_are_seeded():
    cfg = _tiny_cfg()
    a, b = random_state_dict(cfg, seed=5), random_state_dict(cfg, seed=5)
    c = random_state_dict(cfg, seed=6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_bad_gguf_file_exits_2(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    r = subprocess.run([sys.executable, "-m", "tangram.profiles.cli", "--weights", str(bad), "--samples", "1",
                        "-o", str(tmp_path / "p.npz")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "x.gguf" in r.stderr and "Traceback" not in r.stderr

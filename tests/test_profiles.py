"""Corpus splits, selection policies vs reference top-k, scorers, a tiny real calibration run and fidelity run."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tangram.budgets import BudgetProfile
from tangram.profiles.corpus import (TASKS, answer_correct, build_corpus, code_split_of, make_sample,
                                        stdlib_files)
from tangram.profiles.scoring import global_topk_mask, per_head_topk_mask
from tangram.config import get_model
from tangram.errors import ConfigError
from tangram.engine.model import AttnEvent, Session, TorchAttention, attention_probs
from tangram.engine.weights import build_model, random_state_dict

# ------------------------------------------------------------------ corpus


def test_corpus_is_deterministic_and_answerable():
    a = build_corpus(8, "calib", context_tokens=200)
    b = build_corpus(8, "calib", context_tokens=200)
    assert a == b
    assert [s.task for s in a] == list(TASKS) * 2
    for s in a:
        assert 2 <= len(s.turns) <= 4
        for t in s.turns:
            if s.task in ("kv_retrieval", "prefix_suffix", "math_find"):
                assert t.answer in s.context
            else:  # the asked line is in the context, inside the named function
                line = re.search(r"`(.*)`", t.question).group(1)
                assert line in s.context and f"def {t.answer}(" in s.context
        assert answer_correct(f"The answer is {s.turns[0].answer}.", s.turns[0].answer)
        assert not answer_correct("no idea", s.turns[0].answer)


def test_splits_do_not_overlap():
    calib = build_corpus(16, "calib", context_tokens=200)
    held = build_corpus(16, "heldout", context_tokens=200)
    assert not {s.context for s in calib} & {s.context for s in held}
    ans = lambda ss, task: {t.answer for s in ss if s.task == task for t in s.turns}  # noqa: E731
    assert not ans(calib, "kv_retrieval") & ans(held, "kv_retrieval")
    files = stdlib_files()
    split = {p: code_split_of(p) for p in files}
    assert {"calib", "heldout"} == set(split.values())
    for ss, name in ((calib, "calib"), (held, "heldout")):
        for s in ss:
            if s.task == "code_retrieval":
                mod = re.search(r"Python module (\S+)\.py", s.context).group(1)
                assert any(p.stem == mod and split[p] == name for p in files)


# ------------------------------------------------------------------ selection = reference top-k


def _ref_topk(scores: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-scores, kind="stable")[:k].tolist())


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40)),
              elements=st.floats(-4, 4, width=32)), st.data())
def test_tangram_kept_set_equals_reference_topk(scores, data):
    L, H, T = scores.shape
    B = np.array(data.draw(arrays(np.float64, (L, H), elements=st.floats(0.01, 1.0))))
    mask = per_head_topk_mask(torch.from_numpy(scores), B).numpy()
    for l in range(L):
        for h in range(H):
            k = min(T, math.ceil(B[l, h] * T))
            assert set(np.flatnonzero(mask[l, h]).tolist()) == _ref_topk(scores[l, h], k)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40)),
              elements=st.floats(-4, 4, width=32)), st.floats(0.01, 1.0))
def test_dynamic_kept_set_equals_layerwide_topk(scores, rho):
    L, H, T = scores.shape
    mask = global_topk_mask(torch.from_numpy(scores), rho).numpy()
    k = min(H * T, math.ceil(rho * H * T))
    for l in range(L):
        assert set(np.flatnonzero(mask[l].ravel()).tolist()) == _ref_topk(scores[l].ravel(), k)


# ------------------------------------------------------------------ scorers (formulas: tests/test_scoring.py)


def _event(T=24, N=40, Hq=4, Hkv=2, D=8, evicted=True):
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    q = torch.randn(1, Hq, T, D, generator=g)
    k = torch.randn(1, Hkv, N, D, generator=g)
    v = torch.randn(1, Hkv, N, D, generator=g)
    keep = torch.ones(1, Hkv, N, dtype=torch.bool)
    if evicted:
        keep[:, :, : N - T] = torch.rand(1, Hkv, N - T, generator=g) < 0.6
    pos = torch.arange(N)
    return AttnEvent(0, q, k, v, keep, pos, pos[N - T:], N - T, 1 / math.sqrt(D))


def test_attention_probs_masks_and_normalises():
    ev = _event(evicted=True)
    allowed = ev.keep[:, :, None, :].repeat_interleave(2, 1).expand(1, 4, ev.q.shape[2], -1)
    p = attention_probs(ev.q, ev.k, allowed, ev.scale)
    assert torch.allclose(p.sum(-1), torch.ones(1, 4, ev.q.shape[2]))
    assert (p[~allowed] == 0).all()


# ------------------------------------------------------------------ tiny end-to-end runs


@pytest.fixture(scope="module")
def smollm2():
    from tangram.tokenizer import load_tokenizer
    from tangram.engine.weights import load_model
    model, info = load_model("smollm2-135m", "auto")
    return model, load_tokenizer(info["gguf_path"])


def test_tiny_calibration_run_writes_valid_profiles(tmp_path, smollm2, monkeypatch):
    """The CLI on the real SmolLM2 GGUF, every method from one forward per chunk: 2 short samples, two ratios and
    both scopes, loadable profiles with provenance; per-layer keeps each layer's target, cross-layer the total."""
    import tangram.engine.weights as w
    from tangram.budgets import METHODS, layer_targets
    from tangram.profiles import cli
    model, _ = smollm2
    monkeypatch.setattr(w, "load_model", lambda *a, **k: (model, {"source": "smollm2-gguf",
                                                                   "gguf_path": str(w.smollm2_gguf_path())}))
    out = tmp_path / "{method}_{scope}_{rho}.npz"
    with pytest.raises(SystemExit) as e:
        cli.main(["--samples", "2", "--rho", "0.25,0.5", "--scope", "per-layer,cross-layer", "--context-tokens", "96",
                  "--chunk-size", "64", "--method", ",".join(METHODS), "--threads", "1", "--no-progress",
                  "-o", str(out)])
    assert e.value.code == 0
    for method in METHODS:
        scopes = ["per-layer"] if method == "pyramidkv" else ["per-layer", "cross-layer"]
        assert not (tmp_path / f"pyramidkv_cross-layer_0.5.npz").exists()
        for scope in scopes:
            for rho in (0.25, 0.5):
                p = BudgetProfile.load(tmp_path / f"{method}_{scope}_{rho:g}.npz")
                assert p.shape == (30, 3) and p.rho == rho and p.method == method and p.model == "smollm2-135m"
                assert p.scope == scope and p.provenance["scope"] == scope and p.provenance["method"] == method
                assert p.provenance["samples"] == 2 and p.provenance["split"] == "calib" and "command" in p.provenance
                assert p.provenance["pass_methods"] == list(METHODS)
                assert 0 < p.provenance["scorer_seconds"] < p.provenance["pass_seconds"]
                assert np.all((p.B > 0) & (p.B <= 1))
                if scope == "per-layer":  # a layer-wide top-k keeps each layer's target of every chunk
                    assert np.allclose(p.mu.mean(axis=1), layer_targets(method, scope, 30, rho), atol=0.02)
                else:  # one threshold over all layers: only the total is fixed
                    assert p.mu.mean() == pytest.approx(rho, abs=0.01)


def test_one_forward_serves_every_method(smollm2):
    """Scores from the shared pass equal each method's own pass (KVzip's repeat forward does not leak into the
    others' scores, nor theirs into it)."""
    from tangram.profiles.retention import chunk_scores, chunk_scores_multi
    from tangram.profiles.scoring import make_scorer
    model, tok = smollm2
    toks = tok.encode("The quick brown fox jumps over the lazy dog. " * 9)[:70]  # chunks of 32, 32, 6
    methods = ["ada-snapkv", "kvzip", "expected-attention"]
    multi = chunk_scores_multi(model, toks, [make_scorer(m, 30, tokenizer=tok) for m in methods], 32)
    for m, got in zip(methods, multi):
        alone = chunk_scores(model, toks, make_scorer(m, 30, tokenizer=tok), 32)
        assert len(got) == len(alone) == 3
        for a, b in zip(got, alone):
            assert torch.equal(a, b), m


@pytest.mark.parametrize("argv,msg", [(["--rho", "0.2,0.4"], "{rho}"),
                                      (["--scope", "per-layer,cross-layer"], "{scope}"),
                                      (["--scope", "uniform"], "no calibration"),
                                      (["--scope", "global"], "unknown budget scope"),
                                      (["--method", "pyramidkv", "--scope", "cross-layer"], "pyramid"),
                                      (["--alpha", "nan"], "--alpha must be a finite margin >= 0, got nan"),
                                      (["--alpha", "inf"], "--alpha must be a finite margin"),
                                      (["--threads", "0"], "--threads must be >= 1, got 0"),
                                      (["--samples", "0"], "--samples must be >= 1, got 0"),
                                      (["--chunk-size", "1"], "--chunk-size must be >= 2, got 1")])
def test_bad_cli_input_is_one_line_exit_2(tmp_path, capsys, argv, msg):
    from tangram.profiles import cli
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["-o", str(tmp_path / "x.npz")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err


def test_tiny_fidelity_run(smollm2):
    """full agrees with itself; the engine's kept set per head is the reference top-k of the chunk's scores."""
    from tangram.profiles import fidelity as fid
    model, tok = smollm2
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    prof = BudgetProfile(np.full((L, H), 0.4), np.full((L, H), 0.05), 2.0, 0.4, "ada-snapkv", "smollm2-135m")
    specs = [fid.ModeSpec("full", "full"), fid.ModeSpec("dynamic", "dynamic", 0.4),
             fid.ModeSpec("tangram", "tangram", 0.4, fid.tangram_budgets(prof, 1), 1),
             fid.ModeSpec("tangram3", "tangram", 0.4, fid.tangram_budgets(prof, 3), 3)]
    stats = {s.label: fid.SpecStats() for s in specs}
    smp = dataclasses.replace(make_sample("math_find", "heldout", 0, 80), turns=make_sample("math_find", "heldout", 0,
                                                                                            80).turns[:2])
    fid.run_sample(model, tok, smp, specs, chunk=64, max_new=4, method="ada-snapkv", window=None, stats=stats)
    assert stats["full"].agree == [1.0, 1.0] and stats["full"].mass == pytest.approx([1.0, 1.0])
    for s in specs[1:]:
        assert all(0 <= m < 1 for m in stats[s.label].mass)
        assert 0.3 < np.mean(stats[s.label].kept) < 0.75
    # kept set on the real backend == reference top-ceil(B*C) of the same scores
    st_ = fid._fresh(model, "ada-snapkv", None)
    toks = fid.turn_tokens(tok, smp, 0)[:64]
    st_.sess.forward(toks, last_only=True)
    scores = st_.scorer.take()[:, 0]
    fid._compress(st_, specs[2], 0, scores, fid.SpecStats())
    k = math.ceil(0.5 * 64)  # B = 0.4 + 2 * 0.05
    for l in (0, L - 1):
        for h in range(H):
            got = set(torch.nonzero(st_.sess.backend.keep[l][0, h]).ravel().tolist())
            assert got == _ref_topk(scores[l, h].numpy(), k)


def test_group_max_budgets():
    from tangram.profiles.fidelity import tangram_budgets
    B = np.array([[0.1, 0.5, 0.3, 0.9], [0.4, 0.2, 0.8, 0.6]])
    prof = BudgetProfile(B, np.zeros_like(B), 0.0, 0.5, "x", "y")
    eff = tangram_budgets(prof, 2)
    assert np.allclose(eff, [[0.3, 0.9, 0.3, 0.9], [0.4, 0.4, 0.8, 0.8]])
    assert np.all(eff >= B) and np.allclose(tangram_budgets(prof, 1), B)


@pytest.mark.parametrize("argv,msg", [(["--rhos", "nan"], "--rhos must be ratios in (0, 1]"),
                                      (["--rhos", "2"], "--rhos must be ratios in (0, 1]"),
                                      (["--method", "nope"], "--method: unknown scoring method 'nope'"),
                                      (["--samples-per-task", "0"], "--samples-per-task must be >= 1, got 0"),
                                      (["--max-new", "0"], "--max-new must be >= 1, got 0"),
                                      (["--threads", "0"], "--threads must be >= 1, got 0"),
                                      (["--method", "tova", "--rhos", "0.33"], "no shipped tova per-layer profile")])
def test_fidelity_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, msg):
    from tangram.profiles import fidelity
    with pytest.raises(SystemExit) as e:
        fidelity.main(argv + ["--no-progress", "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err


def test_shipped_profiles_are_found_from_any_working_directory(tmp_path, monkeypatch):
    """The fidelity and accuracy tools' default profiles come from the installed package, not from a path
    relative to the repository root (run elsewhere, the fidelity tool said 'profile file not found' and the
    accuracy report would have calibrated every profile again)."""
    from tangram.profiles.accuracy_report import profile_dirs
    from tangram.profiles.fidelity import _profile_path
    from tangram.profiles.registry import DATA_DIR
    monkeypatch.chdir(tmp_path)
    p = _profile_path(None, "smollm2-135m", "tova", 0.5)
    assert p.is_file() and p.parent == DATA_DIR and p.name == "smollm2-135m_tova_per-layer_rho0.5.npz"
    assert _profile_path("mine_{rho}.npz", "smollm2-135m", "tova", 0.5) == Path("mine_0.5.npz")
    assert profile_dirs(None, tmp_path / "o") == [str(DATA_DIR), str(tmp_path / "o" / "profiles")]
    with pytest.raises(ConfigError, match="--profiles: nowhere is not a folder"):
        profile_dirs("nowhere", tmp_path / "o")

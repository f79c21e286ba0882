"""Accuracy tasks, the evaluation harness, confidence intervals, accuracy tables and their use in planning."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tangram.errors import ConfigError, InputError
from tangram.profiles import stats
from tangram.profiles.accuracy import AccuracyModel, AccuracyTable
from tangram.profiles.tasks import MULTIKEY_NEEDLES, TASKS, doc_lines, doc_split_of, make_task, make_text

# ------------------------------------------------------------------ tasks


def _needles(s):
    return [q.answer for q in s.questions]


def test_tasks_are_seeded_and_their_answers_are_in_the_context():
    for task in TASKS:
        for i in range(3):
            a = make_task(task, "heldout", i, 300, n_turns=3)
            assert a == make_task(task, "heldout", i, 300, n_turns=3)  # replayable
            for q in a.questions:
                if task == "vt":  # the chain's first variable holds the value; the others point to it
                    value = re.search(r"value (\d+)\?", q.text).group(1)
                    assert f"VAR {q.answer} = {value}." in a.context
                    assert q.answer_prefix.endswith("VAR") and len(a.meta["chain"]) == 3
                    for x, y in zip(a.meta["chain"], a.meta["chain"][1:]):
                        assert f"VAR {y} = VAR {x}." in a.context
                elif task == "passkey":
                    assert f"The pass key is {q.answer}." in a.context and len(q.answer) == 5
                else:  # needle: key and 7-digit value, asked with the key
                    key = re.search(r"number for (\S+)\?", q.text).group(1)
                    assert f"One of the special magic numbers for {key} is: {q.answer}." in a.context
                    assert len(q.answer) == 7 and q.answer_prefix.endswith(f"{key} is")
        mt = make_task("mt_niah", "heldout", 0, 300, n_turns=3)
        assert len(mt.questions) == 3 and len(set(_needles(mt))) == 3
        assert mt.user_message(0).startswith(mt.context) and mt.user_message(1) == mt.questions[1].text
    multi = make_task("niah_multikey", "heldout", 1, 300)
    assert multi.context.count("One of the special magic numbers for") == MULTIKEY_NEEDLES == 2


def test_documentation_haystack_is_the_shipped_text_not_the_interpreters(monkeypatch, tmp_path):
    """Samples must not depend on the Python that generates them: another interpreter's pydoc_data.topics (its text
    differs between versions) changes nothing, the snapshot is byte-stable, and a broken file is named."""
    import sys
    import types

    from tangram.errors import ConfigError
    from tangram.profiles import tasks

    before = (doc_lines("calib"), doc_lines("heldout"), make_task("niah_single", "heldout", 3, 300).context)
    fake = types.ModuleType("pydoc_data.topics")
    fake.topics = {"other": "text of another Python\n" * 500}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", fake)
    for f in (tasks.doc_topics, tasks.doc_lines):
        f.cache_clear()
    assert (doc_lines("calib"), doc_lines("heldout"), make_task("niah_single", "heldout", 3, 300).context) == before
    assert tasks.write_doc_topics(tmp_path / "fake.json.gz").exists()  # the snapshot reads the interpreter's
    monkeypatch.setattr(tasks, "DOC_TOPICS", tmp_path / "fake.json.gz")
    tasks.doc_topics.cache_clear()
    assert tasks.doc_topics() == fake.topics
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    monkeypatch.setattr(tasks, "DOC_TOPICS", tmp_path / "bad.json.gz")
    tasks.doc_topics.cache_clear()
    with pytest.raises(ConfigError, match="bad.json.gz"):
        tasks.doc_topics()
    monkeypatch.undo()
    for f in (tasks.doc_topics, tasks.doc_lines):
        f.cache_clear()
    assert tasks.write_doc_topics(tmp_path / "again.json.gz").read_bytes() == tasks.DOC_TOPICS.read_bytes() \
        or sys.version_info[:2] != (3, 11)  # byte-stable on the Python it was made with


def test_splits_share_no_documentation_topic_and_no_needle():
    from tangram.profiles.tasks import doc_topics
    topics = doc_topics()
    sides = {doc_split_of(t) for t in topics}
    assert sides == {"calib", "heldout"}
    held, calib = set(doc_lines("heldout")), set(doc_lines("calib"))
    assert len(held) > 100 and len(calib) > 100
    for task in ("passkey", "niah_single"):
        a = {make_task(task, "calib", i, 200).questions[0].answer for i in range(20)}
        b = {make_task(task, "heldout", i, 200).questions[0].answer for i in range(20)}
        assert not a & b


def test_length_is_fitted_with_the_measure():
    measure = lambda s: len(s.context) // 3 + 20  # noqa: E731 - any monotone count
    for task in ("passkey", "niah_multikey"):
        s = make_task(task, "heldout", 2, 400, measure=measure)
        n = s.meta["units"]
        assert measure(s) <= 400
        bigger = make_task(task, "heldout", 2, 10_000, measure=measure)
        assert bigger.meta["units"] > n and _needles(bigger) == _needles(s)  # needles do not depend on length
    with pytest.raises(ConfigError):
        make_task("nope", "heldout", 0, 300)


def test_text_passages_are_token_exact():
    enc = lambda t: [ord(c) for c in t]  # noqa: E731 - a character "tokenizer"
    dec = lambda ids: "".join(map(chr, ids))  # noqa: E731
    s = make_text("heldout", 3, 50, 7, encode=enc, decode=dec)
    assert len(s.meta["context_ids"]) == 50 and len(s.meta["continuation_ids"]) == 7
    assert s.context + s.continuation in "\n".join(doc_lines("heldout") * 2)


# ------------------------------------------------------------------ confidence intervals


def test_wilson_matches_the_closed_form():
    for k, n in ((8, 10), (0, 7), (100, 100), (37, 120)):
        z = 1.959963984540054
        p = k / n
        den = 1 + z * z / n
        c = (p + z * z / (2 * n)) / den
        h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
        lo, hi = stats.wilson(k, n)
        assert lo == pytest.approx(max(0.0, c - h), abs=1e-9) and hi == pytest.approx(min(1.0, c + h), abs=1e-9)
    assert all(math.isnan(x) for x in stats.wilson(0, 0))


def test_bootstrap_intervals():
    assert stats.bootstrap_mean([0.2] * 9) == (0.2, 0.2)
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 1.0, 400)
    lo, hi = stats.bootstrap_mean(x, seed=1)
    se = x.std(ddof=1) / math.sqrt(x.size)  # the t interval and the bootstrap agree on a large normal sample
    assert lo == pytest.approx(x.mean() - 1.96 * se, abs=0.4 * se) and hi == pytest.approx(x.mean() + 1.96 * se,
                                                                                            abs=0.4 * se)
    d, dlo, dhi = stats.paired_difference([1, 1, 1, 0], [0, 1, 1, 0])
    assert d == 0.25 and dlo <= 0.25 <= dhi and dlo >= 0
    m, mlo, mhi = stats.stratified_mean([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert m == 0.75 and mlo <= 0.75 <= mhi and mlo >= 0.5  # the all-ones task never resamples below 1
    assert stats.verdict(0.01, 0.2) == "higher" and stats.verdict(-0.2, 0.1) == "no significant difference"


def _wilson_low(k, n, z=1.959963984540054):
    p = k / n
    den = 1 + z * z / n
    return (p + z * z / (2 * n)) / den - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den


def test_length_choice_is_the_longest_whose_lower_bound_clears_the_floor():
    from tangram.profiles.accuracy_report import choose_length
    v = lambda k, n: [True] * k + [False] * (n - k)  # noqa: E731
    # 95/100 -> lower bound 0.888; 85/100 -> 0.767 (passes on the point estimate, not on the bound); 17/20 -> 0.640
    assert _wilson_low(95, 100) > 0.8 > _wilson_low(85, 100) and _wilson_low(17, 20) < 0.8
    pts = {256: [v(20, 20)], 512: [v(95, 100)], 768: [v(17, 20)], 1024: [v(85, 100)]}
    c = choose_length(pts, 0.8)
    assert c["length"] == 512 and c["passed"] and c["lower_bound"] == pytest.approx(_wilson_low(95, 100), abs=1e-9)
    assert c["bounds"][1024] == pytest.approx(_wilson_low(85, 100), abs=1e-9)
    # every reported outcome must clear it (mt_niah: first turn and follow-up)
    two = {512: [v(99, 100), v(84, 100)], 256: [v(97, 100), v(96, 100)]}
    assert choose_length(two, 0.8)["length"] == 256
    # nothing clears it: the highest lower bound, flagged
    bad = {512: [v(70, 100)], 1024: [v(78, 100)]}
    c = choose_length(bad, 0.8)
    assert c["length"] == 1024 and not c["passed"]
    assert choose_length(bad, 0.5)["length"] == 1024 and choose_length(bad, 0.5)["passed"]


# ------------------------------------------------------------------ accuracy tables


def _table(model="m", rows=None) -> AccuracyTable:
    rows = rows or [
        {"task": "mean", "metric": "accuracy", "policy": "full", "kv_share": 1.0, "value": 0.9},
        *({"task": "mean", "metric": "accuracy", "policy": "tangram", "scorer": "s", "scope": "per-layer",
           "kv_share": x, "value": y} for x, y in ((0.2, 0.3), (0.4, 0.7), (0.7, 0.85))),
        {"task": "mean", "metric": "accuracy", "policy": "dynamic", "scorer": "s", "scope": "per-layer",
         "kv_share": 0.4, "value": 0.5},
        {"task": "mean", "metric": "accuracy", "policy": "dynamic", "scorer": "s", "scope": "per-layer",
         "kv_share": 0.4, "value": 0.7}]
    return AccuracyTable(model, rows, {"command": "hand"}, {"t": {}})


def test_table_interpolation_is_monotone_exact_at_points_and_refuses_extrapolation(tmp_path):
    t = AccuracyTable.load(_table().save(tmp_path / "a.json"))  # round trip through the file
    for x, y in ((0.2, 0.3), (0.4, 0.7), (0.7, 0.85), (1.0, 0.9)):
        assert t.at(x, "tangram", "s", "per-layer").value == pytest.approx(y)
    grid = np.linspace(0.2, 1.0, 81)
    v = [t.at(x, "tangram", "s", "per-layer").value for x in grid]
    assert all(a <= b + 1e-12 for a, b in zip(v, v[1:]))  # PCHIP keeps monotone data monotone (no overshoot)
    assert all(0.3 - 1e-12 <= a <= 0.9 + 1e-12 for a in v)
    e = t.at(0.1, "tangram", "s", "per-layer")
    assert e.value is None and "below the measured range" in e.source
    assert t.at(0.195, "tangram", "s", "per-layer").value == pytest.approx(0.3)  # ceil slack: the first point
    assert t.at(0.55, "tangram", "s", "per-layer").relative == pytest.approx(
        t.at(0.55, "tangram", "s", "per-layer").value / 0.9)
    assert t.at(0.4, "dynamic", "s", "per-layer").value == pytest.approx(0.6)  # duplicates are averaged
    assert t.at(0.5, "tangram", "other", "per-layer").value is None


def test_bad_table_file_names_the_field(tmp_path):
    p = tmp_path / "bad.json"
    d = _table().to_dict()
    d["rows"][2]["value"] = "high"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError, match=r"rows\[2\]\.value"):
        AccuracyTable.load(p)
    p.write_text(json.dumps({"format": "nope"}))
    with pytest.raises(InputError, match="format"):
        AccuracyTable.load(p)


def test_accuracy_model_says_when_not_measured_and_labels_borrowing(tmp_path):
    from tangram.budgets import synthetic_profile
    prof = synthetic_profile(4, 8, 0.25, seed=1)
    acc, label = AccuracyModel.for_run("no-such-model", prof)
    assert acc is None and "accuracy not measured for no-such-model" in label
    path = _table("m").save(tmp_path / "t.json")
    acc, label = AccuracyModel.for_run("other", prof, str(path))
    assert acc.borrowed and "borrowed for other" in label and "'synthetic' not in the table" in label
    e = acc.estimate("tangram", prof, 2.0, 0.25)
    assert e.kv_share == pytest.approx(prof.B.mean()) and e.value is not None
    assert acc.estimate("full", prof, 2.0, 0.25).value == pytest.approx(0.9)
    assert acc.estimate("uniform", prof, 2.0, 0.25).value is None  # no uniform curve in the table


# ------------------------------------------------------------------ selection at a scope


def _ref_topk(x: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-x, kind="stable")[:k].tolist())


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 20)),
              elements=st.floats(-4, 4, width=32)), st.floats(0.01, 1.0))
def test_crosslayer_selection_is_the_global_topk(scores, rho):
    from tangram.profiles.evaluate import crosslayer_topk_mask
    m = crosslayer_topk_mask(torch.from_numpy(scores), rho).numpy()
    k = min(scores.size, max(1, math.ceil(rho * scores.size - 1e-9)))
    assert set(np.flatnonzero(m.ravel()).tolist()) == _ref_topk(scores.ravel(), k)


def test_memory_matched_controls_keep_tangrams_token_count():
    from tangram.profiles.evaluate import Mode
    rng = np.random.default_rng(3)
    L, H, T = 5, 3, 97
    B = rng.uniform(0.05, 1.0, (L, H))
    scores = torch.from_numpy(rng.normal(size=(L, H, T)))
    tang = Mode("tangram", "ada-snapkv", "per-layer", 0.3, alpha=2.0, budgets=B).select(scores)
    for policy, scope in (("dynamic", "per-layer"), ("dynamic", "cross-layer"), ("uniform", "uniform")):
        ctrl = Mode(policy, "ada-snapkv", scope, 0.3, match=B, match_label="tangram a=2").select(scores)
        # equal bytes up to rounding: per layer (per-layer), once (cross-layer) or per head (uniform)
        assert abs(int(ctrl.sum()) - int(tang.sum())) <= L * H
    assert int(tang.sum()) == sum(min(T, math.ceil(b * T)) for b in B.ravel())


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def smollm2():
    """The model as the harness's in-process worker holds it (the in-process CLI run below reuses it)."""
    from tangram.profiles import evaluate
    evaluate.init_worker("smollm2-135m", "auto", torch.get_num_threads(), [], {"dtype": "float32"})
    return evaluate._W["model"], evaluate._W["tok"]


def test_eval_backend_equals_the_reference_backend_with_poisoned_evictions(smollm2):
    from tangram.engine.model import TorchAttention
    from tangram.profiles.evaluate import EvalAttention, _forward
    model, _ = smollm2
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 49000, (90,), generator=g).tolist()
    ref, fast = TorchAttention(model.cfg), EvalAttention(model.cfg)
    assert torch.allclose(_forward(model, ref, ids[:60], 1, False), _forward(model, fast, ids[:60], 1, False),
                          atol=1e-4)
    for l in range(model.cfg.num_layers):
        keep = torch.rand(1, model.cfg.num_kv_heads, 60, generator=g) < 0.5
        ref.evict(l, 0, keep)
        fast.evict(l, 0, keep)
        fast.k[l] = torch.where(keep[..., None], fast.k[l], torch.full_like(fast.k[l], 1e4))  # poison evicted
    rows = EvalAttention.fork(fast, 2)
    a, b = _forward(model, ref, ids[60:], 1, False), _forward(model, rows, ids[60:], 2, False)
    assert torch.allclose(a[0], b[0], atol=1e-4) and torch.equal(b[0], b[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("evicted", [False, True])
def test_eval_attention_mask_is_the_explicit_one_bit_for_bit(dtype, evicted):
    """EvalAttention's attention over a cache (queries after earlier tokens) equals SDPA with the explicit
    [B, Hq, T, N] keep-and-causal bias bit for bit: with nothing evicted it passes the causal bias once, broadcast
    over rows and heads (KVzip's repeat, the full cache's rows); in query blocks when the bias is large."""
    import torch.nn.functional as F
    from tangram.engine.model import AttnContext
    from tangram.profiles import evaluate
    from tangram.profiles.evaluate import EvalAttention
    g = torch.Generator().manual_seed(11 + evicted)
    B, Hkv, grp, D, N0, T = 3, 2, 3, 16, 40, 7
    N = N0 + T
    q = torch.randn(B, Hkv * grp, T, D, generator=g).to(dtype)
    K, V = (torch.randn(B, Hkv, N, D, generator=g).to(dtype) for _ in range(2))
    keep = torch.ones(B, Hkv, N, dtype=torch.bool)
    if evicted:
        keep[:, :, :N0] = torch.rand(B, Hkv, N0, generator=g) < 0.6
    from tangram.config import get_model
    att = EvalAttention(get_model("smollm2-135m"))
    att.pos = torch.arange(N)
    ctx = AttnContext(torch.arange(N0, N))
    allowed = (keep[:, :, None, :] & (att.pos[None, None, None, :] <= ctx.input_pos[None, None, :, None]))
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).repeat_interleave(grp, 1)
    want = F.scaled_dot_product_attention(q, K, V, attn_mask=bias, scale=0.25, enable_gqa=True)
    assert torch.equal(att._attend(q, K, V, keep, ctx, 0.25), want)
    old = evaluate._MASK_BUDGET
    try:  # query blocks of 2 queries (each block is SDPA of those queries with their rows of the same bias)
        evaluate._MASK_BUDGET = 2 * (N if not evicted else B * Hkv * grp * N)
        blocks = [F.scaled_dot_product_attention(q[:, :, a:a + 2], K, V, attn_mask=bias[:, :, a:a + 2], scale=0.25,
                                                 enable_gqa=True) for a in range(0, T, 2)]
        assert torch.equal(att._attend(q, K, V, keep, ctx, 0.25), torch.cat(blocks, dim=2))
    finally:
        evaluate._MASK_BUDGET = old


def test_full_cache_solves_easy_instances_and_keep_all_modes_equal_it(smollm2):
    """Short passkey prompts: the full cache answers them; a tangram row whose budgets keep everything is the
    full cache (same verdicts, KL 0); teacher forcing agrees with free greedy decoding."""
    from tangram.profiles.evaluate import (Mode, answer_ids, build_task_sample, evaluate_sample, prompt_ids,
                                           word_continuation_mask)
    model, tok = smollm2
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    modes = [Mode("full"), Mode("tangram", "ada-snapkv", "per-layer", 1.0, alpha=0.0, budgets=np.ones((L, H))),
             Mode("dynamic", "ada-snapkv", "per-layer", 0.05)]
    cont = word_continuation_mask(tok, model.cfg.vocab)
    dec = lambda i: tok.decode(i, skip_special=True)  # noqa: E731
    for i in (0, 2):
        s = build_task_sample(tok, "passkey", "heldout", i, 256, 2)
        turns = [(prompt_ids(tok, s, 0), answer_ids(tok, s, 0))]
        assert tok.decode(turns[0][1]).strip() == s.questions[0].answer
        r = evaluate_sample(model, modes, turns, chunk=2048, batch=2, eos=tok.eos_id, continues=cont,
                            free_check=(8, dec))
        assert r.correct[0, 0] and r.correct[1, 0]
        assert r.free["prefix"] and r.free["tokens_equal"]
        assert r.kept[0] == 1.0 and r.kept[1] == 1.0 and r.kept[2] < 0.1
    from tangram.profiles.tasks import make_text
    s = make_text("heldout", 0, 64, 6, encode=tok.encode, decode=dec)
    r = evaluate_sample(model, modes, [(s.meta["context_ids"], None)], chunk=2048,
                        continuation=s.meta["continuation_ids"])
    assert r.kl[0] == 0 and r.kl[1] == pytest.approx(0, abs=1e-6) and r.kl[2] > 1e-3
    assert r.top1[1] == 1.0


def test_kvzip_modes_in_the_batched_evaluation_equal_a_one_sequence_reference(smollm2):
    """KVzip runs a repeat forward after each chunk: in the report's batched evaluation (shared first chunk,
    forked rows, the repeat fed to every row) the KL of two kvzip rows equals a batch-1 reference on the
    reference backend that scores, selects and evicts chunk by chunk with one scorer."""
    from tangram.engine.model import Session, TorchAttention
    from tangram.profiles.evaluate import Mode, evaluate_sample
    from tangram.profiles.scoring import make_scorer
    model, tok = smollm2
    L = model.cfg.num_layers
    dec = lambda i: tok.decode(i, skip_special=True)  # noqa: E731
    s = make_text("heldout", 3, 90, 6, encode=tok.encode, decode=dec)
    ids, cont = s.meta["context_ids"], s.meta["continuation_ids"]
    modes = [Mode("full"), Mode("dynamic", "kvzip", "per-layer", 0.5), Mode("dynamic", "kvzip", "per-layer", 0.25)]
    r = evaluate_sample(model, modes, [(ids, None)], chunk=40, batch=2, continuation=cont, tokenizer=tok)
    full = torch.log_softmax(Session(model).forward(ids + cont)[len(ids):].float(), -1)
    for i, m in enumerate(modes[1:], 1):
        sc = make_scorer("kvzip", L, tokenizer=tok)
        sess = Session(model, TorchAttention(model.cfg, observers=[sc]))
        for a in range(0, len(ids), 40):
            piece = ids[a:a + 40]
            sess.forward(piece, last_only=True)
            if len(piece) >= sc.min_tokens:
                sc.after_chunk(sess, piece)
                mask = m.select(sc.take()[:, 0])
                for l in range(L):
                    sess.backend.evict(l, a, mask[l][None])
        sc.enabled = False
        lp = torch.log_softmax(sess.forward(cont).float(), -1)
        kl = float((full.exp() * (full - lp)).sum(-1).mean())
        assert r.kl[i] == pytest.approx(kl, rel=1e-3, abs=1e-5)
    assert r.kl[2] > r.kl[1] > 0  # keeping less moves the distribution further


def _many_modes(L, H, scorers, seed=0):
    from tangram.profiles.evaluate import Mode
    rng = np.random.default_rng(seed)
    modes = [Mode("full")]
    for s in scorers:
        B = rng.uniform(0.2, 1.0, (L, H))
        modes += [Mode("uniform", s, "uniform", 0.5), Mode("dynamic", s, "per-layer", 0.5),
                  *([] if s == "pyramidkv" else [Mode("dynamic", s, "cross-layer", 0.25)]),
                  Mode("uniform", s, "uniform", 0.999),
                  Mode("tangram", s, "per-layer", 0.5, alpha=2.0, budgets=B),
                  Mode("tangram", s, "per-layer", 1.0, alpha=0.0, budgets=np.ones((L, H))),  # keeps everything
                  Mode("dynamic", s, "per-layer", 0.5, match=B, match_label="tangram a=2"),
                  Mode("uniform", s, "uniform", 0.5, match=B, match_label="tangram a=2 per-layer")]
    return modes


def test_shared_state_evaluation_equals_one_row_per_mode(smollm2):
    """The report's evaluation shares a row between modes whose selections are equal and scores each chunk once
    per state; the reference gives every mode its own row. Same verdicts, first wrong positions, kept shares
    and KL on a multi-turn sample split into several chunks (rows split at later chunks), a one-chunk sample
    and a KL passage, with scorers whose scores coincide (pyramidkv's are SnapKV's; its selections follow its
    layer schedule) and KVzip."""
    from accuracy_reference import evaluate_sample_per_mode
    from tangram.profiles.evaluate import answer_ids, build_task_sample, evaluate_sample, prompt_ids
    from tangram.profiles.evaluate import word_continuation_mask
    model, tok = smollm2
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    modes = _many_modes(L, H, ["ada-snapkv", "pyramidkv", "kvzip"])
    cont = word_continuation_mask(tok, model.cfg.vocab)
    dec = lambda i: tok.decode(i, skip_special=True)  # noqa: E731
    cases = []
    s = build_task_sample(tok, "mt_niah", "heldout", 1, 160, 2)
    cases.append(([(prompt_ids(tok, s, t), answer_ids(tok, s, t)) for t in range(2)], None, 48))
    s = build_task_sample(tok, "passkey", "heldout", 0, 140, 2)
    cases.append(([(prompt_ids(tok, s, 0), answer_ids(tok, s, 0))], None, 2048))
    t = make_text("heldout", 2, 100, 5, encode=tok.encode, decode=dec)
    cases.append(([(t.meta["context_ids"], None)], t.meta["continuation_ids"], 40))
    for turns, cont_ids, chunk in cases:
        kw = dict(chunk=chunk, eos=tok.eos_id, continues=cont, continuation=cont_ids, tokenizer=tok,
                  free_check=(8, dec) if cont_ids is None else None)
        ref = evaluate_sample_per_mode(model, modes, turns, batch=5, **kw)
        new = evaluate_sample(model, modes, turns, batch=3, **kw)
        np.testing.assert_array_equal(new.correct, ref.correct)
        np.testing.assert_array_equal(new.first_wrong, ref.first_wrong)
        np.testing.assert_allclose(new.kept, ref.kept, rtol=0, atol=1e-12)
        assert new.free == ref.free
        if cont_ids is not None:
            np.testing.assert_allclose(new.kl, ref.kl, rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(new.top1, ref.top1)
            assert len(set(np.round(new.kl, 6))) > 5  # the modes really differ
        else:
            assert 0 < new.correct.sum() < new.correct.size or new.first_wrong.max() >= 0
    assert len(cases[0][0]) == 2


def test_tiny_accuracy_run_writes_table_and_report(tmp_path, smollm2):
    from tangram.profiles.accuracy_report import main
    out = tmp_path / "acc"
    argv = ["--samples", "1", "--tasks", "mt_niah=200,passkey", "--kl-samples", "1", "--kl-context", "64",
            "--kl-continuation", "4", "--curve", "200", "--curve-samples", "1", "--scorers", "ada-snapkv",
            "--scopes", "per-layer,uniform", "--rhos", "0.5", "--calibrate-missing", "0", "--workers", "1",
            "--dtype", "float32", "--batch", "8", "--no-progress", "-o", str(out)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert len((out / "partial.jsonl").read_text().splitlines()) == 1 + 2 + 1  # fingerprint, 2 tasks, 1 KL passage
    assert len((out / "partial_curve.jsonl").read_text().splitlines()) == 1 + 2  # fingerprint, 2 curve samples
    with pytest.raises(SystemExit):  # a rerun of the same configuration resumes: nothing is recomputed
        main(argv)
    d = json.loads((out / "results.json").read_text())
    assert d["results"]["timings"]["resumed_samples"] == 5
    # passkey had no length: the curve chose it (one sample cannot clear 80%, so the best point, flagged)
    assert d["meta"]["tasks"] == {"mt_niah": 200, "passkey": 200}
    assert d["results"]["lengths"]["passkey"]["passed"] is False
    assert all(r["split"] == "calib" for r in [json.loads(x)["result"] for x in
                                                (out / "partial_curve.jsonl").read_text().splitlines()[1:]])
    t = AccuracyTable.load(out / "accuracy_smollm2-135m.json")
    assert t.provenance["command"].startswith("tangram-accuracy") and t.full() is not None
    assert {"tangram", "dynamic", "uniform", "full"} <= {x["policy"] for x in t.rows}
    assert any(x["metric"] == "kl" for x in t.rows) and all(x["ci_low"] <= x["value"] <= x["ci_high"]
                                                           for x in t.rows if x["ci_low"] is not None)
    md = (out / "report.md").read_text()
    assert "same KV bytes" in md and "[" in md and "Wilson" in md
    assert "![accuracy vs context length](curve.png)" in md and (out / "curve.png").is_file()
    # a run without a curve (--curve ''; lengths fixed by --tasks) says so: no empty table, no missing image
    d["results"]["raw"]["curve"] = []
    (out / "results.json").write_text(json.dumps(d))
    (out / "curve.png").unlink()
    with pytest.raises(SystemExit):
        main(["--report-only", "-o", str(out)])
    md = (out / "report.md").read_text()
    assert "No curve was measured" in md and "curve.png" not in md and "| task |  |" not in md
    bad = subprocess.run([sys.executable, "-m", "tangram.profiles.accuracy_report", "--scopes", "diagonal", "-o",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "diagonal" in bad.stderr


def test_resume_never_reuses_a_sample_of_an_earlier_task_definition(tmp_path):
    """A task whose definition changed (its TASK_VERSIONS entry went up) is measured again on resume; rows of
    unchanged tasks are kept; new rows carry their version and are found again."""
    from tangram.profiles.accuracy_report import _Book
    from tangram.profiles.tasks import task_version
    assert task_version("niah_multikey") == 2 and task_version("passkey") == 1
    path, fp = tmp_path / "partial.jsonl", {"x": 1}
    old = {"kind": "task", "task": "niah_multikey", "index": 0, "length": 512, "correct": [True]}  # v1: no field
    same = {"kind": "task", "task": "passkey", "index": 0, "length": 512, "correct": [True]}
    path.write_text("\n".join(json.dumps(x) for x in (
        {"fingerprint": json.dumps(fp, sort_keys=True)},
        {"job": ["task", "niah_multikey", 0, 512], "result": old},
        {"job": ["task", "passkey", 0, 512], "result": same})) + "\n")
    b = _Book(path, fp, fresh=False)
    assert b.has(("task", "passkey", 0, 512)) and not b.has(("task", "niah_multikey", 0, 512))
    assert [r["task"] for r in b.done.values()] == ["passkey"]
    b.add({**old, "task_version": 2})
    b.close()
    again = _Book(path, fp, fresh=False)
    assert again.has(("task", "niah_multikey", 0, 512)) and len(again.done) == 2


def test_pyramidkv_modes_follow_its_layer_schedule_as_the_engine_does():
    """The evaluation's dynamic and uniform selections are the engine's (kernels' scope_keep_mask): PyramidKV's
    layers keep their pyramid shares (not rho each, which made its rows SnapKV's), other scorers rho per layer;
    pyramidkv has no cross-layer mode and no cross-layer profile is asked for."""
    from tangram.budgets import pyramid_ratios
    from tangram.profiles.evaluate import Mode, ProfileStore, build_modes
    from tangram.profiles.scoring import budget_tokens
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    L, H, T, rho = 6, 3, 64, 0.25
    scores = torch.from_numpy(rng.standard_normal((L, H, T)))
    want = budget_tokens(pyramid_ratios(L, rho), H * T)  # kept per layer, over its heads
    got = Mode("dynamic", "pyramidkv", "per-layer", rho).select(scores).sum(dim=(1, 2)).numpy()
    assert (got == want).all() and len(set(got.tolist())) > 1
    uni = Mode("uniform", "pyramidkv", "uniform", rho).select(scores).sum(-1).numpy()  # [L, H]
    assert (uni == budget_tokens(pyramid_ratios(L, rho), T)[:, None]).all()
    snap = Mode("dynamic", "ada-snapkv", "per-layer", rho).select(scores).sum(dim=(1, 2)).numpy()
    assert (snap == int(np.ceil(rho * H * T))).all()
    modes, notes = build_modes(L, H, ["pyramidkv"], ["per-layer", "cross-layer", "uniform"], [rho], [2.0],
                               ProfileStore("nomodel", []))
    assert not any(m.scope == "cross-layer" for m in modes) and any("cross-layer: skipped" in n for n in notes)


def test_replace_scorer_rows_from_a_remeasurement(tmp_path):
    """A re-measured scorer's rows replace the base table's (and only those), recorded in the provenance; a table
    of other tasks or lengths is refused in one line naming the file."""
    from tangram.profiles.accuracy import AccuracyTable, main
    row = lambda sc, v: {"policy": "dynamic" if sc else "full", "scorer": sc, "scope": "per-layer" if sc else None,  # noqa: E731
                         "rho": 0.5, "alpha": None, "matched_to": None, "kv_share": 0.5, "task": "mean",
                         "metric": "accuracy", "value": v, "ci_low": v, "ci_high": v, "ci_method": "x", "n": 1}
    tasks = {"passkey": {"context_tokens": 512}}
    base = AccuracyTable("m", [row(None, 0.9), row("a", 0.5), row("p", 0.1)], {"command": "base"}, tasks)
    other = AccuracyTable("m", [row(None, 0.8), row("p", 0.7)], {"command": "re", "date": "d"}, tasks)
    bp, op = base.save(tmp_path / "b.json"), other.save(tmp_path / "o.json")
    assert main(["replace-scorer", str(bp), str(op), "p", "-o", str(tmp_path / "m.json")]) == 0
    m = AccuracyTable.load(tmp_path / "m.json")
    assert sorted((r["scorer"], r["value"]) for r in m.rows if r["scorer"]) == [("a", 0.5), ("p", 0.7)]
    assert m.full() == 0.9 and m.provenance["replaced"][0]["command"] == "re"
    AccuracyTable("m", other.rows, {}, {"passkey": {"context_tokens": 1024}}).save(tmp_path / "x.json")
    assert main(["replace-scorer", str(bp), str(tmp_path / "x.json"), "p"]) == 2
    assert AccuracyTable.load(bp).rows == base.rows  # a refused merge writes nothing


def test_greedy_takes_the_first_largest_logit_in_every_precision():
    """bfloat16 logits are compared through float32 (faster on the CPU): the argmax must stay the first largest
    entry, ties included (bfloat16 rounds many neighbouring logits to one value)."""
    from tangram.profiles.evaluate import greedy
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 3, 300, generator=g) * 0.01).round(decimals=2)  # many ties
    for dt in (torch.bfloat16, torch.float32):
        y = x.to(dt)
        want = torch.tensor([[max(range(300), key=lambda i: (float(y[a, b, i]), -i)) for b in range(3)]
                             for a in range(5)])
        assert torch.equal(greedy(y), want)
        assert torch.equal(greedy(y[0, 0]), want[0, 0])


# ------------------------------------------------------------------ numerics of the task model


def test_resume_never_reuses_a_sample_computed_in_other_numerics(tmp_path):
    """The task model's numerics (--dtype) are part of every task/curve row's resume key and are checked on the
    row: a file holding rows of several numerics under one fingerprint (files merged from several runs) feeds each
    run only its own; rows without a label are the bfloat16 rows written before the label existed; KL rows run in
    float32 whatever --dtype says and are shared."""
    from tangram.profiles.accuracy_report import _Book, _job_of, _versioned
    from tangram.profiles.evaluate import NUMERICS
    assert len(NUMERICS) >= 3
    job = ["task", "passkey", 0, 512]
    base = {"kind": "task", "task": "passkey", "index": 0, "length": 512, "task_version": 1}
    keys = {n: json.dumps(_job_of({**base, "numerics": n})) for n in NUMERICS}
    assert len(set(keys.values())) == len(NUMERICS)  # the label is in the key
    assert all(json.dumps(_versioned(job, n)) == k for n, k in keys.items())
    assert _job_of(base) == job  # rows written before the label: bfloat16, key unchanged
    path, fp = tmp_path / "partial.jsonl", {"x": 1}
    rows = [(job, dict(base, correct=[[1]]))]  # a legacy bfloat16 row
    rows += [(_job_of(dict(base, numerics=n)), dict(base, numerics=n, correct=[[i]]))
             for i, n in enumerate(n for n in NUMERICS if n != "bfloat16")]
    rows.append((job, dict(base, numerics="bfloat16-f32compute", correct=[[7]])))  # mislabelled key: the row wins
    kl = {"kind": "kl", "task": "kl_text", "index": 0, "kl": [0.0]}
    rows.append((["kl", 0], kl))
    path.write_text("\n".join(json.dumps(x) for x in [{"fingerprint": json.dumps(fp, sort_keys=True)}]
                              + [{"job": j, "result": r} for j, r in rows]) + "\n")
    for n in NUMERICS:
        b = _Book(path, fp, fresh=False, numerics=n)
        assert b.has(tuple(job)) and b.has(("kl", 0)) and len(b.done) == 2
        got = [r for r in b.done.values() if r["kind"] == "task"]
        assert len(got) == 1 and got[0].get("numerics", "bfloat16") == n
        b.close()
    b = _Book(path, fp, fresh=False, numerics="bfloat16")
    assert b.done[keys["bfloat16"]]["correct"] == [[1]]  # the legacy row, not the mislabelled one
    b.close()
    p2 = tmp_path / "p2.jsonl"
    b = _Book(p2, fp, fresh=False, numerics="bfloat16-f32compute")
    b.add(dict(base, numerics="bfloat16-f32compute", correct=[[1]]))
    b.close()
    assert _Book(p2, fp, fresh=False, numerics="bfloat16-f32compute").has(tuple(job))
    assert not _Book(p2, fp, fresh=False, numerics="bfloat16").has(tuple(job))
    assert not _Book(p2, fp, fresh=False, numerics="float32").has(tuple(job))


def _bf16_ulp_bound(ref: torch.Tensor, accum: torch.Tensor) -> torch.Tensor:
    """|out - ref| allowed for a float32-accumulated result rounded to bfloat16: half an ulp of bfloat16 (2^-8
    relative, round to nearest) plus the accumulation's error bound ``accum`` (Higham's gamma_n bound)."""
    return 2.0 ** -8 * ref.abs() + (1 + 2.0 ** -8) * accum


def test_f32compute_linear_equals_the_float64_reference_within_bfloat16_rounding():
    """bfloat16-f32compute's GEMM: the float64 product of the same bfloat16 inputs, rounded to bfloat16. Bound:
    |out - ref| <= 2^-8 |ref| + K 2^-24 sum_k |x_k w_k| (K = 576, SmolLM2's hidden size); the same bound holds for
    torch's bfloat16 kernel, and the two round to the same bfloat16 in almost every entry."""
    from torch import nn

    from tangram.profiles.evaluate import F32ComputeLinear
    g = torch.Generator().manual_seed(3)
    K, N = 576, 1536
    lin = nn.Linear(K, N, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    x = (torch.randn(3, 40, K, generator=g) * 2).to(torch.bfloat16)
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    accum = K * 2.0 ** -24 * ((x.double().abs() @ lin.weight.double().abs().T) + lin.bias.double().abs())
    native = lin(x)
    lin.__class__ = F32ComputeLinear
    lin.w32, lin.b32 = lin.weight.detach().float(), lin.bias.detach().float()
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= _bf16_ulp_bound(ref, accum)).all()
    assert ((native.double() - ref).abs() <= _bf16_ulp_bound(ref, 2 * accum)).all()
    assert (out == native).double().mean() > 0.98


def test_f32compute_attention_equals_the_float64_reference_and_caches_exact_values():
    """bfloat16-f32compute's attention (EvalAttention with a float32 cache): K/V cached as the exact float32 images
    of the bfloat16 keys and values (observers see the bfloat16 model's numbers), the output within bfloat16
    rounding (2^-8 relative: bfloat16 keeps 8 significant bits) plus 1e-5 of the float64 attention over the kept keys, evicted keys poisoned."""
    from tangram.config import get_model
    from tangram.engine.model import AttnContext
    from tangram.profiles.evaluate import EvalAttention
    cfg = get_model("smollm2-135m")
    H, Hq, D, T0, T1 = cfg.num_kv_heads, cfg.num_q_heads, cfg.head_dim, 50, 7
    g = torch.Generator().manual_seed(9)
    att = EvalAttention(cfg)
    att.kv_dtype = torch.float32
    seen = []
    att.observers = [lambda ev: seen.append(ev.k)]
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    q0, k0, v0 = bf(2, Hq, T0, D), bf(2, H, T0, D), bf(2, H, T0, D)
    out0 = att(0, q0, k0, v0, AttnContext(torch.arange(T0)))
    assert att.k[0].dtype == torch.float32 and torch.equal(att.k[0], k0.float()) and torch.equal(seen[0], k0.float())
    keep = torch.rand(2, H, T0, generator=g) < 0.5
    keep[..., 0] = True
    att.evict(0, 0, keep)
    att.k[0] = torch.where(keep[..., None], att.k[0], torch.full_like(att.k[0], 1e4))  # poison evicted keys
    q1, k1, v1 = bf(2, Hq, T1, D), bf(2, H, T1, D), bf(2, H, T1, D)
    out1 = att(0, q1, k1, v1, AttnContext(torch.arange(T0, T0 + T1)))
    assert out0.dtype == out1.dtype == torch.bfloat16
    gq = Hq // H
    for out, q, Kd, Vd, kp, qpos in (
            (out0, q0, k0.double(), v0.double(), torch.ones(2, H, T0, dtype=torch.bool), torch.arange(T0)),
            (out1, q1, torch.cat([k0, k1], 2).double(), torch.cat([v0, v1], 2).double(),
             torch.cat([keep, torch.ones(2, H, T1, dtype=torch.bool)], 2), torch.arange(T0, T0 + T1))):
        N = Kd.shape[2]
        s = torch.einsum("bhtd,bhnd->bhtn", q.double(), Kd.repeat_interleave(gq, 1)) / math.sqrt(D)
        ok = kp.repeat_interleave(gq, 1)[:, :, None, :] & (torch.arange(N)[None, None, None, :] <= qpos[:, None])
        ref = torch.softmax(s.masked_fill(~ok, -math.inf), -1) @ Vd.repeat_interleave(gq, 1)
        assert ((out.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5).all()


def test_f32compute_model_is_the_bfloat16_model_with_float32_gemms(smollm2):
    """numerics_model: bfloat16-f32compute holds the bfloat16 model's weights (state dict equal bit for bit), every
    linear layer computes in float32 from exact float32 copies of them, the KV cache is float32; its logits on a
    prompt agree with the bfloat16 model's about as closely as bfloat16 rounding allows (greedy tokens equal
    at >= 85% of positions of a random-token prompt, whose near ties flip; both far from float32 by the same order)."""
    from torch import nn

    from tangram.profiles.evaluate import EvalAttention, F32ComputeLinear, _forward, numerics_model
    model, _ = smollm2
    bf, fc = numerics_model(model, "bfloat16"), numerics_model(model, "bfloat16-f32compute")
    assert numerics_model(model, "float32") is model
    with pytest.raises(ConfigError):
        numerics_model(model, "float16")
    sb, sf = bf.state_dict(), fc.state_dict()
    assert sb.keys() == sf.keys() and all(torch.equal(sb[k], sf[k]) for k in sb)
    lins = [m for m in fc.modules() if isinstance(m, nn.Linear)]
    assert lins and all(type(m) is F32ComputeLinear and torch.equal(m.w32, m.weight.float()) for m in lins)
    assert not any(type(m) is F32ComputeLinear for m in bf.modules()) and fc.kv_dtype == torch.float32
    ids = torch.randint(0, 49000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    for name, m in (("bf", bf), ("fc", fc), ("f32", model)):
        att = EvalAttention(model.cfg)
        att.kv_dtype = getattr(m, "kv_dtype", None)
        with torch.no_grad():
            lg = _forward(m, att, ids[:40], 1, False).float()
            lg = torch.cat([lg, _forward(m, att, ids[40:], 1, False).float()], 1)
        out[name] = lg[0]
    assert (out["bf"].argmax(-1) == out["fc"].argmax(-1)).float().mean() >= 0.85
    d_bf, d_fc = (out["bf"] - out["f32"]).abs().mean(), (out["fc"] - out["f32"]).abs().mean()
    assert d_fc < 2 * d_bf and d_bf < 2 * d_fc


@pytest.mark.parametrize("argv,needle", [
    (["--alphas", "nan"], "--alphas: expected finite numbers"),
    (["--alphas", "inf"], "--alphas: expected finite numbers"),
    (["--alphas", ","], "--alphas must be margins >= 0"),
    (["--alphas", "-1"], "--alphas must be margins >= 0"),
    (["--rhos", "nan"], "--rhos"),
    (["--curve", "100.7"], "--curve: expected whole token counts"),
    (["--curve", "0"], "--curve: expected whole token counts"),
    (["--tasks", "passkey=0"], "passkey's length must be >= 1"),
    (["--kl-samples", "-1"], "--kl-samples must be >= 0, got -1"),
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_accuracy_cli_bad_values_name_their_option(argv, needle):
    """Each bad value is refused before any work, by the option it came in (NaN used to run a whole report)."""
    from tangram.profiles.accuracy_report import _resolve_lists, build_parser
    with pytest.raises(ConfigError) as e:
        _resolve_lists(build_parser().parse_args(argv + ["-o", "unused"]))
    assert needle in str(e.value)


def test_accuracy_cli_curve_lengths_in_exponent_form_are_whole_numbers():
    from tangram.profiles.accuracy_report import _resolve_lists, build_parser
    assert _resolve_lists(build_parser().parse_args(["--curve", "1e3,512", "-o", "unused"]))["curve"] == [512, 1000]

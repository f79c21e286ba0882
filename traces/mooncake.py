"""Import Mooncake request traces (FAST'25 release format) as multi-turn sessions with shared prefixes.

Source format (kvcache-ai/Mooncake, ``FAST25-release/traces/``: ``conversation_trace.jsonl``,
``toolagent_trace.jsonl``, ``synthetic_trace.jsonl``; the same schema is consumed by vLLM's and Dynamo's
trace-replay tools): one JSON object per line, ``timestamp`` (ms from trace start), ``input_length`` (the whole
prompt, history included), ``output_length`` and ``hash_ids`` (one id per 512-token block of the prompt, the
last block usually partial; equal ids = identical prefix up to and including that block).

Sessions are implicit. A follow-up's prompt is its parent's prompt + the parent's answer + new text, so its
``hash_ids`` start with **all complete blocks** of the parent's prompt (the parent's partial last block differs:
the answer was appended to it). The rules (docs/traces.md, "Mooncake importer"):

* **parent** of request C: the earlier request P whose complete blocks (``input_length // 512`` of them, at
  least one) are a prefix of C's ``hash_ids`` and with ``input_length(C) > input_length(P) + output_length(P)``;
  the one with the most complete blocks wins, then the most recent. A trie node continued by
  >= ``COMMON_FANOUT`` distinct complete blocks is a *shared prefix* (a system prompt, a popular document), as
  is every node whose only complete continuation is one: a request whose complete blocks end in a shared prefix
  cannot be told from an unrelated request with the same prefix, so it is never a parent;
* the first child (in time) continues the parent's session; a later child is a **branch**: a new session whose
  turn 0 carries the whole prompt;
* shared prefixes (system prompt, documents, a branched history) become ``prefix`` chains: the complete blocks a
  request shares with another session, cut into segments where sharing paths diverge, declared on every request
  that holds them (the earlier ones too), with ids derived from the block ids.

Everything is a few passes over a trie of block ids (dict lookups), O(total blocks); no pairwise scans.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

from tangram.errors import ConfigError, InputError

from .format import META_PREFIX, Trace, Turn, default_request_id, iter_json_lines
from .importing import ImportReport, check_policy, zero_tokens

BLOCK_TOKENS = 512
# A trie node continued by this many distinct complete blocks is a shared prefix rather than one conversation's
# history: a history is continued by its follow-up (1), at most by a second, branched follow-up too (2).
COMMON_FANOUT = 3
MAX_CANDIDATES = 16  # requests whose complete blocks end at the same node: the most recent this many are tried
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class MooncakeRequest:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    extra: dict  # keys beyond the four of the schema, kept as x_* metadata


def read_mooncake(path: str | os.PathLike, *, block_tokens: int = BLOCK_TOKENS, zero: str = "skip",
                  report: ImportReport | None = None) -> list[MooncakeRequest]:
    """Validated requests in file order; every problem is ``file:line: field: message``."""
    p = str(path)
    return _validate(iter_json_lines(p), p, block_tokens, zero, report)


def _validate(records, p: str, block_tokens: int, zero: str, report: ImportReport | None) -> list[MooncakeRequest]:
    check_policy(zero)
    rep = report if report is not None else ImportReport("mooncake", p)
    out = []
    for line, obj in records:
        rep.rows += 1
        if not isinstance(obj, dict):
            raise InputError(p, line, None, "expected a JSON object (one Mooncake request per line)")
        for k in FIELDS:
            if k not in obj:
                raise InputError(p, line, k, "missing required field")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise InputError(p, line, "timestamp", f"expected milliseconds >= 0, got {ts!r}")
        lens = []
        for k in ("input_length", "output_length"):
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InputError(p, line, k, f"expected an integer >= 0, got {v!r}")
            lens.append(v)
        h = obj["hash_ids"]
        if not isinstance(h, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in h):
            raise InputError(p, line, "hash_ids", "expected a list of integer block ids")
        need = -(-lens[0] // block_tokens)
        if len(h) != need:
            raise InputError(p, line, "hash_ids", f"{len(h)} block ids for input_length {lens[0]}: expected "
                                                  f"ceil({lens[0]}/{block_tokens}) = {need} (is the block size "
                                                  f"{block_tokens}?)")
        skip = False
        for j, k in enumerate(("input_length", "output_length")):
            if lens[j] < 1:
                fixed = zero_tokens(rep, zero, p, line, k, lens[j], "no answer" if j else "empty prompt")
                if fixed is None:
                    skip = True
                    break
                lens[j] = fixed
        if skip:
            continue
        extra = {(k if k.startswith(META_PREFIX) else META_PREFIX + k): v for k, v in obj.items() if k not in FIELDS}
        out.append(MooncakeRequest(line, float(ts), lens[0], lens[1], tuple(h), extra))
    if not out:
        raise InputError(p, None, None, "empty Mooncake trace: no requests")
    return out


@dataclass
class Links:
    """The session structure of time-sorted requests (indices into that order)."""

    parent: list[int]  # the request this one continues, or -1
    session: list[int]  # session number (first appearance order)
    turn: list[int]
    branch: list[bool]  # has a parent but starts a new session (the parent was already continued)
    prefix: list[tuple[tuple[str, int], ...]]  # shared-prefix chain per request


class _Trie:
    """Block-id trie over all requests: node ids grow along every path (a parent's id < its children's)."""

    def __init__(self, reqs: list[MooncakeRequest], block_tokens: int):
        child: dict[tuple[int, int], int] = {}
        self.parent: list[int] = []
        self.n_children: list[int] = []
        self.only_child: list[int] = []
        self.complete_children: list[int] = []
        self.edge_complete: list[bool] = []
        self.block: list[int] = []
        self.paths: list[list[int]] = []
        self.chained = True  # every block id sits at one node: ids name whole prefixes (Mooncake's are hashes)
        node_of_id: dict[int, int] = {}
        for r in reqs:
            node, path = -1, []
            c = r.input_length // block_tokens
            for j, b in enumerate(r.hash_ids):
                key = (node, b)
                nxt = child.get(key)
                if nxt is None:
                    nxt = child[key] = len(self.parent)
                    self.parent.append(node)
                    self.n_children.append(0)
                    self.only_child.append(-1)
                    self.complete_children.append(0)
                    self.edge_complete.append(False)
                    self.block.append(b)
                    if node >= 0:
                        self.n_children[node] += 1
                        self.only_child[node] = nxt
                    if node_of_id.setdefault(b, nxt) != nxt:
                        self.chained = False
                if j < c and not self.edge_complete[nxt]:
                    self.edge_complete[nxt] = True
                    if node >= 0:
                        self.complete_children[node] += 1
                path.append(nxt)
                node = nxt
            self.paths.append(path)
        n = len(self.parent)
        common = [self.complete_children[i] >= COMMON_FANOUT for i in range(n)]
        for i in range(n - 1, -1, -1):  # a node whose only complete continuation is shared is shared too
            p = self.parent[i]
            if common[i] and p >= 0 and self.edge_complete[i] and self.complete_children[p] == 1:
                common[p] = True
        self.common = common


def link_requests(reqs: list[MooncakeRequest], block_tokens: int = BLOCK_TOKENS) -> tuple[Links, _Trie]:
    """Parents, sessions, branches and prefix chains of time-sorted requests (module docstring)."""
    trie = _Trie(reqs, block_tokens)
    n = len(reqs)
    ends: dict[int, list[int]] = {}  # node -> requests (time order) whose complete blocks end there
    parent = [-1] * n
    for i, r in enumerate(reqs):
        path = trie.paths[i]
        for d in range(len(path), 0, -1):  # deepest candidate first
            nd = path[d - 1]
            lst = ends.get(nd)
            if not lst or trie.common[nd]:
                continue
            for k in range(len(lst) - 1, max(-1, len(lst) - 1 - MAX_CANDIDATES), -1):
                q = reqs[lst[k]]
                if q.input_length + q.output_length < r.input_length:
                    parent[i] = lst[k]
                    break
            if parent[i] >= 0:
                break
        c = r.input_length // block_tokens
        if c >= 1:
            ends.setdefault(path[c - 1], []).append(i)

    session, turn, branch = [0] * n, [0] * n, [False] * n
    continued = [False] * n
    n_sessions = 0
    for i in range(n):
        p = parent[i]
        if p >= 0 and not continued[p]:
            continued[p] = True
            session[i], turn[i] = session[p], turn[p] + 1
        else:
            session[i], turn[i], branch[i] = n_sessions, 0, p >= 0
            n_sessions += 1

    # shared prefixes: complete-block nodes held by requests of two or more sessions
    nn = len(trie.parent)
    first_sess = [-1] * nn
    multi = [False] * nn
    complete_end = [False] * nn
    for i, r in enumerate(reqs):
        c = r.input_length // block_tokens
        s = session[i]
        for nd in trie.paths[i][:c]:
            f = first_sess[nd]
            if f < 0:
                first_sess[nd] = s
            elif f != s:
                multi[nd] = True
        if c:
            complete_end[trie.paths[i][c - 1]] = True
    seg_cache: dict[tuple[int, int], str] = {}

    def seg_id(ids: tuple[int, ...]) -> str:
        sid = f"b{ids[0]}" if len(ids) == 1 else f"b{ids[0]}-{ids[-1]}"
        if not trie.chained:  # ids do not name whole prefixes: make the id name the run's blocks
            sid += "#" + hashlib.blake2b(repr(ids).encode(), digest_size=4).hexdigest()
        return sid

    prefix: list[tuple[tuple[str, int], ...]] = []
    for i, r in enumerate(reqs):
        path = trie.paths[i]
        c = r.input_length // block_tokens
        depth = 0
        while depth < c and multi[path[depth]]:
            depth += 1
        segs, start = [], 0
        for j in range(depth):
            nd = path[j]
            only = trie.only_child[nd]
            cut = (j == depth - 1 or complete_end[nd] or trie.n_children[nd] != 1 or not multi[only])
            if cut:
                key = (path[start], nd)
                sid = seg_cache.get(key)
                if sid is None:
                    sid = seg_cache[key] = seg_id(r.hash_ids[start:j + 1])
                segs.append((sid, (j + 1 - start) * block_tokens))
                start = j + 1
        prefix.append(tuple(segs))
    return Links(parent, session, turn, branch, prefix), trie


def _service_rate(spec: str | tuple[float, float] | None) -> tuple[float, float] | None:
    if spec is None or isinstance(spec, tuple):
        return spec
    parts = str(spec).split(":")
    try:
        v = tuple(float(x) for x in parts)
    except ValueError:
        v = ()
    if len(v) != 2 or not all(math.isfinite(x) and x > 0 for x in v):
        raise ConfigError(f"--service-rate needs PREFILL_TOKENS_PER_S:DECODE_TOKENS_PER_S (both > 0), got {spec!r}")
    return v  # type: ignore[return-value]


def import_mooncake(path: str | os.PathLike, *, block_tokens: int = BLOCK_TOKENS, zero: str = "skip",
                    service_rate: str | tuple[float, float] | None = None,
                    report: ImportReport | None = None) -> Trace:
    """Rebuild sessions, branches and shared prefixes from a Mooncake trace (rules: module docstring).

    Requests are taken in timestamp order (stable: file order on ties); out-of-order lines are sorted and
    counted in ``report``. ``think_time_s`` of a follow-up is the gap between its and its parent's timestamps,
    an upper bound on the user's think time (the trace is open loop: the gap includes the parent's service);
    ``service_rate=(prefill, decode)`` tokens/s subtracts an estimate of that service,
    ``input/prefill + output/decode`` seconds, floored at 0.
    """
    p = str(path)
    return _import(lambda rep: read_mooncake(p, block_tokens=block_tokens, zero=zero, report=rep), p,
                   block_tokens, service_rate, report)


def import_mooncake_records(records: list[dict], *, source: str = "<memory>", block_tokens: int = BLOCK_TOKENS,
                            zero: str = "skip", service_rate: str | tuple[float, float] | None = None,
                            report: ImportReport | None = None) -> Trace:
    """``import_mooncake`` of in-memory request dicts (e.g. ``generate_mooncake(...).records``); line = index + 1."""
    return _import(lambda rep: _validate(enumerate(records, start=1), source, block_tokens, zero, rep), source,
                   block_tokens, service_rate, report)


def _import(read, p: str, block_tokens, service_rate, report) -> Trace:
    rate = _service_rate(service_rate)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ConfigError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    rep = report if report is not None else ImportReport("mooncake", p)
    rep.format, rep.source = "mooncake", p
    raw = read(rep)
    late = [raw[i].line for i in range(1, len(raw)) if raw[i].timestamp_ms < raw[i - 1].timestamp_ms]
    reqs = sorted(raw, key=lambda r: r.timestamp_ms)
    if late:
        rep.notes.append(f"{len(late)} request(s) with a timestamp earlier than the line before (first at line "
                         f"{late[0]}): imported in timestamp order")
    links, trie = link_requests(reqs, block_tokens)
    turns: list[Turn] = []
    clipped = 0
    for i, r in enumerate(reqs):
        sid = f"mc{links.session[i]}"
        k = links.turn[i]
        meta = {"x_line": r.line, **r.extra}
        par = links.parent[i]
        if links.branch[i]:
            meta["x_branch_of"] = default_request_id(f"mc{links.session[par]}", links.turn[par])
        if k == 0:
            t = Turn(default_request_id(sid, 0), sid, 0, r.timestamp_ms / 1000.0, 0.0, r.input_length,
                     r.output_length, meta=meta, prefix=links.prefix[i])
        else:
            q = reqs[par]
            think = (r.timestamp_ms - q.timestamp_ms) / 1000.0
            if rate is not None:
                est = q.input_length / rate[0] + q.output_length / rate[1]
                if est > think:
                    clipped += 1
                think = max(0.0, think - est)
            t = Turn(default_request_id(sid, k), sid, k, None, round(think, 6),
                     r.input_length - q.input_length - q.output_length, r.output_length, meta=meta,
                     prefix=links.prefix[i])
        turns.append(t)
    n_sess = max(links.session) + 1
    cont = sum(1 for k in links.turn if k > 0)
    n_branch = sum(links.branch)
    with_prefix = sum(1 for x in links.prefix if x)
    # requests that share more than the common root prefix with another session without continuing it
    shared_only = sum(1 for i, x in enumerate(links.prefix) if links.parent[i] < 0 and len(x) > 1)
    rep.facts.update({"requests": len(reqs), "sessions": n_sess, "continuations": cont, "branches": n_branch,
                      "requests_with_shared_prefix": with_prefix,
                      "shared_prefix_tokens": sum(sum(n for _, n in x) for x in links.prefix),
                      "unlinked_sharing_beyond_first_segment": shared_only})
    if not trie.chained:
        rep.notes.append("block ids repeat under different prefixes (not prefix hashes): segment ids carry a "
                         "digest of their blocks")
    if rate is not None:
        rep.notes.append(f"think time = timestamp gap - (parent input/{rate[0]:g} + output/{rate[1]:g}) s; "
                         f"{clipped} follow-up(s) floored at 0")
    else:
        rep.notes.append("think_time_s = timestamp gap to the parent: an upper bound (it includes the parent's "
                         "service time; see --service-rate)")
    return Trace(turns, f"mooncake:{p}")

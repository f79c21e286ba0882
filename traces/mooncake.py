"""Import Mooncake request traces (FAST'25 release format) as multi-turn sessions.

A Mooncake line is one request: ``timestamp`` (ms), ``input_length`` (the whole
prompt, history included), ``output_length`` and ``hash_ids`` (ids of the
prompt's 512-token blocks; equal ids = identical prefix block). Sessions are
implicit: a request sharing a block-id prefix with an earlier request is the
next turn of that request's conversation. The rules (docs/traces.md):

* match: among earlier requests, the one sharing the longest block-id prefix
  (at least one block), the most recent on ties; found by walking a trie of
  block ids in O(len(hash_ids)) per request, no pairwise scans;
* no match: a new session, turn 0, ``arrival_s = timestamp / 1000``;
* match: the next turn of the matched request's session, after the session's
  latest turn ("previous turn"). ``think_time_s`` = gap between the two
  timestamps in seconds (open loop, so an upper bound on the real think time);
  ``new_tokens`` = input_length - (previous input_length + output_length)
  when that is >= 1, else input_length - 512 * shared prefix blocks, floored at 1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from tangram.errors import InputError

from .format import Trace, Turn, default_request_id, iter_json_lines

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class _Req:
    line: int
    ts_ms: float
    input_length: int
    output_length: int
    hash_ids: list


def _read_requests(path: str) -> list[_Req]:
    reqs = []
    for line, obj in iter_json_lines(path):
        if not isinstance(obj, dict):
            raise InputError(path, line, None, "expected a JSON object (one Mooncake request per line)")
        for k in ("timestamp", "input_length", "output_length", "hash_ids"):
            if k not in obj:
                raise InputError(path, line, k, "missing required field")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0 or ts == float("inf"):
            raise InputError(path, line, "timestamp", f"expected milliseconds >= 0, got {ts!r}")
        lens = []
        for k in ("input_length", "output_length"):
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(path, line, k, f"expected an integer >= 1, got {v!r}")
            lens.append(v)
        h = obj["hash_ids"]
        if not isinstance(h, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in h):
            raise InputError(path, line, "hash_ids", "expected a list of integer block ids")
        reqs.append(_Req(line, float(ts), lens[0], lens[1], h))
    if not reqs:
        raise InputError(path, None, None, "empty Mooncake trace: no requests")
    return reqs


def import_mooncake(path: str | os.PathLike) -> Trace:
    """Rebuild multi-turn sessions from a Mooncake trace; requests are taken in timestamp order (stable)."""
    p = str(path)
    reqs = sorted(_read_requests(p), key=lambda r: r.ts_ms)
    child: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node; node -1 is the root
    latest: list[int] = []  # node -> index of the most recent request whose prefix passes through it
    session_of: list[int] = []  # request index -> session number
    last_of_session: list[int] = []  # session number -> index of its latest request
    turn_no: list[int] = []  # request index -> turn number
    turns: list[Turn] = []
    for i, r in enumerate(reqs):
        node, depth = -1, 0
        for b in r.hash_ids:  # deepest existing trie node along this request's blocks
            nxt = child.get((node, b))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        meta = {"x_line": r.line, "x_input_length": r.input_length}
        if depth == 0:
            s = len(last_of_session)
            last_of_session.append(i)
            k = 0
            sid = f"mc{s}"
            t = Turn(default_request_id(sid, 0), sid, 0, r.ts_ms / 1000.0, 0.0, r.input_length, r.output_length,
                     0, None, 0, meta)
        else:
            s = session_of[latest[node]]
            prev = reqs[last_of_session[s]]
            k = turn_no[last_of_session[s]] + 1
            last_of_session[s] = i
            new = r.input_length - (prev.input_length + prev.output_length)
            if new < 1:
                new = max(1, r.input_length - BLOCK_TOKENS * depth)
            sid = f"mc{s}"
            meta["x_shared_blocks"] = depth
            t = Turn(default_request_id(sid, k), sid, k, None, (r.ts_ms - prev.ts_ms) / 1000.0, new,
                     r.output_length, 0, None, 0, meta)
        session_of.append(s)
        turn_no.append(k)
        turns.append(t)
        node = -1
        for b in r.hash_ids:  # insert / refresh this request's path
            key = (node, b)
            nxt = child.get(key)
            if nxt is None:
                nxt = child[key] = len(latest)
                latest.append(i)
            else:
                latest[nxt] = i
            node = nxt
    return Trace(turns, f"mooncake:{p}")

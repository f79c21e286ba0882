"""Session structure, distributions and sanity warnings of a trace (what ``tangram-trace stats`` prints).

The warnings catch a trace that validates but cannot mean what the user thinks: an importer that folded a whole
production trace into one endless session (the first Mooncake importer did: 12,031 turns, arrival span 0) is a
valid file, and only these checks say so.
"""
from __future__ import annotations

import numpy as np

from .format import Trace
from .generate import CATEGORIES, category_of

DEFAULT_MODEL = "llama-3.1-8b"  # the project's reference model (the paper's); its window is the default limit
MOST_OF_TRACE = 0.5  # one session holding more than this share of the turns ...
MOST_OF_TRACE_MIN_TURNS = 10  # ... in a trace of at least this many turns is suspicious


def default_max_context() -> int:
    from tangram.config import get_model

    return get_model(DEFAULT_MODEL).max_context


def _frame(trace: Trace):
    df = trace.to_frame()
    df["input_tokens"] = df["context_before"] + df["new_tokens"]
    return df


def sanity_warnings(trace: Trace, max_context: int | None = None, df=None) -> list[str]:
    """One line per problem; empty when the trace looks like a workload the model can serve."""
    limit = default_max_context() if max_context is None else int(max_context)
    df = _frame(trace) if df is None else df
    out = []
    n = len(df)
    final = df.groupby("session_id", sort=False)["context_after"].last()
    over = final[final > limit]
    if len(over):
        out.append(f"{len(over)} of {len(final)} sessions grow past the {limit:,}-token context window "
                   f"(largest: session {over.idxmax()!r}, {int(over.max()):,} tokens); later turns of such a "
                   f"session cannot be served without truncating its history")
    prompt_over = int((df["input_tokens"] > limit).sum())
    if prompt_over:
        out.append(f"{prompt_over} of {n} turns have a prompt (history + new tokens) longer than the {limit:,}-token "
                   f"context window: they cannot be prefilled")
    sizes = df.groupby("session_id", sort=False).size()
    big = int(sizes.max())
    if n >= MOST_OF_TRACE_MIN_TURNS and big > MOST_OF_TRACE * n:
        out.append(f"session {sizes.idxmax()!r} holds {big} of {n} turns ({100 * big / n:.0f}%): a trace of one "
                   f"endless conversation (did an importer fail to split sessions?)")
    arr = df.loc[df["turn"] == 0, "arrival_s"].to_numpy(dtype=float)
    if n > 1 and float(arr.max() - arr.min()) == 0.0:
        out.append(f"arrival span is 0 s: all {len(arr)} session(s) of the {n} requests arrive at t={arr[0]:g} s, "
                   f"so the trace has no arrival process (rate undefined)")
    return out


def _dist(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return {"count": 0}
    q = np.quantile(x, [0.0, 0.5, 0.9, 0.99, 1.0])
    return {"count": int(len(x)), "mean": round(float(x.mean()), 3), "min": float(q[0]), "p50": float(q[1]),
            "p90": float(q[2]), "p99": float(q[3]), "max": float(q[4])}


def _prefix_stats(trace: Trace) -> dict:
    """Declared vs distinct shared-prefix tokens (a segment is identified by its chain: docs/traces.md)."""
    node: dict[tuple, int] = {}
    distinct = declared = with_prefix = 0
    segments = []
    for t in trace.turns:
        if not t.prefix:
            continue
        with_prefix += 1
        cur = -1
        for sid, n in t.prefix:
            key = (cur, sid, n)
            nxt = node.get(key)
            if nxt is None:
                nxt = node[key] = len(node)
                distinct += n
            cur = nxt
            declared += n
        segments.append(len(t.prefix))
    return {"requests_with_shared_prefix": with_prefix, "shared_prefix_tokens": declared,
            "distinct_prefix_tokens": distinct, "reusable_prefix_tokens": declared - distinct,
            "distinct_prefix_segments": len(node)}


def summary(trace: Trace, max_context: int | None = None) -> dict:
    """Session structure, distributions, offered load and warnings of a trace (``stats --json``)."""
    limit = default_max_context() if max_context is None else int(max_context)
    df = _frame(trace)
    by = df.groupby("session_id", sort=False)
    sess = by.agg(turns=("turn", "size"), final_context=("context_after", "last"),
                  output_tokens=("output_tokens", "sum"))
    first = df[df["turn"] == 0]
    later = df[df["turn"] > 0]
    cats = category_of(sess["final_context"].to_numpy())
    arr = first["arrival_s"].to_numpy(dtype=float)
    span = float(arr.max() - arr.min())
    # the zero-service timeline: turn k of a session arrives at its arrival + the think times before it
    start = df["arrival_s"].groupby(df["session_id"], sort=False).transform("first")
    t_req = start + df["think_time_s"].groupby(df["session_id"], sort=False).cumsum()
    req_span = float(t_req.max() - t_req.min())
    branches = sum(1 for t in trace.turns if t.turn == 0 and "x_branch_of" in t.meta)
    return {
        "source": trace.source,
        "sessions": int(len(sess)),
        "turns": int(len(df)),
        "arrival_span_s": round(span, 6),
        "session_rate_per_s": round((len(sess) - 1) / span, 6) if span > 0 else None,
        "request_span_s": round(req_span, 6),
        "offered_request_rate_per_s": round((len(df) - 1) / req_span, 6) if req_span > 0 else None,
        "largest_session_turns": int(sess["turns"].max()),
        "single_turn_sessions": int((sess["turns"] == 1).sum()),
        "branches": branches,
        **_prefix_stats(trace),
        "categories": {c: int((cats == c).sum()) for c in CATEGORIES},
        "total_new_tokens": int(df["new_tokens"].sum()),
        "total_output_tokens": int(df["output_tokens"].sum()),
        "max_context": limit,
        "warnings": sanity_warnings(trace, limit, df),
        "distributions": {
            "turns_per_session": _dist(sess["turns"]),
            "final_context_tokens": _dist(sess["final_context"]),
            "input_tokens": _dist(df["input_tokens"]),
            "output_tokens": _dist(df["output_tokens"]),
            "first_turn_new_tokens": _dist(first["new_tokens"]),
            "followup_new_tokens": _dist(later["new_tokens"]),
            "shared_context_tokens": _dist(first["shared_context_tokens"]),
            "prefix_tokens": _dist(df.loc[df["prefix_tokens"] > 0, "prefix_tokens"]),
            "think_time_s": _dist(later["think_time_s"]),
        },
    }

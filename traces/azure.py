"""Import Azure LLM inference traces (Azure/AzurePublicDataset) as single-turn sessions.

Schema (AzureLLMInferenceDataset2023.md and AzureLLMInferenceDataset2024.md in github.com/Azure/AzurePublicDataset;
files ``AzureLLMInferenceTrace_{code,conv}.csv`` of 2023 (Splitwise, ISCA'24) and
``AzureLLMInferenceTrace_{code,conv}_1week.csv`` of 2024 (DynamoLLM)): CSV with header
``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is the invocation time as a date-time with sub-second
digits (e.g. ``2023-11-16 18:15:46.6805900``: seven fractional digits, more than Python keeps; a UTC offset may
follow), ContextTokens the prompt, GeneratedTokens the output.

The traces carry no session or prefix information, so every row is a session of one turn; ``arrival_s`` is the
row's time minus the earliest row's (microsecond resolution). Rows are sorted by time (stable); rows with 0
tokens follow the zero-token policy (importing.py).
"""
from __future__ import annotations

import os
import re

from .format import Trace
from .importing import (ImportReport, check_policy, iter_csv, one_turn_sessions, parse_datetime, parse_int,
                        zero_tokens)

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
def _meta_key(col: str) -> str:
    return "x_" + re.sub(r"[^0-9a-zA-Z]+", "_", col).strip("_").lower()


def import_azure(path: str | os.PathLike, *, zero: str = "skip", limit: int | None = None,
                 report: ImportReport | None = None) -> Trace:
    """Every row a one-turn session; ``limit`` keeps the first N data rows of the file."""
    p = str(path)
    check_policy(zero)
    rep = report if report is not None else ImportReport("azure", p)
    rep.format, rep.source = "azure", p
    rows = []
    with iter_csv(p, COLUMNS) as (header, it):
        extra = [h for h in header if h not in COLUMNS]
        for line, row in it:
            if limit is not None and rep.rows >= limit:
                break
            rep.rows += 1
            ts = parse_datetime(p, line, "TIMESTAMP", row["TIMESTAMP"])
            ctx = parse_int(p, line, "ContextTokens", row["ContextTokens"])
            gen = parse_int(p, line, "GeneratedTokens", row["GeneratedTokens"])
            if ctx < 1:
                ctx = zero_tokens(rep, zero, p, line, "ContextTokens", ctx, "empty prompt")
            if ctx is not None and gen < 1:
                gen = zero_tokens(rep, zero, p, line, "GeneratedTokens", gen, "no output")
            if ctx is None or gen is None:
                continue
            meta = {"x_line": line, **{_meta_key(h): row[h] for h in extra}}
            rows.append((ts, ctx, gen, meta))
    turns = one_turn_sessions(rows, "az", rep, p, "skipped")
    t0 = rows[0][0]  # sorted by time now
    rep.facts.update({"requests": len(turns), "sessions": len(turns),
                      "arrival_span_s": turns[-1].arrival_s, "t0": t0.isoformat(sep=" ")})
    rep.notes.append("no session or prefix data in this format: every request is a one-turn session")
    return Trace(turns, f"azure:{p}")

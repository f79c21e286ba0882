"""Import BurstGPT traces (github.com/HPMLL/BurstGPT) as single-turn sessions.

Schema (the repository's README, "Schema"; files ``data/BurstGPT_1.csv``, ``BurstGPT_without_fails_1.csv`` and
``_2``; release v2.0 adds ``BurstGPT_3.csv``): CSV with header
``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``. Timestamp: request submission time in
seconds from 0:00:00 of the first day; Model: ``ChatGPT`` or ``GPT-4``; Total tokens = request + response; Log
Type: ``Conversation log`` (the chat service) or ``API log``. The files without ``without_fails`` keep failed
requests, whose Response tokens are 0; rows with 0 request tokens exist too. Columns are found by name: the v2.0
files insert ``Session ID`` and ``Elapsed time`` after Timestamp; they (and any other extra column) are kept as
``x_*`` metadata.

Every row becomes a one-turn session: the README does not say whether a conversation's Request tokens include
its history, so rows are not chained into sessions (``x_session_id`` keeps the id). ``arrival_s`` = Timestamp
minus the earliest kept row's. ``log_type`` keeps only conversation or API rows (filtered rows are counted);
zero-token rows follow the zero-token policy and are always counted by kind.
"""
from __future__ import annotations

import os

from tangram.errors import ConfigError, InputError

from .azure import _meta_key
from .format import Trace
from .importing import ImportReport, check_policy, iter_csv, one_turn_sessions, parse_int, parse_seconds, zero_tokens

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
LOG_TYPES = {"all": None, "conversation": "Conversation log", "api": "API log"}


def import_burstgpt(path: str | os.PathLike, *, log_type: str = "all", zero: str = "skip",
                    limit: int | None = None, report: ImportReport | None = None) -> Trace:
    """Every kept row a one-turn session with ``x_model`` and ``x_log_type``; ``limit`` = first N data rows."""
    p = str(path)
    check_policy(zero)
    if log_type not in LOG_TYPES:
        raise ConfigError(f"log_type must be one of {', '.join(LOG_TYPES)}, got {log_type!r}")
    want = LOG_TYPES[log_type]
    rep = report if report is not None else ImportReport("burstgpt", p)
    rep.format, rep.source = "burstgpt", p
    zero_req = zero_resp = zero_both = mismatch = 0
    kinds: dict[str, int] = {}
    rows = []
    with iter_csv(p, COLUMNS) as (header, it):
        extra = [h for h in header if h not in COLUMNS]
        for line, row in it:
            if limit is not None and rep.rows >= limit:
                break
            rep.rows += 1
            ts = parse_seconds(p, line, "Timestamp", row["Timestamp"])
            req = parse_int(p, line, "Request tokens", row["Request tokens"])
            resp = parse_int(p, line, "Response tokens", row["Response tokens"])
            total = parse_int(p, line, "Total tokens", row["Total tokens"])
            lt = row["Log Type"].strip()
            model = row["Model"].strip()
            if not model:
                raise InputError(p, line, "Model", "empty model name")
            if not lt:
                raise InputError(p, line, "Log Type", "empty log type (expected 'Conversation log' or 'API log')")
            kinds[lt] = kinds.get(lt, 0) + 1
            mismatch += total != req + resp
            zero_req += req == 0 and resp > 0
            zero_resp += resp == 0 and req > 0
            zero_both += req == 0 and resp == 0
            if want is not None and lt != want:
                rep.skip(f"Log Type {lt!r} (--log-type {log_type})")
                continue
            if req < 1:
                req = zero_tokens(rep, zero, p, line, "Request tokens", req, "empty prompt")
            if req is not None and resp < 1:
                resp = zero_tokens(rep, zero, p, line, "Response tokens", resp, "no response: a failed request")
            if req is None or resp is None:
                continue
            meta = {"x_line": line, "x_model": model, "x_log_type": lt}
            for h in extra:
                v = row[h].strip()
                if h == "Elapsed time" and v:
                    try:
                        meta["x_elapsed_s"] = float(v)
                        continue
                    except ValueError:
                        pass
                if v:
                    meta[_meta_key(h)] = v
            rows.append((ts, req, resp, meta))
    turns = one_turn_sessions(rows, "bg", rep, p, "filtered or skipped")
    t0 = rows[0][0]  # sorted by time now
    rep.facts.update({"requests": len(turns), "sessions": len(turns), "log_types": kinds,
                      "rows_with_zero_request_tokens": zero_req, "rows_with_zero_response_tokens": zero_resp,
                      "rows_with_zero_request_and_response_tokens": zero_both, "t0_timestamp_s": t0})
    if mismatch:
        rep.notes.append(f"{mismatch} row(s) whose Total tokens != Request tokens + Response tokens (kept; Total "
                         f"is not used)")
    rep.notes.append("no session or prefix data is used: every request is a one-turn session")
    return Trace(turns, f"burstgpt:{p}")

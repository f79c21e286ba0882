"""Which format a trace file is in, and reading any supported format as a :class:`~.format.Trace`.

``tangram-sim trace.jsonl`` is the product's front door: a user who downloads a public trace runs it on that file
first. Tools that read a trace (``tangram-sim``, ``tangram-tune``, ``tangram-validate``, ``tangram-bench``,
``tangram-trace check/stats``) therefore take our JSON-lines format and every format ``tangram-trace import``
converts, detected from the file's first record (``--trace-format`` names it instead). A public format is imported
on the fly with the importer's defaults, and the reader says so; to set an importer's options (Mooncake's block
size, the zero-token policy, ShareGPT's arrival rate, ...) import the file once with ``tangram-trace import``.

Detection reads only the head of the file (the first line, or its first 64 KiB for a JSON document):

* JSON lines whose first object has ``timestamp``, ``input_length`` and ``output_length``: Mooncake (FAST'25
  conversation, tool-agent and synthetic traces);
* any other JSON lines: ours (docs/traces.md; our loader names the first field it rejects);
* a JSON array, or JSON lines whose first object has ``conversations``, ``conversation`` (LMSYS-Chat-1M, WildChat)
  or ``messages``: ShareGPT-style;
* CSV whose header has ``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens``: Azure LLM inference (2023, 2024);
* CSV whose header has ``Request tokens`` and ``Response tokens``: BurstGPT.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from typing import Callable

from tangram.errors import InputError

from .format import Trace, load_trace
from .importing import ImportReport, open_text

OURS = "tangram"
FORMATS = ("mooncake", "azure", "burstgpt", "sharegpt")  # what tangram-trace import converts
TRACE_FORMATS = ("auto", OURS) + FORMATS
_HEAD_BYTES = 1 << 16  # characters

_NAMES = {"mooncake": "a Mooncake trace", "azure": "an Azure LLM inference trace", "burstgpt": "a BurstGPT trace",
          "sharegpt": "ShareGPT-style conversations", OURS: "a tangram trace"}


def _head(path: str) -> str:
    """The file's first characters (gunzipped when it is gzip data, as every reader accepts ``.gz``)."""
    import gzip
    import zlib

    try:
        with open_text(path) as f:
            f.reconfigure(errors="replace")  # a bad byte is the reader's to report, at its line
            return f.read(_HEAD_BYTES)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise InputError(path, None, None, f"corrupt gzip data: {e}") from None


def _json_keys(line: str) -> set[str] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return set(obj) if isinstance(obj, dict) else None


def detect_format(path: str | os.PathLike) -> str:
    """The file's format: ``"tangram"`` (ours) or one of :data:`FORMATS`. A file that is none of the public formats
    is taken as ours (so our loader reports its first problem with file, line and field), except text whose first
    line is a CSV header of none of them: an InputError naming the file, line 1 and the formats known."""
    p = str(path)
    head = _head(p)
    text = head.lstrip()
    if not text:
        return OURS  # the loader's "empty trace" error
    first = text.splitlines()[0].strip()
    if text[0] == "[":
        return "sharegpt"
    if text[0] == "{":
        keys = _json_keys(first)
        if keys is None:  # a pretty-printed JSON document: look for ShareGPT's field names near its start
            return "sharegpt" if any(f'"{k}"' in head for k in ("conversations", "conversation", "messages")) else OURS
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        if keys & {"conversations", "conversation", "messages"} and "session_id" not in keys:
            return "sharegpt"
        return OURS
    cols = {c.strip().strip('"').strip() for c in next(csv.reader(io.StringIO(first)), [])}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols:
        return "azure"
    if {"Request tokens", "Response tokens"} <= cols:
        return "burstgpt"
    if len(cols) > 1:
        raise InputError(p, 1, None, f"a CSV header of no known trace format (got {first[:80]!r}); {_KNOWN}")
    return OURS


_KNOWN = ("known formats: our JSON lines (session_id, turn, new_tokens, ...: docs/traces.md), Mooncake JSON lines "
          "(timestamp, input_length, output_length, hash_ids), Azure CSV (TIMESTAMP, ContextTokens, "
          "GeneratedTokens), BurstGPT CSV (Timestamp, Request tokens, Response tokens, ...), ShareGPT JSON "
          "(conversations: [{from, value}]; LMSYS-Chat-1M / WildChat conversation: [{role, content}])")


def import_trace(fmt: str, path: str | os.PathLike, report: ImportReport | None = None, **opts) -> Trace:
    """Convert a public-format file with its importer (``opts``: that importer's keyword options; absent ones
    take its defaults). ``tangram-trace import`` and :func:`read_trace` both come here."""
    p = str(path)
    if fmt == "mooncake":
        from .mooncake import import_mooncake as f
    elif fmt == "azure":
        from .azure import import_azure as f
    elif fmt == "burstgpt":
        from .burstgpt import import_burstgpt as f
    elif fmt == "sharegpt":
        from .sharegpt import import_sharegpt as f
    else:
        raise InputError(p, None, None, f"unknown import format {fmt!r}; choose from {', '.join(FORMATS)}")
    return f(p, report=report if report is not None else ImportReport(fmt, p), **opts)


def read_trace(path: str | os.PathLike, fmt: str = "auto", *, notes: Callable[[str], None] | None = None) -> Trace:
    """The trace in ``path``, in our format or any format ``tangram-trace import`` converts (``fmt``: one of
    :data:`TRACE_FORMATS`; ``auto`` detects it). A public format is imported with the importer's defaults;
    ``notes`` (default: stderr) receives one line saying so and the importer's notes."""
    p = str(path)
    if fmt not in TRACE_FORMATS:
        raise InputError(p, None, None, f"unknown trace format {fmt!r}; choose from {', '.join(TRACE_FORMATS)}")
    found = detect_format(p) if fmt == "auto" else fmt
    if found == OURS:
        return load_trace(p)
    rep = ImportReport(found, p)
    trace = import_trace(found, p, report=rep)
    trace.source_format = found
    say = notes or (lambda s: print(f"note: {s}", file=sys.stderr))
    how = "detected" if fmt == "auto" else "as --trace-format says"
    say(f"{p}: read as {_NAMES[found]} ({how}) and imported with `tangram-trace import {found}`'s defaults: "
        f"{len(trace)} turns in {trace.num_sessions} sessions (import it once with tangram-trace import to set "
        f"the importer's options and skip this step)")
    for line in rep.lines():
        say(f"{found} import: {line}")
    return trace


__all__ = ["detect_format", "import_trace", "read_trace", "FORMATS", "TRACE_FORMATS", "OURS"]

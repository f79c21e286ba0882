"""Multi-turn trace format: one JSON object per line, one line per turn.

The format is the contract between workload sources (generator, importers,
hand-written files) and the scheduler shared by the engine and the simulator,
so it is validated strictly: a typo or an out-of-order turn must fail loudly
with ``file:line: field: what is wrong`` rather than silently change a run.
See docs/traces.md for the field reference.
"""
from __future__ import annotations

import difflib
import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from tangram.errors import ConfigError, InputError

FIELDS = ("session_id", "turn", "arrival_s", "think_time_s", "new_tokens", "output_tokens",
          "shared_context_tokens", "prefix", "text", "request_id")
REQUIRED = ("session_id", "turn", "new_tokens", "output_tokens")
META_PREFIX = "x_"


@dataclass(frozen=True, slots=True)  # slots: a public trace holds millions of turns (~0.6 KB each less)
class Turn:
    """One request of a session: append ``new_tokens`` to the history, then decode ``output_tokens``.

    ``arrival_s`` is set on turn 0 only (absolute seconds from trace start);
    a later turn becomes ready ``think_time_s`` after the previous turn of its
    session finished, so the arrival of later turns depends on the server
    (closed loop per session, open loop across sessions).
    """

    request_id: str
    session_id: str
    turn: int
    arrival_s: float | None
    think_time_s: float
    new_tokens: int
    output_tokens: int
    shared_context_tokens: int = 0
    text: str | None = None
    line: int = field(default=0, compare=False)  # 1-based line in the source file; 0 when built in memory
    meta: dict = field(default_factory=dict, hash=False)  # the line's "x_*" keys, kept verbatim
    # Shared-prefix chain: the first sum(tokens) tokens of this turn's *context* (the session's history before the
    # turn, then its new tokens) are these segments, in order. A segment is identified by the chain up to it, so
    # two requests whose chains agree on their first k (id, tokens) pairs hold identical first tokens there and
    # may share that KV (docs/traces.md, "Shared prefixes").
    prefix: tuple[tuple[str, int], ...] = ()

    @property
    def prefix_tokens(self) -> int:
        return sum(n for _, n in self.prefix)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this turn; optional fields at their default are left out."""
        d: dict[str, Any] = {"session_id": self.session_id, "turn": self.turn}
        if self.turn == 0:
            d["arrival_s"] = self.arrival_s
        else:
            d["think_time_s"] = self.think_time_s
        d["new_tokens"] = self.new_tokens
        d["output_tokens"] = self.output_tokens
        if self.shared_context_tokens:
            d["shared_context_tokens"] = self.shared_context_tokens
        if self.prefix:
            d["prefix"] = [[sid, n] for sid, n in self.prefix]
        if self.text is not None:
            d["text"] = self.text
        if self.request_id != default_request_id(self.session_id, self.turn):
            d["request_id"] = self.request_id
        d.update(self.meta)
        return d


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_window(text: str) -> tuple[float, float]:
    """``START:DURATION`` -> seconds (start, duration); each a number with an optional unit s, m, h or d
    (``86400:3600`` = ``1d:1h``). A ConfigError says what was expected."""
    def secs(part: str, what: str) -> float:
        p = part.strip().lower()
        unit = _UNITS.get(p[-1:], None)
        num = p[:-1] if unit is not None else p
        try:
            v = float(num) * (unit or 1.0)
        except ValueError:
            raise ConfigError(f"trace window {text!r}: {what} {part.strip()!r} is not a number of seconds "
                              f"(units s, m, h, d)") from None
        if not math.isfinite(v):
            raise ConfigError(f"trace window {text!r}: {what} must be finite")
        return v

    parts = str(text).split(":")
    if len(parts) != 2:
        raise ConfigError(f"trace window {text!r}: expected START:DURATION (e.g. 86400:3600 or 1d:1h)")
    start, dur = secs(parts[0], "start"), secs(parts[1], "duration")
    if start < 0 or dur <= 0:
        raise ConfigError(f"trace window {text!r}: start must be >= 0 and duration > 0")
    return start, dur


def default_request_id(session_id: str, turn: int) -> str:
    return f"{session_id}:{turn}"


@dataclass
class Trace:
    """The turns of a trace in file order, plus where they came from (for messages and reports)."""

    turns: list[Turn]
    source: str = "<memory>"
    source_format: str = "tangram"  # the file's format when read: ours, or the public format imported on the fly

    def __len__(self) -> int:
        return len(self.turns)

    def __iter__(self) -> Iterator[Turn]:
        return iter(self.turns)

    def sessions(self) -> dict[str, list[Turn]]:
        """Session id -> its turns in turn order; sessions in order of first appearance."""
        out: dict[str, list[Turn]] = {}
        for t in self.turns:
            out.setdefault(t.session_id, []).append(t)
        for ts in out.values():
            ts.sort(key=lambda t: t.turn)
        return out

    @property
    def num_sessions(self) -> int:
        return len({t.session_id for t in self.turns})

    def first_turns(self) -> list[Turn]:
        """Turn 0 of every session, by arrival time (file order on ties): the open-loop arrival stream."""
        firsts = [t for t in self.turns if t.turn == 0]
        firsts.sort(key=lambda t: t.arrival_s)  # stable: file order on ties
        return firsts

    def scaled(self, rate_scale: float) -> "Trace":
        """Same sessions arriving ``rate_scale`` times as fast (turn-0 arrivals divided by it).

        Think times are left alone: a faster arrival stream means more users,
        not users who type faster. The simulator's capacity search uses this.
        """
        if isinstance(rate_scale, bool) or not isinstance(rate_scale, numbers.Real) \
                or not (math.isfinite(rate_scale) and rate_scale > 0):
            raise ConfigError(f"rate_scale must be a finite number > 0, got {rate_scale!r}")
        turns = [replace(t, arrival_s=t.arrival_s / rate_scale) if t.turn == 0 else t for t in self.turns]
        return Trace(turns, f"{self.source} (rate x{rate_scale:g})", self.source_format)

    def head(self, n_sessions: int) -> "Trace":
        """The ``n_sessions`` earliest-arriving sessions (all their turns, file order kept)."""
        if isinstance(n_sessions, bool) or not isinstance(n_sessions, numbers.Integral) or n_sessions < 0:
            raise ConfigError(f"n_sessions must be an integer >= 0, got {n_sessions!r}")
        keep = {t.session_id for t in self.first_turns()[:n_sessions]}
        return Trace([t for t in self.turns if t.session_id in keep], f"{self.source} (first {n_sessions} sessions)",
                     self.source_format)

    def window(self, start_s: float, duration_s: float) -> "Trace":
        """The sessions whose turn 0 arrives in ``[start_s, start_s + duration_s)`` of the trace's time (all their
        turns, file order kept), arrivals shifted by ``-start_s``: a slice of a long public trace (BurstGPT spans
        months, Azure's 2024 traces a week) replayed at its own rate. An empty slice is a ConfigError that gives
        the trace's arrival span."""
        for name, v in (("start", start_s), ("duration", duration_s)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ConfigError(f"trace window: {name} must be a finite number of seconds, got {v!r}")
        if start_s < 0 or duration_s <= 0:
            raise ConfigError(f"trace window: start must be >= 0 and duration > 0 seconds, got {start_s:g} and "
                              f"{duration_s:g}")
        end = start_s + duration_s
        keep = {t.session_id for t in self.turns if t.turn == 0 and start_s <= t.arrival_s < end}
        if not keep:
            arr = [t.arrival_s for t in self.turns if t.turn == 0]
            raise ConfigError(f"trace window [{start_s:g} s, {end:g} s) of {self.source}: no session arrives in it "
                              f"(sessions arrive from {min(arr):g} s to {max(arr):g} s)")
        turns = [(replace(t, arrival_s=t.arrival_s - start_s) if t.turn == 0 else t) for t in self.turns
                 if t.session_id in keep]
        return Trace(turns, f"{self.source} (window {start_s:g} s + {duration_s:g} s)", self.source_format)

    def windowed(self, text: str | None) -> "Trace":
        """:meth:`window` of a ``START:DURATION`` text (:func:`parse_window`); the trace itself when None."""
        return self if not text else self.window(*parse_window(text))

    def validate(self) -> None:
        """Re-check an in-memory trace against the file format (what ``save_trace`` would write)."""
        _validate_records(((i + 1, t.to_dict()) for i, t in enumerate(self.turns)), self.source, keep=False)

    def to_frame(self):
        """One row per turn with the session's history before/after it (``context_*`` in tokens).

        ``context_before`` is what the session holds when the turn starts (all
        earlier turns' new + output tokens); ``context_after`` adds this turn.
        """
        import pandas as pd

        cols = ["request_id", "session_id", "turn", "arrival_s", "think_time_s", "new_tokens", "output_tokens",
                "shared_context_tokens", "prefix_tokens"]
        ts = self.turns  # column by column: a DataFrame from a list of rows infers every row (millions of turns)
        df = pd.DataFrame({c: [getattr(t, c) for t in ts] for c in cols}, columns=cols)
        df["arrival_s"] = df["arrival_s"].astype(float)
        grown = df["new_tokens"] + df["output_tokens"]
        df["context_after"] = grown.groupby(df["session_id"], sort=False).cumsum()
        df["context_before"] = df["context_after"] - df["output_tokens"] - df["new_tokens"]
        return df


# --------------------------------------------------------------------------- validation


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), type(v).__name__)


class _Checker:
    """Field checks for one line; raises InputError located at ``path:line``."""

    def __init__(self, path: str, line: int, obj: dict):
        self.path, self.line, self.obj = path, line, obj

    def fail(self, fld: str | None, msg: str) -> None:
        raise InputError(self.path, self.line, fld, msg)

    def integer(self, fld: str, minimum: int, default: int | None = None) -> int:
        if fld not in self.obj:
            if default is None:
                self.fail(fld, "missing required field")
            return default
        v = self.obj[fld]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(fld, f"expected an integer >= {minimum}, got {_type_name(v)} {json.dumps(v)}")
        if v < minimum:
            self.fail(fld, f"must be >= {minimum}, got {v}")
        return v

    def number(self, fld: str, default: float | None = None) -> float:
        if fld not in self.obj:
            if default is None:
                self.fail(fld, "missing required field")
            return default
        v = self.obj[fld]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(fld, f"expected a number >= 0 (seconds), got {_type_name(v)} {json.dumps(v)}")
        if not math.isfinite(v):
            self.fail(fld, f"must be finite, got {v}")
        if v < 0:
            self.fail(fld, f"must be >= 0, got {v}")
        return float(v)

    def string(self, fld: str, required: bool) -> str | None:
        if fld not in self.obj or (not required and self.obj[fld] is None):
            if required:
                self.fail(fld, "missing required field")
            return None
        v = self.obj[fld]
        if not isinstance(v, str):
            self.fail(fld, f"expected a string, got {_type_name(v)} {json.dumps(v)[:40]}")
        return v


_FIELD_SET = frozenset(FIELDS)
_NUM = (int, float)
_EXACT_INT = 1 << 53  # larger integers go the checked way (a float of them may round, or overflow)


def _fast_record(line: int, obj: Any) -> Turn | None:
    """The turn of a well-formed record, or None for anything :func:`_parse_record` must look at (which then
    accepts it the same way or names what is wrong). Only exact types pass here (``type(v) is int`` also keeps
    booleans out), so every record accepted here is one the checked path accepts, as the same turn. The checked
    path's per-field calls were most of the time of reading an imported public trace of millions of records
    (benchmarks/trace_io.py)."""
    if type(obj) is not dict:
        return None
    g = obj.get
    sid, turn, new, out = g("session_id"), g("turn"), g("new_tokens"), g("output_tokens")
    if not (type(sid) is str and sid and type(turn) is int and 0 <= turn < _EXACT_INT and type(new) is int
            and 1 <= new < _EXACT_INT and type(out) is int and 1 <= out < _EXACT_INT):
        return None
    if turn == 0:
        a = g("arrival_s")
        if type(a) not in _NUM or not 0 <= a < _EXACT_INT:  # (NaN and inf fail the range, go the checked way)
            return None
        th = g("think_time_s", 0.0)
        if type(th) not in _NUM or th != 0:
            return None
        arrival, think = float(a), 0.0
    else:
        if "arrival_s" in obj:
            return None
        th = g("think_time_s", 0.0)
        if type(th) not in _NUM or not 0 <= th < _EXACT_INT:
            return None
        arrival, think = None, float(th)
    shared = g("shared_context_tokens", 0)
    if type(shared) is not int or shared < 0 or shared > new or (shared and turn):
        return None
    pv = g("prefix")
    prefix: tuple = ()
    if pv is not None:
        if type(pv) is not list:
            return None
        for seg in pv:
            if not (type(seg) is list and len(seg) == 2 and type(seg[0]) is str and seg[0] and type(seg[1]) is int
                    and 1 <= seg[1] < _EXACT_INT):
                return None
        prefix = tuple((a, n) for a, n in pv)
    text = g("text")
    if text is not None and type(text) is not str:
        return None
    rid = g("request_id")
    if rid is None:
        rid = default_request_id(sid, turn)
    elif type(rid) is not str or not rid:
        return None
    meta = {}
    extra = obj.keys() - _FIELD_SET
    if extra:
        for k in extra:
            if not k.startswith(META_PREFIX):
                return None  # an unknown field: the checked path names it
        meta = {k: v for k, v in obj.items() if k in extra}
    return Turn(rid, sid, turn, arrival, think, new, out, shared, text, line, meta, prefix)


def _parse_record(path: str, line: int, obj: Any) -> Turn:
    t = _fast_record(line, obj)
    return t if t is not None else _parse_checked(path, line, obj)


def _parse_checked(path: str, line: int, obj: Any) -> Turn:
    """Every field checked in turn; the first problem is an InputError naming file, line and field."""
    if not isinstance(obj, dict):
        raise InputError(path, line, None, f"expected a JSON object (one turn per line), got {_type_name(obj)}")
    c = _Checker(path, line, obj)
    unknown = [k for k in obj if k not in FIELDS and not k.startswith(META_PREFIX)]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(k, FIELDS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        c.fail(k, f"unknown field ({hint}allowed: {', '.join(FIELDS)}; metadata keys must start with "
                  f"{META_PREFIX!r})")
    for k in REQUIRED:
        if k not in obj:
            c.fail(k, "missing required field")
    sid = c.string("session_id", required=True)
    if not sid:
        c.fail("session_id", "must be a non-empty string")
    turn = c.integer("turn", 0)
    if turn == 0:
        if "arrival_s" not in obj:
            c.fail("arrival_s", "missing: required on turn 0 (seconds from trace start)")
        arrival = c.number("arrival_s")
        think = c.number("think_time_s", default=0.0)
        if think != 0.0:
            c.fail("think_time_s", f"must be 0 or absent on turn 0 (its start is arrival_s), got {think:g}")
    else:
        if "arrival_s" in obj:
            c.fail("arrival_s", f"only allowed on turn 0; turn {turn} starts think_time_s after the previous "
                                f"turn of its session finishes")
        arrival = None
        think = c.number("think_time_s", default=0.0)
    new = c.integer("new_tokens", 1)
    out = c.integer("output_tokens", 1)
    shared = c.integer("shared_context_tokens", 0, default=0)
    if shared and turn != 0:
        c.fail("shared_context_tokens", f"only allowed on turn 0, got {shared} on turn {turn}")
    if shared > new:
        c.fail("shared_context_tokens", f"{shared} exceeds new_tokens={new} (it counts part of new_tokens)")
    prefix = _parse_prefix(c, obj.get("prefix"))
    text = c.string("text", required=False)
    rid = c.string("request_id", required=False)
    if rid is None:
        rid = default_request_id(sid, turn)
    elif not rid:
        c.fail("request_id", "must be a non-empty string")
    meta = {k: v for k, v in obj.items() if k.startswith(META_PREFIX)}
    return Turn(rid, sid, turn, arrival, think, new, out, shared, text, line, meta, prefix)


def _parse_prefix(c: _Checker, v: Any) -> tuple[tuple[str, int], ...]:
    """``[[segment_id, tokens], ...]`` -> a tuple of (str, int) pairs (absent or null: no prefix)."""
    if v is None:
        return ()
    if not isinstance(v, list):
        c.fail("prefix", f"expected an array of [segment_id, tokens] pairs, got {_type_name(v)}")
    out = []
    for i, seg in enumerate(v):
        if not (isinstance(seg, list) and len(seg) == 2):
            c.fail("prefix", f"item {i}: expected a [segment_id, tokens] pair, got {json.dumps(seg)[:40]}")
        sid, n = seg
        if not isinstance(sid, str) or not sid:
            c.fail("prefix", f"item {i}: segment id must be a non-empty string, got {json.dumps(sid)[:40]}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            c.fail("prefix", f"item {i}: tokens must be an integer >= 1, got {json.dumps(n)[:40]}")
        out.append((sid, n))
    return tuple(out)


def _validate_records(records: Iterable[tuple[int, Any]], path: str, keep: bool = True) -> list[Turn]:
    """Parse (line, object) pairs into turns, checking per-session turn order and id uniqueness (``keep``: return
    the turns; else only check, and return [])."""
    turns: list[Turn] = []
    n = 0
    session_lines: dict[str, list[int]] = {}  # session -> line of each turn seen so far
    history: dict[str, int] = {}  # session -> tokens of its finished turns (new + output)
    rid_line: dict[str, int] = {}
    for line, obj in records:
        t = _parse_record(path, line, obj)
        seen = session_lines.setdefault(t.session_id, [])
        expected = len(seen)
        if t.turn != expected:
            sid = t.session_id
            if t.turn < expected:
                msg = f"duplicate turn {t.turn} of session {sid!r} (already at line {seen[t.turn]})"
            elif expected == 0:
                msg = f"session {sid!r} starts with turn {t.turn}; its turn 0 must come first in the file"
            else:
                msg = (f"turn {t.turn} of session {sid!r} is out of order: expected turn {expected} "
                       f"(turn {expected - 1} is at line {seen[-1]})")
            raise InputError(path, line, "turn", msg)
        if t.request_id in rid_line:
            raise InputError(path, line, "request_id",
                             f"duplicate request_id {t.request_id!r} (already at line {rid_line[t.request_id]})")
        hist = history.get(t.session_id, 0)
        if t.prefix and t.prefix_tokens > hist + t.new_tokens:
            raise InputError(path, line, "prefix",
                             f"the chain covers {t.prefix_tokens} tokens but the turn's context (history {hist} + "
                             f"new_tokens {t.new_tokens}) holds {hist + t.new_tokens}")
        history[t.session_id] = hist + t.new_tokens + t.output_tokens
        seen.append(line)
        rid_line[t.request_id] = line
        n += 1
        if keep:
            turns.append(t)
    if not n:
        raise InputError(path, None, None, "empty trace: no turns (expected one JSON object per line)")
    return turns


def read_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped when it is gzip data (public traces often ship as ``.gz``)."""
    import gzip
    import zlib

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(path, None, None, f"cannot read trace: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(path, None, None, f"corrupt gzip data: {e}") from None
    return data


def _read_lines(path: str) -> list[bytes]:
    return read_bytes(path).split(b"\n")


class _NonFinite(ValueError):
    pass


def _reject_constant(name: str):
    raise _NonFinite(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _NonFinite(f"{text} overflows a float (numbers must be finite)")
    return v


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_DECLINED = object()


def _decode_fast(text: str) -> Any:
    """The line's object when it is one JSON value between JSON whitespace (what ``json.loads`` accepts), by one
    shared decoder; ``_DECLINED`` for anything else, which ``json.loads`` then reads or rejects with its message."""
    t = text.strip(" \t\n\r")
    try:
        obj, end = _DECODER.raw_decode(t)
    except (ValueError, RecursionError):  # (JSONDecodeError and _NonFinite are ValueErrors)
        return _DECLINED
    return obj if end == len(t) else _DECLINED


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object) for every non-blank line; bad UTF-8 or JSON is an InputError.

    Python's json accepts NaN/Infinity, which standard JSON does not; they are
    rejected here so every loaded trace can be written back.
    """
    p = str(path)
    for i, raw in enumerate(_read_lines(p), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # tolerate an editor's BOM
        except UnicodeDecodeError as e:
            raise InputError(p, i, None, f"not UTF-8 text (byte {e.start + 1})") from None
        obj = _decode_fast(text)
        if obj is not _DECLINED:
            yield i, obj
            continue
        try:
            obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except json.JSONDecodeError as e:
            raise InputError(p, i, None, f"invalid JSON: {e.msg} (column {e.colno})") from None
        except _NonFinite as e:
            raise InputError(p, i, None, f"invalid JSON: {e}") from None
        except RecursionError:
            raise InputError(p, i, None, "invalid JSON: nested too deeply") from None
        yield i, obj


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a JSON-lines trace; any problem is an InputError naming file, line and field."""
    p = str(path)
    return Trace(_validate_records(iter_json_lines(p), p), p)


def dumps_turn(t: Turn) -> str:
    return _dumps(t.to_dict())


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), allow_nan=False)
_dumps = _ENCODER.encode  # json.dumps with these arguments, without building an encoder per record


def _atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write via a temporary file and rename: a crash never leaves a half-written file behind."""
    p = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent if str(p.parent) else ".")
    except OSError as e:
        raise InputError(str(p), None, None, f"cannot write trace: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(str(p), None, None, f"cannot write trace: {e.strerror or e}") from None


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Validate, then write atomically (a crash never leaves a half-written trace behind)."""
    p = Path(path)
    lines: list[str] = []

    def records():  # each record is written out once the check has passed it; only the lines are kept
        for i, t in enumerate(trace.turns):
            r = t.to_dict()
            yield i + 1, r
            lines.append(_dumps(r))

    _validate_records(records(), str(p), keep=False)
    _atomic_write(p, ("\n".join(lines) + "\n").encode("utf-8"))  # (never empty: the check refuses that)

"""What every importer shares: a report of what it read, kept and skipped, and the zero-token policy.

Importers never drop a row silently: every skipped row is counted under a named reason and the CLI prints the
counts. Public traces do contain rows a session trace cannot hold (BurstGPT's failed requests have 0 response
tokens), so the policy is the user's choice: ``skip`` (default, counted), ``clamp`` (raise to 1 token, counted)
or ``error`` (the first such row is an InputError).
"""
from __future__ import annotations

import contextlib
import csv
import io
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone

from tangram.errors import InputError

from .format import Turn, default_request_id

ZERO_POLICIES = ("skip", "clamp", "error")


@dataclass
class ImportReport:
    """Counts an importer fills in; ``lines()`` is what ``tangram-trace import`` prints."""

    format: str
    source: str
    rows: int = 0  # records read from the source (requests, CSV rows, conversations)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows not imported
    clamped: dict[str, int] = field(default_factory=dict)  # reason -> rows imported with a value raised to 1
    facts: dict[str, object] = field(default_factory=dict)  # format-specific counts (continuations, branches...)
    notes: list[str] = field(default_factory=list)  # things the user must know (assumptions, reorderings)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def clamp(self, reason: str, n: int = 1) -> None:
        self.clamped[reason] = self.clamped.get(reason, 0) + n

    def lines(self) -> list[str]:
        out = []
        if self.facts:
            out.append(", ".join(f"{k}={v}" for k, v in self.facts.items()))
        for reason, n in self.skipped.items():
            out.append(f"skipped {n} of {self.rows} rows: {reason}")
        for reason, n in self.clamped.items():
            out.append(f"clamped {n} of {self.rows} rows to 1 token: {reason}")
        out += self.notes
        return out


def zero_tokens(report: ImportReport, policy: str, path: str, line: int, fld: str, value: int,
                what: str) -> int | None:
    """Apply the zero-token policy to ``value`` (< 1): the value to use, or None to skip the row."""
    if policy == "error":
        raise InputError(path, line, fld, f"{value} tokens ({what}); use --zero skip or --zero clamp to import "
                                          f"such rows")
    if policy == "clamp":
        report.clamp(f"{fld} = {value} ({what})")
        return 1
    report.skip(f"{fld} = {value} ({what})")
    return None


def check_policy(policy: str) -> None:
    from tangram.errors import ConfigError

    if policy not in ZERO_POLICIES:
        raise ConfigError(f"zero-token policy must be one of {', '.join(ZERO_POLICIES)}, got {policy!r}")


def open_text(path: str):
    """A text stream over the file (gunzipped on the fly when it is gzip data), UTF-8 with an optional BOM."""
    import gzip

    try:
        raw = open(path, "rb")
        magic = raw.peek(2)[:2]
    except OSError as e:
        raise InputError(path, None, None, f"cannot read trace: {e.strerror or e}") from None
    stream = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
    return io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")


@contextlib.contextmanager
def iter_csv(path: str, required: tuple[str, ...]):
    """``with iter_csv(path, cols) as (header, rows)``: rows are (line number, {column: cell}), streamed.

    Columns are found by name (extra columns are allowed, order is free). A missing required column, a row
    with the wrong number of fields, bad UTF-8 or bad gzip data is an InputError at the physical line an
    editor shows.
    """
    f = open_text(path)
    reader = csv.reader(f)

    def fail(line, msg, fld=None):
        raise InputError(path, line, fld, msg) from None

    def nxt():
        try:
            return next(reader, None)
        except csv.Error as e:
            fail(reader.line_num, f"bad CSV: {e}")
        except UnicodeDecodeError as e:
            fail(reader.line_num + 1, f"not UTF-8 text ({e.reason})")
        except (OSError, EOFError, zlib.error) as e:
            fail(None, f"corrupt gzip data: {e}")

    try:
        header = nxt()
        if header is None:
            fail(None, "empty CSV file: no header line")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            fail(1, f"missing column (expected columns {', '.join(required)}; the header has "
                    f"{', '.join(header) or 'nothing'})", missing[0])
        dup = [h for i, h in enumerate(header) if h in header[:i]]
        if dup:
            fail(1, "duplicate column name", dup[0])

        def rows():
            while True:
                start = reader.line_num + 1
                rec = nxt()
                if rec is None:
                    return
                if not rec or all(not x.strip() for x in rec):
                    continue
                if len(rec) != len(header):
                    fail(start, f"expected {len(header)} fields ({', '.join(header)}), got {len(rec)}")
                yield start, dict(zip(header, rec))

        yield header, rows()
    finally:
        f.close()


def parse_int(path: str, line: int, fld: str, s: str) -> int:
    """A non-negative integer cell (``12`` or ``12.0``); anything else is an InputError."""
    t = s.strip()
    try:
        v = int(t)
    except ValueError:
        try:
            f = float(t)
        except ValueError:
            raise InputError(path, line, fld, f"expected an integer >= 0, got {s!r}") from None
        if not (f == f and abs(f) != float("inf") and f == int(f)):
            raise InputError(path, line, fld, f"expected an integer >= 0, got {s!r}") from None
        v = int(f)
    if v < 0:
        raise InputError(path, line, fld, f"must be >= 0, got {v}")
    return v


_FRACTION = re.compile(r"(\.\d{6})\d+")  # keep microseconds: Azure 2023 rows have 7 fractional digits


def parse_datetime(path: str, line: int, fld: str, s: str) -> datetime:
    """An ISO-like date-time (space or T separator, any number of fractional digits, optional offset) in UTC."""
    t = _FRACTION.sub(r"\1", s.strip())
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise InputError(path, line, fld, f"expected a date-time like 2023-11-16 18:15:46.6805900, got {s!r}") \
            from None
    if dt.tzinfo is not None:  # offsets are converted; naive times are taken as UTC
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
    return dt


def parse_seconds(path: str, line: int, fld: str, s: str) -> float:
    import math

    try:
        v = float(s.strip())
    except ValueError:
        raise InputError(path, line, fld, f"expected seconds (a number), got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise InputError(path, line, fld, f"expected finite seconds >= 0, got {s!r}")
    return v


def one_turn_sessions(rows: list, sid_prefix: str, report: ImportReport, path: str, dropped: str) -> list[Turn]:
    """Request logs without sessions (Azure, BurstGPT): rows ``(time, prompt, output, meta)`` become one-turn
    sessions in time order, arrivals from the first row's time (datetimes or seconds); rows out of order are
    counted in the report. ``dropped`` says how rows can go missing, for the error when none is left."""
    if not rows:
        raise InputError(path, None, None, f"no importable rows (empty trace, or every row {dropped}: "
                                           + "; ".join(report.lines()) + ")")
    late = sum(1 for a, b in zip(rows, rows[1:]) if b[0] < a[0])
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    turns = []
    for i, (ts, prompt, output, meta) in enumerate(rows):
        sid = f"{sid_prefix}{i}"
        dt = ts - t0
        arrival = round(dt.total_seconds() if hasattr(dt, "total_seconds") else dt, 6)
        turns.append(Turn(default_request_id(sid, 0), sid, 0, arrival, 0.0, prompt, output, meta=meta))
    if late:
        report.notes.append(f"{late} row(s) with a timestamp earlier than the row before: imported in time order")
    return turns

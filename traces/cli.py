"""``tangram-trace``: check, generate, import and summarise multi-turn traces.

Every user error (bad file, bad option) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from tangram.errors import ConfigError, cli_errors

from .format import Trace, load_trace, save_trace
from .generate import CATEGORIES, DEFAULT_BURST_CV, DEFAULT_MIX, DEFAULT_RATE, DEFAULTS, Dist, category_of, generate
from .mooncake import import_mooncake


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line + exit 2, no usage dump
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_float(name: str):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {s!r}")
        return v
    return conv


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}")
    return v


def _mix(s: str) -> tuple[float, float, float]:
    parts = s.split(":")
    try:
        w = tuple(float(x) for x in parts)
    except ValueError:
        w = ()
    if len(w) != 3 or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise argparse.ArgumentTypeError(f"--mix needs SHORT:MID:LONG weights >= 0, got {s!r}")
    return w  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tangram-trace", description="Multi-turn trace tools (format: docs/traces.md).")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    c = sub.add_parser("check", help="validate a trace; one summary line when valid")
    c.add_argument("file")

    g = sub.add_parser("gen", help="generate a seeded synthetic SCBench-like trace")
    g.add_argument("--sessions", type=_positive_int, required=True)
    g.add_argument("--category", choices=CATEGORIES + ("mixed",), required=True)
    g.add_argument("--seed", type=int, required=True)
    g.add_argument("-o", "--output", required=True)
    g.add_argument("--arrival", choices=("poisson", "bursty"), default="poisson")
    g.add_argument("--rate", type=_positive_float("--rate"), default=DEFAULT_RATE, help="sessions per second")
    g.add_argument("--burst-cv", type=_positive_float("--burst-cv"), default=DEFAULT_BURST_CV,
                   help="coefficient of variation of bursty inter-arrivals (> 1)")
    g.add_argument("--turns", default=DEFAULTS["turns"], help="turns per session distribution")
    g.add_argument("--think-time", default=DEFAULTS["think_time"], help="think time distribution (s)")
    g.add_argument("--output-tokens", default=DEFAULTS["output_tokens"], help="output tokens per turn")
    g.add_argument("--followup-tokens", default=DEFAULTS["followup_tokens"],
                   help="new tokens of a follow-up question (turn > 0) and of the first question")
    g.add_argument("--mix", type=_mix, default=DEFAULT_MIX, help="SHORT:MID:LONG weights for --category mixed")

    i = sub.add_parser("import", help="convert another trace format")
    i.add_argument("format", choices=("mooncake",))
    i.add_argument("input")
    i.add_argument("-o", "--output", required=True)

    s = sub.add_parser("stats", help="sessions, turns and token distributions")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


def summary(trace: Trace) -> dict:
    """Per-session and per-turn distributions of a trace (what ``stats`` prints)."""
    df = trace.to_frame()
    by = df.groupby("session_id", sort=False)
    sess = by.agg(turns=("turn", "size"), final_context=("context_after", "last"),
                  output_tokens=("output_tokens", "sum"))
    first = df[df["turn"] == 0]
    later = df[df["turn"] > 0]
    cats = category_of(sess["final_context"].to_numpy())
    arr = first["arrival_s"].to_numpy()
    span = float(arr.max() - arr.min())

    def dist(x) -> dict:
        x = x.astype(float)
        if len(x) == 0:
            return {"count": 0}
        q = x.quantile([0.0, 0.5, 0.9, 1.0]).to_numpy()
        return {"count": int(len(x)), "mean": round(float(x.mean()), 3), "min": float(q[0]), "p50": float(q[1]),
                "p90": float(q[2]), "max": float(q[3])}

    return {
        "source": trace.source,
        "sessions": int(len(sess)),
        "turns": int(len(df)),
        "arrival_span_s": round(span, 6),
        "session_rate_per_s": round((len(sess) - 1) / span, 6) if span > 0 else None,
        "categories": {c: int((cats == c).sum()) for c in CATEGORIES},
        "total_new_tokens": int(df["new_tokens"].sum()),
        "total_output_tokens": int(df["output_tokens"].sum()),
        "distributions": {
            "turns_per_session": dist(sess["turns"]),
            "final_context_tokens": dist(sess["final_context"]),
            "first_turn_new_tokens": dist(first["new_tokens"]),
            "shared_context_tokens": dist(first["shared_context_tokens"]),
            "followup_new_tokens": dist(later["new_tokens"]),
            "output_tokens": dist(df["output_tokens"]),
            "think_time_s": dist(later["think_time_s"]),
        },
    }


def _cmd_check(a) -> int:
    t = load_trace(a.file)
    d = t.to_frame()
    print(f"{a.file}: OK: {len(t)} turns in {t.num_sessions} sessions, "
          f"{int(d['new_tokens'].sum())} new + {int(d['output_tokens'].sum())} output tokens, "
          f"max context {int(d['context_after'].max())} tokens")
    return 0


def _cmd_gen(a) -> int:
    t = generate(a.sessions, a.category, a.seed, arrival=a.arrival, rate=a.rate, burst_cv=a.burst_cv,
                 turns=Dist.parse(a.turns, "--turns"), think_time=Dist.parse(a.think_time, "--think-time"),
                 output_tokens=Dist.parse(a.output_tokens, "--output-tokens"),
                 followup_tokens=Dist.parse(a.followup_tokens, "--followup-tokens"), mix=a.mix)
    save_trace(t, a.output)
    print(f"wrote {a.output}: {len(t)} turns in {t.num_sessions} sessions")
    return 0


def _cmd_import(a) -> int:
    t = import_mooncake(a.input)
    save_trace(t, a.output)
    cont = sum(1 for x in t.turns if x.turn > 0)
    print(f"wrote {a.output}: {len(t)} turns in {t.num_sessions} sessions ({cont} continuations)")
    return 0


def _cmd_stats(a) -> int:
    import pandas as pd

    s = summary(load_trace(a.file))
    if a.json:
        print(json.dumps(s))
        return 0
    head = {k: v for k, v in s.items() if k not in ("distributions", "categories", "source")}
    print(f"{a.file}: " + ", ".join(f"{k}={v}" for k, v in head.items()))
    print("categories by final context: " + ", ".join(f"{k}={v}" for k, v in s["categories"].items()))
    table = pd.DataFrame.from_dict(s["distributions"], orient="index")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(float_format=lambda x: f"{x:.6g}"))
    return 0


@cli_errors
def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return {"check": _cmd_check, "gen": _cmd_gen, "import": _cmd_import, "stats": _cmd_stats}[a.cmd](a)
    except BrokenPipeError:  # e.g. `stats FILE | head`
        return 0


if __name__ == "__main__":
    main()

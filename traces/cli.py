"""``tangram-trace``: check, generate, import and summarise multi-turn traces.

Every user error (bad file, bad option) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tangram.cli import Parser, cli_main, output_file, refuse_replacing_inputs
from tangram.errors import InputError

from .detect import FORMATS, TRACE_FORMATS, import_trace, read_trace
from .format import Trace, save_trace
from .generate import CATEGORIES, DEFAULT_BURST_CV, DEFAULT_MIX, DEFAULT_RATE, DEFAULTS, Dist, generate
from .importing import ZERO_POLICIES, ImportReport
from .sharegpt import ARRIVALS as SHAREGPT_ARRIVALS
from .stats import DEFAULT_MODEL, sanity_warnings, summary


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


def _nonnegative_float(name: str):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (math.isfinite(v) and v >= 0):
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {s!r}")
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
    p = Parser(prog="tangram-trace", description="Multi-turn trace tools (format: docs/traces.md).")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    c = sub.add_parser("check", help="validate a trace; one summary line when valid, warnings on stderr")
    c.add_argument("file")
    _format_arg(c)
    _limit_args(c)
    _window_arg(c)

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

    f = sub.add_parser("gen-sessions", help="generate N sessions of exactly T turns, lengths jittered uniformly "
                                            "around given means (engine benchmark recipes)")
    f.add_argument("--sessions", type=_positive_int, required=True)
    f.add_argument("--turns", type=_positive_int, default=3, help="turns per session (default 3)")
    f.add_argument("--first", type=_positive_int, default=8000,
                   help="mean new tokens of a first turn, drawn x U(0.75, 1.25) (default 8000)")
    f.add_argument("--later", type=_positive_int, default=256,
                   help="mean new tokens of a later turn, drawn x U(0.5, 1.5) (default 256)")
    f.add_argument("--out-tokens", type=_positive_int, default=128,
                   help="mean output tokens per turn, drawn x U(0.5, 1.5) (default 128)")
    f.add_argument("--spread-s", type=_nonnegative_float("--spread-s"), default=4.0,
                   help="sessions arrive uniformly within this many seconds (default 4)")
    f.add_argument("--think-s", type=_nonnegative_float("--think-s"), default=1.0,
                   help="mean think time before a later turn, drawn x U(0.5, 1.5) (default 1)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("-o", "--output", required=True)

    m = sub.add_parser("gen-mooncake", help="generate a seeded raw trace in Mooncake's format "
                                            "(statistics of its public conversation trace)")
    m.add_argument("--requests", type=_positive_int, default=12_000)
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--duration", type=_positive_float("--duration"), default=3_537.0,
                   help="seconds from the first to the last request (default 3537, the public trace's)")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--truth", help="also write the ground truth (parent line per request) as JSON lines")

    i = sub.add_parser("import", help="convert a public trace format (docs/traces.md)")
    fmts = i.add_subparsers(dest="format", required=True, parser_class=Parser, metavar="{" + ",".join(FORMATS) + "}")
    helps = {"mooncake": "Mooncake FAST'25 JSON lines (conversation, tool-agent, synthetic traces)",
             "azure": "Azure LLM inference CSV (TIMESTAMP,ContextTokens,GeneratedTokens; 2023 and 2024)",
             "burstgpt": "BurstGPT CSV (Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type)",
             "sharegpt": "ShareGPT-style conversations JSON (id, conversations: [{from, value}]; also "
                         "LMSYS-Chat-1M / WildChat records, conversation: [{role, content}])"}
    sp = {}
    for f in FORMATS:
        sp[f] = x = fmts.add_parser(f, help=helps[f])
        x.add_argument("input")
        x.add_argument("-o", "--output", required=True)
        _limit_args(x)
        _window_arg(x)
        if f != "sharegpt":
            x.add_argument("--zero", choices=ZERO_POLICIES, default="skip",
                           help="rows with 0 prompt or output tokens: skip (counted), clamp to 1, or error")
        if f in ("azure", "burstgpt", "sharegpt"):
            x.add_argument("--limit", type=_positive_int, help="import only the first N rows/conversations")
    sp["mooncake"].add_argument("--block-tokens", type=_positive_int, default=512, help="tokens per hash block")
    sp["mooncake"].add_argument("--service-rate", metavar="PREFILL:DECODE",
                                help="subtract an estimated service time of the parent (tokens/s) from the "
                                     "timestamp gap; default: think time = the whole gap (an upper bound)")
    sp["burstgpt"].add_argument("--log-type", choices=("all", "conversation", "api"), default="all",
                                help="keep only 'Conversation log' or 'API log' rows")
    sg = sp["sharegpt"]
    sg.add_argument("--seed", type=int, default=0, help="seed of the generated arrivals and think times")
    sg.add_argument("--rate", type=_positive_float("--rate"), default=1.0, help="sessions per second (Poisson)")
    sg.add_argument("--arrivals", choices=SHAREGPT_ARRIVALS, default="auto",
                    help="session arrivals from each record's `timestamp` (WildChat) or a seeded Poisson process at "
                         "--rate; auto: timestamps when every conversation has one (default)")
    sg.add_argument("--think-time", default="lognormal:60:1.0:2:900", help="think time distribution (s)")
    sg.add_argument("--keep-text", action="store_true", help="store each turn's prompt text in `text`")

    s = sub.add_parser("stats", help="session structure, distributions, offered load and warnings")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    _format_arg(s)
    _limit_args(s)
    _window_arg(s)
    return p


def _format_arg(p) -> None:
    p.add_argument("--format", choices=TRACE_FORMATS, default="auto",
                   help="the file's format (default: detected; a public format is imported with tangram-trace "
                        "import's defaults, which a note says)")


def _window_arg(p) -> None:
    p.add_argument("--window", metavar="START:DURATION",
                   help="only the sessions whose first turn arrives in this window of the trace's time (e.g. 1d:1h; "
                        "units s, m, h, d), shifted to start at 0 (docs/traces.md, 'A slice of a long trace')")


def _windowed(t: Trace, a) -> Trace:
    if not getattr(a, "window", None):
        return t
    w = t.windowed(a.window)
    print(f"note: window {a.window}: {w.num_sessions} of {t.num_sessions} sessions, {len(w)} of {len(t)} turns",
          file=sys.stderr)
    return w


def _limit_args(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--max-context", type=_positive_int,
                   help=f"context window for the warnings (default: {DEFAULT_MODEL}'s, 131072)")
    g.add_argument("--model", help="take the context window from this model preset (tangram.config.MODELS)")


def _max_context(a) -> int | None:
    if getattr(a, "model", None):
        from tangram.config import get_model

        return get_model(a.model).max_context
    return getattr(a, "max_context", None)


def _warn(trace: Trace, a, df=None) -> None:
    for w in sanity_warnings(trace, _max_context(a), df):
        print(f"warning: {w}", file=sys.stderr)


def _cmd_check(a) -> int:
    t = _windowed(read_trace(a.file, a.format), a)
    d = t.to_frame()
    limit = _max_context(a)
    print(f"{a.file}: OK: {len(t)} turns in {t.num_sessions} sessions, "
          f"{int(d['new_tokens'].sum())} new + {int(d['output_tokens'].sum())} output tokens, "
          f"max context {int(d['context_after'].max())} tokens")
    for w in sanity_warnings(t, limit):
        print(f"warning: {w}", file=sys.stderr)
    return 0


def _cmd_gen(a) -> int:
    t = generate(a.sessions, a.category, a.seed, arrival=a.arrival, rate=a.rate, burst_cv=a.burst_cv,
                 turns=Dist.parse(a.turns, "--turns"), think_time=Dist.parse(a.think_time, "--think-time"),
                 output_tokens=Dist.parse(a.output_tokens, "--output-tokens"),
                 followup_tokens=Dist.parse(a.followup_tokens, "--followup-tokens"), mix=a.mix)
    save_trace(t, _made(a.output))
    print(f"wrote {a.output}: {len(t)} turns in {t.num_sessions} sessions")
    return 0


def _cmd_gen_sessions(a) -> int:
    from .generate import fixed_sessions

    t = fixed_sessions(a.sessions, turns=a.turns, first=a.first, later=a.later, out_tokens=a.out_tokens,
                       spread_s=a.spread_s, think_s=a.think_s, seed=a.seed)
    save_trace(t, _made(a.output))
    print(f"wrote {a.output}: {len(t)} turns in {t.num_sessions} sessions")
    return 0


def _cmd_gen_mooncake(a) -> int:
    from .mooncake_gen import generate_mooncake, truth_records, write_mooncake

    g = generate_mooncake(a.requests, a.seed, duration_s=a.duration)
    write_mooncake(g.records, _made(a.output))
    if a.truth:
        from .format import _atomic_write

        _atomic_write(_made(a.truth), "".join(json.dumps(r) + "\n" for r in truth_records(g)).encode())
    fc = g.first_child
    print(f"wrote {a.output}: {len(g.records)} requests over {g.records[-1]['timestamp'] / 1000:g} s, "
          f"{int((g.parent < 0).sum())} conversations, {int(fc.sum())} continuations, "
          f"{int(((g.parent >= 0) & ~fc).sum())} branches, {int(g.doc_first.sum())} documents opened, "
          f"{int(((g.doc >= 0) & (g.parent < 0) & ~g.doc_first).sum())} requests reusing one")
    return 0


def _cmd_import(a) -> int:
    rep = ImportReport(a.format, a.input)
    if a.format == "mooncake":
        opts = dict(block_tokens=a.block_tokens, zero=a.zero, service_rate=a.service_rate)
    elif a.format == "azure":
        opts = dict(zero=a.zero, limit=a.limit)
    elif a.format == "burstgpt":
        opts = dict(log_type=a.log_type, zero=a.zero, limit=a.limit)
    else:
        opts = dict(seed=a.seed, rate=a.rate, think_time=a.think_time, keep_text=a.keep_text, limit=a.limit,
                    progress=sys.stderr.isatty(), arrivals=a.arrivals)
    t = _windowed(import_trace(a.format, a.input, report=rep, **opts), a)
    save_trace(t, _made(a.output))
    cont = sum(1 for x in t.turns if x.turn > 0)
    print(f"wrote {a.output}: {len(t)} turns in {t.num_sessions} sessions ({cont} continuations)")
    lines = rep.lines()
    if rep.facts:
        print(lines[0])
        lines = lines[1:]
    for line in lines:
        print(f"note: {line}", file=sys.stderr)
    _warn(t, a)
    return 0


def _cmd_stats(a) -> int:
    import pandas as pd

    s = summary(_windowed(read_trace(a.file, a.format), a), _max_context(a))
    for w in s["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if a.json:
        print(json.dumps(s))
        return 0
    head = {k: v for k, v in s.items() if k not in ("distributions", "categories", "source", "warnings")}
    print(f"{a.file}: " + ", ".join(f"{k}={v}" for k, v in head.items()))
    print("categories by final context: " + ", ".join(f"{k}={v}" for k, v in s["categories"].items()))
    table = pd.DataFrame.from_dict(s["distributions"], orient="index")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(float_format=lambda x: f"{x:.6g}"))
    return 0


def _made(path: str) -> str:
    """``path``, its folder created now that the work is done (:func:`_check_outputs` checked it could be)."""
    parent = Path(path).parent
    if str(parent):
        parent.mkdir(parents=True, exist_ok=True)
    return path


def _check_outputs(a) -> None:
    """Before any work (an import of a public trace reads millions of rows): every file the command writes can be
    written (:func:`tangram.cli.output_file`: its folder created, a file tried there, not a folder), and none is the
    file it reads (an import's ``-o`` over its input used to replace the raw trace)."""
    outs = [(x, flag) for x, flag in ((getattr(a, "output", None), "-o"), (getattr(a, "truth", None), "--truth")) if x]
    for o, flag in outs:
        refuse_replacing_inputs([output_file(o, flag)], flag, {"the input file": getattr(a, "input", None)})
    if len(outs) == 2 and Path(outs[0][0]).resolve() == Path(outs[1][0]).resolve():
        raise InputError(outs[1][0], None, None, "--truth and -o name the same file")


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if hasattr(a, "max_context"):
        a.max_context = _max_context(a)  # an unknown --model fails before any work
        a.model = None
    _check_outputs(a)
    try:
        return {"check": _cmd_check, "gen": _cmd_gen, "gen-sessions": _cmd_gen_sessions, "gen-mooncake": _cmd_gen_mooncake, "import": _cmd_import,
                "stats": _cmd_stats}[a.cmd](a)
    except BrokenPipeError:  # e.g. `stats FILE | head`
        return 0


if __name__ == "__main__":
    main()

"""What every command-line tool shares: one parser class (one-line errors, exit 2), the deployment spec's flags
generated from the config dataclasses' option fields (:mod:`tangram.options`), the argv a report quotes, and the
entry-point wrapper (a user error is one line and exit 2).

A tool declares its options like this::

    p = spec_parser("tangram-sim", __doc__, ("deployment", "trace", "engine", "replay", "sim", "output"),
                    defaults={"out": "tangram-sim-out"})
    p.add_argument("--capacity", action="store_true", help="...")   # the tool's own options: plain argparse
    args = parse(p, argv)
    spec = from_cli(args)            # tangram.spec.load(--config, the spec options given on the command line)

The spec imports lazily: tools that take no spec options (kernel benchmarks) use only :class:`Parser`,
:func:`parse` and :func:`cli_main`.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Mapping

from tangram.errors import ConfigError, TangramError

GROUPS = {  # option group -> its title in --help
    "deployment": "deployment",
    "trace": "trace",
    "engine": "engine configuration (tangram.config.EngineConfig)",
    "replay": "replay",
    "sim": "simulator",
    "run": "engine run",
    "output": "output",
}
DEST = "spec:"  # generated options land in the namespace as "spec:<field>": tools read the loaded spec, not flags
_DEFAULTS = "spec_defaults_"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2, like every other bad input; no abbreviated flags (argparse
    read tangram-mem's ``--mode tangram`` as ``--model tangram``: "unknown model 'tangram'")."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, keeping the argument list as ``args._argv`` (reports quote their command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args._argv = argv
    return args


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a tool's entry point: a user error prints one line to stderr and exits 2; Ctrl-C exits 130; a reader
    that closes the pipe early (``tangram-mem | head``) ends the tool quietly, as ``head`` expects."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = fn(*args, **kwargs)
        except TangramError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130)
        except BrokenPipeError:
            # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush cannot raise
            # again (the Python docs' recipe for SIGPIPE), and exit as a tool cut short by `head` does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0)
        raise SystemExit(rc or 0)

    return wrapper


def refuse_replacing_inputs(outputs, flag: str, inputs: dict) -> None:
    """Before any work: none of the files a tool will write (``outputs``) is one of its ``inputs`` ({what it is:
    path}), also through a link: a CSV trace called requests.csv inside --out, an import's -o over its input."""
    for dst in map(Path, outputs):
        if not dst.exists():
            continue
        for what, src in inputs.items():
            if src and Path(src).exists() and os.path.samefile(src, dst):
                raise ConfigError(f"{flag} {dst}: writing it would replace {what} ({src}); choose another {flag}")


def output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """The output folder, created and checked writable now, before any work: a run that ends by failing to write
    its results (``--out afile/sub``, a read-only place) would throw away everything it computed."""
    p = Path(path)
    for parent in (p, *p.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):  # access() can say yes where a write fails (read-only mounts, /proc)
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return p


def writable(path: str | os.PathLike, flag: str = "--out", *, folder: bool = False) -> Path:
    """Check, before any work and without creating anything, that a file (``folder``: files in a folder) can be
    written at ``path``: the nearest folder that exists on the way is a folder and takes a file (a write is tried:
    ``os.access`` says yes to root on read-only mounts and /proc). The writer creates the missing folders when it
    writes; a run that fails for another reason leaves nothing behind."""
    p = Path(path)
    first = p if folder else (p.parent if str(p.parent) else Path("."))
    for parent in (first, *first.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
            try:
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as e:
                raise ConfigError(f"{flag} {path}: cannot write in {parent} ({e.strerror or e})") from None
            return p
    return p


def output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """An output file that can be written (:func:`writable`) and is not a folder, checked before the measurement,
    fit or import that ends by writing it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; {flag} names the file to write")
    return writable(p, flag)


# --------------------------------------------------------------------------- generated options


def check_at_least(*limits: tuple[str, float, float]) -> None:
    """(flag, value, lowest allowed) for each count option: one error naming the first that is below."""
    for flag, value, lo in limits:
        if value < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {value}")


def _typed(s, scale: float | None = None):
    """argparse ``type=``: the option's text checked like a config file's value (tangram.options.check)."""
    from tangram.options import check

    def conv(text: str):
        try:
            if scale is None:
                return check(s, text, text=True)
            num = float(text)
            if not num > 0 or num == float("inf"):
                raise ConfigError(f"expected a positive number, got {text!r}")
            return int(round(num * scale))
        except (ConfigError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    conv.__name__ = s.name  # argparse names the type in its messages
    return conv


def _help(s) -> str:
    return f"{s.help} (default: {s.shown_default()})".replace("%", "%%")


def _selected(options: Iterable[str]):
    from tangram.spec import ENGINE_OPTIONS, OPTIONS, SPEC_OPTIONS

    out = []
    for name in options:
        if name == "engine":
            out += [("engine", s) for s in ENGINE_OPTIONS]
        elif name in GROUPS:
            out += [(name, s) for s in SPEC_OPTIONS if s.opt.group == name]
        elif name in OPTIONS:
            out.append((OPTIONS[name].opt.group, OPTIONS[name]))
        else:
            raise ValueError(f"unknown option or group {name!r}")
    return out


def add_options(parser: argparse.ArgumentParser, options: Iterable[str], *, skip: Iterable[str] = (),
                trace: str = "positional", defaults: Mapping[str, object] | None = None,
                show: Mapping[str, str] | None = None) -> None:
    """Add a flag per option of ``options`` (group names of :data:`GROUPS` or option names), but ``skip``.
    ``trace`` is how the tool takes its trace: ``positional`` (an optional TRACE), ``required`` (a TRACE) or
    ``flag`` (``--trace``). ``defaults`` are the tool's own defaults (below a config file's values); ``show`` says
    how the tool decides an option left out, where that is no single value (tangram-placement's H_p: all heads of
    a rank, per TP degree)."""
    from tangram.spec import OPTIONS

    skip, defaults, show = set(skip), dict(defaults or {}), dict(show or {})
    for name in (*defaults, *show):
        if name not in OPTIONS:
            raise ValueError(f"unknown option {name!r}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for group, s in _selected(options):
        if s.name in skip:
            continue
        g = groups.get(group) or groups.setdefault(group, parser.add_argument_group(GROUPS[group]))
        if s.name in defaults or s.name in show:
            helptext = f"{s.help} (default: {defaults.get(s.name, show.get(s.name))})".replace("%", "%%")
        else:
            helptext = _help(s)
        dest = DEST + s.name
        if s.name == "trace" and trace in ("positional", "required"):
            g.add_argument(dest, nargs=None if trace == "required" else "?", metavar="TRACE",
                           default=argparse.SUPPRESS, help=helptext)
            continue
        meta = s.opt.metavar or (("{" + ",".join(map(str, s.opt.choices)) + "}") if s.opt.choices else
                                 {int: "N", float: "X"}.get(s.base, s.name.upper()))
        if s.base is bool:
            g.add_argument(s.flags[0], *s.flags[1:], dest=dest, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=helptext)
        else:
            g.add_argument(*s.flags, dest=dest, default=argparse.SUPPRESS, help=helptext, metavar=meta,
                           type=_typed(s), action="append" if s.opt.repeat else "store")
        for alias, factor, unit in s.opt.scaled:
            g.add_argument(alias, dest=dest, default=argparse.SUPPRESS, metavar=unit, type=_typed(s, factor),
                           help=f"{s.flag} in {unit}")
    prev = getattr(parser, "_tangram_defaults", {})
    parser._tangram_defaults = {**prev, **defaults}
    parser.set_defaults(**{_DEFAULTS: parser._tangram_defaults})


def spec_parser(prog: str, description: str | None, options: Iterable[str], *, trace: str = "positional",
                config: bool = True, skip: Iterable[str] = (), defaults: Mapping[str, object] | None = None,
                show: Mapping[str, str] | None = None) -> Parser:
    """A :class:`Parser` with the spec's flags of ``options`` (see :func:`add_options`) and ``--config``."""
    p = Parser(prog=prog, description=(description or "").split("\n\n")[0])
    add_options(p, options, skip=skip, trace=trace, defaults=defaults, show=show)
    if config:
        p.add_argument("--config", metavar="FILE",
                       help="JSON config file: the deployment spec's options and EngineConfig fields, flat (as "
                            "tangram-tune writes its best configuration); options on the command line override it")
    return p


def add_sweep(parser: argparse.ArgumentParser, name: str, what: str, default: Iterable | None = None) -> None:
    """A flag taking several values of option ``name``, for a tool that compares or searches them (tangram-tune
    ``--tp 1 2``, tangram-placement): the option's own flag, type check and choices, and its default alone
    unless the tool names other ``default`` values. The values land in ``args.<name>`` as a list; the flag is the
    tool's dimension, not the spec option (which such a tool does not take: the spec's flag would clash)."""
    from tangram.options import check
    from tangram.spec import OPTIONS

    s = OPTIONS[name]
    default = [s.default] if default is None else list(default)
    for v in default:  # a tool's default is checked like a value given
        check(s, v, text=False)
    meta = s.opt.metavar or (("{" + ",".join(map(str, s.opt.choices)) + "}") if s.opt.choices else
                             {int: "N", float: "X"}.get(s.base, s.name.upper()))
    parser.add_argument(s.flag, dest=name, nargs="+", type=_typed(s), default=default, metavar=meta,
                        help=f"{what}: one or more values of the {s.name} option (docs/configuration.md; "
                             f"default: {' '.join(map(str, default))})".replace("%", "%%"))


def spec_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The spec options given on the command line: option name -> checked value."""
    return {k[len(DEST):]: v for k, v in vars(args).items() if k.startswith(DEST)}


def from_cli(args: argparse.Namespace, config: str | None = None, **extra):
    """The spec of ``--config`` (or ``config``) under the command line's options (and ``extra`` ones on top)."""
    from tangram.spec import load

    path = config if config is not None else getattr(args, "config", None)
    return load(path, {**spec_overrides(args), **extra}, getattr(args, _DEFAULTS, None))


def options_markdown() -> str:
    """The options table of docs/configuration.md, generated from the option fields (a test keeps the doc equal)."""
    from tangram.spec import ENGINE_OPTIONS, SPEC_OPTIONS

    rows = ["| config key (old keys) | flags | default | group | what |", "|---|---|---|---|---|"]
    for s in SPEC_OPTIONS + ENGINE_OPTIONS:
        keys = ", ".join(f"`{k}`" for k in (s.name, *s.opt.keys))
        flags = ", ".join(f"`{f}`" for f in s.flags + tuple(a for a, _, _ in s.opt.scaled))
        if s.base is bool:
            flags += f", `--no-{s.flag[2:]}`"
        choices = f" ({' / '.join(map(str, s.opt.choices))})" if s.opt.choices else ""
        cells = (keys, flags, s.shown_default(), s.opt.group, s.help + choices)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")

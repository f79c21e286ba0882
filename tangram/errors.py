"""User-facing errors: every bad input becomes one clear line and exit code 2."""
from __future__ import annotations

import functools
import sys
from typing import Callable


class TangramError(Exception):
    """Base class for errors caused by bad user input (not bugs)."""


class ConfigError(TangramError):
    pass


class InputError(TangramError):
    """A problem in an input file, located as ``file:line: field: what is wrong``."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        loc = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{loc}: {field}: {message}" if field else f"{loc}: {message}")


def cli_errors(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI entry point: user errors print one line to stderr and exit 2."""

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
        raise SystemExit(rc or 0)

    return wrapper


def parse_cli(parser, argv=None):
    """``parser.parse_args(argv)`` with the argument list kept as ``_argv``: reports print the command they ran."""
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    return args

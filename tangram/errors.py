"""User-facing errors: every bad input becomes one clear line and exit code 2."""
from __future__ import annotations


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

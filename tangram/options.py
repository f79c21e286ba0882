"""Config fields that are also options: declared once, in the config dataclass, with one default.

A field is an option when it has an *attribute docstring* (a string literal right below it, the PEP 257 / Sphinx
convention): that text is its ``--help``. :func:`option` adds what a plain field cannot say (old flag spellings,
old config-file keys, choices, how a file or flag value becomes the field's value). :mod:`tangram.cli` turns the
options into flags and :func:`tangram.spec.load` reads them from config files; both type-check a value with
:func:`check`, so ``--page-size 16.5`` and ``"page_size": true`` are refused alike.

::

    @dataclass(frozen=True)
    class EngineConfig:
        heads_per_group: int = option(4, aliases=("--hp",))
        \"\"\"heads per group H_p of ragged paging (must divide the model's KV heads)\"\"\"
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from tangram.errors import ConfigError

META = "tangram.option"
MISSING = dataclasses.MISSING
_UNSET = object()  # Option.default not given


@dataclass(frozen=True)
class Option:
    """How one option field is given (everything but its help, which is the field's docstring)."""

    group: str = "engine"  # which tools show the flag (tangram.cli.GROUPS)
    flag: str | None = None  # the primary flag (default: --field-name)
    aliases: tuple[str, ...] = ()  # old flag spellings, kept working
    keys: tuple[str, ...] = ()  # old config-file keys, kept working
    choices: tuple | None = None
    input: type | tuple | None = None  # what a file or flag gives, when the field holds a parsed object
    parse: Callable[[Any], Any] | None = None  # checked input -> field value (may raise ConfigError)
    input_default: Any = _UNSET  # the input default of a field that the dataclass requires (model, gpu)
    show: str | None = None  # how the default reads in --help, when not the value itself
    scaled: tuple[tuple[str, float, str], ...] = ()  # alias flags in another unit: (flag, factor, unit)
    repeat: bool = False  # the flag may be given several times (values accumulate in a list)
    metavar: str | None = None
    optional: bool | None = None  # None is a value (default: the field's type says)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **kw) -> Any:
    """A dataclass field that is an option (keywords: :class:`Option`); its help is the docstring below it."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={META: Option(**kw)})


@dataclass(frozen=True)
class Spec:
    """One option of a config dataclass: field name, how it is given, accepted input type, default, help."""

    name: str
    opt: Option
    base: Any  # accepted input type(s)
    optional: bool  # None is a value
    default: Any  # input default (what --help shows and the loader starts from)
    help: str

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.opt.flag or "--" + self.name.replace("_", "-"), *self.opt.aliases)

    @property
    def flag(self) -> str:
        return self.flags[0]

    def shown_default(self) -> str:
        if self.opt.show is not None:
            return self.opt.show
        d = self.default
        return "none" if d is None else str(d).lower() if isinstance(d, bool) else str(d)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The attribute docstrings of a class's fields (source parsed with :mod:`ast`), whitespace folded."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): options without help text
        return {}
    body = ast.parse(src).body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


@functools.cache
def options_of(cls) -> tuple[Spec, ...]:
    """The option fields of a config dataclass (those with a docstring), in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            continue
        opt = f.metadata.get(META) or Option()
        base, optional = _base(hints[f.name])
        if opt.optional is not None:
            optional = opt.optional
        if opt.input is not None:
            base = opt.input
        if opt.input_default is not _UNSET:
            default = opt.input_default
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: an option needs a default")
        out.append(Spec(f.name, opt, base, optional, default, docs[f.name]))
    return tuple(out)


def _base(hint) -> tuple[Any, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else tuple(args)), len(args) < len(typing.get_args(hint))
    return hint, False


_INT = re.compile(r"[+-]?\d+\Z")
_NAMES = {str: "a string", list: "a list", int: "an integer", float: "a number", dict: "an object"}


def check(s: Spec, value: Any, *, text: bool) -> Any:
    """``value`` of option ``s`` type-checked: ``text`` is what a command line gives, else a JSON value.
    The parse hook is not applied (:func:`finish` does). Raises ConfigError saying what was expected."""
    got = repr(value) if text else _show(value)
    if value is None or (text and s.optional and isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if s.optional:
            return None
        raise ConfigError(f"a value is required, got {got}")
    base = s.base
    if base is bool:
        if text:
            low = value.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"expected true or false, got {got}")
            value = low in ("true", "1", "yes")
        elif not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {got}")
    elif base is int:
        if text:
            if not _INT.match(value.strip()):
                raise ConfigError(f"expected an integer, got {got}")
            value = int(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {got}")
    elif base is float:
        if text:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"expected a number, got {got}") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {got}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"expected a finite number, got {got}")
    elif base is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {got}")
    elif isinstance(base, tuple) and not text:  # e.g. (str, list): what the parse hook accepts
        if not isinstance(value, base):
            raise ConfigError(f"expected {' or '.join(_NAMES.get(b, b.__name__) for b in base)}, got {got}")
    if s.opt.choices is not None and value not in s.opt.choices:
        raise ConfigError(f"expected one of {', '.join(map(str, s.opt.choices))}, got {got}")
    return value


def finish(s: Spec, value: Any) -> Any:
    """A checked value -> the field's value (the option's parse hook, e.g. a model name -> its ModelConfig)."""
    if value is None or s.opt.parse is None:
        return value
    return s.opt.parse(value)


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)

"""tangram.traces: multi-turn session traces (format, loader, generators, importers of public traces).

The format is documented in docs/traces.md; ``tangram-trace`` (cli.py) checks,
generates, imports and summarises trace files.
"""
from __future__ import annotations

from pathlib import Path

from .azure import import_azure
from .burstgpt import import_burstgpt
from .format import Trace, Turn, load_trace, save_trace
from .generate import BANDS, CATEGORIES, Dist, category_of, generate
from .importing import ImportReport
from .mooncake import import_mooncake, import_mooncake_records
from .mooncake_gen import MooncakeShape, MooncakeSynth, generate_mooncake, write_mooncake
from .sharegpt import import_sharegpt
from .stats import sanity_warnings, summary

DATA_DIR = Path(__file__).resolve().parent / "data"


def default_trace_path() -> Path:
    """The bundled default trace: 48 long-context multi-turn sessions (mostly Mid/Long)."""
    return DATA_DIR / "default.jsonl"


def long_multiturn_trace_path() -> Path:
    """The bundled 200-session long-context trace used for the simulator's capacity experiments."""
    return DATA_DIR / "long_multiturn.jsonl"


__all__ = ["Trace", "Turn", "load_trace", "save_trace", "generate", "import_mooncake", "import_mooncake_records",
           "import_azure", "import_burstgpt", "import_sharegpt", "ImportReport", "generate_mooncake", "write_mooncake",
           "MooncakeShape", "MooncakeSynth", "sanity_warnings", "summary", "Dist", "BANDS", "CATEGORIES",
           "category_of", "default_trace_path", "long_multiturn_trace_path", "DATA_DIR"]

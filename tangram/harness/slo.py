"""Service-level objectives: parsing ``'ttft_p99=2s,tpot_p99=100ms'`` and checking a run's summary against them."""
from __future__ import annotations

import math

from tangram.errors import ConfigError

SLO_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99")
# rejections that do not depend on load (a single turn larger than the pool or the context window)
LOAD_FREE_REJECTIONS = ("turn larger than the KV pool", "context ", "previous turn rejected")


def parse_slo(text: str) -> dict[str, float]:
    """``'ttft_p99=2s,tpot_p99=100ms'`` -> {'ttft_p99': 2.0, 'tpot_p99': 0.1}."""
    out: dict[str, float] = {}
    if not text or not text.strip():
        raise ConfigError("--slo: empty; expected e.g. 'ttft_p99=2s,tpot_p99=0.1s'")
    for part in text.split(","):
        key, sep, val = part.strip().partition("=")
        key, val = key.strip(), val.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo: cannot parse {part.strip()!r}; expected KEY=VALUE with KEY in "
                              f"{', '.join(SLO_KEYS)} and VALUE like 2s or 100ms")
        scale = 1e-3 if val.endswith("ms") else 1.0
        num = val[:-2] if val.endswith("ms") else val[:-1] if val.endswith("s") else val
        try:
            v = float(num) * scale
        except ValueError:
            raise ConfigError(f"--slo: {key}: {val!r} is not a duration like 2s or 100ms") from None
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"--slo: {key} must be a positive duration, got {val!r}")
        out[key] = v
    return out


def meets_slo(summary: dict, slo: dict[str, float]) -> bool:
    """All SLO percentiles met, and no request lost to load (stalls); size rejections are load-free."""
    for k, v in slo.items():
        got = summary.get(f"{k}_s")
        if got is None or got > v:
            return False
    if any(not r.startswith(LOAD_FREE_REJECTIONS) for r in summary.get("rejected_reasons", {})):
        return False
    return summary["completed"] > 0

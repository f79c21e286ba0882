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


def vacuous(summary: dict, key: str) -> bool:
    """A TPOT term with nothing to measure: requests finished, but none decoded a second token (every output one
    token long, as in prefill-only or scoring traces). It holds, whatever the load; a TTFT or E2E term without a value
    means nothing finished, which is a miss."""
    return key.startswith("tpot") and summary.get(f"{key}_s") is None and (summary.get("completed") or 0) > 0


def meets_slo(summary: dict, slo: dict[str, float]) -> bool:
    """All SLO percentiles met, and no request lost to load (stalls); size rejections are load-free."""
    for k, v in slo.items():
        got = summary.get(f"{k}_s")
        if vacuous(summary, k):
            continue
        if got is None or got > v:
            return False
    if any(not r.startswith(LOAD_FREE_REJECTIONS) for r in summary.get("rejected_reasons", {})):
        return False
    return summary["completed"] > 0


def slo_verdict(summary: dict, slo: dict[str, float]) -> dict:
    """Each SLO term against a run's summary, and the whole: ``{"terms": {key: {"bound_s", "measured_s", "met"}},
    "load_rejections": n, "met": bool}`` (``met`` is :func:`meets_slo`: every term, no turn lost to load, and
    something completed). A term the run has no value for is not met when nothing completed, and met when it is a
    TPOT term and no finished request decoded a second token (:func:`vacuous`)."""
    terms = {}
    for k, bound in slo.items():
        got = summary.get(f"{k}_s")
        terms[k] = {"bound_s": float(bound), "measured_s": None if got is None else float(got),
                    "met": vacuous(summary, k) or (got is not None and got <= bound)}
    lost = sum(n for r, n in (summary.get("rejected_reasons") or {}).items()
               if not r.startswith(LOAD_FREE_REJECTIONS))
    return {"terms": terms, "load_rejections": int(lost), "met": meets_slo(summary, slo)}


def slo_text(slo: dict[str, float] | None) -> str:
    """``ttft_p99 <= 60 s, tpot_p99 <= 0.5 s``: an SLO as reports and the terminal state it."""
    return ", ".join(f"{k} <= {v:g} s" for k, v in (slo or {}).items())


def verdict_line(verdict: dict) -> str:
    """One line for a terminal or a report: ``met`` / ``MISSED`` and every term's measured value and bound."""
    parts = []
    for k, t in verdict["terms"].items():
        got = ("n/a (no request decoded a second token)" if t["met"] else "n/a") if t["measured_s"] is None else \
            f"{t['measured_s']:.4g} s"
        parts.append(f"{k} {got} {'<=' if t['met'] else '>'} {t['bound_s']:g} s{'' if t['met'] else ' (missed)'}")
    if verdict["load_rejections"]:
        parts.append(f"{verdict['load_rejections']} requests rejected under load (missed)")
    return ("met" if verdict["met"] else "MISSED") + ": " + "; ".join(parts)


DEFAULT_SLO = "ttft_p99=60s,tpot_p99=0.5s"  # tangram-sim --capacity and tangram-tune without --slo


def violations_needed(n: int, q: float) -> int:
    """Fewest values above a bound that put numpy's (linear) ``q``-th percentile of ``n`` values above it.

    The percentile sits at position ``pos = q/100 (n-1)`` of the sorted values, at or above the value of rank
    ``floor(pos)``; that value exceeds the bound once ``n - floor(pos)`` values do. Nondecreasing in ``n``, so a
    count reached for the largest ``n`` a run can still end with is reached for any smaller one.
    """
    return n - math.floor(q / 100.0 * (n - 1)) if n > 0 else 1


class SLOMonitor:
    """Decides during a replay that it will miss an SLO whatever happens next, so a capacity probe can stop early.

    Every request gets a deadline per SLO key: ``arrival + bound`` for TTFT and end-to-end latency, ``first token +
    bound x (output_tokens - 1)`` for TPOT. A request still without the measure at its deadline is certain to
    exceed the bound (it can only end later); one whose measure is known counts when it exceeds it. A key is
    certain to fail once its count reaches :func:`violations_needed` for the most requests the run can still finish
    (all of them less those rejected so far). The failing probes of a capacity search are its slowest runs (an
    overloaded queue drains for hours of simulated time); this ends them at the first moment the verdict is known.
    """

    def __init__(self, slo: dict[str, float], output_tokens):
        import heapq

        self._heapq = heapq
        self.out = list(output_tokens)
        n = len(self.out)
        self.keys = []
        for key, bound in slo.items():
            metric, q = key.split("_p")
            self.keys.append((key, metric, float(q), float(bound)))
        self.count = {k[0]: 0 for k in self.keys}
        self.counted = {k[0]: bytearray(n) for k in self.keys}
        self.heaps = {k[0]: [] for k in self.keys}
        self.n_max = {"ttft": n, "e2e": n, "tpot": sum(1 for o in self.out if o >= 2)}
        self.arrival = [0.0] * n
        self.known = {"ttft": bytearray(n), "e2e": bytearray(n), "tpot": bytearray(n)}
        self.reason: str | None = None

    def _hit(self, key: str, rid: int) -> None:
        c = self.counted[key]
        if not c[rid]:
            c[rid] = 1
            self.count[key] += 1

    def arrived(self, rid: int, t: float) -> None:
        self.arrival[rid] = t
        for key, metric, _, bound in self.keys:
            if metric in ("ttft", "e2e"):
                self._heapq.heappush(self.heaps[key], (t + bound, rid))

    def first_token(self, rid: int, t: float) -> None:
        self.known["ttft"][rid] = 1
        for key, metric, _, bound in self.keys:
            if metric == "ttft" and t - self.arrival[rid] > bound:
                self._hit(key, rid)
            elif metric == "tpot" and self.out[rid] >= 2:
                self._heapq.heappush(self.heaps[key], (t + bound * (self.out[rid] - 1), rid))

    def finished(self, rid: int, t: float, first_token_s: float) -> None:
        self.known["e2e"][rid] = self.known["tpot"][rid] = 1
        for key, metric, _, bound in self.keys:
            if metric == "e2e" and t - self.arrival[rid] > bound:
                self._hit(key, rid)
            elif metric == "tpot" and self.out[rid] >= 2 and (t - first_token_s) / (self.out[rid] - 1) > bound:
                self._hit(key, rid)

    def rejected(self, rid: int) -> None:
        self.n_max["ttft"] -= 1
        self.n_max["e2e"] -= 1
        if self.out[rid] >= 2:
            self.n_max["tpot"] -= 1

    def check(self, now: float) -> str | None:
        """The first SLO key certain to be missed at time ``now`` (its reason), else None."""
        if self.reason is not None:
            return self.reason
        for key, metric, q, bound in self.keys:
            h, known = self.heaps[key], self.known[metric]
            while h and h[0][0] < now:
                _, rid = self._heapq.heappop(h)
                if not known[rid]:
                    self._hit(key, rid)
            need = violations_needed(self.n_max[metric], q)
            if self.count[key] >= need:
                self.reason = (f"{key} certain to exceed {bound:g} s: {self.count[key]} of at most "
                               f"{self.n_max[metric]} requests already over it at t = {now:.6g} s")
                return self.reason
        return None

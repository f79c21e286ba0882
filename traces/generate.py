"""Seeded synthetic multi-turn traces shaped like SCBench sessions.

SCBench (the paper's workload) opens each session with a large shared
document plus a first question, then asks short follow-up questions over the
same context. The paper buckets tasks by context length (Short < 20K, Mid
20K-100K, Long > 100K tokens); here a session's *final* context (sum of
new + output tokens over its turns) is drawn inside its category's band, so
the category is a guarantee, not a tendency. Distributions are documented in
docs/traces.md.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from tangram.errors import ConfigError

from .format import Trace, Turn, default_request_id

CATEGORIES = ("short", "mid", "long")
# Final-context bands in tokens, [lo, hi] inclusive. Short/Mid/Long follow the paper's SCBench split
# (section 5.1); the Short floor and the Long ceiling are ours: the ceiling keeps every session inside
# Llama-3.1-8B's 131072-token window.
BANDS: dict[str, tuple[int, int]] = {"short": (4_000, 19_999), "mid": (20_000, 100_000), "long": (100_001, 128_000)}
# "mixed" weights: proportional to the number of SCBench tasks the paper puts in each category
# (Short: Many-Shot; Mid: RepoQA, Multi-Choice QA, MathFind; Long: Retrieve Prefix-Suffix, KV, Summary).
DEFAULT_MIX = (1.0, 3.0, 3.0)

DEFAULTS = {
    "turns": "uniform:2:6",
    "think_time": "lognormal:5:0.8:0.5:60",
    "output_tokens": "lognormal:128:0.7:16:1024",
    "followup_tokens": "lognormal:150:0.6:50:500",
}
DEFAULT_RATE = 1.0  # sessions per second
DEFAULT_BURST_CV = 3.0

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


@dataclass(frozen=True)
class Dist:
    """A small distribution spec usable from the command line.

    ``const:V`` | ``uniform:LO:HI`` (integers inclusive when sampling counts)
    | ``exp:MEAN[:LO:HI]`` | ``lognormal:MEDIAN:SIGMA[:LO:HI]``; a bare
    number means ``const``. Optional LO:HI clip the samples.
    """

    kind: str
    a: float
    b: float = 0.0
    lo: float | None = None
    hi: float | None = None

    @classmethod
    def parse(cls, spec: "str | Dist", name: str) -> "Dist":
        if isinstance(spec, Dist):
            return spec
        s = str(spec).strip()
        parts = s.split(":")
        if re.fullmatch(_NUM, s):
            parts = ["const", s]
        kind, args = parts[0], parts[1:]
        nargs = {"const": (1,), "uniform": (2,), "exp": (1, 3), "lognormal": (2, 4)}
        if kind not in nargs:
            raise ConfigError(f"{name}: unknown distribution {kind!r} in {s!r} "
                              f"(use const:V, uniform:LO:HI, exp:MEAN[:LO:HI] or lognormal:MEDIAN:SIGMA[:LO:HI])")
        if len(args) not in nargs[kind] or not all(re.fullmatch(_NUM, a) for a in args):
            raise ConfigError(f"{name}: {kind} needs {' or '.join(map(str, nargs[kind]))} numbers, got {s!r}")
        v = [float(a) for a in args]
        if any(x < 0 for x in v):
            raise ConfigError(f"{name}: parameters must be >= 0, got {s!r}")
        lo = hi = None
        if kind == "const":
            d = cls(kind, v[0])
        elif kind == "uniform":
            d = cls(kind, v[0], v[1])
            if v[0] > v[1]:
                raise ConfigError(f"{name}: uniform needs LO <= HI, got {s!r}")
        else:
            if kind == "exp" and len(v) == 3 or kind == "lognormal" and len(v) == 4:
                lo, hi = v[-2], v[-1]
                if lo > hi:
                    raise ConfigError(f"{name}: clip bounds need LO <= HI, got {s!r}")
            d = cls(kind, v[0], v[1] if kind == "lognormal" else 0.0, lo, hi)
            if d.a <= 0:
                raise ConfigError(f"{name}: {'mean' if kind == 'exp' else 'median'} must be > 0, got {s!r}")
        return d

    def __str__(self) -> str:
        g = "{:g}".format
        if self.kind == "const":
            return f"const:{g(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{g(self.a)}:{g(self.b)}"
        core = f"exp:{g(self.a)}" if self.kind == "exp" else f"lognormal:{g(self.a)}:{g(self.b)}"
        return core if self.lo is None else f"{core}:{g(self.lo)}:{g(self.hi)}"

    def sample(self, rng: np.random.Generator, size, integer: bool = False) -> np.ndarray:
        """Draw ``size`` samples; integer draws are rounded and at least 1 (they count tokens or turns)."""
        if self.kind == "const":
            x = np.full(size, self.a, dtype=np.float64)
        elif self.kind == "uniform":
            if integer:
                return np.maximum(rng.integers(math.ceil(self.a), math.floor(self.b) + 1, size=size), 1)
            x = rng.uniform(self.a, self.b, size=size)
        elif self.kind == "exp":
            x = rng.exponential(self.a, size=size)
        else:
            x = self.a * np.exp(self.b * rng.standard_normal(size))
        if self.lo is not None:
            x = np.clip(x, self.lo, self.hi)
        if integer:
            return np.maximum(np.rint(x), 1).astype(np.int64)
        return x


def interarrivals(rng: np.random.Generator, n: int, arrival: str, rate: float, burst_cv: float) -> np.ndarray:
    """Gaps between session arrivals with mean 1/rate.

    Bursty gaps are Gamma(shape k = 1/CV^2, scale = CV^2/rate): same mean as
    Poisson, coefficient of variation CV > 1, i.e. clumps of near-simultaneous
    sessions separated by long lulls.
    """
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if arrival == "bursty":
        k = 1.0 / burst_cv**2
        return rng.gamma(k, 1.0 / (rate * k), size=n)
    raise ConfigError(f"arrival must be 'poisson' or 'bursty', got {arrival!r}")


def generate(n_sessions: int, category: str = "mixed", seed: int = 0, *, arrival: str = "poisson",
             rate: float = DEFAULT_RATE, burst_cv: float = DEFAULT_BURST_CV,
             turns: str | Dist = DEFAULTS["turns"], think_time: str | Dist = DEFAULTS["think_time"],
             output_tokens: str | Dist = DEFAULTS["output_tokens"],
             followup_tokens: str | Dist = DEFAULTS["followup_tokens"],
             mix: tuple[float, float, float] = DEFAULT_MIX) -> Trace:
    """A seeded trace of ``n_sessions`` SCBench-like sessions (same arguments -> same trace, bit for bit).

    Per session: draw the category (``mixed``: weights ``mix`` over short/mid/long),
    a final context T uniform in the category band, a turn count, per-turn
    output lengths and follow-up question lengths. Follow-ups and outputs are
    scaled down if they would take more than half of T; turn 0 gets the rest
    (a shared document of ``shared_context_tokens`` plus a first question), so
    the final context is exactly T.
    """
    if isinstance(n_sessions, bool) or not isinstance(n_sessions, (int, np.integer)) or n_sessions < 1:
        raise ConfigError(f"n_sessions must be an integer >= 1, got {n_sessions!r}")
    if category not in CATEGORIES + ("mixed",):
        raise ConfigError(f"category must be one of short, mid, long, mixed; got {category!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be > 0 sessions/s, got {rate}")
    if arrival == "bursty" and not (math.isfinite(burst_cv) and burst_cv > 1):
        raise ConfigError(f"burst_cv must be > 1 for bursty arrivals, got {burst_cv}")
    mix_w = np.asarray(mix, dtype=np.float64)
    if mix_w.shape != (3,) or not np.all(np.isfinite(mix_w)) or np.any(mix_w < 0) or mix_w.sum() <= 0:
        raise ConfigError(f"mix must be three weights >= 0 (short, mid, long) with a positive sum, got {mix}")
    d_turns = Dist.parse(turns, "turns")
    d_think = Dist.parse(think_time, "think_time")
    d_out = Dist.parse(output_tokens, "output_tokens")
    d_fu = Dist.parse(followup_tokens, "followup_tokens")

    n = int(n_sessions)
    rng = np.random.default_rng(seed)
    gaps = interarrivals(rng, n, arrival, rate, burst_cv)
    arrivals = np.round(np.concatenate([[0.0], np.cumsum(gaps[:-1])]), 6)
    cat = rng.choice(3, size=n, p=mix_w / mix_w.sum()) if category == "mixed" else \
        np.full(n, CATEGORIES.index(category))
    lo = np.array([BANDS[c][0] for c in CATEGORIES])[cat]
    hi = np.array([BANDS[c][1] for c in CATEGORIES])[cat]
    total = rng.integers(lo, hi + 1)  # final context per session
    k = d_turns.sample(rng, n, integer=True)
    kmax = int(k.max())
    live = np.arange(kmax)[None, :] < k[:, None]  # [n, kmax] turn exists
    out = d_out.sample(rng, (n, kmax), integer=True) * live
    fu = d_fu.sample(rng, (n, kmax), integer=True) * live  # column 0: the first question
    think = np.round(d_think.sample(rng, (n, kmax)), 3) * live
    think[:, 0] = 0.0

    later = out.sum(1) + fu[:, 1:].sum(1)  # tokens after turn 0's prompt
    cap = total // 2
    scale = np.minimum(1.0, cap / np.maximum(later, 1))[:, None]
    out = np.where(live, np.maximum(np.floor(out * scale), 1), 0).astype(np.int64)
    fu_l = np.where(live[:, 1:], np.maximum(np.floor(fu[:, 1:] * scale), 1), 0).astype(np.int64)
    first = total - out.sum(1) - fu_l.sum(1)
    if np.any(first < 2):
        bad = int(np.argmin(first))
        raise ConfigError(f"turns distribution {d_turns} leaves no room for the first prompt of a "
                          f"{CATEGORIES[cat[bad]]} session ({k[bad]} turns in {total[bad]} tokens); use fewer turns")
    question = np.minimum(fu[:, 0], first // 2)
    shared = first - question
    new = np.concatenate([first[:, None], fu_l], axis=1)

    width = len(str(n - 1))
    rows: list[Turn] = []
    for i in range(n):  # building the Turn objects is inherently per turn; all sampling above is vectorised
        sid = f"s{i:0{width}d}"
        meta = {"x_category": CATEGORIES[cat[i]]}
        for j in range(int(k[i])):
            rows.append(Turn(default_request_id(sid, j), sid, j, float(arrivals[i]) if j == 0 else None,
                             float(think[i, j]), int(new[i, j]), int(out[i, j]),
                             int(shared[i]) if j == 0 else 0, None, 0, meta if j == 0 else {}))
    src = (f"generate(n_sessions={n}, category={category!r}, seed={seed}, arrival={arrival!r}, rate={rate:g}"
           + (f", burst_cv={burst_cv:g}" if arrival == "bursty" else "")
           + f", turns={str(d_turns)!r}, think_time={str(d_think)!r}, output_tokens={str(d_out)!r}, "
             f"followup_tokens={str(d_fu)!r})")
    return Trace(rows, src)


def category_of(final_context_tokens):
    """Paper's SCBench category of a session from its final context length (vectorised)."""
    x = np.asarray(final_context_tokens)
    return np.where(x < 20_000, "short", np.where(x <= 100_000, "mid", "long"))


def fixed_sessions(n_sessions: int, *, turns: int = 3, first: int = 8000, later: int = 256, out_tokens: int = 128,
                   spread_s: float = 4.0, think_s: float = 1.0, seed: int = 0) -> Trace:
    """``n_sessions`` sessions of exactly ``turns`` turns each, lengths jittered around the given means: the engine
    benchmark recipe (``tangram-trace gen-sessions``), where the point is a controlled load, not a realistic mix.

    A first prompt is ``first x U(0.75, 1.25)`` tokens, a later one ``later x U(0.5, 1.5)``, every output
    ``out_tokens x U(0.5, 1.5)``, a think time ``think_s x U(0.5, 1.5)``; sessions arrive uniformly within
    ``spread_s`` seconds (0.5 s with 0.1 s think times saturates the engine at once). The draws are made session by
    session in this order so that a seed gives the traces committed under reports/ bit for bit.
    """
    for name, v in (("n_sessions", n_sessions), ("turns", turns), ("first", first), ("later", later),
                    ("out_tokens", out_tokens)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    for name, v in (("spread_s", spread_s), ("think_s", think_s)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{name} must be a number of seconds >= 0, got {v!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0, spread_s, n_sessions))
    width = max(3, len(str(n_sessions - 1)))
    rows: list[Turn] = []
    for s in range(n_sessions):  # sequential draws (see above): a few dozen sessions, not a hot path
        sid = f"s{s:0{width}d}"
        first_tokens = int(first * rng.uniform(0.75, 1.25))
        for t in range(turns):
            new = first_tokens if t == 0 else int(later * rng.uniform(0.5, 1.5))
            out = int(out_tokens * rng.uniform(0.5, 1.5))
            think = 0.0 if t == 0 else float(think_s * rng.uniform(0.5, 1.5))
            rows.append(Turn(default_request_id(sid, t), sid, t, float(arrivals[s]) if t == 0 else None, think,
                             max(new, 1), max(out, 1)))
    src = (f"fixed_sessions(n_sessions={n_sessions}, turns={turns}, first={first}, later={later}, "
           f"out_tokens={out_tokens}, spread_s={spread_s:g}, think_s={think_s:g}, seed={seed})")
    return Trace(rows, src)

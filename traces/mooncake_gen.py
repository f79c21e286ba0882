"""Seeded raw traces in Mooncake's format with the statistics of its public conversation trace.

The public FAST'25 conversation trace (12,031 requests over 3,537 s) is what production chat looks like to a
serving engine: every prompt opens with one shared 512-token system block, follow-ups re-send the whole history
(parent prompt + parent answer + a new message), a few histories are continued twice (branches) and a few
hundred requests open with a document an earlier request also used. This module writes such traces, with a
ground truth (who continues whom), for tests and for the simulator's benchmarks. Targets and how each
distribution is fitted are in ``MooncakeShape`` and docs/traces.md ("Mooncake-format generator").

Construction: conversation trees start as a Poisson process; each has K requests (truncated power law on
[1, max_turns]); request k > 0 continues request k-1 or, with ``branch_prob`` (k >= 2), is a second child of
request k-1's parent. A request's token stream is its parent's stream + the parent's answer + new text, so
its 512-token blocks (hashed by their whole prefix, ids numbered by first appearance in time, block 0 = the
system prompt) share exactly what the real trace's do. The trace keeps the first ``n_requests`` requests in
time, so conversations still running at the end are cut like a real capture.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import numpy as np

from tangram.errors import ConfigError

BLOCK = 512
Z90 = 1.2815515655446004  # standard normal 0.9 quantile (scipy.stats.norm.ppf(0.9))


@dataclass(frozen=True)
class MooncakeShape:
    """Target statistics (quoted facts of the conversation trace) and the assumptions that fill the gaps."""

    requests_per_session: float = 12_031 / 8_000  # ~8,000 reconstructed conversations (sessions), 12,031 requests
    max_turns: int = 23
    branch_prob: float = 0.04  # a follow-up (k >= 2) is a second child of its parent's parent (assumed)
    doc_new_prob: float = 0.05  # a conversation opens with a document nobody used before (assumed)
    doc_reuse_prob: float = 0.05  # ... or with a document an earlier conversation opened: several hundred requests
    doc_median_tokens: float = 1_500.0  # -> 2-6+ shared blocks (block 0 + whole document blocks); assumed
    doc_sigma: float = 0.8
    doc_min_tokens: int = 512
    doc_max_tokens: int = 16_384
    system_tokens: int = BLOCK  # block 0: the shared system prompt
    input_p50: float = 6_900.0  # all requests' input_length
    input_p90: float = 27_000.0
    input_max: int = 126_000
    output_mean: float = 343.0
    output_max: int = 2_000
    output_sigma: float = 1.0  # assumed: only the mean and the cap are published
    new_p50: float = 46.0  # tokens a follow-up adds beyond parent prompt + answer
    new_p90: float = 4_200.0
    gap_median_s: float = 144.0  # timestamp gap between a request and its parent
    gap_sigma: float = 1.0  # assumed
    gap_floor_s: float = 1.0  # a follow-up never arrives before the parent could have answered:
    gap_floor_per_output_token_s: float = 0.02  # floor = 1 s + 20 ms per parent output token
    # Fitted by fit_mooncake_shape() (docs/traces.md): P(K = k) ~ k^-turns_exponent on [1, max_turns]; first-turn
    # input_length lognormal(first_median, first_sigma) truncated to [system_tokens + 1, input_max]; chosen so that
    # the default 12,000-request / 3,537 s window has requests_per_session and the input p50/p90 above.
    turns_exponent: float = 2.4515
    first_median: float = 5_601.0
    first_sigma: float = 1.0301


def _truncated_zeta(a: float, kmax: int) -> np.ndarray:
    k = np.arange(1, kmax + 1, dtype=np.float64)
    w = k ** -a
    return w / w.sum()


def _output_mu(shape: MooncakeShape) -> float:
    """log-median of the output lognormal whose mean, capped at output_max, is output_mean (closed form + brentq).

    E[min(X, c)] = exp(mu + s^2/2) Phi((ln c - mu - s^2)/s) + c (1 - Phi((ln c - mu)/s)).
    """
    from scipy.optimize import brentq
    from scipy.stats import norm

    s, c = shape.output_sigma, float(shape.output_max)
    if not 1 <= shape.output_mean < c:
        raise ConfigError(f"output_mean must be in [1, output_max), got {shape.output_mean}")

    def err(mu):
        lc = math.log(c)
        return (math.exp(mu + s * s / 2) * norm.cdf((lc - mu - s * s) / s) + c * norm.sf((lc - mu) / s)
                - shape.output_mean)

    return float(brentq(err, -20.0, math.log(c) + 10 * s))


@dataclass
class _Draws:
    """Every random number a trace needs, drawn up front in a fixed order (fits reuse them: common numbers)."""

    start: np.ndarray  # per conversation: Exp(1) inter-start gaps
    u_k: np.ndarray  # per conversation: U(0,1) for the request count (inverse CDF)
    u_first: np.ndarray  # per conversation: U(0,1) for the first prompt (inverse CDF)
    u_doc: np.ndarray  # per conversation: doc decision
    u_doc_pick: np.ndarray  # per conversation: which earlier doc
    z_doc: np.ndarray  # per conversation: doc length normal
    z_q0: np.ndarray  # per conversation: question after a document
    z_new: np.ndarray  # per request slot: conversation c, request j at c * max_turns + j
    z_out: np.ndarray
    z_gap: np.ndarray
    u_branch: np.ndarray


def _draw(rng: np.random.Generator, n_conv: int, max_turns: int) -> _Draws:
    """Per conversation, then per request slot (max_turns slots each, so draws do not depend on parameters)."""
    start = rng.exponential(1.0, n_conv)
    u_k, u_first, u_doc, u_doc_pick = (rng.random(n_conv) for _ in range(4))
    z_doc, z_q0 = rng.standard_normal(n_conv), rng.standard_normal(n_conv)
    n = n_conv * max_turns
    return _Draws(start, u_k, u_first, u_doc, u_doc_pick, z_doc, z_q0, rng.standard_normal(n),
                  rng.standard_normal(n), rng.standard_normal(n), rng.random(n))


@dataclass
class _Conv:
    """Lengths and tree of every generated request (generation order: conversation by conversation)."""

    conv: list = field(default_factory=list)
    parent: list = field(default_factory=list)  # generation index or -1
    input: list = field(default_factory=list)
    output: list = field(default_factory=list)
    new: list = field(default_factory=list)  # new text (first turn: after system + document)
    rel: list = field(default_factory=list)  # seconds after the conversation's first request
    doc: list = field(default_factory=list)  # per conversation: doc id or -1
    doc_len: list = field(default_factory=list)  # per doc id


def _lengths(d: _Draws, shape: MooncakeShape, first_median: float, first_sigma: float) -> _Conv:
    from scipy.stats import norm

    sys_t, cap = shape.system_tokens, shape.input_max
    lo = (math.log(sys_t + 1) - math.log(first_median)) / first_sigma
    hi = (math.log(cap) - math.log(first_median)) / first_sigma
    plo, phi = norm.cdf(lo), norm.cdf(hi)
    first = np.exp(math.log(first_median) + first_sigma * norm.ppf(plo + d.u_first * (phi - plo)))
    mu_o, s_o = _output_mu(shape), shape.output_sigma
    out_all = np.clip(np.rint(np.exp(mu_o + s_o * d.z_out)), 1, shape.output_max).astype(np.int64)
    mu_n = math.log(shape.new_p50)
    s_n = math.log(shape.new_p90 / shape.new_p50) / Z90
    new_all = np.maximum(np.rint(np.exp(mu_n + s_n * d.z_new)), 1).astype(np.int64)
    gap_all = np.exp(math.log(shape.gap_median_s) + shape.gap_sigma * d.z_gap)
    mu_d = math.log(shape.doc_median_tokens)
    cdf = np.cumsum(_truncated_zeta(shape.turns_exponent, shape.max_turns))
    ks = np.minimum(np.searchsorted(cdf, d.u_k * cdf[-1], side="right") + 1, shape.max_turns)
    c = _Conv()
    for ci in range(len(ks)):
        o = ci * shape.max_turns
        # document?
        doc = -1
        if d.u_doc[ci] < shape.doc_reuse_prob and c.doc_len:
            doc = int(d.u_doc_pick[ci] * len(c.doc_len))
        elif d.u_doc[ci] < shape.doc_reuse_prob + shape.doc_new_prob:
            dl = int(np.clip(round(math.exp(mu_d + shape.doc_sigma * d.z_doc[ci])), shape.doc_min_tokens,
                             shape.doc_max_tokens))
            dl = min(dl, cap - sys_t - 1)
            doc = len(c.doc_len)
            c.doc_len.append(dl)
        c.doc.append(doc)
        x0 = int(round(first[ci]))
        if doc >= 0:
            q = max(1, int(round(math.exp(mu_n + s_n * d.z_q0[ci]))))
            x0 = min(cap, max(x0, sys_t + c.doc_len[doc] + q))
            new0 = x0 - sys_t - c.doc_len[doc]
        else:
            new0 = x0 - sys_t
        c.conv.append(ci)
        c.parent.append(-1)
        c.input.append(x0)
        c.output.append(int(out_all[o]))
        c.new.append(new0)
        c.rel.append(0.0)
        for j in range(1, int(ks[ci])):
            prev = len(c.input) - 1
            par = prev
            if j >= 2 and d.u_branch[o + j] < shape.branch_prob:
                par = c.parent[prev]  # a second child of the previous request's parent
            base_len = c.input[par] + c.output[par]
            new = int(min(new_all[o + j], cap - base_len))
            if new < 1:
                break  # the conversation reached the context cap
            c.conv.append(ci)
            c.parent.append(par)
            c.input.append(base_len + new)
            c.output.append(int(out_all[o + j]))
            c.new.append(new)
            floor = shape.gap_floor_s + shape.gap_floor_per_output_token_s * c.output[par]
            # a branch comes after the request it branches beside (the user went back and edited)
            c.rel.append(c.rel[prev] + max(float(gap_all[o + j]), floor))
    return c


@dataclass
class _Window:
    c: _Conv
    order: np.ndarray  # generation indices of the kept requests, in timestamp order
    ts_ms: np.ndarray  # per generation index


def _simulate(d: _Draws, shape: MooncakeShape, n_requests: int, duration_s: float) -> _Window:
    """Lengths and times of every drawn conversation; keep the first ``n_requests`` requests in time.

    Conversations start as a Poisson process whose rate is solved (fixed point, 5 steps) so that the
    ``n_requests``-th request arrives at ``duration_s``.
    """
    c = _lengths(d, shape, shape.first_median, shape.first_sigma)
    n_all = len(c.input)
    if n_all < n_requests:
        raise ConfigError("internal: too few requests drawn")
    conv = np.asarray(c.conv)
    rel = np.asarray(c.rel)
    cum = np.cumsum(d.start)
    rate = n_requests / duration_s / (n_all / len(d.start))
    for _ in range(5):
        t = cum[conv] / rate + rel
        span = float(np.partition(t, n_requests - 1)[n_requests - 1] - t.min())
        rate *= span / duration_s
    t = cum[conv] / rate + rel
    ts_ms = np.rint((t - t.min()) * 1000.0).astype(np.int64)
    order = np.lexsort((np.arange(n_all), ts_ms))[:n_requests]
    if int(conv[order].max()) >= len(d.start) - 1:
        raise ConfigError("internal: the window reached the last drawn conversation")
    return _Window(c, order, ts_ms)


def _n_conversations(n_requests: int) -> int:
    return int(math.ceil(1.3 * n_requests)) + 50  # >= 1 request each: always enough to fill the window


def _window_stats(w: _Window) -> tuple[float, float, float]:
    """(requests per session, input p50, input p90) of a window, sessions counted as the importer will."""
    par = np.asarray(w.c.parent)[w.order]
    keep = set(w.order.tolist())
    first, seen = 0, set()
    for p in par:  # a request is its parent's first child (same session) unless the parent was continued already
        if p >= 0 and p in keep and p not in seen:
            seen.add(int(p))
            first += 1
    inputs = np.asarray(w.c.input, dtype=np.float64)[w.order]
    q50, q90 = np.percentile(inputs, [50, 90])
    return len(par) / (len(par) - first), float(q50), float(q90)


def fit_mooncake_shape(shape: MooncakeShape = MooncakeShape(), n_requests: int = 12_000,
                       duration_s: float = 3_537.0, seeds: tuple[int, ...] = (1, 2, 3, 4)) -> MooncakeShape:
    """``shape`` with turns_exponent, first_median and first_sigma fitted to its targets.

    Three targets (requests per session, all inputs' p50 and p90 in the generated window), three unknowns:
    scipy.optimize.least_squares on log-ratios, each residual the mean over ``seeds`` windows whose random
    numbers are drawn once (common random numbers, so the residual is a deterministic function).
    """
    from scipy.optimize import least_squares

    draws = [_draw(np.random.default_rng(sd), _n_conversations(n_requests), shape.max_turns) for sd in seeds]

    def with_x(x):
        return replace(shape, turns_exponent=float(x[0]), first_median=float(math.exp(x[1])), first_sigma=float(x[2]))

    def res(x):
        sh = with_x(x)
        st = np.mean([_window_stats(_simulate(d, sh, n_requests, duration_s)) for d in draws], axis=0)
        return [math.log(st[0] / shape.requests_per_session), math.log(st[1] / shape.input_p50),
                math.log(st[2] / shape.input_p90)]

    x0 = [shape.turns_exponent, math.log(shape.first_median), shape.first_sigma]
    r = least_squares(res, x0, diff_step=1e-3, bounds=([1.05, math.log(shape.system_tokens + 1), 0.05],
                                                       [20.0, 20.0, 5.0]))
    return with_x(r.x)


@dataclass
class MooncakeSynth:
    """A generated raw trace (requests in timestamp order) and its ground truth."""

    records: list[dict]  # {"timestamp", "input_length", "output_length", "hash_ids"}, Mooncake's order
    parent: np.ndarray  # index (in records) of the request this one continues, -1 for a conversation's first
    conversation: np.ndarray  # conversation tree id (branches stay in their tree)
    doc: np.ndarray  # document id the conversation opened with, -1 for none
    doc_first: np.ndarray  # True on the request that first used its document (in time)
    doc_tokens: np.ndarray  # length of that document (0 for none): blocks [1, 1 + doc_tokens // 512) are shared
    shape: MooncakeShape

    @property
    def first_child(self) -> np.ndarray:
        """True where a request is its parent's first child in time (it continues the parent's session)."""
        seen, out = set(), np.zeros(len(self.parent), dtype=bool)
        for i, p in enumerate(self.parent):
            if p >= 0 and p not in seen:
                seen.add(int(p))
                out[i] = True
        return out


def generate_mooncake(n_requests: int = 12_000, seed: int = 0, *, duration_s: float = 3_537.0,
                      shape: MooncakeShape = MooncakeShape()) -> MooncakeSynth:
    """A seeded Mooncake-format trace of ``n_requests`` requests over ``duration_s`` seconds (last request).

    Same arguments -> same trace, bit for bit. The shape's fitted parameters hold for the default size; other
    sizes keep the same per-conversation distributions (a shorter window cuts more conversations short).
    """
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests < 1:
        raise ConfigError(f"n_requests must be an integer >= 1, got {n_requests!r}")
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError(f"duration_s must be > 0, got {duration_s!r}")
    d = _draw(np.random.default_rng(seed), _n_conversations(n_requests), shape.max_turns)
    w = _simulate(d, shape, n_requests, duration_s)
    c, order, ts_ms = w.c, w.order, w.ts_ms
    conv, parent = np.asarray(c.conv), np.asarray(c.parent)
    pos = np.full(len(c.input), -1)
    pos[order] = np.arange(n_requests)
    hashes = _hash_ids(c, shape, order)
    records = []
    par_out = np.full(n_requests, -1)
    docs = np.full(n_requests, -1)
    doc_first = np.zeros(n_requests, dtype=bool)
    seen_doc: set[int] = set()
    for j, i in enumerate(order):
        records.append({"timestamp": int(ts_ms[i]), "input_length": int(c.input[i]),
                        "output_length": int(c.output[i]), "hash_ids": hashes[j]})
        if parent[i] >= 0:
            par_out[j] = pos[parent[i]]
        dc = c.doc[conv[i]]
        docs[j] = dc
        if dc >= 0 and parent[i] < 0 and dc not in seen_doc:
            seen_doc.add(dc)
            doc_first[j] = True
    doc_tokens = np.array([c.doc_len[x] if x >= 0 else 0 for x in docs], dtype=np.int64)
    return MooncakeSynth(records, par_out, conv[order], docs, doc_first, doc_tokens, shape)


def _hash_ids(c: _Conv, shape: MooncakeShape, order: np.ndarray) -> list[list[int]]:
    """Block ids of the kept requests (in ``order``): a block is named by its whole prefix, ids by first use.

    A request's stream is pieces (key, length): system, [document], then per ancestor its new text and answer.
    Blocks are interned on (previous block, pieces inside the block); a child reuses its parent's complete blocks.
    """
    n_all = len(c.input)
    pieces: dict[int, list] = {}
    blocks: dict[int, list[int]] = {}
    intern: dict[tuple, int] = {}

    def stream(i: int) -> list:
        s = pieces.get(i)
        if s is None:
            p = c.parent[i]
            if p < 0:
                s = [(("s",), shape.system_tokens)]
                dc = c.doc[c.conv[i]]
                if dc >= 0:
                    s.append((("d", dc), c.doc_len[dc]))
                s.append((("q", i), c.new[i]))
            else:
                s = stream(p) + [(("o", p), c.output[p]), (("q", i), c.new[i])]
            pieces[i] = s
        return s

    def block_ids(i: int) -> list[int]:
        b = blocks.get(i)
        if b is not None:
            return b
        p = c.parent[i]
        length = c.input[i]
        s = stream(i)
        keep = []
        if p >= 0:
            keep = block_ids(p)[: c.input[p] // BLOCK]
        out = list(keep)
        j = len(out)
        prev = out[-1] if out else -1
        # walk pieces from token j*BLOCK
        pos, k = 0, 0
        while k < len(s) and pos + s[k][1] <= j * BLOCK:
            pos += s[k][1]
            k += 1
        nblocks = -(-length // BLOCK)
        while j < nblocks:
            lo, hi = j * BLOCK, min((j + 1) * BLOCK, length)
            parts = []
            kk, pp = k, pos
            while kk < len(s) and pp < hi:
                key, ln = s[kk]
                a0, a1 = max(lo, pp), min(hi, pp + ln)
                if a1 > a0:
                    parts.append((key, a0 - pp, a1 - pp))
                pp += ln
                kk += 1
            ikey = (prev, tuple(parts))
            uid = intern.get(ikey)
            if uid is None:
                uid = intern[ikey] = len(intern)
            out.append(uid)
            prev = uid
            j += 1
            while k < len(s) and pos + s[k][1] <= j * BLOCK:
                pos += s[k][1]
                k += 1
        blocks[i] = out
        return out

    del n_all
    remap: dict[int, int] = {}
    res = []
    for i in order:
        ids = block_ids(int(i))
        res.append([remap.setdefault(u, len(remap)) for u in ids])
    return res


def write_mooncake(records: list[dict], path: str | os.PathLike) -> None:
    """One request per line, Mooncake's key order; written atomically."""
    from .format import _atomic_write

    _atomic_write(path, "".join(json.dumps({k: r[k] for k in ("timestamp", "input_length", "output_length",
                                                                "hash_ids")}) + "\n" for r in records).encode())


def truth_records(s: MooncakeSynth) -> list[dict]:
    """Ground truth per request (``--truth`` file): line (1-based), parent line (0 = none), conversation, doc."""
    return [{"line": i + 1, "parent_line": int(p) + 1, "conversation": int(c), "doc": int(d),
             "doc_first": bool(f)} for i, (p, c, d, f) in enumerate(zip(s.parent, s.conversation, s.doc, s.doc_first))]


__all__ = ["MooncakeShape", "MooncakeSynth", "generate_mooncake", "write_mooncake", "fit_mooncake_shape",
           "truth_records"]

"""The GPU executor: runs the shared scheduler's ``StepPlan`` on the model with the paged kernels.

One forward per step over every token of the step: the decode rows' single
tokens and the prefill rows' chunks are concatenated for the GEMMs; only
attention is per kind:

* decode rows write their new K/V at each head's own position (slot order,
  ``lens_after - 1``), then one decode launch per layer for the whole batch with
  the partition ``engine.partition`` asks for: ``aot`` (Algorithm 1's split map,
  precomputed once per (layer, batch bucket) from the profile, a lookup per step),
  ``static`` (FlashDecoding's ``num_splits`` for every head) or ``runtime``
  (FlashInfer-style per-layer plan built on the host every step, timed as
  ``runtime_plan``);
* prefill rows go through chunk attention with fused compression: the scores of
  ``engine.score_method`` (:func:`tangram.kernels.scoring.engine_chunk_scores`),
  per-head top-k of ``plan.prefill_keep`` (static modes) or, in ``dynamic``, the
  selection of ``engine.budget_scope`` (per-layer: the layer's top-k over all its
  heads; uniform: each head's; cross-layer: one top-k over every layer of the
  chunk, selected and scattered once the step's forward has scored all layers;
  the realised per-head keep goes back as ``StepResult.realized_keep`` so the
  scheduler can reclaim pages), and a scatter of the kept K/V into the pages.
  ``full`` skips scoring and keeps everything.

Every mode (full, uniform, dynamic, br, br+rp, tangram) runs here; the layout
(ragged or monolithic) only changes the pool's shape (:mod:`tangram.engine.kv_cache`).

Token ids: a turn's prompt is the trace's ``text`` through the tokenizer when the
turn has one (truncated, or repeated, to exactly ``new_tokens``), else seeded
random ids (``seed``, request id). A session's token stream (prompts + sampled
outputs) is kept here so a recompute after preemption or eviction prefills the
same tokens; the chunk at logical position ``start`` is ``stream[start:start+c]``
and a decode row feeds ``stream[ctx-1]``. EOS is ignored: the scheduler ends a
turn after exactly its ``output_tokens``.

Pure-decode steps whose batch fits a captured bucket replay a CUDA graph of the whole decode forward
(:mod:`tangram.engine.cuda_graphs`; ``ExecutorOptions.cuda_graphs``); steps with prefill chunks, the
``runtime`` partition and ``time_ops`` runs stay eager. Padded graph rows write into one scratch page past the
scheduler's pool.

``duration_s`` is the measured wall time of the step (``torch.cuda.synchronize``
at the end) plus the scheduler's host time for it when the scheduler is a
:class:`TimedScheduler`.

Asynchronous decode steps (``ExecutorOptions.async_steps``; ``launch`` / ``complete``, docs/engine.md): a graphed
pure-decode step is launched before the previous step's tokens reach the host; its rows read them on the device and
the host records them one step late. Its duration is the time between the two steps' end events.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

import torch.nn.functional as F

from tangram.budgets import drawn_keep, layer_targets
from tangram.config import EngineConfig
from tangram.engine.cuda_graphs import DecodeGraphs, StaticBuffers, context_bucket
from tangram.engine.kv_cache import KVCache
from tangram.engine.model import Transformer, fuse_projections
from tangram.engine.sampling import Sampler, SamplingParams
from tangram.engine.split_table import AotSplitTable
from tangram.errors import ConfigError
from tangram.kernels import (
    add_rms_norm, global_keep_counts, launch_decode, prefill_attention_varlen, rms_norm, rope_qkv,
    runtime_plan_schedules, score_width, select_scatter, silu_mul, snapkv_compress, snapkv_compress_layers,
    snapkv_scores_varlen, static_split_decode,
)
from tangram.kernels.decode import DEFAULT_CONFIG, DecodeConfig, kernel_resources
from tangram.kernels.scoring import ScoreParams, engine_chunk_scores, method_spec, snapkv_finish_batched
from tangram.plan import StepPlan, StepResult
from tangram.planner import DecodeCosts
from tangram.scheduler import Scheduler


class TimedScheduler(Scheduler):
    """The shared scheduler, timing its own host work so the engine can charge it to the step."""

    _host_s = 0.0

    def schedule(self) -> StepPlan:
        t = time.perf_counter()
        plan = super().schedule()
        self._host_s += time.perf_counter() - t
        return plan

    def update(self, plan, result):
        t = time.perf_counter()
        ev = super().update(plan, result)
        self._host_s += time.perf_counter() - t
        return ev

    def take_host_s(self) -> float:
        """Host seconds since the last call: this step's schedule() plus the previous step's update()."""
        s, self._host_s = self._host_s, 0.0
        return s


class TokenSource:
    """Prompt ids per turn: tokenized ``text`` when present, else seeded random ids (reproducible per rid).

    Shared prefixes: the context positions a session's turns declare as ``prefix`` segments (the first declaration
    of a position wins) hold ids drawn from the segment's content id (``chain_hashes``, a function of the chain up
    to it), so sessions that share a chain share those token ids, and a cache hit is reproducible bit for bit;
    outputs at such positions (a history another session continues) are the declared ids, not the samples.
    """

    def __init__(self, vocab: int, seed: int = 0, texts: dict[int, str] | None = None, tokenizer=None):
        self.vocab, self.seed = vocab, seed
        self.texts = texts or {}
        self.tokenizer = tokenizer
        self._session: dict[int, str] = {}
        self._spans: dict[str, list[tuple[int, int, int]]] = {}  # session -> (start, end, content id)
        self._segments: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def from_trace(cls, trace, vocab: int, seed: int = 0, tokenizer=None) -> "TokenSource":
        texts = {i: t.text for i, t in enumerate(trace.turns) if t.text} if tokenizer is not None else {}
        src = cls(vocab, seed, texts, tokenizer)
        for i, t in enumerate(trace.turns):
            if t.prefix:
                src.declare(i, t.session_id, t.prefix)
        return src

    def declare(self, rid: int, sid: str, prefix) -> None:
        """Turn ``rid`` of session ``sid`` declares ``prefix`` over its context."""
        from tangram.prefix_cache import chain_hashes

        self._session[rid] = sid
        spans = self._spans.setdefault(sid, [])
        start = 0
        for (_, n), key in zip(prefix, chain_hashes(prefix)):
            end = start + int(n)
            if not any(a < end and start < b for a, b, _ in spans):
                spans.append((start, end, key))
            start = end

    def _segment(self, key: int, n: int) -> np.ndarray:
        seg = self._segments.get((key, n))
        if seg is None:
            seg = self._segments[(key, n)] = np.random.default_rng([self.seed, key]).integers(0, self.vocab, n,
                                                                                               dtype=np.int64)
        return seg

    def turn_ids(self, rid: int, n: int, start: int = 0) -> np.ndarray:
        """The turn's ``n`` prompt ids, the first at context position ``start`` of its session."""
        text = self.texts.get(rid)
        if text and self.tokenizer is not None:
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64) % self.vocab
            if ids.size:
                return np.resize(ids, n)  # repeats when the text is shorter than the trace says
        ids = np.random.default_rng([self.seed, rid]).integers(0, self.vocab, n, dtype=np.int64)
        for a, b, key in self._spans.get(self._session.get(rid), ()):
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                ids[lo - start:hi - start] = self._segment(key, b - a)[lo - a:hi - a]
        return ids

    def declared_id(self, rid: int, pos: int) -> int | None:
        """The id a shared-prefix declaration fixes at context position ``pos`` of turn ``rid``'s session (what the
        stream holds there whatever is sampled), else None."""
        if rid not in self.texts:
            for a, b, key in self._spans.get(self._session.get(rid), ()):
                if a <= pos < b:
                    return int(self._segment(key, b - a)[pos - a])
        return None

    def output_id(self, rid: int, pos: int, sampled: int) -> int:
        """The id the session's stream holds at ``pos`` after sampling ``sampled`` there."""
        d = self.declared_id(rid, pos)
        return sampled if d is None else d



# Chunks up to this many tokens compress with snapkv_compress (score + kvpress finish + top-k in one launch, the
# kept K/V copied by a second launch on every token block); longer ones by the unfused launches (not measured past
# 4096). H100, 2026-11-24 (benchmarks/compress_phases.py, reports/engine/compression/): Llama-3.1-8B 14.9 vs 44.5 us
# unfused at 512-token chunks, 16.5 vs 46.4 at 1024, 23.6 vs 49.8 at 2048, 50.0 vs 69.0 at 4096 (SmolLM2-135M 12.9
# vs 38.9 ... 31.2 vs 50.6); with the copy left to the selecting program (one launch) it was 27.3, 44.8, 88.0 and
# 167.8 us, which is why the limit was 1024 before.
FUSED_COMPRESS_MAX_CHUNK = 4096
# ... and every layer's chunks in one launch after the last layer (snapkv_compress_layers: the launch cost and each
# head's serial selection tail paid once a step instead of once a layer; a chunk's attention never reads the pages
# its compression writes) when the step's stacked qkv projections and LSE, kept until then, take at most this many
# bytes (Llama-3.1-8B: 32 layers x 12 KiB a row, ~680 rows; SmolLM2-135M: 30 x 1.9 KiB, ~4,600); otherwise layer by
# layer. Well inside the engine's activation reserve (EngineConfig.activation_reserve_bytes, 2 GiB by default).
DEFER_COMPRESS_MAX_BYTES = 256 * 2**20

@dataclass
class ExecutorOptions:
    sampling: SamplingParams = SamplingParams()
    time_ops: bool = False  # per-operator times (CUDA events on the GPU) in StepResult.breakdown
    num_sms: int | None = None  # static split heuristic; default: the device's SMs, else the CPU's cores
    n_occ: int | None = None  # resident decode CTAs (N_CTA); default: from the compiled kernel on the GPU
    score_window: int = 32
    # dynamic mode: "topk" = the layer's global top-k of the scores (real weights); "profile" = per-head keep
    # drawn from the budget profile's retention distribution, then per-head top-k (random weights have no
    # attention structure, so their global top-k is near-uniform across heads; labelled in reports)
    dynamic_keep: str = "topk"
    record_logits: bool = False  # keep (rid, position, logits) of every sampled row (tests)
    # pure-decode steps up to EngineConfig.cuda_graph_max_bs through captured graphs: "auto" (on CUDA), "off",
    # or "emulate" (the static-buffer path without capture, for CPU tests of its padding and buffers)
    cuda_graphs: str = "auto"
    # layers per captured graph of a decode step: a step replays ceil(L / graph_layers) graphs back to back, so the
    # host's launch of each overlaps the GPU running the one before (one graph of every layer: the whole launch,
    # ~0.5-1 ms of host time for ~340 nodes on the H100, left the GPU idle; reports/engine/roofline/). 0: one graph
    graph_layers: int = 4
    graph_max_context: int | None = None  # tokens the static block tables hold per table (None: the block
    # table's width at start, regrown on demand); tangram-bench passes the trace's longest session
    # costs of a decode launch, for the AOT split table's regime choice (tangram.planner.aot_bucket_split_map);
    # tangram-bench passes the GPU's tables (the ones the cost model reads); None = Algorithm 1 capped per context
    decode_costs: DecodeCosts | None = None
    # the decode kernel's tile (BLOCK_N x warps x stages); None: tangram.kernels.decode.DEFAULT_CONFIG, the tile the
    # shipped tables were measured with (the routing's occupancy follows the tile: N_CTA is read from its kernel)
    decode_config: DecodeConfig | None = None
    # the AOT decode launch's order: "request" (request-major grid, slots in budget order), "lpt" (longest pieces
    # first, item-major: the last wave holds the shortest) or "paired" (lpt, and a launch of exactly a batch
    # bucket's rows, as graphed steps are, balances the first wave's bytes per SM); A/B knobs, the shipped decode
    # costs were fitted on "request"
    decode_order: str = "request"
    # asynchronous decode steps (the harness's launch / complete): a graphed pure-decode step is launched before the
    # previous step's sampled tokens reach the host; its rows read those tokens on the device, and the host records
    # them one step late (docs/engine.md, "Asynchronous decode steps"). Other steps run synchronously. Off: every
    # step syncs on its tokens before the next is planned
    async_steps: bool = False


# the host's placeholder id of a row whose input token is still on the device (the previous step's sample, not yet
# copied back): the device gather overwrites it before the forward reads it (a test poisons it to prove that)
PENDING_TOKEN = 0


def _mark(cuda: bool):
    """A point on the step clock: a CUDA event recorded on the current stream (its time is when the GPU reaches
    it, after every earlier launch), or perf_counter on the CPU (where every launch has finished on return)."""
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def _elapsed(a, b, cuda: bool) -> float:
    return a.elapsed_time(b) / 1e3 if cuda else b - a


@dataclass
class _InFlight:
    """A step launched ahead: on the device, its sampled tokens not yet read by the host."""

    plan: StepPlan
    toks: torch.Tensor  # [kd] int64 sampled tokens on the device (the next step's pending rows read them)
    host: torch.Tensor  # [kd] their copy to (pinned) host memory, issued after the sampling; valid once `end` is done
    end: object  # clock mark after the step's last launch (sampling and the token copy included)
    start: object | None  # mark before its host work when nothing was in flight; None: the previous step's end
    prev_end: object | None
    rows: dict  # request id -> row of toks
    pos: list
    logits: torch.Tensor | None  # record_logits: a device copy (the next replay overwrites the static buffer)
    host_s: float  # the scheduler's host time since the last step (overlapped when start is None)
    capture_s: float
    fed: int  # rows whose input token came from the previous step's device tokens


class _Ops:
    """Per-operator timing: CUDA events on the GPU, perf_counter on the CPU; no-op when disabled."""

    def __init__(self, enabled: bool, cuda: bool):
        self.enabled, self.cuda = enabled, cuda
        self.marks: list[tuple[str, object, object]] = []
        self._open: dict[str, object] = {}

    def start(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._open[name] = e
        else:
            self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if not self.enabled:
            return
        s = self._open.pop(name)
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, s, e))
        else:
            self.marks.append((name, s, time.perf_counter()))

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, s, e in self.marks:
            dt = s.elapsed_time(e) / 1e3 if self.cuda else e - s
            out[name] = out.get(name, 0.0) + dt
        self.marks = []
        return out


class Executor:
    """``execute(plan) -> StepResult`` for one replica: the model, its KV pool and the scheduler it serves."""

    def __init__(self, model: Transformer, sched: Scheduler, tokens: TokenSource,
                 options: ExecutorOptions | None = None):
        self.model, self.sched, self.tokens = model, sched, tokens
        self.opts = options or ExecutorOptions()
        self.cfg = model.cfg
        self.engine: EngineConfig = sched.engine
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.cuda = self.device.type == "cuda"
        lay = sched.layout
        self.scratch_page = sched.pool.num_pages  # one page past the scheduler's pool, for padded graph rows
        self.cache = KVCache(lay, sched.pool.num_pages + 1, self.dtype, self.device)
        self.hp, self.G, self.P = lay.heads_per_group, lay.n_groups, lay.page_size
        self.mode, self.retention = self.engine.mode, sched.retention
        self.partition = self.engine.partition
        self.sampler = Sampler(self.opts.sampling, self.device)
        self.streams: dict[str, list[int]] = {}  # session -> token stream (prompts and sampled outputs)
        self._started: set[int] = set()
        self.logit_log: list[tuple[int, int, torch.Tensor]] = []
        self.steps = 0
        self._queue: deque = deque()  # launched steps not yet completed, in launch order (_InFlight or StepResult)
        self.device_fed = 0  # decode rows whose input token was read on the device (asynchronous steps)
        if self.opts.num_sms is not None:
            self.num_sms = self.opts.num_sms
        elif self.cuda:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:  # CPU (reference kernels or the Triton interpreter): one "SM" per core keeps grids small
            self.num_sms = os.cpu_count() or 1
        self.decode_config = self.opts.decode_config or DEFAULT_CONFIG
        self.n_occ = self.opts.n_occ or self._measure_n_occ()
        self.aot = None
        fuse_projections(model)  # q/k/v and gate/up as one GEMM each (views: no extra memory)
        if self.partition == "aot":
            B = sched.profile.B if sched.profile is not None else np.ones((self.cfg.num_layers, self.cfg.num_kv_heads))
            c = self.cfg
            self.aot = AotSplitTable(B, lay.perm, self.hp, self.n_occ, max_batch=max(1, self.engine.max_num_seqs),
                                     waves=self.engine.n_cta_scale, rounding=self.engine.split_rounding,
                                     costs=self.opts.decode_costs, gq=c.gqa_group, head_dim=c.head_dim,
                                     dtype_bytes=c.dtype_bytes, num_sms=self.num_sms, device=self.device,
                                     order=self.opts.decode_order)
        elif self.partition not in ("static", "runtime"):
            raise ConfigError(f"unknown decode partition {self.partition!r}")
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        if not method_spec(self.engine.score_method).engine:
            raise ConfigError(f"scoring method {self.engine.score_method!r} needs a reconstruction forward per chunk "
                              "and cannot run in the engine's fused compression (calibrate it with tangram-profile)")
        self.score_params = ScoreParams(window=self.opts.score_window)
        # dynamic mode's kept share per layer (per-layer / uniform scope), or None: one threshold over all layers
        self.layer_rho = layer_targets(self.engine.score_method, self.engine.budget_scope, self.cfg.num_layers,
                                       self.engine.rho)
        if self.opts.dynamic_keep not in ("topk", "profile"):
            raise ConfigError(f"dynamic_keep must be topk or profile, got {self.opts.dynamic_keep!r}")
        if self.opts.dynamic_keep == "profile" and self.retention == "global" and sched.profile is None:
            raise ConfigError("dynamic_keep='profile' needs a budget profile")
        self._bt_dev: torch.Tensor | None = None  # device mirror of the scheduler's block table
        self._bt_src = None
        self.graphs: DecodeGraphs | None = None
        cg = self.opts.cuda_graphs
        if cg not in ("auto", "off", "emulate"):
            raise ConfigError(f"cuda_graphs must be auto, off or emulate, got {cg!r}")
        if ((cg == "auto" and self.cuda) or cg == "emulate") and self.engine.graph_max_batch:
            P = self.P
            width = (self.sched.bt.pages.shape[2] if self.opts.graph_max_context is None
                     else -(-int(self.opts.graph_max_context) // P) + 1)
            self.graphs = DecodeGraphs(
                max_bs=self.engine.graph_max_batch, n_tables=lay.n_tables,
                num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads, vocab=self.cfg.vocab,
                greedy=self.opts.sampling.temperature == 0.0, device=self.device, scratch_page=self.scratch_page,
                width=width, body=self._decode_body, emulate=not self.cuda,
                layers_per_graph=self.opts.graph_layers)

    def describe(self) -> dict:
        """Where this executor's step durations come from (the harness's summary reads it)."""
        dev = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        return {"sources": {"all": f"measured on {dev} (tangram-bench)"}, "tables": None, "n_cta": self.n_occ}

    # ------------------------------------------------------------------ setup
    def _measure_n_occ(self) -> int:
        """N_CTA = resident decode CTAs: compile the decode kernel once on a dummy layer, then ask its occupancy."""
        from tangram.kernels import decode_n_cta

        if not self.cuda:
            return 4 * self.num_sms
        H, d, Hq = self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.num_q_heads
        pool = torch.zeros((2, 2, self.hp, self.P, d), dtype=self.dtype, device=self.device)
        q = torch.zeros((1, Hq, d), dtype=self.dtype, device=self.device)
        bt = torch.zeros((1, self.G, 1), dtype=torch.int32, device=self.device)
        lens = torch.ones((1, H), dtype=torch.int32, device=self.device)
        static_split_decode(q, pool, bt, lens, self.cache.slot_to_head[0], page_size=self.P, heads_per_group=self.hp,
                            max_len=1, num_sms=self.num_sms, config=self.decode_config)
        torch.cuda.synchronize()
        return decode_n_cta(kernel_resources(self.decode_config))

    # ------------------------------------------------------------------ tokens
    def _stream(self, rid: int) -> list[int]:
        req = self.sched.requests[rid]
        s = self.streams.setdefault(req.sid, [])
        if rid not in self._started:  # first chunk of this turn: its prompt joins the session's stream
            self._started.add(rid)
            s.extend(self.tokens.turn_ids(rid, req.new_tokens, start=len(s)).tolist())
        return s

    def forget_session(self, sid: str) -> None:
        self.streams.pop(sid, None)

    def _record_samples(self, plan: StepPlan, toks_np: np.ndarray, logits: torch.Tensor, pos: list[int],
                        last: list[int]) -> dict[int, int]:
        """Append each sampled token (decode rows, then the chunks that end a prompt) to its session's stream, log
        its logits if asked; returns {request id: token}."""
        kd, kp = plan.num_decode, plan.num_prefill
        sample_ids = plan.decode_ids.tolist() + [int(plan.prefill_ids[i]) for i in range(kp) if plan.prefill_last[i]]
        sampled = {}
        for j, (rid, tok) in enumerate(zip(sample_ids, toks_np.tolist())):
            sampled[rid] = tok
            s = self._stream(rid)
            s.append(self.tokens.output_id(rid, len(s), tok))
            if self.opts.record_logits:
                self.logit_log.append((rid, pos[j] if j < kd else pos[last[j - kd]], logits[j].to("cpu", copy=True)))
        return sampled

    # ------------------------------------------------------------------ graphs
    def graph_keys(self, max_context: int, max_batch: int | None = None) -> list[tuple[int, int]]:
        """Every (batch bucket, context bucket) a run with contexts up to ``max_context`` tokens and at most
        ``max_batch`` requests decoding together can replay."""
        if self.graphs is None:
            return []
        top = self.graphs.bucket(max_batch) if max_batch else None
        buckets = [b for b in self.graphs.buckets if top is None or b <= top]
        ctxs, c = [], context_bucket(1)
        while True:
            ctxs.append(c)
            if c >= context_bucket(max_context):
                break
            c *= 2
        if self.partition == "static":
            return [(b, c) for b in buckets for c in ctxs]
        # aot: one graph per distinct set of split maps (context buckets that launch the same CTAs share it)
        return list(dict.fromkeys((b, self.aot.canonical_context(b, c)) for b in buckets for c in ctxs))

    def capture_graphs(self, max_context: int, max_batch: int | None = None) -> None:
        """Capture ahead of a run (tangram-bench does, before its clock starts)."""
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture(self.graph_keys(max_context, max_batch))

    def _decode_body(self, bufs: StaticBuffers, bs: int, ctx: int, lo: int, hi: int, carry: tuple | None) -> tuple:
        """One captured piece of the decode step, layers [lo, hi) (the first piece embeds, the last ends with the
        logits and, greedy, the sampled tokens in the static buffers: lm_head and argmax are in the graph); reads
        ``bufs[:bs]`` only, so a replay sees the next step's inputs. Returns the carry the next piece reads."""
        L = self.cfg.num_layers
        st = {"kd": bs, "kp": 0, "ops": _Ops(False, self.cuda), "dec_tables": bufs.tables[:bs],
              "dec_lens": bufs.lens[:bs]}
        if self.partition == "aot":
            st["sched"] = self.aot.step(bs, ctx)
        else:
            st["max_len"] = [ctx] * L
        if carry is None:
            carry = self._stack_input(bufs.tokens[:bs], bufs.pos[:bs])
        carry = self._layer_range(carry, lo, hi, st)
        if hi == L:
            logits = self._lm_head(carry[1])
            bufs.logits[:bs].copy_(logits)
            if bufs.sampled is not None:
                bufs.sampled[:bs].copy_(logits.argmax(dim=-1))
        return carry

    def _use_graph(self, kd: int, kp: int) -> bool:
        return self.graphs is not None and not self.opts.time_ops and bool(self.engine.decode_graphed(kd, kp))

    # ------------------------------------------------------------------ step
    def _gather(self, plan: StepPlan) -> tuple[list[int], list[int], list[int]]:
        """Token ids and positions of the step's rows (decode rows first, then each chunk), chunk bounds."""
        ids, pos = [], []
        for rid, ctx in zip(plan.decode_ids.tolist(), plan.decode_ctx.tolist()):
            ids.append(self._stream(rid)[ctx - 1])
            pos.append(ctx - 1)
        bounds = [plan.num_decode]
        for rid, st, c in zip(plan.prefill_ids.tolist(), plan.prefill_start.tolist(), plan.prefill_tokens.tolist()):
            s = self._stream(rid)
            if st + c > len(s):
                raise RuntimeError(f"request {rid}: chunk [{st}, {st + c}) beyond its session's {len(s)} tokens")
            ids.extend(s[st:st + c])
            pos.extend(range(st, st + c))
            bounds.append(bounds[-1] + c)
        return ids, pos, bounds

    def _upload(self, arrays: dict) -> dict:
        """Every per-step int array to the device in one pinned host-to-device copy; device views by name."""
        return self.cache.upload(arrays, np.int32)

    def _tables_dev(self) -> torch.Tensor:
        """The scheduler's block table ``[rows, T, cap]`` on the device, kept current from its write log: a step
        uploads only the page ids written since the last one (at H_p 1 a decode row has 256 tables, and copying
        the rows' whole tables every step was 21-80 MB of host gathering and transfer at batch 64)."""
        arrays = self._table_write_arrays()
        if arrays:
            self._apply_table_writes(self.cache.upload(arrays, np.int64))
        return self._bt_dev

    def _table_write_arrays(self) -> dict:
        """The block-table writes the device mirror lacks as flat positions and page ids (empty when none, or when
        the mirror was just rebuilt from the whole table)."""
        bt = self.sched.bt
        w = None
        if (self._bt_dev is not None and self._bt_src is bt and tuple(self._bt_dev.shape) == bt.pages.shape
                and hasattr(bt, "take_writes")):
            w = bt.take_writes()
        if w is None:  # first use, a new or regrown table, or tracking switched off behind our back: start over
            self._bt_dev = self.cache.to_device(bt.pages).clone()  # a copy (on the CPU to_device shares memory)
            self._bt_src = bt
            if hasattr(bt, "track_writes"):
                bt.track_writes()
            return {}
        if not w.size:
            return {}
        _, T, cap = self._bt_dev.shape
        return {"w_at": (w[:, 0].astype(np.int64) * T + w[:, 1]) * cap + w[:, 2], "w_page": w[:, 3]}

    def _apply_table_writes(self, up: dict) -> None:
        if "w_at" in up:
            self._bt_dev.view(-1).index_put_((up["w_at"].long(),), up["w_page"].to(torch.int32))

    def _rows_tables(self, rows: np.ndarray) -> tuple[torch.Tensor, int]:
        """(``[len(rows), T, w]`` device tables of the rows, w) with w their widest table's pages."""
        w = max(1, int(self.sched.bt.npages[rows].max())) if len(rows) else 1
        dev = self._tables_dev()
        idx = self.cache.to_device(np.asarray(rows, dtype=np.int64))
        return dev.index_select(0, idx)[:, :, :w], w

    # tensor parallelism overrides these three (tangram.engine.tp): vocabulary-parallel embedding and lm_head, the
    # all-reduce after the row-parallel o and down projections
    def _embed(self, tok_t: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(tok_t)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, V]``."""
        return self.model.lm_head(h).float()

    def _layers(self, tok_t: torch.Tensor, pos_t: torch.Tensor, st: dict) -> torch.Tensor:
        """The decoder stack over the step's tokens; returns the final-normed hidden states [N, hidden]."""
        return self._layer_range(self._stack_input(tok_t, pos_t), 0, self.cfg.num_layers, st)[1]

    def _stack_input(self, tok_t: torch.Tensor, pos_t: torch.Tensor) -> tuple:
        """The carry entering layer 0: (residual stream x, its RMSNorm h, RoPE cos, sin)."""
        x = self._embed(tok_t)
        cos, sin = self.model.rope(pos_t, x.dtype)
        return x, rms_norm(x, self.model.model.layers[0].input_layernorm.weight, self.cfg.rms_eps), cos, sin

    def _layer_range(self, carry: tuple, lo: int, hi: int, st: dict) -> tuple:
        """Layers [lo, hi) on the carry (x, h, cos, sin); after the last layer h is the final-normed hidden.

        Per layer: RMSNorm (fused with the previous residual add), one qkv GEMM, RoPE of q/k in place with the
        decode rows' KV written into their pages (one kernel), attention, o GEMM, add + RMSNorm, one gate/up
        GEMM, SiLU * up, down GEMM: 9-10 launches, the same for every mode."""
        m, c = self.model, self.cfg
        ops: _Ops = st["ops"]
        kd = st["kd"]
        layers = m.model.layers
        eps = c.rms_eps
        x, h, cos, sin = carry
        N = x.shape[0]
        for l in range(lo, hi):
            layer = layers[l]
            a, mlp = layer.self_attn, layer.mlp
            if "stash_qkv" in st:  # deferred compression reads every layer's q/k/v after the last layer
                qkv = st["stash_qkv"][l]
                if a._qkv_bias is None:
                    torch.mm(h, a._qkv.t(), out=qkv)
                else:
                    torch.addmm(a._qkv_bias, h, a._qkv.t(), out=qkv)
            else:
                qkv = F.linear(h, a._qkv, a._qkv_bias)
            ops.start("kv_write")
            kw = {}
            if kd:
                kw = dict(kv_pool=self.cache.layer_pool(l), block_table=self.cache.layer_table(st["dec_tables"], l),
                          head_lens=st["dec_lens"][:, l], head_to_slot=self.cache.head_to_slot[l],
                          page_size=self.P, heads_per_group=self.hp, n_decode=kd)
            q, k, v = rope_qkv(qkv, cos, sin, num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, q_norm=a.q_norm.weight if c.qk_norm else None,
                               k_norm=a.k_norm.weight if c.qk_norm else None, eps=eps, **kw)
            ops.stop("kv_write")
            o = self._attention(l, q, k, v, st)
            x, h = add_rms_norm(x, self._reduce(F.linear(o.view(N, -1), a.o_proj.weight)),
                                layer.post_attention_layernorm.weight, eps)
            y = self._reduce(F.linear(silu_mul(F.linear(h, mlp._gate_up)), mlp.down_proj.weight))
            nw = layers[l + 1].input_layernorm.weight if l + 1 < len(layers) else m.model.norm.weight
            x, h = add_rms_norm(x, y, nw, eps)
        return x, h, cos, sin

    def _forward_eager(self, plan: StepPlan, ids, pos, bounds, last, ops: _Ops) -> tuple[torch.Tensor, dict, float]:
        """The step's forward issued op by op; returns (final hidden of the sampling rows, step state, host
        planning seconds)."""
        kd, kp = plan.num_decode, plan.num_prefill
        L, H = self.cfg.num_layers, self.cfg.num_kv_heads
        arrays = {"tok": np.asarray(ids), "pos": np.asarray(pos),
                  "rows": np.asarray(list(range(kd)) + last)}  # logits only for the rows that sample
        if kd:
            arrays["dec_lens"] = plan.decode_head_lens
        keep = None
        if kp:
            arrays["pf_lens"] = plan.prefill_head_lens
            arrays["cu"] = np.asarray(bounds) - kd
            c = plan.prefill_tokens
            if self.retention == "global" and self.opts.dynamic_keep == "profile":
                keep = self._drawn_keep(plan)
            elif self.retention == "global" and self.engine.budget_scope == "uniform":  # no threshold: per head
                keep = np.broadcast_to(np.ceil(self.layer_rho[None, :, None] * c[:, None, None] - 1e-9),
                                       (kp, L, H)).astype(np.int64)
            elif self.retention not in ("full", "global"):
                keep = plan.prefill_keep
            if keep is not None:  # every layer's per-head counts in the step's one copy
                arrays["keep"] = np.minimum(keep, c[:, None, None])
            elif self.retention == "global" and self.layer_rho is not None:  # per layer: its top-k over its heads
                Hg = self.selection_heads  # every KV head of the layer, on whichever rank it lives
                arrays["gk"] = np.ceil(self.layer_rho[None, :] * Hg * c[:, None] - 1e-9)  # [kp, L]
                gk_max = arrays["gk"].max(axis=0).astype(np.int64).tolist()
            elif self.retention == "global":  # cross-layer: one top-k over every layer, after the last layer
                arrays["gk"] = np.ceil(self.engine.rho * L * self.selection_heads * c - 1e-9)[:, None]  # [kp, 1]
                gk_max = [int(arrays["gk"].max())]
        st = dict(self._upload(arrays), kd=kd, kp=kp, bounds=bounds, ops=ops)
        if kd:
            st["dec_tables"], _ = self._rows_tables(plan.decode_rows)
        if kp:
            st["pf_tables"], _ = self._rows_tables(plan.prefill_rows)
        host_plan_s = 0.0
        if kd:
            if self.partition == "aot":
                ctx = int(plan.decode_ctx.max())
                st["sched"] = self.aot.step(kd, ctx)
            elif self.partition == "runtime":
                t = time.perf_counter()
                st["sched"] = runtime_plan_schedules(plan.decode_head_lens.astype(np.int32),
                                                     max(1, int(round(self.n_occ * self.engine.n_cta_scale))),
                                                     self.device)
                host_plan_s = time.perf_counter() - t
            else:
                st["max_len"] = plan.decode_head_lens.max(axis=(0, 2)).tolist()
        if kp:
            st["max_chunk"] = int(plan.prefill_tokens.max())
            st["gk_max"] = gk_max if "gk" in arrays else None
            st["pf_start"], st["pf_tokens"] = plan.prefill_start.tolist(), plan.prefill_tokens.astype(np.int64)
            st["realized"] = torch.zeros((kp, L, H), dtype=torch.int32, device=self.device)
            if self.retention == "global" and "keep" not in arrays and self.layer_rho is None:
                st["deferred"] = []  # cross-layer: (pooled scores, k, v, tables, lens) per layer
            elif "keep" in st and self._fused_snapkv(st):
                self._stash_for_deferred_compression(st, len(ids), kd)
        h = self._layers(st["tok"], st["pos"], st)
        if "deferred" in st:
            ops.start("compression")
            self._cross_layer_select(st)
            ops.stop("compression")
        elif "stash_qkv" in st:
            ops.start("compression")
            self._deferred_compress(st)
            ops.stop("compression")
        return h.index_select(0, st["rows"]), st, host_plan_s

    def _stash_for_deferred_compression(self, st: dict, n_rows: int, kd: int) -> None:
        """Buffers for every layer's qkv projection and prefill LSE of the step, when they fit
        DEFER_COMPRESS_MAX_BYTES: their compression then runs once after the last layer (:meth:`_deferred_compress`)."""
        L, Hq = self.cfg.num_layers, self.cfg.num_q_heads
        w = self.model.model.layers[0].self_attn._qkv
        n_pf = n_rows - kd
        need = L * n_rows * w.shape[0] * w.element_size() + L * Hq * n_pf * 4
        if need > DEFER_COMPRESS_MAX_BYTES:
            return
        st["stash_qkv"] = torch.empty((L, n_rows, w.shape[0]), dtype=w.dtype, device=self.device)
        st["stash_lse"] = torch.empty((L, Hq, n_pf), dtype=torch.float32, device=self.device)

    def _deferred_compress(self, st: dict) -> None:
        """SnapKV compression of the step's chunks at every layer in one launch (plus its copy launch), from the
        stacked projections (RoPE applied in place) and LSE the layer loop left."""
        qkv = st.pop("stash_qkv")
        q0, k0, v0 = st.pop("stash_views")  # layer 0's prefill rows: the same offsets and strides in every layer

        def stacked(t):
            return torch.as_strided(qkv, (qkv.shape[0], *t.shape), (qkv.stride(0), *t.stride()), t.storage_offset())

        P = self.score_params
        width = score_width(max(self.engine.chunk_size, st["max_chunk"]))
        snapkv_compress_layers(stacked(q0), stacked(k0), stacked(v0), st.pop("stash_lse"), st["cu"], st["max_chunk"],
                               st["keep"], self.cache.stacked_pool(), self.cache.stacked_tables(st["pf_tables"]),
                               st["pf_lens"], self.cache.slot_to_head, page_size=self.P, heads_per_group=self.hp,
                               window=P.window, pool_kernel=P.kernel, sm_scale=self.scale, width=width,
                               kept=st["realized"])

    def _forward_graph(self, plan: StepPlan, ids, pos, src=None,
                       prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A graphed decode step: all host work first (table writes since the last step, rows, tokens, positions,
        lengths), then one upload, the table writes and row gather, the static-buffer copies and the replays, back
        to back, so the GPU does not wait on the host between them. ``src`` (asynchronous steps): per row, the row
        of ``prev`` (the step in flight's device tokens) that holds its input token, -1 where ``ids`` has it."""
        if self.partition == "static":
            ctx = context_bucket(int(plan.decode_head_lens.max()))
        else:
            ctx = self.aot.canonical_context(plan.num_decode, int(plan.decode_ctx.max()))
        rows = np.asarray(plan.decode_rows, dtype=np.int64)
        w = max(1, int(self.sched.bt.npages[rows].max())) if rows.size else 1
        arrays = {"rows": rows, "tok": np.asarray(ids), "pos": np.asarray(pos), "lens": plan.decode_head_lens,
                  **self._table_write_arrays()}
        if src is not None:
            arrays["src"] = np.asarray(src)
        up = self.cache.upload(arrays, np.int64)
        self._apply_table_writes(up)
        tables = self._bt_dev.index_select(0, up["rows"])[:, :, :w]
        tok = up["tok"]
        if src is not None:  # the previous step's samples, read on the device in stream order (no host round trip)
            tok = torch.where(up["src"] >= 0, prev.index_select(0, up["src"].clamp(min=0)), tok)
        return self.graphs.run(tok, up["pos"], tables, up["lens"], ctx)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; it is complete (tokens in the streams, duration measured) when this returns."""
        if self._queue:
            raise RuntimeError("execute() while launched steps are not completed: call complete() first")
        return self._execute_sync(plan)

    # ------------------------------------------------------------------ asynchronous steps
    @property
    def runs_ahead(self) -> bool:
        """The harness drives this executor by ``launch`` / ``complete`` (it may plan the next step while one runs)."""
        return bool(self.opts.async_steps) and self.graphs is not None

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> bool:
        """Start one step. True: it is in flight (a graphed pure-decode step with ``async_steps``): the scheduler
        may plan the next step, whose launch reads this one's tokens on the device, before :meth:`complete`
        returns this one. False: it ran synchronously (after completing what was in flight, since it reads the
        host token streams). Either way :meth:`complete` returns the results in launch order."""
        kd, kp = plan.num_decode, plan.num_prefill
        if not (self.opts.async_steps and kp == 0 and self._use_graph(kd, kp)):
            self._drain()
            self._queue.append(self._execute_sync(plan))
            return False
        # at most one step stays in flight under the new one: the newest, whose tokens are the new one's inputs
        self._drain(keep_last=bool(self._queue) and isinstance(self._queue[-1], _InFlight))
        prev = self._queue[-1] if self._queue and isinstance(self._queue[-1], _InFlight) else None
        start = None if prev is not None else _mark(self.cuda)
        host_s = self.sched.take_host_s() if hasattr(self.sched, "take_host_s") else 0.0
        if plan.copy_src.size:
            self.cache.copy_pages(plan.copy_src, plan.copy_dst)
        ids, pos, src, fed = self._gather_ahead(plan, prev)
        captures0 = self.graphs.stats.capture_s
        logits, toks = self._forward_graph(plan, ids, pos, src if fed else None, prev.toks if fed else None)
        if toks is None:
            toks = self.sampler(logits)
        host = torch.empty(kd, dtype=torch.long, pin_memory=self.cuda)
        host.copy_(toks, non_blocking=True)  # lands when the step does; read after `end` completes
        keep = logits.clone() if self.opts.record_logits else None
        end = _mark(self.cuda)
        self.device_fed += fed
        self._queue.append(_InFlight(plan, toks, host, end, start, prev.end if prev is not None else None,
                                     {rid: j for j, rid in enumerate(plan.decode_ids.tolist())}, pos, keep, host_s,
                                     self.graphs.stats.capture_s - captures0, fed))
        return True

    @torch.inference_mode()
    def complete(self) -> StepResult:
        """The result of the oldest launched step, waiting for it on the device if it is in flight."""
        if not self._queue:
            raise RuntimeError("complete() without a launched step")
        item = self._queue.popleft()
        return self._finish(item) if isinstance(item, _InFlight) else item

    def _drain(self, keep_last: bool = False) -> None:
        """Complete every step in flight (all but the newest with ``keep_last``), in launch order; their results
        stay queued for :meth:`complete`."""
        n = len(self._queue) - (1 if keep_last else 0)
        for i in range(max(0, n)):
            if isinstance(self._queue[i], _InFlight):
                self._queue[i] = self._finish(self._queue[i])

    def _gather_ahead(self, plan: StepPlan, prev: _InFlight | None) -> tuple[list, list, list, int]:
        """Input ids, positions and device sources of an asynchronous decode step's rows. A row whose stream ends
        just before the position it feeds, and that sampled in ``prev`` (still in flight), is fed that sample: read
        on the device (``src`` = its row there; ``ids`` holds PENDING_TOKEN), unless a shared-prefix declaration
        fixes the id at that position (the host knows it: what ``TokenSource.output_id`` will record). Any other row
        reads its stream (a position the stream already holds, e.g. a prompt token, is never the sample). Returns
        (ids, pos, src, rows fed on the device)."""
        ids, pos, src = [], [], []
        rows = prev.rows if prev is not None else {}
        fed = 0
        for rid, ctx in zip(plan.decode_ids.tolist(), plan.decode_ctx.tolist()):
            p = ctx - 1
            j = rows.get(rid)
            s = self._stream(rid)
            if j is None or len(s) > p:
                ids.append(s[p])
                src.append(-1)
            elif (d := self.tokens.declared_id(rid, p)) is not None:
                ids.append(d)
                src.append(-1)
            else:
                ids.append(PENDING_TOKEN)
                src.append(j)
                fed += 1
            pos.append(p)
        return ids, pos, src, fed

    def _finish(self, rec: _InFlight) -> StepResult:
        """Wait for an in-flight step, record its tokens in the streams, and time it: from the previous step's end
        when it was launched behind one (the time between consecutive step completions, which counts whatever host
        work the GPU waited through and nothing it did not), else from its own start plus the scheduler's time
        before it (as a synchronous step)."""
        if self.cuda:
            rec.end.synchronize()
        sampled = self._record_samples(rec.plan, rec.host.numpy(), rec.logits, rec.pos, [])
        behind = rec.start is None
        span = _elapsed(rec.prev_end if behind else rec.start, rec.end, self.cuda)
        breakdown = {"host_overlapped": rec.host_s} if behind else {"host": rec.host_s}
        if rec.capture_s:
            breakdown["graph_capture"] = rec.capture_s
        breakdown["engine_graph"] = max(0.0, span - rec.capture_s)
        self.steps += 1
        return StepResult(rec.plan.step, span + (0.0 if behind else rec.host_s), breakdown, None, sampled)

    def _execute_sync(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        ops = _Ops(self.opts.time_ops, self.cuda)
        kd, kp = plan.num_decode, plan.num_prefill
        if plan.copy_src.size:  # shared prefixes: copy-on-write of the partial pages a hit continues
            self.cache.copy_pages(plan.copy_src, plan.copy_dst)
        ids, pos, bounds = self._gather(plan)
        last = [bounds[i + 1] - 1 for i in range(kp) if plan.prefill_last[i]]
        host_plan_s, st = 0.0, {}
        graphed = self._use_graph(kd, kp)
        captures0 = self.graphs.stats.capture_s if self.graphs is not None else 0.0
        ops.start("forward")
        if graphed:
            logits, toks = self._forward_graph(plan, ids, pos)
            if toks is None:
                toks = self.sampler(logits)
        else:
            h, st, host_plan_s = self._forward_eager(plan, ids, pos, bounds, last, ops)
            ops.start("lm_head_sampling")
            logits = self._lm_head(h)
            toks = self.sampler(logits)
            ops.stop("lm_head_sampling")
        ops.stop("forward")
        toks_np = toks.cpu().numpy()  # syncs the step
        realized = st["realized"].cpu().numpy().astype(np.int64) if kp and self.retention == "global" else None
        if self.cuda:
            torch.cuda.synchronize()
        gpu_s = time.perf_counter() - t0

        sampled = self._record_samples(plan, toks_np, logits, pos, last)
        host_s = self.sched.take_host_s() if hasattr(self.sched, "take_host_s") else 0.0
        breakdown = {"host": host_s}
        if host_plan_s:
            breakdown["runtime_plan"] = host_plan_s
        if graphed:
            cap = self.graphs.stats.capture_s - captures0
            if cap:
                breakdown["graph_capture"] = cap
            breakdown["engine_graph"] = gpu_s - cap
        elif self.opts.time_ops:
            tot = ops.totals()
            fwd = tot.pop("forward", 0.0)
            breakdown.update(tot)
            breakdown["dense"] = max(0.0, fwd - sum(tot.values()))
            breakdown["step_overhead"] = max(0.0, gpu_s - host_plan_s - fwd)
        else:
            breakdown["engine"] = gpu_s - host_plan_s
        self.steps += 1
        return StepResult(plan.step, gpu_s + host_s, breakdown, realized, sampled)

    # ------------------------------------------------------------------ attention
    def _attention(self, l: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: dict) -> torch.Tensor:
        """Attention of layer ``l`` for the step's rows: ``q [N, Hq, d]``, ``k``/``v [N, H, d]`` (views into
        the qkv projection, RoPE applied; the decode rows' K/V are already in their pages) -> ``[N, Hq, d]``."""
        ops: _Ops = st["ops"]
        kd, kp = st["kd"], st["kp"]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        pool = self.cache.layer_pool(l)
        s2h = self.cache.slot_to_head[l]
        if kd:
            tables = self.cache.layer_table(st["dec_tables"], l)
            lens = st["dec_lens"][:, l]
            ops.start("decode_attention")
            if self.partition == "static":
                static_split_decode(q[:kd], pool, tables, lens, s2h, page_size=self.P, heads_per_group=self.hp,
                                    max_len=st["max_len"][l], num_sms=self.num_sms, out=out[:kd],
                                    config=self.decode_config)
            else:
                launch_decode(q[:kd], pool, tables, lens, s2h, st["sched"][l], page_size=self.P,
                              heads_per_group=self.hp, out=out[:kd], config=self.decode_config)
            ops.stop("decode_attention")
        if kp:
            self._prefill(l, q[kd:], k[kd:], v[kd:], out[kd:], pool, st)
        return out

    def _prefill(self, l, q, k, v, out, pool, st) -> None:
        """Every prefill chunk of the step at layer ``l``: batched chunk attention, then compression (scores,
        per-head top-k and the copy of the kept K/V into the pages: two launches for all chunks)."""
        ops: _Ops = st["ops"]
        tables = self.cache.layer_table(st["pf_tables"], l)
        lens = st["pf_lens"][:, l]
        cu, cmax = st["cu"], st["max_chunk"]
        h2s, s2h = self.cache.head_to_slot[l], self.cache.slot_to_head[l]
        ops.start("prefill_attention")
        _, lse = prefill_attention_varlen(q, k, v, cu, cmax, pool, tables, lens, h2s, page_size=self.P,
                                          heads_per_group=self.hp, out=out,
                                          lse=st["stash_lse"][l] if "stash_lse" in st else None)
        ops.stop("prefill_attention")
        if "stash_qkv" in st:  # compressed after the last layer, every layer at once (_deferred_compress)
            if "stash_views" not in st:
                st["stash_views"] = (q, k, v)
            return
        ops.start("compression")
        kw = dict(page_size=self.P, heads_per_group=self.hp)
        if self.retention == "full":
            select_scatter(None, k, v, cu, cmax, None, pool, tables, lens, s2h, **kw)
        else:
            realized = st["realized"][:, l]
            if "keep" in st and self._fused_snapkv(st):  # score, kvpress's finish, top-k; then the copy
                P = self.score_params
                width = score_width(max(self.engine.chunk_size, cmax))  # a longer chunk (never planned) widens it
                snapkv_compress(q, k, v, lse, cu, cmax, st["keep"][:, l], pool, tables, lens, s2h, window=P.window,
                                pool_kernel=P.kernel, sm_scale=self.scale, width=width, kept=realized, **kw)
                ops.stop("compression")
                return
            scores = self._chunk_scores(l, q, k, v, lse, cu, cmax, st)  # finished: select_scatter pools nothing
            if "keep" in st:  # per-head counts: the plan's (static modes), drawn (dynamic, profile) or the uniform scope
                select_scatter(scores, k, v, cu, cmax, st["keep"][:, l], pool, tables, lens, s2h, pool_kernel=1,
                               kept=realized, **kw)
            elif "deferred" in st:  # dynamic, cross-layer: selected once every layer has scored the chunks
                st["deferred"].append((scores, k, v, tables, lens))
            else:  # dynamic, per-layer: the layer's top-k of each chunk over all its heads, as per-head counts
                counts = self._own_heads(global_keep_counts(self._all_heads(scores, [l]), cu, st["gk"][:, l],
                                                            st["gk_max"][l]), [l])
                select_scatter(scores, k, v, cu, cmax, counts, pool, tables, lens, s2h, pool_kernel=1, kept=realized,
                               **kw)
        ops.stop("compression")

    def _fused_snapkv(self, st: dict) -> bool:
        """SnapKV/PyramidKV with every chunk longer than the window and per-head counts, in an engine whose chunks
        are at most FUSED_COMPRESS_MAX_CHUNK tokens: the case :func:`tangram.kernels.compress.snapkv_compress`
        does in two launches (score + select, then the copy; the scores never leave the first). Decided per engine,
        not per step, so one engine compiles one path in its warm-up."""
        return method_spec(self.engine.score_method).scorer == "snapkv" and \
            self.engine.chunk_size <= FUSED_COMPRESS_MAX_CHUNK and int(st["pf_tokens"].min()) > self.score_params.window

    def _chunk_scores(self, l: int, q, k, v, lse, cu, max_chunk: int, st: dict) -> torch.Tensor:
        """Importance ``[kp, H, CS]`` (fp32, slot order, 0 past a chunk's end) of every new token of the step's
        chunks at layer ``l`` by ``engine.score_method`` (:func:`tangram.kernels.scoring.engine_chunk_scores`,
        the scores the profiles are calibrated with). SnapKV/PyramidKV with every chunk longer than the window:
        one launch for all chunks (the raw window sums) and kvpress's finish batched (mean over the window's
        queries, pooling over the tokens before the window, the window kept); other methods chunk by chunk."""
        kp, H = cu.numel() - 1, self.cfg.num_kv_heads
        # one width per engine (its chunk size), not per step: the selection kernel's block is a compile-time
        # constant, and a step whose longest chunk fell in another power-of-two class compiled inside the run
        CS = score_width(max(self.engine.chunk_size, max_chunk))  # a longer chunk (never planned) widens it
        spec, P = method_spec(self.engine.score_method), self.score_params
        c = st["pf_tokens"]
        W = P.window
        if spec.scorer == "snapkv" and int(c.min()) > W:
            raw = snapkv_scores_varlen(q, k, lse, cu, max_chunk, self.cache.head_to_slot[l], window=W,
                                       sm_scale=self.scale, width=CS)
            return snapkv_finish_batched(raw, cu[1:] - cu[:-1], W, self.cfg.num_q_heads // H, P.kernel)
        out = torch.zeros((kp, H, CS), dtype=torch.float32, device=q.device)
        bounds = np.concatenate([[0], np.cumsum(c)])
        s2h, h2s = self.cache.slot_to_head[l], self.cache.head_to_slot[l]
        for i in range(kp):
            a, b = int(bounds[i]), int(bounds[i + 1])
            out[i, :, :b - a] = engine_chunk_scores(self.engine.score_method, q[a:b], k[a:b], v[a:b], lse[:, a:b],
                                                    s2h, pos0=st["pf_start"][i], inv_freq=self.model.inv_freq,
                                                    params=P, head_to_slot=h2s, scale=self.scale)
        return out

    # dynamic mode's selection compares every KV head of a layer; under tensor parallelism they live on several
    # ranks (tangram.engine.tp overrides these three), on one GPU they are all here
    @property
    def selection_heads(self) -> int:
        """KV heads of a layer that one global top-k compares."""
        return self.cfg.num_kv_heads

    def _all_heads(self, scores: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """``[kp, X*H_here, CS]`` scores of ``layers`` (layer-major, slot order) -> ``[kp, X*H, CS]`` of every head
        of those layers, in KV-head order (so the top-k's tie-break at the threshold does not depend on the head
        placement; on one GPU the dynamic layout's slots are the heads)."""
        return scores

    def _own_heads(self, counts: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """Per-head counts ``[kp, X*H]`` in KV-head order -> those of the slots held here."""
        return counts

    def _drawn_keep(self, plan: StepPlan) -> np.ndarray:
        """``dynamic_keep='profile'``: the per-head counts drawn from the profile (as the cost model draws them)."""
        return drawn_keep(self.sched.profile, self.sched.layout, self.opts.sampling.seed, plan)

    def _cross_layer_select(self, st: dict) -> None:
        """Dynamic mode, cross-layer scope: each chunk keeps its top ceil(rho * L * H * c) keys over every layer and
        head at once (one threshold), then each layer's kept K/V is copied as in the per-layer path. The chunk's
        own attention never reads its pages, so deferring the copy to the end of the step changes nothing."""
        rows = st.pop("deferred")
        cu, cmax = st["cu"], st["max_chunk"]
        L, H = len(rows), self.cfg.num_kv_heads
        every = list(range(L))
        scores = self._all_heads(torch.cat([r[0] for r in rows], dim=1), every)  # [kp, L*H, CS], layer-major
        counts = self._own_heads(global_keep_counts(scores, cu, st["gk"][:, 0], st["gk_max"][0]), every)
        counts = counts.view(-1, L, H)
        kw = dict(page_size=self.P, heads_per_group=self.hp, pool_kernel=1)
        for l, (sc, k, v, tables, lens) in enumerate(rows):
            select_scatter(sc, k, v, cu, cmax, counts[:, l].contiguous(), self.cache.layer_pool(l), tables, lens,
                           self.cache.slot_to_head[l], kept=st["realized"][:, l], **kw)

    # ------------------------------------------------------------------ checks
    def pages_in_use(self) -> int:
        return int(self.sched.pool.n_used)

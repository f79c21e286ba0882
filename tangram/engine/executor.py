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
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from tangram.budgets import drawn_keep, layer_targets
from tangram.config import EngineConfig
from tangram.engine.cuda_graphs import DecodeGraphs, StaticBuffers, context_bucket
from tangram.engine.kv_cache import KVCache
from tangram.engine.model import AttnContext, Transformer
from tangram.engine.sampling import Sampler, SamplingParams
from tangram.errors import ConfigError
from tangram.kernels import (
    AotSplitTable, launch_decode, prefill_attention, runtime_plan_schedules, scatter_kept, select_keep,
    static_split_decode,
)
from tangram.kernels.scoring import ScoreParams, engine_chunk_scores, method_spec
from tangram.plan import StepPlan, StepResult
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
    """Prompt ids per turn: tokenized ``text`` when present, else seeded random ids (reproducible per rid)."""

    def __init__(self, vocab: int, seed: int = 0, texts: dict[int, str] | None = None, tokenizer=None):
        self.vocab, self.seed = vocab, seed
        self.texts = texts or {}
        self.tokenizer = tokenizer

    @classmethod
    def from_trace(cls, trace, vocab: int, seed: int = 0, tokenizer=None) -> "TokenSource":
        texts = {i: t.text for i, t in enumerate(trace.turns) if t.text} if tokenizer is not None else {}
        return cls(vocab, seed, texts, tokenizer)

    def turn_ids(self, rid: int, n: int) -> np.ndarray:
        text = self.texts.get(rid)
        if text and self.tokenizer is not None:
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64) % self.vocab
            if ids.size:
                return np.resize(ids, n)  # repeats when the text is shorter than the trace says
        return np.random.default_rng([self.seed, rid]).integers(0, self.vocab, n, dtype=np.int64)


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
    graph_max_context: int | None = None  # tokens the static block tables hold per table (None: the block
    # table's width at start, regrown on demand); tangram-bench passes the trace's longest session


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
        if self.opts.num_sms is not None:
            self.num_sms = self.opts.num_sms
        elif self.cuda:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:  # CPU (reference kernels or the Triton interpreter): one "SM" per core keeps grids small
            self.num_sms = os.cpu_count() or 1
        self.n_occ = self.opts.n_occ or self._measure_n_occ()
        self.aot = None
        if self.partition == "aot":
            B = sched.profile.B if sched.profile is not None else np.ones((self.cfg.num_layers, self.cfg.num_kv_heads))
            self.aot = AotSplitTable(B, lay.perm, self.hp, self.n_occ, max_batch=max(1, self.engine.max_num_seqs),
                                     waves=self.engine.n_cta_scale, rounding=self.engine.split_rounding,
                                     device=self.device)
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
                num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads, hidden=self.cfg.hidden,
                dtype=self.dtype, device=self.device, scratch_page=self.scratch_page, width=width,
                body=self._decode_body, emulate=not self.cuda)

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
                            max_len=1, num_sms=self.num_sms)
        torch.cuda.synchronize()
        return decode_n_cta()

    # ------------------------------------------------------------------ tokens
    def _stream(self, rid: int) -> list[int]:
        req = self.sched.requests[rid]
        s = self.streams.setdefault(req.sid, [])
        if rid not in self._started:  # first chunk of this turn: its prompt joins the session's stream
            self._started.add(rid)
            s.extend(self.tokens.turn_ids(rid, req.new_tokens).tolist())
        return s

    def forget_session(self, sid: str) -> None:
        self.streams.pop(sid, None)

    # ------------------------------------------------------------------ graphs
    def graph_keys(self, max_context: int, max_batch: int | None = None) -> list[tuple[int, int]]:
        """Every (batch bucket, context bucket) a run with contexts up to ``max_context`` tokens and at most
        ``max_batch`` requests decoding together can replay."""
        if self.graphs is None:
            return []
        top = self.graphs.bucket(max_batch) if max_batch else None
        buckets = [b for b in self.graphs.buckets if top is None or b <= top]
        ctxs = [0]
        if self.partition == "static":
            ctxs, c = [], context_bucket(1)
            while True:
                ctxs.append(c)
                if c >= context_bucket(max_context):
                    break
                c *= 2
        return [(b, c) for b in buckets for c in ctxs]

    def capture_graphs(self, max_context: int, max_batch: int | None = None) -> None:
        """Capture ahead of a run (tangram-bench does, before its clock starts)."""
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture(self.graph_keys(max_context, max_batch))

    def _decode_body(self, bufs: StaticBuffers, bs: int, ctx: int) -> None:
        """The captured decode forward: reads ``bufs[:bs]`` only, so a replay sees the next step's inputs."""
        tables, lens = bufs.tables[:bs], bufs.lens[:bs]
        st = {"kd": bs, "kp": 0, "bounds": [bs], "ops": _Ops(False, self.cuda), "dec_tables": tables,
              "dec_lens": lens}
        st["dec_page"], st["dec_off"] = self.cache.decode_slots(tables, lens)
        if self.partition == "aot":
            st["sched"] = [self.aot.lookup(l, bs) for l in range(self.cfg.num_layers)]
        else:
            st["max_len"] = [ctx] * self.cfg.num_layers
        x = self._layers(bufs.tokens[:bs], bufs.pos[:bs], st)
        bufs.hidden[:bs].copy_(self.model.model.norm(x[0]))

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

    def _layers(self, tok_t: torch.Tensor, pos_t: torch.Tensor, st: dict) -> torch.Tensor:
        m = self.model
        x = m.model.embed_tokens(tok_t)[None]
        cos, sin = m.rope(pos_t, x.dtype)
        ctx = AttnContext(pos_t, {"step": st})
        for layer in m.model.layers:
            x = layer(x, cos, sin, self._attention, ctx)
        return x

    def _forward_eager(self, plan: StepPlan, ids, pos, bounds, last, ops: _Ops) -> tuple[torch.Tensor, dict, float]:
        """The step's forward issued op by op; returns (final hidden of the sampling rows, step state, host
        planning seconds)."""
        kd, kp = plan.num_decode, plan.num_prefill
        L, H = self.cfg.num_layers, self.cfg.num_kv_heads
        tok_t = self.cache.to_device(np.asarray(ids, dtype=np.int64))
        pos_t = self.cache.to_device(np.asarray(pos, dtype=np.int64))
        st = {"kd": kd, "kp": kp, "bounds": bounds, "ops": ops}
        host_plan_s = 0.0
        if kd:
            st["dec_tables"] = self.cache.tables(self.sched.bt.pages[plan.decode_rows])
            lens_np = plan.decode_head_lens.astype(np.int32)
            st["dec_lens"] = self.cache.to_device(lens_np)
            st["dec_page"], st["dec_off"] = self.cache.decode_slots(st["dec_tables"], st["dec_lens"])
            if self.partition == "aot":
                st["sched"] = [self.aot.lookup(l, kd) for l in range(L)]
            elif self.partition == "runtime":
                t = time.perf_counter()
                st["sched"] = runtime_plan_schedules(lens_np, max(1, int(round(self.n_occ * self.engine.n_cta_scale))),
                                                     self.device)
                host_plan_s = time.perf_counter() - t
            else:
                st["max_len"] = plan.decode_head_lens.max(axis=(0, 2)).tolist()
        if kp:
            st["pf_start"] = plan.prefill_start.tolist()
            st["pf_tables"] = self.cache.tables(self.sched.bt.pages[plan.prefill_rows])
            st["pf_lens"] = self.cache.to_device(plan.prefill_head_lens.astype(np.int32))
            keep = None
            if self.retention == "global" and self.opts.dynamic_keep == "profile":
                keep = drawn_keep(self.sched.profile, self.sched.layout, self.opts.sampling.seed, plan)
            elif self.retention == "global" and self.engine.budget_scope == "uniform":  # no threshold: per head
                c = plan.prefill_tokens[:, None, None]
                keep = np.broadcast_to(np.ceil(self.layer_rho[None, :, None] * c - 1e-9), (kp, L, H)).astype(np.int64)
            elif self.retention not in ("full", "global"):
                keep = plan.prefill_keep
            if keep is not None:  # every layer's per-head counts in one pinned copy (no per-layer stream sync)
                keep = np.minimum(keep, plan.prefill_tokens[:, None, None])
                st["keep_np"], st["keep_dev"] = keep, self.cache.to_device(keep.astype(np.int32))
            st["realized"] = torch.zeros((kp, L, H), dtype=torch.int32, device=self.device)
            if self.retention == "global" and "keep_dev" not in st and self.layer_rho is None:
                st["deferred"] = [[] for _ in range(kp)]  # cross-layer: (scores, k, v, table, lens) per layer
        x = self._layers(tok_t, pos_t, st)
        if "deferred" in st:
            ops.start("compression")
            self._cross_layer_select(st, bounds)
            ops.stop("compression")
        # logits only for the rows that sample: decode rows and the last token of completing chunks
        rows = self.cache.to_device(np.asarray(list(range(kd)) + last, dtype=np.int64))
        return self.model.model.norm(x[0].index_select(0, rows)), st, host_plan_s

    def _forward_graph(self, plan: StepPlan, ids, pos) -> torch.Tensor:
        rows = plan.decode_rows
        pages = self.sched.bt.pages
        w = max(1, int(self.sched.bt.npages[rows].max()))
        ctx = context_bucket(int(plan.decode_head_lens.max())) if self.partition == "static" else 0
        return self.graphs.run(np.asarray(ids), np.asarray(pos), pages[rows, :, :w], plan.decode_head_lens, ctx,
                               self.cache.to_device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        ops = _Ops(self.opts.time_ops, self.cuda)
        kd, kp = plan.num_decode, plan.num_prefill
        ids, pos, bounds = self._gather(plan)
        last = [bounds[i + 1] - 1 for i in range(kp) if plan.prefill_last[i]]
        host_plan_s, st = 0.0, {}
        graphed = self._use_graph(kd, kp)
        captures0 = self.graphs.stats.capture_s if self.graphs is not None else 0.0
        ops.start("forward")
        if graphed:
            h = self._forward_graph(plan, ids, pos)
        else:
            h, st, host_plan_s = self._forward_eager(plan, ids, pos, bounds, last, ops)
        ops.start("lm_head_sampling")
        logits = self.model.lm_head(h).float()
        toks = self.sampler(logits)
        ops.stop("lm_head_sampling")
        ops.stop("forward")
        toks_np = toks.cpu().numpy()  # syncs the step
        realized = st["realized"].cpu().numpy().astype(np.int64) if kp and self.retention == "global" else None
        if self.cuda:
            torch.cuda.synchronize()
        gpu_s = time.perf_counter() - t0

        sample_ids = plan.decode_ids.tolist() + [int(plan.prefill_ids[i]) for i in range(kp) if plan.prefill_last[i]]
        sampled = {}
        for j, (rid, tok) in enumerate(zip(sample_ids, toks_np.tolist())):
            sampled[rid] = tok
            self._stream(rid).append(tok)
            if self.opts.record_logits:
                self.logit_log.append((rid, pos[j] if j < kd else pos[last[j - kd]], logits[j].cpu()))
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

    # ------------------------------------------------------------------ attention backend
    def _attention(self, l: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        st = ctx.extra["step"]
        ops: _Ops = st["ops"]
        kd, bounds = st["kd"], st["bounds"]
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, H*, d]
        out = torch.empty_like(q)
        pool = self.cache.layer_pool(l)
        s2h = self.cache.slot_to_head[l]
        if kd:
            tables = self.cache.layer_table(st["dec_tables"], l)
            lens = st["dec_lens"][:, l]
            ops.start("kv_write")
            self.cache.write_decode(l, st["dec_page"][:, l], st["dec_off"][:, l], k[:kd], v[:kd])
            ops.stop("kv_write")
            ops.start("decode_attention")
            qd = q[:kd].contiguous()
            if self.partition == "static":
                static_split_decode(qd, pool, tables, lens, s2h, page_size=self.P, heads_per_group=self.hp,
                                    max_len=st["max_len"][l], num_sms=self.num_sms, out=out[:kd])
            else:
                launch_decode(qd, pool, tables, lens, s2h, st["sched"][l], page_size=self.P,
                              heads_per_group=self.hp, out=out[:kd])
            ops.stop("decode_attention")
        for i in range(st["kp"]):
            a, b = bounds[i], bounds[i + 1]
            qi, ki, vi = q[a:b], k[a:b], v[a:b]
            table = self.cache.layer_table(st["pf_tables"], l)[i]
            hl = st["pf_lens"][i, l].clone()
            ops.start("prefill_attention")
            o, lse = prefill_attention(qi, ki, vi, pool, table, hl, s2h, page_size=self.P, heads_per_group=self.hp,
                                       head_to_slot=self.cache.head_to_slot[l])
            out[a:b] = o
            ops.stop("prefill_attention")
            ops.start("compression")
            c = b - a
            if self.retention == "full":
                keep = torch.ones((self.cfg.num_kv_heads, c), dtype=torch.bool, device=q.device)
                counts = None
            else:
                scores = engine_chunk_scores(self.engine.score_method, qi, ki, vi, lse, s2h, pos0=st["pf_start"][i],
                                             inv_freq=self.model.inv_freq, params=self.score_params,
                                             head_to_slot=self.cache.head_to_slot[l], scale=self.scale)
                if "keep_dev" in st:  # per-head counts: the plan's (static), drawn (dynamic, profile) or uniform scope
                    keep, counts = select_keep(scores, st["keep_np"][i, l], counts=st["keep_dev"][i, l])
                elif "deferred" in st:  # dynamic, cross-layer: selected once every layer has scored the chunk
                    st["deferred"][i].append((scores, ki, vi, table, hl))
                    ops.stop("compression")
                    continue
                else:  # dynamic, per-layer: the layer's top-k over all its heads
                    gk = int(math.ceil(self.layer_rho[l] * self.cfg.num_kv_heads * c - 1e-9))
                    keep, counts = select_keep(scores, global_keep=gk)
                if self.retention == "global":
                    st["realized"][i, l] = counts
            scatter_kept(ki, vi, keep, pool, table, hl, s2h, page_size=self.P, heads_per_group=self.hp,
                         counts=counts)
            ops.stop("compression")
        return out.transpose(0, 1)[None]

    def _cross_layer_select(self, st: dict, bounds: list[int]) -> None:
        """Dynamic mode, cross-layer scope: each chunk keeps its top ceil(rho * L * H * c) keys over every layer and
        head at once (one threshold), then each layer's kept K/V is scattered as in the per-layer path. The chunk's
        own attention never reads its pages, so deferring the scatter to the end of the step changes nothing."""
        for i, rows in enumerate(st["deferred"]):
            c = bounds[i + 1] - bounds[i]
            scores = torch.stack([r[0] for r in rows])  # [L, H, c], slot order within each layer
            L, H = scores.shape[:2]
            gk = int(math.ceil(self.engine.rho * L * H * c - 1e-9))
            keep, counts = select_keep(scores.reshape(L * H, c), global_keep=gk)
            keep, counts = keep.view(L, H, c), counts.view(L, H)
            for l, (_, ki, vi, table, hl) in enumerate(rows):
                scatter_kept(ki, vi, keep[l], self.cache.layer_pool(l), table, hl, self.cache.slot_to_head[l],
                             page_size=self.P, heads_per_group=self.hp, counts=counts[l])
            st["realized"][i] = counts

    # ------------------------------------------------------------------ checks
    def pages_in_use(self) -> int:
        return int(self.sched.pool.n_used)

"""Tensor-parallel engine (issue 16.1): one scheduler on rank 0, the model and the KV pool sharded over ``tp`` ranks.

Megatron-style sharding of the same full state dict a single GPU loads (so TP=N and TP=1 are comparable), by the
placement the scheduler's layout already encodes (``KVLayout.perm`` is rank-major, :mod:`tangram.placement`):

* attention, column-parallel q/k/v: rank ``r`` holds KV heads ``perm[l, r*H/N:(r+1)*H/N]`` of layer ``l`` in slot
  order, each with its ``gqa`` query heads; o_proj is row-parallel over the same query heads (one permutation of
  the weight shards per layer, applied at load time), followed by an all-reduce;
* MLP: gate/up column-parallel, down row-parallel + all-reduce (``I`` zero-padded to a multiple of ``N``: a zero
  gate/up row gives silu(0)*0 = 0, so padding is exact);
* embedding and lm_head vocabulary-parallel (rows ``r*V/N..``, ``V`` zero-padded to a multiple of ``N``): the
  embedding masks ids outside the rank's rows and all-reduces (one non-zero term per token, so exact), the lm_head
  all-gathers the logit columns. This is what ``sim/tp.py`` prices (2L+1 all-reduces and one logits all-gather).

Each rank's KV pool holds only its heads: a monolithic page of a rank spans its ``H/N`` heads (``1/N`` of every
page, same page ids); a ragged table lives on one rank (:func:`tangram.placement.rank_tables`), so rank ``r``'s
pool holds pages of its own tables only. The scheduler's one :class:`~tangram.paging.PagePool` is not rank-aware,
so rank 0 keeps a :class:`PageMap` per rank (the scheduler's page id -> a page of that rank's pool), updated from
each step's block-table rows (a page seen on a rank for the first time gets a rank page) and from the pool
(a page the scheduler freed gives its rank page back).

One step (vLLM v1's pattern): rank 0 schedules, then sends each rank a :class:`RankStep` with
``torch.distributed.scatter_object_list`` (pickled): the plan with the rank's slots of the per-head arrays, the
step's token ids and positions (rank 0 keeps the session streams), the rows' block tables in the rank's page ids,
the rank pages given and taken back this step, and the copy-on-write pairs of its pages. Workers decide nothing:
they apply the message, run their shard of the forward (all-reduces inside), join the logits all-gather and wait
for the next message. Sampling and every token that goes back to the scheduler happen on rank 0. Each rank keeps
its own account of the rank pages in use from the messages alone, so the leak check at the end of a run (every
rank's account and rank 0's map empty) covers every rank.

``dynamic`` mode: its top-k compares every head of a layer (per-layer scope) or of the model (cross-layer), so each
rank all-gathers the chunk scores of its heads, every rank computes the same per-head counts from the gathered
scores and keeps its own heads' share; the counts each rank realised are all-gathered back to rank 0 for the
scheduler's page reclaim. With ``dynamic_keep='profile'`` rank 0 draws the counts for every head (the scheduler's
layout, as on one GPU) and sends each rank its slice.

Not covered: CUDA graphs (steps run eager), and a rank-aware allocator: the scheduler's pool is sized by the
fullest rank's page share (as ``sim/tp.py`` does) and a rank whose pages run out raises a clear error.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tangram.budgets import drawn_keep
from tangram.config import EngineConfig, ModelConfig
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource, _Ops
from tangram.engine.model import Transformer
from tangram.engine.weights import build_model
from tangram.errors import ConfigError
from tangram.paging import KVLayout, OutOfPages, PagePool
from tangram.placement import check_tp, page_shares, rank_tables
from tangram.plan import StepPlan, StepResult

# --------------------------------------------------------------------------- weights


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one rank runs: its heads, ``ceil(I/N)`` MLP columns and ``ceil(V/N)`` vocabulary rows."""
    check_tp(cfg.num_kv_heads, tp)
    return dataclasses.replace(cfg, name=f"{cfg.name}[tp{tp}]", num_q_heads=cfg.num_q_heads // tp,
                               num_kv_heads=cfg.num_kv_heads // tp, intermediate=-(-cfg.intermediate // tp),
                               vocab=-(-cfg.vocab // tp))


def _rows(w: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows ``rank*n .. (rank+1)*n`` of ``w``, zero rows past its end."""
    out = torch.zeros((n,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
    part = w[rank * n:(rank + 1) * n]
    out[:part.shape[0]] = part
    return out


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, perm: np.ndarray, tp: int,
                     rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a full Hugging Face-named state dict: its KV heads ``perm[l, rank's slots]`` in
    slot order with their query heads (q/k/v rows, o columns), its gate/up rows and down columns, its vocabulary
    rows of the embedding and lm_head; norms replicated."""
    L, H, Hq, d, h = cfg.num_layers, cfg.num_kv_heads, cfg.num_q_heads, cfg.head_dim, cfg.hidden
    hr, g = H // tp, Hq // H
    sc = shard_config(cfg, tp)
    perm = np.asarray(perm)
    if perm.shape != (L, H) or not (np.sort(perm, axis=1) == np.arange(H)).all():
        raise ConfigError(f"head placement must be a permutation of the {H} KV heads per layer, shape {(L, H)}")
    out: dict[str, torch.Tensor] = {}
    done = set()
    for l in range(L):
        p = f"model.layers.{l}."
        heads = torch.as_tensor(perm[l, rank * hr:(rank + 1) * hr], dtype=torch.long)
        qh = (heads[:, None] * g + torch.arange(g)[None]).reshape(-1)
        for name, idx, n in (("q_proj", qh, Hq), ("k_proj", heads, H), ("v_proj", heads, H)):
            w = sd[p + f"self_attn.{name}.weight"]
            out[p + f"self_attn.{name}.weight"] = w.view(n, d, h)[idx].reshape(-1, h)
            done.add(p + f"self_attn.{name}.weight")
            b = sd.get(p + f"self_attn.{name}.bias")
            if b is not None:
                out[p + f"self_attn.{name}.bias"] = b.view(n, d)[idx].reshape(-1)
                done.add(p + f"self_attn.{name}.bias")
        wo = sd[p + "self_attn.o_proj.weight"]
        out[p + "self_attn.o_proj.weight"] = wo.view(h, Hq, d)[:, qh].reshape(h, -1)
        for name in ("gate_proj", "up_proj"):
            out[p + f"mlp.{name}.weight"] = _rows(sd[p + f"mlp.{name}.weight"], rank, sc.intermediate)
        out[p + "mlp.down_proj.weight"] = _rows(sd[p + "mlp.down_proj.weight"].t(), rank, sc.intermediate).t() \
            .contiguous()
        done.update(p + k for k in ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                    "mlp.down_proj.weight"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in sd:
            out[name] = _rows(sd[name], rank, sc.vocab)
            done.add(name)
    for k, v in sd.items():  # norms (and q/k norms): replicated
        if k not in done:
            out[k] = v
    return out


def build_shard(sd: dict[str, torch.Tensor], cfg: ModelConfig, perm: np.ndarray, tp: int, rank: int, *,
                dtype: torch.dtype, device) -> Transformer:
    return build_model(shard_config(cfg, tp), shard_state_dict(sd, cfg, perm, tp, rank), dtype, device)


# --------------------------------------------------------------------------- pages of each rank


class PageMap:
    """One rank's pages: the scheduler's page id -> a page of the rank's own pool. The rank pages come from a
    :class:`~tangram.paging.PagePool` of the rank's capacity (the one allocator class: its free space and its
    double-free checks), each held once while the scheduler's page is mapped."""

    def __init__(self, num_pages: int, capacity: int, rank: int):
        self.g2l = np.full(num_pages, -1, dtype=np.int64)
        self.pool = PagePool(int(capacity), 1)
        self.capacity, self.rank = int(capacity), rank
        self.peak = 0

    @property
    def n_used(self) -> int:
        return self.pool.n_used

    def release(self, gids: np.ndarray) -> np.ndarray:
        loc = self.g2l[gids]
        assert (loc >= 0).all(), "release of a page this rank does not hold"
        self.g2l[gids] = -1
        self.pool.release(loc)
        return loc

    def assign(self, gids: np.ndarray) -> np.ndarray:
        try:
            loc = self.pool.alloc(gids.size).astype(np.int64)
        except OutOfPages:
            raise RuntimeError(f"tensor-parallel rank {self.rank} is out of KV pages ({self.capacity} pages, "
                               f"{self.pool.n_free} free, {gids.size} needed): the scheduler's one pool is sized by "
                               f"the fullest rank's page share and this mix put more on rank {self.rank}; lower "
                               f"gpu_memory_utilization or use the balanced placement") from None
        self.g2l[gids] = loc
        self.peak = max(self.peak, self.n_used)
        return loc


def tp_pool_pages(layout: KVLayout, budgets: np.ndarray | None, per_rank_bytes: int) -> tuple[int, int]:
    """(pages of the scheduler's pool, pages of each rank's pool) for ``per_rank_bytes`` of KV memory per GPU: a
    rank page is a ragged page (one table's ``H_p`` heads) or ``1/N`` of a monolithic page; the scheduler's pool is
    the rank pool over the fullest rank's share of a request's pages (``sim/tp.py``'s ``tp_pool_bytes``)."""
    tp = layout.tp
    if not layout.ragged:
        n = int(per_rank_bytes // (layout.page_bytes // tp))
        return n, n
    B = budgets if budgets is not None else np.ones((layout.num_layers, layout.num_kv_heads))
    shares = page_shares(B, layout.perm, tp, layout.heads_per_group, True)
    cap = int(per_rank_bytes // layout.page_bytes)
    return int(cap / float(shares.max())), cap


# --------------------------------------------------------------------------- messages


@dataclass
class RankSetup:
    """What every rank needs to build its shard of one run (sent once per run by broadcast)."""

    model: ModelConfig
    engine: EngineConfig
    layout: KVLayout  # the scheduler's (global, rank-major slots)
    capacity: int  # pages of each rank's pool
    budgets: np.ndarray | None  # [L, H] head order (the scheduler's profile.B), for each rank's AOT split map
    options: ExecutorOptions
    shard_perm: np.ndarray | None = None  # tests only: shard the weights by another placement than the layout's


@dataclass
class RankStep:
    op: str  # "step" | "leak"
    plan: StepPlan | None = None  # per-head arrays cut to the rank's slots, prefill_pages to its tables
    ids: np.ndarray | None = None  # int64 [tokens]
    pos: np.ndarray | None = None
    tables: np.ndarray | None = None  # int32 [rows of the step, T_r, w]: decode rows then prefill rows, rank pages
    freed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rank pages given back
    alloc: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rank pages taken
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _rank_tables(layout: KVLayout, rank: int) -> np.ndarray:
    if not layout.ragged:
        return np.zeros(1, dtype=np.int64)
    return np.flatnonzero(rank_tables(layout.num_layers, layout.n_groups, layout.tp) == rank)


# --------------------------------------------------------------------------- one rank's executor


class _RankView:
    """What :class:`Executor` reads of a scheduler, for one rank: its layout, pool size and split-map budgets."""

    def __init__(self, s: RankSetup, rank: int):
        lay = s.layout
        sl = lay.rank_slots(rank)
        self.engine, self.layout, self.retention = s.engine, lay.rank_layout(rank), s.engine.retention
        self.pool = SimpleNamespace(num_pages=s.capacity)
        self.profile = None if s.budgets is None else SimpleNamespace(B=lay.to_slots(s.budgets)[:, sl])


class TPRank(Executor):
    """Rank ``rank``'s shard of the forward: the shared executor's layers on its heads and columns, with the
    vocabulary-parallel embedding/lm_head and the all-reduces of :mod:`tangram.engine.tp`."""

    def __init__(self, model: Transformer, setup: RankSetup, rank: int, tp: int):
        opts = dataclasses.replace(setup.options, cuda_graphs="off")
        super().__init__(model, _RankView(setup, rank), None, opts)
        self.rank, self.tp = rank, tp
        self.vocab = setup.model.vocab
        self.heads_all = setup.model.num_kv_heads
        self.global_perm = np.asarray(setup.layout.perm)  # [L, H] the scheduler's slot -> KV head
        self.v0 = rank * model.cfg.vocab
        self.used = np.zeros(setup.capacity, dtype=bool)  # this rank's own account of its pages, from the messages
        self.step_s: list[float] = []
        self.op_s: dict[str, float] = {}
        self._ops: _Ops | None = None
        self._tab: torch.Tensor | None = None
        self._row_pos: dict[int, int] = {}

    # collectives
    def _embed(self, tok_t: torch.Tensor) -> torch.Tensor:
        w = self.model.model.embed_tokens.weight
        loc = tok_t.long() - self.v0
        ok = (loc >= 0) & (loc < w.shape[0])
        x = F.embedding(loc.clamp(0, w.shape[0] - 1), w) * ok[:, None].to(w.dtype)
        return self._reduce(x)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        ops = self._ops
        if ops is not None:
            ops.start("allreduce")
        dist.all_reduce(y)
        if ops is not None:
            ops.stop("allreduce")
        return y

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        loc = F.linear(h, self.model.lm_head.weight).float().contiguous()
        parts = [torch.empty_like(loc) for _ in range(self.tp)]
        dist.all_gather(parts, loc)
        return torch.cat(parts, dim=-1)[:, :self.vocab]

    # dynamic mode: one selection over the heads of every rank
    @property
    def selection_heads(self) -> int:
        return self.heads_all

    def _all_heads(self, scores: torch.Tensor, layers: list[int]) -> torch.Tensor:
        kp, n, cs = scores.shape
        hr, X = self.cfg.num_kv_heads, len(layers)
        parts = [torch.empty_like(scores) for _ in range(self.tp)]
        dist.all_gather(parts, scores.contiguous())
        # rank-major slots within each layer: [kp, X, N, H_r, CS] -> [kp, X, H, CS] in slot order -> head order
        s = torch.stack([p.view(kp, X, hr, cs) for p in parts], dim=2).reshape(kp, X, hr * self.tp, cs)
        slot_of_head = torch.as_tensor(np.argsort(self.global_perm[layers], axis=1), device=s.device)
        return s[:, torch.arange(X, device=s.device)[:, None], slot_of_head].reshape(kp, n * self.tp, cs)

    def _own_heads(self, counts: torch.Tensor, layers: list[int]) -> torch.Tensor:
        kp, hr, X = counts.shape[0], self.cfg.num_kv_heads, len(layers)
        c = counts.view(kp, X, hr * self.tp)
        head_of_slot = torch.as_tensor(self.global_perm[layers][:, self.rank * hr:(self.rank + 1) * hr],
                                       device=c.device)
        return c[:, torch.arange(X, device=c.device)[:, None], head_of_slot].reshape(kp, -1)

    def _drawn_keep(self, plan: StepPlan) -> np.ndarray:
        return plan.prefill_keep  # rank 0 drew every head's count and sent this rank its slots (TPDriver.messages)

    def _rows_tables(self, rows: np.ndarray) -> tuple[torch.Tensor, int]:
        idx = [self._row_pos[int(r)] for r in np.asarray(rows).tolist()]
        t = self._tab[idx]
        return t, int(t.shape[2])

    def account(self, m: RankStep) -> None:
        if m.freed.size:
            if not self.used[m.freed].all():
                raise AssertionError(f"rank {self.rank}: page given back that it does not hold")
            self.used[m.freed] = False
        if m.alloc.size:
            if self.used[m.alloc].any():
                raise AssertionError(f"rank {self.rank}: page given that it already holds")
            self.used[m.alloc] = True

    @torch.inference_mode()
    def step(self, m: RankStep) -> tuple[torch.Tensor, float, np.ndarray | None]:
        """Run the rank's shard of the step; returns (logits of the sampling rows, host planning seconds, and in
        dynamic mode the per-head counts every rank realised [kp, L, H] in slot order)."""
        t0 = time.perf_counter()
        self.account(m)
        if m.copy_src.size:
            self.cache.copy_pages(m.copy_src, m.copy_dst)
        plan = m.plan
        kd, kp = plan.num_decode, plan.num_prefill
        bounds = [kd] + (kd + np.cumsum(plan.prefill_tokens)).tolist()
        last = [bounds[i + 1] - 1 for i in range(kp) if plan.prefill_last[i]]
        rows = np.concatenate([plan.decode_rows, plan.prefill_rows]).tolist()
        self._row_pos = {r: i for i, r in enumerate(rows)}
        self._tab = self.cache.tables(m.tables)
        ops = self._ops = _Ops(self.opts.time_ops, self.cuda)
        h, st, host_plan_s = self._forward_eager(plan, m.ids.tolist(), m.pos.tolist(), bounds, last, ops)
        logits = self._lm_head(h)
        realized = None
        if kp and self.retention == "global":
            mine = st["realized"].contiguous()
            parts = [torch.empty_like(mine) for _ in range(self.tp)]
            dist.all_gather(parts, mine)
            realized = torch.cat(parts, dim=2).cpu().numpy().astype(np.int64)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._ops = None
        for k, v in ops.totals().items():
            self.op_s[k] = self.op_s.get(k, 0.0) + v
        self.step_s.append(time.perf_counter() - t0)
        return logits, host_plan_s, realized

    def report(self) -> dict:
        return {"rank": self.rank, "pages_in_use": int(self.used.sum()), "pages_total": int(self.used.size),
                "steps": len(self.step_s), "step_s": float(sum(self.step_s)), "op_s": dict(self.op_s),
                "kv_pool_bytes": int(self.cache.nbytes)}


# --------------------------------------------------------------------------- rank 0: the harness's executor


class TPDriver:
    """``execute(plan) -> StepResult`` of a ``tp``-rank replica, on rank 0: translates the plan into each rank's
    message, sends them, runs rank 0's shard and samples."""

    _stream = Executor._stream  # the session token streams (prompts + sampled outputs) live on rank 0 only
    _gather = Executor._gather
    _record_samples = Executor._record_samples
    forget_session = Executor.forget_session

    def __init__(self, rank0: TPRank, sched: TimedScheduler, tokens: TokenSource, setup: RankSetup):
        self.rank0, self.sched, self.tokens, self.setup = rank0, sched, tokens, setup
        self.opts = rank0.opts
        self.tp = rank0.tp
        lay = sched.layout
        self.layout = lay
        n = sched.pool.num_pages
        self.maps = [PageMap(n, setup.capacity, r) for r in range(self.tp)]
        self.owner = np.full(n, -1, dtype=np.int64)  # ragged: the rank whose table last held each page
        self.tables = [_rank_tables(lay, r) for r in range(self.tp)]
        self.slots = [lay.rank_slots(r) for r in range(self.tp)]
        self.streams: dict[str, list[int]] = {}
        self._started: set[int] = set()
        self.logit_log: list[tuple[int, int, torch.Tensor]] = []
        self.steps = 0
        self.send_s = 0.0

    def describe(self) -> dict:
        dev = torch.cuda.get_device_name(self.rank0.device) if self.rank0.cuda else "cpu"
        return {"sources": {"all": f"measured on {self.tp} x {dev}, tensor parallel ({self.layout_label()})"},
                "tables": None, "n_cta": self.rank0.n_occ}

    def layout_label(self) -> str:
        return f"tp={self.tp}, placement={self.sched.engine.placement}"

    def _free_stale(self) -> list[list[np.ndarray]]:
        """Rank pages of scheduler pages the pool has freed since the last step."""
        pool = self.sched.pool
        in_use = (pool.ref > 0) | (pool.pins > 0)
        out = []
        for pm in self.maps:
            stale = np.flatnonzero((pm.g2l >= 0) & ~in_use)
            out.append([pm.release(stale)])
            self.owner[stale] = -1
        return out

    def messages(self, plan: StepPlan, ids, pos) -> list[RankStep]:
        freed = self._free_stale()
        bt = self.sched.bt
        rows = np.concatenate([plan.decode_rows, plan.prefill_rows]).astype(np.int64)
        w = max(1, int(bt.npages[rows].max())) if rows.size else 1
        G = bt.pages[rows, :, :w]
        ragged = self.layout.ragged
        tabs, allocs = [], []
        for r, pm in enumerate(self.maps):
            Gr = G[:, self.tables[r]]
            ids_r = np.unique(Gr[Gr >= 0]).astype(np.int64)
            if ragged:  # a page another rank's table held before it was freed and taken again within one step
                prev = self.owner[ids_r]
                moved = (prev >= 0) & (prev != r)
                for q in np.unique(prev[moved]).tolist():
                    freed[q].append(self.maps[q].release(ids_r[moved & (prev == q)]))
                self.owner[ids_r] = r
            allocs.append(pm.assign(ids_r[pm.g2l[ids_r] < 0]))
            tabs.append(np.where(Gr >= 0, pm.g2l[np.maximum(Gr, 0)], -1).astype(np.int32))
        ids = np.asarray(ids, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        keep = plan.prefill_keep
        if plan.num_prefill and self.sched.engine.retention == "global" and self.opts.dynamic_keep == "profile":
            keep = drawn_keep(self.sched.profile, self.layout, self.opts.sampling.seed, plan)  # every head, as TP=1
        out = []
        for r, pm in enumerate(self.maps):
            sl = self.slots[r]
            rp = dataclasses.replace(plan, decode_head_lens=plan.decode_head_lens[:, :, sl],
                                     prefill_head_lens=plan.prefill_head_lens[:, :, sl],
                                     prefill_keep=keep[:, :, sl],
                                     prefill_pages=plan.prefill_pages[:, self.tables[r]], counters={},
                                     copy_src=np.zeros(0, np.int64), copy_dst=np.zeros(0, np.int64))
            m = RankStep("step", rp, ids, pos, tabs[r], np.concatenate(freed[r]), allocs[r])
            if plan.copy_src.size:  # copy-on-write: each pair lies on the rank of its table (every rank: monolithic)
                src, dst = np.asarray(plan.copy_src, np.int64), np.asarray(plan.copy_dst, np.int64)
                sel = self.owner[src] == r if ragged else np.ones(src.size, dtype=bool)
                s_l, d_l = pm.g2l[src[sel]], pm.g2l[dst[sel]]
                assert (s_l >= 0).all() and (d_l >= 0).all(), "copy-on-write of a page its rank does not hold"
                m.copy_src, m.copy_dst = s_l, d_l
            out.append(m)
        return out

    def _send(self, msgs: list) -> RankStep:
        t = time.perf_counter()
        recv = [None]
        dist.scatter_object_list(recv, msgs, src=0)
        self.send_s += time.perf_counter() - t
        return recv[0]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        kp = plan.num_prefill
        ids, pos, bounds = self._gather(plan)
        last = [bounds[i + 1] - 1 for i in range(kp) if plan.prefill_last[i]]
        mine = self._send(self.messages(plan, ids, pos))
        logits, host_plan_s, realized = self.rank0.step(mine)
        toks_np = self.rank0.sampler(logits).cpu().numpy()
        gpu_s = time.perf_counter() - t0
        sampled = self._record_samples(plan, toks_np, logits, pos, last)
        host_s = self.sched.take_host_s()
        breakdown = {"host": host_s, "engine": gpu_s - host_plan_s}
        if host_plan_s:
            breakdown["runtime_plan"] = host_plan_s
        self.steps += 1
        return StepResult(plan.step, gpu_s + host_s, breakdown, realized, sampled)

    def finish(self) -> dict:
        """After the run (every session ended, the prefix cache cleared): every rank gives back the pages the pool
        freed and reports its own account; ok when every rank holds no page and rank 0's maps are empty."""
        freed = self._free_stale()
        msgs = [RankStep("leak", freed=np.concatenate(f)) for f in freed]
        self.rank0.account(self._send(msgs))
        reports = [None] * self.tp
        dist.all_gather_object(reports, self.rank0.report())
        for rep, pm in zip(reports, self.maps):
            rep["map_pages_in_use"] = pm.n_used
            rep["pages_peak"] = pm.peak
        ok = all(r["pages_in_use"] == 0 and r["map_pages_in_use"] == 0 for r in reports)
        return {"ok": ok, "ranks": reports}


# --------------------------------------------------------------------------- sessions (rank 0) and workers


def _setup_send(setup: RankSetup | None) -> None:
    obj = [setup]
    dist.broadcast_object_list(obj, src=0)


def serve(rank: int, tp: int, full_sd: dict, *, dtype: torch.dtype, device) -> None:
    """A worker: build the shard of each run rank 0 announces, run the steps it sends, report, until told to stop."""
    while True:
        obj = [None]
        dist.broadcast_object_list(obj, src=0)
        setup: RankSetup | None = obj[0]
        if setup is None:
            return
        ex = _make_rank(setup, full_sd, rank, tp, dtype, device)
        while True:
            recv = [None]
            dist.scatter_object_list(recv, None, src=0)
            m: RankStep = recv[0]
            if m.op == "step":
                ex.step(m)
            else:
                ex.account(m)
                dist.all_gather_object([None] * tp, ex.report())
                break
        del ex


def stop_workers() -> None:
    _setup_send(None)


def _make_rank(setup: RankSetup, full_sd: dict, rank: int, tp: int, dtype, device) -> TPRank:
    perm = setup.shard_perm if setup.shard_perm is not None else setup.layout.perm
    model = build_shard(full_sd, setup.model, perm, tp, rank, dtype=dtype, device=device)
    return TPRank(model, setup, rank, tp)


def serve_tp(trace, spec, mode: str, full_sd: dict, *, dtype, device, options: ExecutorOptions, seed: int = 0,
             tokenizer=None, progress=None, shard_perm: np.ndarray | None = None, record_kv: bool = True):
    """Rank 0: serve ``trace`` in ``mode`` on ``spec.engine.tp`` ranks (workers in :func:`serve`); returns
    (ClusterResult, driver, leak check of every rank)."""
    from tangram.engine.bench import leak_check, pool_bytes_for
    from tangram.harness import Cluster

    engine = spec.engine.with_(mode=mode)
    tp = engine.tp
    per_rank = pool_bytes_for(spec.model, spec.gpu, engine, device, torch.empty((), dtype=dtype).element_size())
    probe = TimedScheduler(spec.model, engine, spec.profile, num_pages=1)
    B = probe.profile.B if probe.profile is not None else None
    n_pages, cap = tp_pool_pages(probe.layout, B, per_rank)
    sched = TimedScheduler(spec.model, engine, spec.profile, num_pages=n_pages)
    setup = RankSetup(spec.model, engine, sched.layout, cap, B, options, shard_perm)
    _setup_send(setup)
    rank0 = _make_rank(setup, full_sd, 0, tp, dtype, device)
    tokens = TokenSource.from_trace(trace, spec.model.vocab, seed, tokenizer)
    drv = TPDriver(rank0, sched, tokens, setup)
    res = Cluster(trace, [(sched, drv)], spec.router, progress=progress, record_kv=record_kv).run()
    leak = leak_check(sched)
    ranks = drv.finish()
    leak = dict(leak, ok=bool(leak["ok"] and ranks["ok"]), ranks=ranks["ranks"])
    return res, drv, leak


def run_mode_tp(trace, spec, mode: str, model, *, device, seed: int = 0, sampling=None, time_ops: bool = False,
                tokenizer=None, progress=None, warmup: bool = True, dynamic_keep: str = "topk",
                cuda_graphs: str = "off") -> tuple[dict, object, dict]:
    """:func:`tangram.engine.bench.run_mode` for a ``tp``-rank replica, on rank 0 (``model``: the full model on
    the CPU, sharded per run); adds per-rank pages and step times under ``"tp"``."""
    from tangram.engine.bench import _mini_trace, max_session_tokens
    from tangram.engine.sampling import SamplingParams
    from tangram.harness import summarize
    from tangram.planner import DecodeCosts

    sd = model.state_dict()
    dtype = model.lm_head.weight.dtype
    opts = ExecutorOptions(sampling=sampling or SamplingParams(seed=seed), time_ops=time_ops,
                           dynamic_keep=dynamic_keep, cuda_graphs="off",
                           graph_max_context=max_session_tokens(trace),
                           decode_costs=DecodeCosts.for_gpu(spec.gpu.name, spec.model.name))
    if warmup:
        serve_tp(_mini_trace(spec.engine), spec, mode, sd, dtype=dtype, device=device, options=opts, seed=seed + 7,
                 record_kv=False)
    t = time.perf_counter()
    res, drv, leak = serve_tp(trace, spec, mode, sd, dtype=dtype, device=device, options=opts, seed=seed,
                              tokenizer=tokenizer, progress=progress)
    wall = time.perf_counter() - t
    engine = drv.sched.engine
    summ = summarize(res, engine, [drv])
    sched = drv.sched
    ranks = leak["ranks"]
    step = np.array([r["step_s"] for r in ranks])
    tpi = {"tp": engine.tp, "placement": engine.placement,
           "rank_pages_peak": [r["pages_peak"] for r in ranks], "rank_pages_total": [r["pages_total"] for r in ranks],
           "rank_kv_pool_bytes": [r["kv_pool_bytes"] for r in ranks],
           "rank_step_s": step.tolist(), "plan_send_s": drv.send_s}
    peaks = np.array(tpi["rank_pages_peak"], dtype=np.float64)
    tpi["pages_peak_max_over_mean"] = float(peaks.max() / peaks.mean()) if peaks.mean() > 0 else 1.0
    if time_ops:  # compute = measured operators minus time in collectives (which includes waiting for peers)
        comp = np.array([sum(v for k, v in r["op_s"].items() if k != "allreduce") for r in ranks])
        tpi["rank_op_s"] = [r["op_s"] for r in ranks]
        tpi["rank_compute_s"] = comp.tolist()
        tpi["step_time_imbalance"] = float(comp.max() / comp.mean()) if comp.mean() > 0 else 1.0
    summ.update({"wall_s": wall, "kv_pool_bytes": sched.pool.num_pages * sched.layout.page_bytes,
                 "kv_pool_pages": sched.pool.num_pages, "leak_check": leak, "leak_ok": leak["ok"],
                 "dynamic_keep": dynamic_keep if spec.engine.with_(mode=mode).retention == "global" else None,
                 "peak_kv_gib": summ["peak_kv_bytes"] / 2**30, "cuda_graphs": None,
                 "tp": tpi})
    return summ, res, leak


def serve_jobs(rank: int, tp: int, cfg: ModelConfig, weights_seed: int, jobs: list[dict],
               cpu_reference: bool = True) -> list[dict] | None:
    """A :func:`launch` target: seeded random weights of ``cfg`` on every rank, then each job
    (``trace, spec, mode, options``, optional ``shard_perm``) served on ``tp`` ranks; rank 0 returns per job the
    session streams, the recorded logits (``options.record_logits``), the request statuses and the leak check."""
    from tangram.engine.weights import random_state_dict
    from tangram.kernels import cpu_reference as _ref

    sd = random_state_dict(cfg, seed=weights_seed)
    device = torch.device("cpu")
    with _ref(cpu_reference):
        if rank:
            serve(rank, tp, sd, dtype=torch.float32, device=device)
            return None
        out = []
        for j in jobs:
            res, drv, leak = serve_tp(j["trace"], j["spec"], j["mode"], sd, dtype=torch.float32, device=device,
                                      options=j["options"], seed=j.get("seed", 0), shard_perm=j.get("shard_perm"))
            st = drv.sched.stats
            out.append({"streams": drv.streams, "leak": leak, "perm": drv.layout.perm, "page_copies": st.page_copies,
                        "prefix_hits": st.prefix_hits, "pages_reclaimed": st.pages_reclaimed,
                        "status": {r.request_id: r.status for r in res.records},
                        "logits": [(rid, p, lg.numpy()) for rid, p, lg in drv.logit_log]})
        stop_workers()
        return out


def run_bench(args, spec) -> dict:
    """``tangram-bench --tp N``: N processes (NCCL on CUDA, one GPU each; gloo on the CPU); rank 0 runs the bench
    (:func:`tangram.engine.bench.run`), the others serve; returns rank 0's metrics."""
    tp = spec.engine.tp
    check_tp(spec.model.num_kv_heads, tp, spec.engine.heads_per_group if spec.engine.ragged else None)
    cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() < tp:
        raise ConfigError(f"--tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    return launch(tp, _bench_rank, args, backend="nccl" if cuda else "gloo")


def _bench_rank(rank: int, tp: int, args) -> dict | None:
    from tangram.cli import from_cli
    from tangram.engine.bench import device_dtype, run
    from tangram.engine.weights import load_model

    if rank == 0:
        try:
            return run(args, tp_rank0=True)
        finally:
            stop_workers()
    spec = from_cli(args)
    device, dtype = device_dtype(spec.device, spec.dtype)
    model, _ = load_model(spec.model, spec.weights, dtype=dtype, device="cpu", seed=spec.seed)
    serve(rank, tp, model.state_dict(), dtype=dtype, device=device)
    return None


# --------------------------------------------------------------------------- processes


def launch(tp: int, target, *args, backend: str | None = None):
    """Run ``target(rank, tp, *args)`` in ``tp`` processes (torch.multiprocessing spawn, a ``file://`` rendezvous
    in a fresh temporary folder, so parallel launches never collide); returns rank 0's return value."""
    import torch.multiprocessing as mp

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory(prefix="tangram-tp-") as d:
        out = Path(d) / "result.pkl"
        mp.spawn(_entry, args=(tp, f"file://{d}/rendezvous", str(out), backend, target, args), nprocs=tp,
                 join=True)
        return pickle.loads(out.read_bytes())


def _entry(rank: int, tp: int, init: str, out: str, backend: str, target, args) -> None:
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal (a C++ abort in a collective) still prints its Python stack
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp)
    try:
        r = target(rank, tp, *args)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(r))
        dist.barrier()  # no rank tears the group down while a peer still waits in a collective
    finally:
        dist.destroy_process_group()


__all__ = ["shard_config", "shard_state_dict", "build_shard", "PageMap", "tp_pool_pages", "RankSetup", "RankStep",
           "TPRank", "TPDriver", "serve", "serve_tp", "serve_jobs", "stop_workers", "run_mode_tp", "run_bench", "launch"]

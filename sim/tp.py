"""Pricing a tensor-parallel replica (issue 16.3): ``tp`` GPUs run every step together, each on its shard.

Megatron-style sharding, what the engine's TP path runs (tangram/engine/tp.py):

* GEMMs: q/k/v and gate/up split by output column (``n/tp``), o and down by input row (``k/tp``), lm_head by
  vocabulary (``V/tp`` rows, logits gathered). A rank's GEMM is read from the cost table at its own shape when
  the table has it, else the table's time for the full shape over ``tp`` (both its FLOPs and its weight bytes
  split ``tp`` ways; the small-shape efficiency loss is not priced), else the roofline at the rank's shape.
* Element-wise: RMSNorm runs replicated on the whole hidden state; RoPE on the rank's heads and SiLU-mul on the
  rank's ``I/tp`` columns (their full-model time over ``tp``); sampling once, on the gathered logits.
* Attention: rank ``r`` holds the KV heads of slots ``KVLayout.rank_slots(r)`` (the placement of
  ``tangram.placement``), its own ragged tables and its own AOT split map (Algorithm 1 over its head groups with
  all of its GPU's CTAs). Decode attention is priced per rank and per layer by the wave model, and because every
  layer ends in an all-reduce, the step pays the slowest rank of each layer (``sum_l max_r``). Prefill attention
  and compression are priced per rank (a table measured on all heads is read at the rank's retained tokens scaled
  to all heads and charged the rank's share of heads) and the slowest rank is charged.
* Communication: two all-reduces per layer (after o and after down) plus one for the vocabulary-parallel
  embedding, of ``tokens x hidden x dtype`` bytes each, and one all-gather of the logit rows (fp32, ``V`` each).
  From ``allreduce.csv`` of the tables folder when it has rows for this ``tp`` (written by
  ``python -m tangram.sim.fit_allreduce``, with provenance), else the ring model ``latency + 2(N-1)/N x bytes /
  (eff x NVLink bandwidth per direction)`` from the GPU preset (``cost_model_source`` says which).
* Host: the one scheduler runs on rank 0 and is charged once. Sending the step plan to the workers is not priced
  (vLLM v1 broadcasts it through shared memory; not measured here).

The KV pool: every rank has :func:`tangram.config.kv_pool_bytes` (``1/tp`` of the weights). The one scheduler's
pool holds the pages of all ranks; a ragged table lives on one rank, and a long request puts a fixed share of its
pages on each rank (its groups' summed largest budgets, :func:`tangram.placement.page_shares`), so the pool the
scheduler may fill is the per-rank pool over the fullest rank's share (``tp`` pools when balanced). Page rounding
and the dynamic mode's realised retention move the shares a little; that is not modelled.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tangram.budgets import BudgetProfile
from tangram.config import EngineConfig, GPUConfig, ModelConfig, kv_pool_bytes
from tangram.errors import ConfigError, InputError
from tangram.paging import KVLayout
from tangram.placement import check_tp, page_shares
from tangram.plan import RunResult, StepPlan, StepResult
from tangram.planner import aot_bucket_split_map, decode_context_bucket, flashdecoding_num_splits, pow2_bucket, \
    launch_fixed_times, runtime_plan, split_kv_block, tail_layer_times, tail_wave_time, wave_launch

from .costmodel import CostModel, _groups

ALLREDUCE_FILE = "allreduce.csv"
ALLREDUCE_COLS = ("tp", "bytes", "median_us")


class AllReduceTable:
    """Measured all-reduce times per (tp, bytes) of one machine: ``allreduce.csv`` of a tables folder."""

    def __init__(self, path: str | Path):
        from .tables import LogInterp1D, _read_csv

        self.path = Path(path)
        import pandas as pd

        df = _read_csv(self.path, ALLREDUCE_COLS)
        for c in ALLREDUCE_COLS:
            v = pd.to_numeric(df[c], errors="coerce")
            if v.isna().any():
                i = int(np.flatnonzero(v.isna().to_numpy())[0])
                raise InputError(str(self.path), i + 2, c, f"not a number: {df[c].iloc[i]!r}")
            df[c] = v
        bad = df[(df["tp"] < 2) | (df["bytes"] <= 0) | (df["median_us"] <= 0)]
        if len(bad):
            raise InputError(str(self.path), int(bad.index[0]) + 2, None, "tp must be >= 2, bytes and median_us > 0")
        self.df = df
        self._f = {int(t): LogInterp1D(g["bytes"].to_numpy(), g["median_us"].to_numpy() * 1e-6, monotone=True)
                   for t, g in df.groupby("tp")}
        prov = [f"{c}={df[c].iloc[0]}" for c in ("gpu", "backend", "date", "command") if c in df.columns]
        self.label = f"table:{self.path.name}" + (f" ({', '.join(prov)})" if prov else "")

    def has(self, tp: int) -> bool:
        return int(tp) in self._f

    def seconds(self, tp: int, nbytes) -> np.ndarray:
        return np.asarray(self._f[int(tp)](np.asarray(nbytes, dtype=np.float64)), dtype=np.float64)


def tp_pool_bytes(model: ModelConfig, gpu: GPUConfig, engine: EngineConfig, layout: KVLayout,
                  budgets: np.ndarray | None) -> int:
    """Bytes of the one scheduler's pool for a ``tp``-GPU replica: the per-rank pool over the fullest rank's share
    of a request's pages (see the module docstring)."""
    per_rank = kv_pool_bytes(model, gpu, engine)
    if engine.tp == 1:
        return per_rank
    B = budgets if budgets is not None else np.ones((model.num_layers, model.num_kv_heads))
    shares = page_shares(B, layout.perm, engine.tp, layout.heads_per_group, layout.ragged)
    return int(per_rank / float(shares.max()))


class TPCostModel(CostModel):
    """:class:`CostModel` of a ``tp``-GPU replica: per-rank shapes, the slowest rank, plus communication."""

    def __init__(self, model: ModelConfig, gpu: GPUConfig, engine: EngineConfig, layout: KVLayout,
                 profile: BudgetProfile | None = None, **kw):
        self.tp = engine.tp
        check_tp(model.num_kv_heads, self.tp, layout.heads_per_group if layout.ragged else None)
        if layout.tp != self.tp:
            raise ConfigError(f"layout has tp={layout.tp}, engine tp={self.tp}")
        super().__init__(model, gpu, engine, layout, profile, **kw)
        self.shards = self.tp
        tp, m = self.tp, model
        for name, v in (("q heads", m.num_q_heads), ("intermediate", m.intermediate), ("vocab", m.vocab)):
            if v % tp:
                raise ConfigError(f"tp={tp} must divide {m.name}'s {name} ({v})")
        self.hr = m.num_kv_heads // tp
        h, d, Hq, H = m.hidden, m.head_dim, m.num_q_heads, m.num_kv_heads
        self.rank_shapes = {"qkv": ((Hq + 2 * H) * d // tp, h), "o": (h, Hq * d // tp),
                            "gate_up": (2 * m.intermediate // tp, h), "down": (h, m.intermediate // tp),
                            "lm_head": (m.vocab // tp, h)}
        self._rank_gemm = {}
        for op, (n, k) in self.rank_shapes.items():
            f = self.tables.gemm_interp(m, op, n, k)
            if f is not None:
                self._rank_gemm[op], src = (f, 1.0), f"table:gemm.csv at the rank's shape ({n}x{k})"
            elif self._gemm_interp[op] is not None:
                self._rank_gemm[op], src = (self._gemm_interp[op], 1.0 / tp), \
                    f"table:gemm.csv at the full shape / tp={tp}"
            else:
                self._rank_gemm[op], src = (None, 1.0), f"roofline at the rank's shape ({n}x{k})"
            self.sources[f"gemm_{op}"] = src
        self._rank_splits: dict[tuple[int, int, int], np.ndarray] = {}
        # a rank's decode launch (CTA counts, wave structure, fixed seconds) for the last launch shapes: a running
        # batch is priced again and again with the same CTA counts (only sizes change), and building the launch was
        # ~40% of a TP replay's decode pricing
        self._rank_launches: dict[tuple, tuple] = {}
        self.rank_layouts = [layout.rank_layout(r) for r in range(tp)]
        # all-reduce: measurements for this tp from the GPU family's own folder (a multi-GPU host's, even when
        # its kernel tables are transferred from another family), else from the tables folder, else the ring model
        self.allreduce, ar_own = None, False
        from .tables import tables_dir_for

        d_ = self.tables.directory
        own = tables_dir_for(gpu.name) if kw.get("tables", "auto") == "auto" else None
        for folder in dict.fromkeys(x for x in (own, Path(d_) if d_ is not None else None) if x is not None):
            if (folder / ALLREDUCE_FILE).is_file():
                t = AllReduceTable(folder / ALLREDUCE_FILE)
                if t.has(tp):
                    self.allreduce, ar_own = t, folder == own
                    break
        p = self.params
        if self.allreduce is not None:
            self.sources["allreduce"] = self.allreduce.label + (
                f" [{self.tables.label}]" if self.tables.label and not ar_own else f" [{gpu.name}'s own folder]")
        else:
            self.sources["allreduce"] = (
                f"ring model: {p.allreduce_latency_s * 1e6:g} us + 2(N-1)/N x bytes / ({p.allreduce_bw_eff:g} x "
                f"{gpu.nvlink_bandwidth / 1e9:g} GB/s NVLink per direction, {gpu.name} {gpu.source}) "
                f"(no {ALLREDUCE_FILE} with tp={tp} rows in the tables folder)")
        self.sources["tensor_parallel"] = (
            f"tp={tp}, placement={engine.placement}: per-rank GEMM/attention shapes, decode priced per layer at the "
            f"slowest rank, prefill at the slowest rank, 2L+1 all-reduces + logits all-gather per step")

    # ------------------------------------------------------------------ communication
    def _ring(self, nbytes, factor: float) -> np.ndarray:
        p = self.params
        return p.allreduce_latency_s + factor * np.asarray(nbytes, dtype=np.float64) / (
            p.allreduce_bw_eff * self.gpu.nvlink_bandwidth)

    def _comm(self, tokens, logit_rows) -> np.ndarray:
        """All-reduces of the hidden state (2 per layer + the embedding's) and the gather of the logit rows."""
        m, N = self.model, self.tp
        tokens, logit_rows = np.asarray(tokens, dtype=np.float64), np.asarray(logit_rows, dtype=np.float64)
        ar_bytes = tokens * m.hidden * m.dtype_bytes
        n_ar = 2 * m.num_layers + 1
        if self.allreduce is not None:
            ar = self.allreduce.seconds(N, np.maximum(ar_bytes, 1.0))
        else:
            ar = self._ring(ar_bytes, 2.0 * (N - 1) / N)
        gather = self._ring(logit_rows * m.vocab * 4, (N - 1) / N)  # all-gather moves (N-1)/N of the result
        return np.where(tokens > 0, n_ar * ar, 0.0) + np.where(logit_rows > 0, gather, 0.0)

    def execute(self, plan: StepPlan) -> StepResult:
        res = super().execute(plan)
        logits = plan.num_decode + (int(plan.prefill_last.sum()) if plan.num_prefill else 0)
        c = float(self._comm(plan.num_tokens, logits))
        res.breakdown["allreduce"] = c
        res.duration_s += c
        return res

    def execute_run(self, run) -> RunResult:
        out = super().execute_run(run)
        kd, kp = run.num_decode, run.num_prefill
        k = run.k
        if np.any(kp):
            tokens = kd + np.bincount(run.chunk_step, weights=run.chunk_tokens, minlength=k + 1)[1:]
            logits = kd + np.bincount(run.chunk_step, weights=run.chunk_last, minlength=k + 1)[1:]
        else:
            tokens = logits = np.full(k, kd, dtype=np.float64)
        c = self._comm(tokens, logits)
        out.breakdown["allreduce"] = c
        out.durations = out.durations + c
        return out

    # ------------------------------------------------------------------ dense layers at the rank's shapes
    def _gemm_time(self, op: str, rows: int) -> float:
        f, scale = self._rank_gemm[op]
        if f is not None:
            return self._table_time(("gemm", op) if scale != 1.0 else ("gemm_rank", op), f, rows) * scale
        return self._gemm_roofline(*self.rank_shapes[op], rows)

    # ------------------------------------------------------------------ attention per rank
    def rank_split_map(self, rank: int, batch: int, context: int | None = None) -> np.ndarray:
        """Rank ``rank``'s AOT split map ``S[L, G/tp]``: Algorithm 1 over its own head groups with its GPU's CTAs."""
        b = pow2_bucket(batch) if self.params.aot_batch_buckets else 1
        c = decode_context_bucket(context) if context is not None else decode_context_bucket(1 << 30)
        S = self._rank_splits.get((rank, b, c))
        if S is None:
            lay, m = self.rank_layouts[rank], self.model
            Bs = self._B_slots[:, self.layout.rank_slots(rank)]
            ident = np.tile(np.arange(lay.num_kv_heads), (lay.num_layers, 1))
            S = aot_bucket_split_map(Bs, ident, lay.heads_per_group, self.n_occ, b, waves=self.engine.n_cta_scale,
                                     rounding=self.engine.split_rounding, context=c, costs=self.decode_costs,
                                     gq=m.gqa_group, head_dim=m.head_dim, dtype_bytes=m.dtype_bytes,
                                     num_sms=self.gpu.num_sms)
            self._rank_splits[(rank, b, c)] = S
        return S

    def _decode_prices(self, lens0: np.ndarray, offs: np.ndarray, contexts: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """The base class's batched pricing: per rank and launch shape, every point at once, each exactly as
        :meth:`_decode_attention` prices it alone (the same operations on the same values, row by row: tests); the
        runtime partition, whose plan changes with every point, one point at a time."""
        if self.partition not in ("aot", "static"):
            out, fixed = np.empty(offs.size), np.empty(offs.size)
            for i, o in enumerate(offs.tolist()):
                out[i] = self._decode_attention(lens0 + o, None if contexts is None else int(contexts[i]))[0]
                fixed[i] = self._dec_fixed
            return out, fixed
        kd, L, H = lens0.shape
        m = offs.size
        per_layer = np.zeros((self.tp, m, L))
        fixed = np.zeros((self.tp, m, L))
        ctx = [None] * m if contexts is None else [int(c) for c in contexts.tolist()]
        for r in range(self.tp):
            lr0 = lens0[:, :, self.layout.rank_slots(r)]
            Hr = lr0.shape[2]
            if self.partition == "aot":
                b = pow2_bucket(kd) if self.params.aot_batch_buckets else 1
                keys = [("aot", r, kd, b, decode_context_bucket(c) if c is not None else decode_context_bucket(1 << 30))
                        for c in ctx]
            else:
                block_n = split_kv_block(self.model.head_dim)
                top = int(lr0.max()) if lr0.size else None  # the longest head grown by o: lr.max(initial=1)
                keys = [("static", r, kd, Hr, flashdecoding_num_splits(
                    kd * Hr, self.gpu.num_sms, max(1, -(-(max(top + o, 1) if top is not None else 1) // block_n))))
                    for o in offs.tolist()]
            for key, idx in _groups(keys).items():
                ii = np.arange(m) if isinstance(idx, int) else np.asarray(idx)
                c0 = ctx[int(ii[0])]

                def make(key=key, c0=c0, Hr=Hr, r=r):
                    if key[0] == "aot":
                        hp = self.rank_layouts[r].heads_per_group
                        per_head = np.repeat(self.rank_split_map(r, kd, c0), hp, axis=1)
                        return np.broadcast_to(per_head[:, None, :], (L, kd, Hr))
                    return np.full((L, kd, Hr), key[4], dtype=np.int64)
                reps, launch, fx = self._rank_launch(key, make, L)
                lr = lr0[None] + offs[ii][:, None, None, None]  # [points, kd, L, Hr]
                size = lr.transpose(0, 2, 1, 3) / reps
                per_layer[r, ii] = self._rank_layer_times(size.reshape(ii.size, L, -1) * self.tok_head_bytes,
                                                          launch, fx)
                if fx is not None:
                    fixed[r, ii] = fx
        tot = fixed.max(axis=0).sum(axis=1) if self.price_costs is not None else np.full(m, L * self.dec_launch)
        return per_layer.max(axis=0).sum(axis=1), tot

    def _rank_layer_times(self, size: np.ndarray, launch, fixed: np.ndarray | None) -> np.ndarray:
        """:meth:`_layer_times` of several size sets ``size`` [m, L, n] of one launch at once ([m, L]; each row as
        alone: the same sums along the same axis, and the tail's leading axis)."""
        m, L = size.shape[:2]
        total = (size * launch.reps).sum(axis=2) if not launch.empty else np.zeros((m, L))
        tail = size.reshape(m, -1)[:, launch.tsrc]
        c = self.price_costs
        if c is not None:
            return tail_layer_times(total, tail, launch, c, gq=self.gq, head_dim=self.model.head_dim, fixed=fixed)
        t = tail_wave_time(total, tail, launch, self.dec_bw, self.cta_bw)
        return t + launch.ctas * (self.gq * (self.model.head_dim + 2) * 4) / self.dec_bw + self.dec_launch

    def _decode_attention(self, lens: np.ndarray, context: int | None = None) -> tuple[float, float]:
        """Per rank and layer: the wave model on the rank's heads; each layer waits for its slowest rank (the AOT
        and static partitions: :meth:`_decode_prices` of one point; the runtime partition plans each rank here)."""
        if self.partition in ("aot", "static"):
            t, fixed = self._decode_prices(lens, np.zeros(1, dtype=np.int64),
                                           None if context is None else np.array([context]))
            self._dec_fixed = float(fixed[0])
            return float(t[0]), 0.0
        kd, L, H = lens.shape
        per_layer = np.zeros((self.tp, L))
        fixed = np.zeros((self.tp, L))
        plan_s = 0.0
        for r in range(self.tp):  # a handful of ranks; the work inside is numpy over [L, kd, H/tp]
            lr = lens[:, :, self.layout.rank_slots(r)]
            rp = runtime_plan(lr, self.n_cta)
            reps = np.stack(rp.splits).astype(np.int64)
            plan_s = max(plan_s, rp.host_items * self.host.runtime_plan_item_s)  # ranks plan concurrently
            # a runtime plan changes with the lengths: its launch is built for this pricing alone (key None)
            reps, launch, fx = self._rank_launch(None, lambda reps=reps: reps, L)
            size = lr.transpose(1, 0, 2) / reps
            per_layer[r] = self._layer_times(size.reshape(L, -1) * self.tok_head_bytes, launch, fx)
            if fx is not None:
                fixed[r] = fx
        # the rescale cache's fixed part: the slowest rank's per layer (the fallback's: its call intercepts)
        self._dec_fixed = float(fixed.max(axis=0).sum()) if self.price_costs is not None else L * self.dec_launch
        return float(per_layer.max(axis=0).sum()), plan_s

    def _rank_launch(self, key, make, L: int) -> tuple:
        """(CTA counts [L, kd, H/tp], their :func:`wave_launch`, its :func:`launch_fixed_times` or None), kept for
        the last ``64 x tp`` keys (``key`` None: not kept); ``make()`` gives the counts when they are not kept."""
        hit = self._rank_launches.get(key) if key is not None else None
        if hit is None:
            reps = make()
            launch = wave_launch(np.asarray(reps).reshape(L, -1), self.n_occ)
            fx = launch_fixed_times(launch, self.price_costs, gq=self.gq, head_dim=self.model.head_dim) \
                if self.price_costs is not None else None
            hit = (reps, launch, fx)
            if key is not None:
                if len(self._rank_launches) >= 64 * self.tp:  # the last ~64 batch shapes of every rank
                    self._rank_launches.pop(next(iter(self._rank_launches)))
                self._rank_launches[key] = hit
        return hit

    def _prefill_rows(self, tokens, head_lens, keep, retention: str) -> dict:
        ranks = []
        for r in range(self.tp):
            sl = self.layout.rank_slots(r)
            ranks.append(super()._prefill_rows(tokens, head_lens[..., sl], keep[..., sl], retention))
        return {"ranks": ranks}

    def _prefill_sum(self, rows: dict, sl: slice) -> tuple[float, float]:
        per = [super(TPCostModel, self)._prefill_sum(r, sl) for r in rows["ranks"]]
        return max(per, key=lambda ac: ac[0] + ac[1])


__all__ = ["TPCostModel", "AllReduceTable", "tp_pool_bytes", "ALLREDUCE_FILE"]

"""Decode cases of the kernel benchmark: random KV pages in one arena, ragged and monolithic tables, FlashInfer."""
from __future__ import annotations

import math

import numpy as np
import torch

from tangram.budgets import constant_profile, head_groups, synthetic_profile
from tangram.kernels import decode as dec

from .timing import L2_BYTES, time_host


def point_profile(m, prof_name: str, batch: int, ctx: int):
    """(budget ratios [L, H], H_p, layer-calls) of a decode point of the roofline benchmarks: ``paper`` (the
    synthetic profile at rho 0.25, alpha 2, H_p 4), ``tuned`` (the same, H_p 1) or ``uniform`` (full context,
    H_p = H), and enough layer-calls for one replay to stream 4x the L2."""
    L, H = m.num_layers, m.num_kv_heads
    if prof_name == "uniform":
        Bratio, Hp = constant_profile(L, H, 1.0).B, H
    else:
        Bratio = synthetic_profile(L, H, 0.25, alpha=2.0, seed=0, model=m.name).B
        Hp = 4 if prof_name == "paper" else 1
    per_layer = batch * H * ctx * 2 * m.head_dim * 2 * float(Bratio.mean())
    return Bratio, Hp, int(min(2 * L, max(4, math.ceil(4 * L2_BYTES / per_layer))))


class Arena:
    """One big random bf16 buffer; every pool of every config is a view of it, pages drawn at random."""

    def __init__(self, nbytes: int, device):
        self.n = nbytes // 2
        self.buf = torch.empty(self.n, dtype=torch.bfloat16, device=device)
        for i in range(0, self.n, 1 << 30):
            self.buf[i:i + (1 << 30)].normal_()
        self.device = device

    def pool(self, page_elems: int, shape_tail: tuple) -> torch.Tensor:
        npages = self.n // page_elems
        return self.buf[: npages * page_elems].view(npages, *shape_tail)


def layer_lens(Bratio: np.ndarray, perm: np.ndarray, ctx: int) -> np.ndarray:
    """Per-layer retained tokens in slot order [L, H]: ceil(B[l, perm[l, slot]] * ctx)."""
    Bs = np.take_along_axis(Bratio, perm, axis=1)
    return np.minimum(ctx, np.ceil(Bs * ctx - 1e-9)).astype(np.int64)


def ragged_tables(lens_slot: np.ndarray, batch: int, Hp: int, P: int, npages_pool: int, device):
    """Block table [B, G, max_pages] of one layer-call with random distinct pages of the pool."""
    H = lens_slot.size
    G = H // Hp
    pg = -(-lens_slot.reshape(G, Hp).max(1) // P)  # pages per group
    maxp = max(1, int(pg.max()))
    total = batch * int(pg.sum())
    if total > npages_pool:
        return None
    ids = torch.randperm(npages_pool, device=device)[:total].to(torch.int32)
    bt = torch.zeros((batch, G, maxp), dtype=torch.int32, device=device)
    mask = torch.arange(maxp, device=device)[None, None, :] < torch.from_numpy(pg).to(device)[None, :, None]
    bt[mask.expand(batch, G, maxp)] = ids
    return bt


class DecodeCase:
    """All layer-calls of one (model, batch, context, rho, H_p, profile) point, for every variant."""

    def __init__(self, arena: Arena, model, batch, ctx, rho, Hp, seed, P, Bratio, n_calls, dtype=torch.bfloat16):
        self.m, self.batch, self.ctx, self.rho, self.Hp, self.seed, self.P = model, batch, ctx, rho, Hp, seed, P
        H, Hq, d = model.num_kv_heads, model.num_q_heads, model.head_dim
        self.H, self.Hq, self.d = H, Hq, d
        self.Bratio = Bratio
        dev = arena.device
        self.perm = head_groups(Bratio, Hp)
        self.lens_slot = layer_lens(Bratio, self.perm, ctx)  # [L, H]
        self.n_calls = n_calls
        self.layers = [c % Bratio.shape[0] for c in range(n_calls)]
        self.pool = arena.pool(2 * Hp * P * d, (2, Hp, P, d))
        self.q = [torch.randn(batch, Hq, d, device=dev, dtype=dtype) for _ in range(n_calls)]
        self.out = [torch.empty_like(x) for x in self.q]
        self.bt, self.lens_t, self.s2h = [], [], []
        for l in self.layers:
            bt = ragged_tables(self.lens_slot[l], batch, Hp, P, self.pool.shape[0], dev)
            if bt is None:
                raise MemoryError("does not fit the arena")
            self.bt.append(bt)
            self.lens_t.append(torch.from_numpy(np.tile(self.lens_slot[l], (batch, 1)).astype(np.int32)).to(dev))
            self.s2h.append(torch.from_numpy(self.perm[l].astype(np.int32)).to(dev))
        self.kv_tokens = int(batch * sum(self.lens_slot[l].sum() for l in self.layers)) // n_calls
        es = 2
        self.bytes = self.kv_tokens * 2 * d * es + 2 * batch * Hq * d * es  # K,V read + q read + o written

    def launcher(self, scheds, config):
        """The case's layer-calls under one schedule per call, as one function (what a graph captures)."""
        def fn():
            for i in range(self.n_calls):
                dec.launch_decode(self.q[i], self.pool, self.bt[i], self.lens_t[i], self.s2h[i], scheds[i],
                                  page_size=self.P, heads_per_group=self.Hp, out=self.out[i], config=config)
        return fn

    def aot(self, table: dec.AotSplitTable, config):
        scheds = [table.lookup(l, self.batch, self.ctx) for l in self.layers]
        fn = self.launcher(scheds, config)
        # the engine's host work: one split-table lookup per step for all L layers (AotSplitTable.step), priced
        # per layer-call as the static split's one num_splits heuristic per step is
        plan = time_host(lambda: table.step(self.batch, self.ctx)) / self.Bratio.shape[0]
        return fn, plan, scheds

    def runtime(self, n_cta, config):
        lens = np.stack([np.tile(self.lens_slot[l], (self.batch, 1)) for l in self.layers], axis=1)  # [B, calls, H]
        plan_ms = time_host(lambda: runtime_step_plan(lens, n_cta, self.q[0].device)) / self.n_calls
        scheds = runtime_step_plan(lens, n_cta, self.q[0].device)
        return self.launcher(scheds, config), plan_ms, scheds


def runtime_step_plan(lens: np.ndarray, n_cta: int, device):
    """Baseline (b)'s host work per step (see tangram.kernels.decode.runtime_plan_schedules)."""
    return dec.runtime_plan_schedules(lens, n_cta, device)


class MonoCase:
    """The same lengths in the monolithic layout: pool [pages, calls, 2, H, P, d], one table [B, max_pages]."""

    def __init__(self, arena: Arena, case: DecodeCase):
        self.c = case
        H, P, d, B = case.H, case.P, case.d, case.batch
        self.lens_head = [case.lens_slot[l][np.argsort(case.perm[l])] for l in case.layers]
        maxp = max(1, -(-int(max(x.max() for x in self.lens_head)) // P))
        # layers of the monolithic pool: one per call if the arena holds them (it often does not: the
        # monolithic page table is sized by the longest head, which is the fragmentation Tangram removes)
        self.n_layers = min(case.n_calls, arena.n // (B * maxp * 2 * H * P * d))
        if self.n_layers < 1:
            raise MemoryError("monolithic layout does not fit the arena")
        self.pool6 = arena.pool(self.n_layers * 2 * H * P * d, (self.n_layers, 2, H, P, d))
        dev = arena.device
        self.bt2 = torch.randperm(self.pool6.shape[0], device=dev)[: B * maxp].view(B, maxp).to(torch.int32)
        self.lens_t = [torch.from_numpy(np.tile(x, (B, 1)).astype(np.int32)).to(dev) for x in self.lens_head]
        self.ident = torch.arange(H, dtype=torch.int32, device=dev)
        self.max_len = int(max(x.max() for x in self.lens_head))

    def static(self, num_sms, config):
        c = self.c
        views = [dec.monolithic_layer_view(self.pool6, self.bt2, i % self.n_layers) for i in range(c.n_calls)]
        ns = dec.static_split_num_splits(c.batch, c.H, self.max_len, num_sms, c.d)
        sched = dec.static_schedule(c.H, ns, c.q[0].device)
        plan_ms = time_host(lambda: dec.static_split_num_splits(c.batch, c.H, self.max_len, num_sms, c.d)) / \
            c.Bratio.shape[0]  # one heuristic call per step, shared by the L layers

        def fn():
            for i in range(c.n_calls):
                pool, bt = views[i]
                dec.launch_decode(c.q[i], pool, bt, self.lens_t[i], self.ident, sched, page_size=c.P,
                                  heads_per_group=c.H, out=c.out[i], config=config)
        return fn, plan_ms, sched


# ----------------------------------------------------------------------------- FlashInfer


class FlashInferPeer:
    def __init__(self, device):
        import flashinfer  # noqa: F401 - carried wheel; imported from outside its source folder

        self.fi = flashinfer
        self.version = getattr(flashinfer, "__version__", "?")
        self.device = device
        self.ws = {}
        # one float workspace for all wrappers: runs are sequential on one stream
        self.buf = torch.zeros(128 * 2**20, dtype=torch.uint8, device=device)

    MAX_CALLS = 16  # wrappers (one per distinct layer-call plan) kept alive

    def wrapper(self, key, tc: bool):
        if key not in self.ws:
            self.ws[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.buf, "HND", use_tensor_cores=tc)
        return self.ws[key]

    def uniform(self, case: DecodeCase, tc: bool):
        """Full/uniform lengths: FlashInfer on the G = 1 pool [pages, 2, H, P, d] (HND) with our block tables."""
        c = case
        assert c.Hp == c.H
        calls = []
        for i in range(min(c.n_calls, self.MAX_CALLS)):
            n = int(c.lens_slot[c.layers[i]][0])
            npg = -(-n // c.P)
            indices = c.bt[i][:, 0, :npg].reshape(-1).contiguous()
            indptr = torch.arange(c.batch + 1, device=self.device, dtype=torch.int32) * npg
            last = torch.full((c.batch,), n - (npg - 1) * c.P, dtype=torch.int32, device=self.device)
            w = self.wrapper(("u", i, tc), tc)
            w.plan(indptr, indices, last, c.Hq, c.H, c.d, c.P, pos_encoding_mode="NONE", q_data_type=c.q[i].dtype,
                   kv_data_type=c.pool.dtype)
            calls.append((w, (indptr, indices, last)))
        torch.cuda.synchronize()
        w0, args0 = calls[0]
        # uniform lengths: one plan per step, reused by all L layers
        plan_ms = time_host(lambda: w0.plan(*args0, c.Hq, c.H, c.d, c.P, pos_encoding_mode="NONE",
                                            q_data_type=c.q[0].dtype, kv_data_type=c.pool.dtype)) / c.Bratio.shape[0]
        torch.cuda.synchronize()

        def fn():
            for i, (w, _) in enumerate(calls):
                w.run(c.q[i], c.pool, out=c.out[i])
        return fn, plan_ms, len(calls)

    def ragged_hp1(self, case: DecodeCase, tc: bool):
        """Non-uniform heads as varlen (request, head) sequences of one KV head each (H_p = 1 pool), planned per layer."""
        c = case
        assert c.Hp == 1
        gq = c.Hq // c.H
        per = []
        for i in range(min(c.n_calls, self.MAX_CALLS)):
            lens = c.lens_slot[c.layers[i]]  # [H] slot order
            npg = np.maximum(1, -(-lens // c.P))
            bt = c.bt[i]  # [B, H, maxp]
            maxp = bt.shape[2]
            mask = torch.arange(maxp, device=self.device)[None, None, :] < torch.from_numpy(npg).to(self.device)[None, :, None]
            indices = bt[mask.expand_as(bt)].contiguous()
            nseq = c.batch * c.H
            pg = np.tile(npg, c.batch)
            indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pg)]).astype(np.int32)).to(self.device)
            lastl = np.tile(np.where(lens > 0, lens - (npg - 1) * c.P, 0), c.batch).astype(np.int32)
            last = torch.from_numpy(lastl).to(self.device)
            s2h = c.s2h[i].long()
            h2s = torch.argsort(s2h)
            per.append((indptr, indices, last, s2h, h2s, nseq))
        ws = [self.wrapper(("r", i, tc), tc) for i in range(len(per))]

        def plan_all():
            for i, (indptr, indices, last, *_rest) in enumerate(per):
                ws[i].plan(indptr, indices, last, gq, 1, c.d, c.P, pos_encoding_mode="NONE",
                           q_data_type=c.q[i].dtype, kv_data_type=c.pool.dtype)
        plan_all()
        torch.cuda.synchronize()
        plan_ms = time_host(plan_all, reps=5) / len(per)
        plan_all()
        torch.cuda.synchronize()

        def fn():
            for i, (indptr, indices, last, s2h, h2s, nseq) in enumerate(per):
                qs = c.q[i].view(c.batch, c.H, gq, c.d)[:, s2h].reshape(nseq, gq, c.d)
                o = ws[i].run(qs, c.pool)
                c.out[i].view(c.batch, c.H, gq, c.d).copy_(o.view(c.batch, c.H, gq, c.d)[:, h2s])
        return fn, plan_ms, len(per)



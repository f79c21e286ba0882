"""The sweeps of the kernel benchmark: decode (AOT vs static over batch x context x rho), prefill with fused
compression (per layer-call, graph-timed), the model's GEMMs and element-wise ops, each under a time budget."""
from __future__ import annotations

import time

import numpy as np
import torch

from tangram.budgets import head_groups, synthetic_profile
from tangram.kernels import fused as fu
from tangram.kernels import prefill as pre
from tangram.kernels.scoring import ScoreParams, snapkv_finish_batched

from .tables import ELEM_FIELDS, GEMM_FIELDS, PREFILL_FIELDS, Table
from .timing import kernel_launches, log, time_eager, time_graph, time_graph_calls, time_graphs


class Sweeps:
    """Mixin of :class:`tangram.kernels.bench.Bench`."""

    PREFILL_CHUNKS = (512, 1024, 2048, 4096)
    PREFILL_CACHED = (0, 8192, 32768)

    def decode_sweep(self, arena, dtab, tables_cache, models, stop_at):
        """Every (batch, context, rho) point: the static split on the monolithic layout (baseline a) and the AOT
        split table at each ``--sweep-hps`` H_p (runtime plan at H_p 1); rows flushed as measured."""
        a = self.args
        batches = [int(x) for x in a.sweep_batches.split(",")]
        ctxs = [int(x) for x in a.sweep_contexts.split(",")]
        rhos = [float(x) for x in a.sweep_rhos.split(",")]
        hps = [int(x) for x in a.sweep_hps.split(",")]
        if a.quick:
            batches, ctxs, rhos, hps = [1, 16], [1024, 8192], [0.25, 1.0], hps[:2]
        for m in models:
            H = m.num_kv_heads
            mhps = [h for h in hps if H % h == 0] or [H]
            for b in batches:
                for c in ctxs:
                    if c > m.max_context:
                        continue
                    for rho in rhos:
                        if time.time() > stop_at:
                            log(f"decode sweep: time budget reached after {dtab.n} rows")
                            return
                        for i, Hp in enumerate(mhps):
                            # static on the same ragged layout at every H_p (the like-with-like ratio), the
                            # monolithic static once per point (baseline a as a system would run it)
                            kern = ["tangram_aot", "static_split_ragged"] + (["runtime_plan"] if Hp == 1 else []) + \
                                (["static_split"] if i == 0 else []) + \
                                (["tangram_aot_lpt"] if "lpt" in self.args.aot_orders.split(",") else [])
                            try:
                                self.decode_point(dtab, arena, m, b, c, rho, Hp, 0, kern, tables_cache)
                            except torch.cuda.OutOfMemoryError:
                                torch.cuda.empty_cache()
                                log(f"OOM at {m.name} B={b} ctx={c} rho={rho} H_p={Hp}")
                            except Exception as e:  # noqa: BLE001
                                log(f"decode point {m.name} B={b} ctx={c} rho={rho} H_p={Hp} failed: {e!r}")
                                self.meta["notes"].append(f"decode point failed: {m.name} B={b} ctx={c} rho={rho} "
                                                          f"H_p={Hp}: {e!r}"[:300])
                    log(f"decode {m.name} B={b} ctx={c}: {dtab.n} rows")
        log(f"decode sweep complete: {dtab.n} rows")

    # -- prefill with fused compression
    def prefill_sweep(self, models, stop_at):
        """Per layer-call, one request's chunk: the batched path (chunk attention; SnapKV scores; the fused
        selection + copy), each timed as a CUDA-graph replay of ``n_calls`` layer-calls on distinct inputs, and the
        per-chunk path it replaced (eager, as the engine issued it). ``select_ms`` is the one-launch SnapKV compression
        (``snapkv_compress``: score, kvpress's finish, top-k, copy; ``score_ms`` and ``scatter_ms`` 0): the cost model
        sums score + select + scatter. ``compression_ms`` is what compression adds over the uncompressed prefill of
        the chunk (attention + fused minus attention + the full-mode KV copy, both one graph each, replays
        interleaved); ``unfused_ms`` the engine's former launches (scores, kvpress finish, select); ``launches_*``
        the CUDA kernels each path launches per layer-call (torch.profiler)."""
        from tangram.kernels import compress as cmp

        tab = Table(self.out / "prefill_attention.csv", PREFILL_FIELDS, self.common)
        chunks, cacheds = list(self.PREFILL_CHUNKS), list(self.PREFILL_CACHED)
        if self.args.quick:
            chunks, cacheds = [512, 2048], [0, 8192]
        P, n_calls = 16, 8
        for m in models:
            H, Hq, d = m.num_kv_heads, m.num_q_heads, m.head_dim
            Hp = 4 if H % 4 == 0 else 1
            G = H // Hp
            prof = synthetic_profile(m.num_layers, H, 0.25, seed=0)
            perm = head_groups(prof.B, Hp)
            for cached in cacheds:
                if cached > m.max_context:
                    continue
                for c in chunks:
                    if time.time() > stop_at:
                        log("prefill sweep: time budget reached")
                        return
                    calls = []
                    for li in range(n_calls):
                        ratios_slot = prof.B[li][perm[li]]
                        lens0 = np.ceil(ratios_slot * cached - 1e-9).astype(np.int32)
                        maxp = int(-(-(lens0.reshape(G, Hp).max(1).max() + c) // P)) + 1
                        maxp = -(-maxp // 16) * 16
                        pool = torch.randn(G * maxp + 4, 2, Hp, P, d, device=self.dev, dtype=torch.bfloat16)
                        bt = torch.randperm(pool.shape[0], device=self.dev)[:G * maxp].view(1, G, maxp).to(torch.int32)
                        s2h = torch.from_numpy(perm[li].astype(np.int32)).to(self.dev)
                        h2s = torch.argsort(s2h.long()).to(torch.int32)
                        qkv = torch.randn(c, (Hq + 2 * H) * d, device=self.dev, dtype=torch.bfloat16)
                        q = qkv[:, :Hq * d].view(c, Hq, d)
                        k = qkv[:, Hq * d:(Hq + H) * d].view(c, H, d)
                        v = qkv[:, (Hq + H) * d:].view(c, H, d)
                        lens = torch.from_numpy(lens0[None]).to(self.dev)
                        counts_np, _ = pre.keep_budget("tangram", c, H, ratios=ratios_slot)
                        counts = torch.from_numpy(np.minimum(counts_np, c).astype(np.int32)[None]).to(self.dev)
                        gk_host = int(np.ceil(0.25 * H * c - 1e-9))
                        gk = torch.tensor([gk_host], device=self.dev)
                        calls.append(dict(pool=pool, bt=bt, s2h=s2h, h2s=h2s, q=q, k=k, v=v, lens=lens,
                                          counts=counts, counts_np=counts_np, gk=gk, gk_host=gk_host,
                                          out=torch.empty_like(q),
                                          ntok=int(lens0.sum())))
                    cu = torch.tensor([0, c], dtype=torch.int32, device=self.dev)
                    lse = [cmp.prefill_attention_varlen(x["q"], x["k"], x["v"], cu, c, x["pool"], x["bt"], x["lens"],
                                                        x["h2s"], page_size=P, heads_per_group=Hp, out=x["out"])[1]
                           for x in calls]
                    raw = [cmp.snapkv_scores_varlen(x["q"], x["k"], lse[i], cu, c, x["h2s"]) for i, x in enumerate(calls)]

                    W, K = ScoreParams().window, ScoreParams().kernel
                    CS = cmp.score_width(c)
                    gq = Hq // H
                    clen = cu[1:] - cu[:-1]

                    def attn():
                        for x in calls:
                            cmp.prefill_attention_varlen(x["q"], x["k"], x["v"], cu, c, x["pool"], x["bt"], x["lens"],
                                                         x["h2s"], page_size=P, heads_per_group=Hp, out=x["out"])

                    def copy():  # uncompressed prefill's KV write (the engine's full mode)
                        for x in calls:
                            cmp.select_scatter(None, x["k"], x["v"], cu, c, None, x["pool"], x["bt"], x["lens"],
                                               x["s2h"], page_size=P, heads_per_group=Hp)

                    def unfused():  # the engine's SnapKV launches before the fusion: scores, kvpress finish, select
                        for i, x in enumerate(calls):
                            r = cmp.snapkv_scores_varlen(x["q"], x["k"], lse[i], cu, c, x["h2s"], window=W, width=CS,
                                                         out=raw[i])
                            fin = snapkv_finish_batched(r, clen, W, gq, K)
                            cmp.select_scatter(fin, x["k"], x["v"], cu, c, x["counts"], x["pool"], x["bt"],
                                               x["lens"], x["s2h"], page_size=P, heads_per_group=Hp, pool_kernel=1)

                    def fused():  # the engine's SnapKV compression now: one launch
                        for i, x in enumerate(calls):
                            cmp.snapkv_compress(x["q"], x["k"], x["v"], lse[i], cu, c, x["counts"], x["pool"],
                                                x["bt"], x["lens"], x["s2h"], page_size=P, heads_per_group=Hp,
                                                window=W, pool_kernel=K, width=CS)

                    def attn_copy():
                        attn()
                        copy()

                    def attn_fused():
                        attn()
                        fused()

                    def select_dyn():
                        for i, x in enumerate(calls):
                            pooled = cmp.pool_scores(raw[i])
                            cnt = cmp.global_keep_counts(pooled, cu, x["gk"], x["gk_host"])
                            cmp.select_scatter(pooled, x["k"], x["v"], cu, c, cnt, x["pool"], x["bt"], x["lens"],
                                               x["s2h"], page_size=P, heads_per_group=Hp, pool_kernel=1)
                    fns = [attn, copy, unfused, fused, attn_copy, attn_fused, select_dyn]
                    t_att, t_copy, t_unf, t_fus, t_ac, t_af, t_dyn = \
                        [t[0] / n_calls for t in time_graphs(fns)]  # interleaved replays: like with like
                    launches = {name: kernel_launches(f) / n_calls for name, f in
                                (("copy", copy), ("unfused", unfused), ("fused", fused))}
                    t_comp = t_af - t_ac  # what compression adds over the uncompressed prefill of the chunk
                    x0 = calls[0]
                    lens_t = x0["lens"][0].clone()

                    def old_path():
                        lens_t.copy_(x0["lens"][0])
                        pre.prefill_compress(x0["q"], x0["k"], x0["v"], x0["pool"], x0["bt"][0], lens_t, x0["s2h"],
                                             page_size=P, heads_per_group=Hp, keep_counts=x0["counts_np"])
                    t_old = time_eager(old_path)[0]
                    ntok = int(np.mean([x["ntok"] for x in calls]))
                    gq = Hq // H
                    flops = 4 * d * gq * (c * ntok + H * c * c / 2)  # QK^T and PV; causal half of the chunk
                    tab.add(model=m.name, dtype="bfloat16", mode="tangram", heads_per_group=Hp, rho=0.25, chunk=c,
                            cached=cached, cached_tokens=ntok, kept_tokens=int(np.minimum(x0["counts_np"], c).sum()),
                            attention_ms=t_att, score_ms=0.0, select_ms=t_fus, scatter_ms=0.0, total_ms=t_af,
                            select_dynamic_ms=t_dyn, attn_tflops=flops / (t_att * 1e-3) / 1e12,
                            compression_ms=t_comp, compress_vs_attention=t_comp / t_att, per_chunk_path_ms=t_old,
                            timer="graph", copy_ms=t_copy, fused_ms=t_fus, unfused_ms=t_unf,
                            fused_vs_attention=t_fus / t_att, unfused_vs_attention=t_unf / t_att,
                            attn_copy_ms=t_ac, launches_copy=launches["copy"], launches_fused=launches["fused"],
                            launches_unfused=launches["unfused"])
                    log(f"prefill {m.name} c={c} cached={cached}: attn {t_att * 1e3:.1f} us; compression adds "
                        f"{t_comp * 1e3:.1f} us over attn+copy ({t_comp / t_att:.0%} of attention); fused kernel "
                        f"{t_fus * 1e3:.1f} us ({launches['fused']:g} launch) vs unfused {t_unf * 1e3:.1f} us "
                        f"({launches['unfused']:g} launches), copy {t_copy * 1e3:.1f} us; per-chunk path (eager) "
                        f"{t_old * 1e3:.1f} us")
                    calls.clear()
        torch.cuda.empty_cache()

    # -- GEMMs and elementwise
    def gemm_sweep(self, models, stop_at):
        tab = Table(self.out / "gemm.csv", GEMM_FIELDS, self.common)
        toks = [2**i for i in range(14)]
        if self.args.quick:
            toks = [1, 64, 2048]
        for m in models:
            h, I, Hq, H, d = m.hidden, m.intermediate, m.num_q_heads, m.num_kv_heads, m.head_dim
            ops = {"qkv": ((Hq + 2 * H) * d, h), "o": (h, Hq * d), "gate_up": (2 * I, h), "down": (h, I),
                   "lm_head": (m.vocab, h)}
            for op, (n, k) in ops.items():
                w = torch.randn(n, k, device=self.dev, dtype=torch.bfloat16) * 0.02
                for t in toks:
                    if time.time() > stop_at:
                        log("gemm sweep: time budget reached")
                        return
                    xs = [torch.randn(t, k, device=self.dev, dtype=torch.bfloat16) for _ in range(2)]
                    med, p20, p80 = time_eager(lambda: torch.matmul(xs[0], w.t()), 10)
                    tab.add(model=m.name, dtype="bfloat16", op=op, tokens=t, m=t, n=n, k=k, median_ms=med, p20_ms=p20,
                            p80_ms=p80, tflops=2 * t * n * k / (med * 1e-3) / 1e12)
                del w
            log(f"gemm {m.name} done")

    def elementwise_sweep(self, models, stop_at):
        import torch.nn.functional as F

        tab = Table(self.out / "elementwise.csv", ELEM_FIELDS, self.common)
        toks = [1, 4, 16, 64, 256, 1024, 4096, 8192]
        if self.args.quick:
            toks = [1, 256, 4096]
        for m in models:
            h, I, d = m.hidden, m.intermediate, m.head_dim
            wn = torch.randn(h, device=self.dev, dtype=torch.bfloat16)
            for t in toks:
                if time.time() > stop_at:
                    log("elementwise sweep: time budget reached")
                    return
                x = torch.randn(t, h, device=self.dev, dtype=torch.bfloat16)
                gu = torch.randn(t, 2 * I, device=self.dev, dtype=torch.bfloat16)
                qk = torch.randn(t, m.num_q_heads + m.num_kv_heads, d, device=self.dev, dtype=torch.bfloat16)
                pos = torch.arange(t, device=self.dev)
                inv = 1.0 / (m.rope_theta ** (torch.arange(0, d, 2, device=self.dev).float() / d))

                def rope():
                    f = pos[:, None].float() * inv[None]
                    cos, sin = f.cos()[:, None].to(qk.dtype), f.sin()[:, None].to(qk.dtype)
                    a, b = qk[..., : d // 2], qk[..., d // 2:]
                    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

                ops = {
                    "rmsnorm": (lambda: F.rms_norm(x, (h,), wn, m.rms_eps), 2 * t * h * 2),
                    "rope": (rope, 2 * qk.numel() * 2),
                    "silu_mul": (lambda: F.silu(gu[:, :I]) * gu[:, I:], 3 * t * I * 2),
                }
                if t <= 256:
                    logits = torch.randn(t, m.vocab, device=self.dev, dtype=torch.float32)

                    def sample():
                        p = torch.softmax(logits / 0.8, -1)
                        return torch.multinomial(p, 1)
                    ops["sampling"] = (sample, logits.numel() * 4)
                    ops["greedy"] = (lambda: logits.argmax(-1), logits.numel() * 4)
                for op, (fn, nbytes) in ops.items():
                    med, p20, p80 = time_eager(fn, 10)
                    tab.add(model=m.name, dtype="bfloat16", op=op, impl="torch", tokens=t,
                            hidden=h if op != "silu_mul" else I, median_ms=med, p20_ms=p20, p80_ms=p80,
                            gbps=nbytes / (med * 1e-3) / 1e9)
                # the engine's own kernels (kernels/fused.py), one launch each, timed back to back in a CUDA graph
                # as a graphed step runs them: what the cost model prices (impl "fused" rows win over "torch")
                r = torch.randn(t, h, device=self.dev, dtype=torch.bfloat16)
                Hq, H = m.num_q_heads, m.num_kv_heads
                qkv = torch.randn(t, (Hq + 2 * H) * d, device=self.dev, dtype=torch.bfloat16)
                f = pos[:, None].float() * inv[None]
                emb = torch.cat([f, f], -1)
                cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
                fused = {
                    "rmsnorm": (lambda: fu.add_rms_norm(x, r, wn, m.rms_eps), 4 * t * h * 2),
                    "rope": (lambda: fu.rope_qkv(qkv, cos, sin, num_q_heads=Hq, num_kv_heads=H, head_dim=d),
                             2 * (Hq + H) * d * t * 2),
                    "silu_mul": (lambda: fu.silu_mul(gu), 3 * t * I * 2),
                }
                for op, (fn, nbytes) in fused.items():
                    med, p20, p80 = time_graph_calls(fn)
                    tab.add(model=m.name, dtype="bfloat16", op=op, impl="fused", tokens=t,
                            hidden=h if op != "silu_mul" else I, median_ms=med, p20_ms=p20, p80_ms=p80,
                            gbps=nbytes / (med * 1e-3) / 1e9)
            log(f"elementwise {m.name} done")

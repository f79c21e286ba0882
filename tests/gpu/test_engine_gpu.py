"""GPU correctness of the engine and its kernels, before any timing (marker ``gpu``: CI, which has no GPU, never
selects them; a GPU run does: ``python -m pytest -m gpu tests/gpu``).

* Llama-3.1-8B's layer shape (4 of its 32 layers), random fp32 weights, the Triton kernels (fp32 runs them in
  IEEE precision, so a layout bug cannot hide behind bf16 noise): ``full`` through the executor (chunked
  prefill, paged decode, 3 sessions x 2 turns, batched) against the plain model on the same token streams;
* every mode serves the trace with finite logits (the KV pool is NaN-poisoned) and returns every page;
* the graph-replayed decode steps (one graph per layer, replayed back to back) give the eager path's logits
  (3 sessions decode together: bucket 4 with a padded row);
* the fused kernels (RMSNorm, residual add, SiLU*up, RoPE + KV write) against the torch code they replace, and
  the batched compression path against the float64 references, on the model's shapes in bf16.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


@pytest.fixture(scope="module")
def llama4():
    from tangram.config import get_model
    from tangram.engine.weights import load_model

    cfg = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=4)
    model, _ = load_model(cfg, "random", dtype=torch.float32, device=DEV, seed=int.from_bytes(os.urandom(2), "little"))
    return cfg, model


def _trace():
    from tangram.traces.format import Trace, Turn

    return Trace([Turn("a:0", "a", 0, 0.0, 0.0, 700, 6), Turn("a:1", "a", 1, None, 0.0, 90, 5),
                  Turn("b:0", "b", 0, 0.0, 0.0, 300, 8), Turn("b:1", "b", 1, None, 0.0, 40, 4),
                  Turn("c:0", "c", 0, 0.0, 0.0, 200, 9), Turn("c:1", "c", 1, None, 0.0, 30, 6)])


def _serve(cfg, model, mode, cuda_graphs, graph_layers=4, async_steps=False):
    from tangram.budgets import synthetic_profile
    from tangram.config import EngineConfig
    from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
    from tangram.planner import DecodeCosts, tables_dir
    from tangram.harness.cluster import Cluster

    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.25, alpha=2.0, seed=0, model=cfg.name)
    eng = EngineConfig(mode=mode, chunk_size=256, max_batched_tokens=512, kv_pool_bytes=2 * 2**30)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=1),
                   ExecutorOptions(record_logits=True, cuda_graphs=cuda_graphs, graph_layers=graph_layers,
                                   decode_costs=DecodeCosts.load(tables_dir("h100")), async_steps=async_steps))
    res = Cluster(_trace(), [(sched, exe)]).run()
    return sched, exe, res


def test_full_mode_matches_the_plain_model(llama4):
    from tangram.engine.model import Session

    cfg, model = llama4
    sched, exe, res = _serve(cfg, model, "full", "auto")
    worst, agree, n = 0.0, 0, 0
    for sid, stream in exe.streams.items():
        with torch.no_grad():
            ref = Session(model).forward(torch.tensor(stream, device=DEV)).float().cpu()
        rids = {x.rid for x in res.records if x.session_id == sid}
        for rid, pos, lg in exe.logit_log:
            if rid in rids:
                worst = max(worst, float((lg - ref[pos]).abs().max() / ref[pos].abs().max()))
                agree += int(lg.argmax() == ref[pos].argmax())
                n += 1
    print(f"full vs plain model: max rel err {worst:.2e}, greedy agreement {agree}/{n}")
    assert n > 20 and worst < 1e-3 and agree == n


@pytest.mark.parametrize("mode", ["full", "uniform", "dynamic", "br", "br+rp", "tangram"])
def test_every_mode_finite_no_leak_and_graphs_equal_eager(llama4, mode):
    cfg, model = llama4
    sched, exe, res = _serve(cfg, model, mode, "auto", graph_layers=1)  # a graph per layer: the carry between them
    assert len(exe.graphs.pieces) == cfg.num_layers
    assert all(r.status == "finished" for r in res.records) and sched.pool.n_used == 0
    assert all(bool(torch.isfinite(lg).all()) for _, _, lg in exe.logit_log)
    assert exe.graphs is not None and exe.graphs.stats.replays > 0
    s2, e2, _ = _serve(cfg, model, mode, "off")
    ref = {(rid, pos): lg for rid, pos, lg in e2.logit_log}
    got = {(rid, pos): lg for rid, pos, lg in exe.logit_log}
    assert got.keys() == ref.keys()
    err = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    print(f"{mode}: graph vs eager max rel err {err:.2e}, {exe.graphs.stats.replays} replays, "
          f"keys {exe.graphs.stats.keys}")
    assert err < 1e-4 and exe.streams == e2.streams


@pytest.mark.parametrize("mode", ["full", "tangram", "dynamic"])
def test_async_decode_steps_equal_the_synchronous_ones(llama4, mode):
    """Asynchronous decode steps on CUDA (the next step launched before the previous one's tokens reach the host,
    its rows fed those tokens on the device, the token copy non-blocking into pinned memory): the same greedy
    tokens, logits and scheduler outcomes as synchronous steps (every turn is ready at once with no think time, so
    the synchronous order depends on no clock)."""
    cfg, model = llama4
    s0, e0, r0 = _serve(cfg, model, mode, "auto")
    s1, e1, r1 = _serve(cfg, model, mode, "auto", async_steps=True)
    assert e1.runs_ahead and e1.device_fed > 0 and not e1._queue
    assert e1.streams == e0.streams
    ref = {(rid, pos): lg for rid, pos, lg in e0.logit_log}
    got = {(rid, pos): lg for rid, pos, lg in e1.logit_log}
    assert got.keys() == ref.keys()
    err = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    print(f"{mode}: async vs sync max rel err {err:.2e}, {e1.device_fed} rows fed on the device, "
          f"{r1.replicas[0].steps} steps, busy {r1.replicas[0].busy_s:.3f} s vs {r0.replicas[0].busy_s:.3f} s")
    assert err < 1e-6
    assert [(r.status, r.preemptions) for r in r1.records] == [(r.status, r.preemptions) for r in r0.records]
    assert r1.replicas[0].steps == r0.replicas[0].steps and r1.replicas[0].reserved == r0.replicas[0].reserved
    assert s1.pool.n_used == 0 and all(d > 0 for d in [r1.replicas[0].busy_s])


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fused_elementwise_kernels_match_torch():
    from tangram.kernels.fused import _torch_rms_norm, _torch_rope, add_rms_norm, rms_norm, rope_qkv, silu_mul

    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for N in (1, 37, 512):
        x = torch.randn(N, 4096, device=DEV, generator=g).bfloat16()
        r = torch.randn(N, 4096, device=DEV, generator=g).bfloat16()
        w = torch.randn(4096, device=DEV, generator=g).bfloat16()
        y = torch.full_like(x, float("nan"))
        y.copy_(rms_norm(x, w, 1e-5))
        assert _rel(y, _torch_rms_norm(x, w, 1e-5)) < 4e-3
        s, y2 = add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r) and _rel(y2, _torch_rms_norm(x + r, w, 1e-5)) < 4e-3
        gu = torch.randn(N, 2 * 14336, device=DEV, generator=g).bfloat16()
        assert _rel(silu_mul(gu), F.silu(gu[:, :14336]) * gu[:, 14336:]) < 4e-3
        Hq, H, d = 32, 8, 128
        qkv = torch.randn(N, (Hq + 2 * H) * d, device=DEV, generator=g).bfloat16()
        pos = torch.randint(0, 100000, (N,), device=DEV, generator=g)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
        f = pos.float()[:, None] * inv[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
        ref = qkv.clone()
        q, k, v = rope_qkv(qkv, cos, sin, num_q_heads=Hq, num_kv_heads=H, head_dim=d)
        rq = _torch_rope(ref[:, :Hq * d].view(N, Hq, d), cos[:, None], sin[:, None])
        rk = _torch_rope(ref[:, Hq * d:(Hq + H) * d].view(N, H, d), cos[:, None], sin[:, None])
        assert (q.float() - rq.float()).abs().max() <= 2 ** -6 * rq.float().abs().max()
        assert (k.float() - rk.float()).abs().max() <= 2 ** -6 * rk.float().abs().max()
        assert torch.equal(v, ref[:, (Hq + H) * d:].view(N, H, d))


def test_rope_kv_write_places_every_head_at_its_position():
    from tangram.kernels.fused import _torch_kv_write, rope_qkv

    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, Hq, H, d, P = 24, 32, 8, 128, 16
    for Hp in (1, 4, 8):
        G = H // Hp
        pool = torch.full((B * G * 8 + 4, 2, Hp, P, d), float("nan"), device=DEV).bfloat16()
        tables = torch.randperm(pool.shape[0], device=DEV, generator=g)[:B * G * 8].view(B, G, 8).to(torch.int32)
        lens = torch.randint(1, 8 * P + 1, (B, H), device=DEV, generator=g).to(torch.int32)
        h2s = torch.randperm(H, device=DEV, generator=g).to(torch.int32)
        qkv = torch.randn(B + 5, (Hq + 2 * H) * d, device=DEV, generator=g).bfloat16()
        cos, sin = torch.randn(B + 5, d, device=DEV, generator=g).bfloat16(), torch.randn(B + 5, d, device=DEV,
                                                                                           generator=g).bfloat16()
        q, k, v = rope_qkv(qkv, cos, sin, num_q_heads=Hq, num_kv_heads=H, head_dim=d, kv_pool=pool,
                           block_table=tables, head_lens=lens, head_to_slot=h2s, page_size=P, heads_per_group=Hp,
                           n_decode=B)
        ref = torch.full_like(pool, float("nan"))
        _torch_kv_write(ref, tables, lens, h2s, k[:B], v[:B], P, Hp)
        assert torch.equal(torch.isnan(pool), torch.isnan(ref))
        m = ~torch.isnan(ref)
        assert torch.equal(pool[m], ref[m])


@pytest.mark.parametrize("model_name", ["llama-3.1-8b", "smollm2-135m"])
def test_batched_compression_matches_float64_references(model_name):
    from tangram.config import get_model
    from tangram.kernels.compress import (global_keep_counts, pool_scores, prefill_attention_varlen, select_scatter,
                                          snapkv_scores_varlen)
    from tangram.kernels.reference import ref_prefill_attention, ref_scatter, ref_snapkv_scores, is_topk_set

    m = get_model(model_name)
    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    H, Hq, d, P = m.num_kv_heads, m.num_q_heads, m.head_dim, 16
    Hp = 4 if H % 4 == 0 else 1
    G = H // Hp
    cs, cached = [512, 1000, 77], [0, 3000, 700]
    kp, N = len(cs), sum(cs)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(cs)]), dtype=torch.int32, device=DEV)
    W = (max(cached) + max(cs)) // P + 2
    pool = torch.randn(kp * G * W + 8, 2, Hp, P, d, device=DEV, generator=g).bfloat16()
    tables = torch.randperm(pool.shape[0], device=DEV, generator=g)[:kp * G * W].view(kp, G, W).to(torch.int32)
    s2h = torch.randperm(H, device=DEV, generator=g).to(torch.int32)
    h2s = torch.argsort(s2h.long()).to(torch.int32)
    lens = torch.tensor([[max(0, c - 7 * s) for s in range(H)] for c in cached], dtype=torch.int32, device=DEV)
    qkv = torch.randn(N, (Hq + 2 * H) * d, device=DEV, generator=g).bfloat16()
    q = qkv[:, :Hq * d].view(N, Hq, d)
    k = qkv[:, Hq * d:(Hq + H) * d].view(N, H, d)
    v = qkv[:, (Hq + H) * d:].view(N, H, d)
    out = torch.full((N, Hq, d), float("nan"), device=DEV).bfloat16()
    out, lse = prefill_attention_varlen(q, k, v, cu, max(cs), pool, tables, lens, h2s, page_size=P,
                                        heads_per_group=Hp, out=out)
    raw = snapkv_scores_varlen(q, k, lse, cu, max(cs), h2s, window=32)
    pooled = pool_scores(raw)
    counts = torch.stack([torch.from_numpy(np.minimum(c, np.ceil(np.linspace(0.05, 1.0, H) * c)).astype(np.int32))
                          for c in cs]).to(DEV)
    for kind in ("per_head", "global", "full"):
        p2 = pool.clone()
        if kind == "per_head":
            kept = select_scatter(raw, k, v, cu, max(cs), counts, p2, tables, lens, s2h, page_size=P, heads_per_group=Hp)
            want = counts
        elif kind == "global":
            want = global_keep_counts(pooled, cu, torch.tensor([int(0.25 * H * c) for c in cs], device=DEV))
            kept = select_scatter(pooled, k, v, cu, max(cs), want, p2, tables, lens, s2h, page_size=P,
                                  heads_per_group=Hp, pool_kernel=1)
        else:
            kept = select_scatter(None, k, v, cu, max(cs), None, p2, tables, lens, s2h, page_size=P, heads_per_group=Hp)
            want = torch.tensor(cs, device=DEV)[:, None].expand(kp, H)
        assert torch.equal(kept.long(), want.long())
        for i in range(kp):
            a, b = int(cu[i]), int(cu[i + 1])
            if kind == "per_head":
                o_ref, probs = ref_prefill_attention(q[a:b], k[a:b], v[a:b], pool, tables[i], lens[i], s2h,
                                                     page_size=P, heads_per_group=Hp)
                assert _rel(out[a:b], o_ref) < 1e-2
                s_ref = ref_snapkv_scores(probs, lens[i], s2h, window=32)
                assert _rel(pooled[i, :, :b - a], s_ref) < 1e-2
            s = pooled[i, :, :b - a].double().cpu().numpy()
            # the kept set, read back from the pool, is a top-k of the kernel's own scores
            keep = np.zeros((H, b - a), dtype=bool)
            ref_pool = pool.clone()
            if kind == "full":
                keep[:] = True
            else:
                for slot in range(H):
                    n = int(want[i, slot])
                    keep[slot, np.sort(np.argsort(-s[slot], kind="stable")[:n])] = True
                assert is_topk_set(s, keep, want[i].cpu().numpy())
            rp, _ = ref_scatter(ref_pool, tables[i], lens[i], s2h, k[a:b], v[a:b], keep, page_size=P,
                                heads_per_group=Hp)
            pages = tables[i].long().flatten()
            if kind == "full":
                assert torch.equal(p2[pages], rp[pages])
            else:  # where the k-th and (k+1)-th scores are apart (no near-tie at the boundary) the set is unique
                clear = True
                for slot in range(H):
                    n, srt = int(want[i, slot]), np.sort(s[slot])[::-1]
                    if 0 < n < srt.size and srt[n - 1] - srt[n] <= 1e-5 * max(srt[0], 1e-30):
                        clear = False
                if clear:
                    assert torch.equal(p2[pages], rp[pages])

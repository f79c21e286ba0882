"""Asynchronous decode steps (``ExecutorOptions.async_steps``) on the CPU, graphs emulated: the harness launches a
pure-decode step before the previous one's tokens reach the host, and the step's rows read those tokens on the
device. The truth is the synchronous path of the same engine: token streams, logits, every scheduler outcome (steps,
finishes, preemptions, evictions, the KV samples after each step) and the page accounting must be identical."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tangram.engine.executor as executor_mod
from engine_cases import reference_kernels, tiny_model  # noqa: F401 (reference_kernels: autouse fixture)
from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig
from tangram.engine.bench import leak_check
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.engine.sampling import SamplingParams
from tangram.harness import Cluster
from tangram.traces.format import Trace, Turn


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(5)


def mixed_trace() -> Trace:
    """Four sessions of two turns, all ready at once and no think time (the synchronous loop's order then depends on
    no clock): prefill chunks mix with decode rows, turns finish at different steps. Session a's first turn
    declares a prefix and its second a longer chain, so a's first outputs (positions 60-63) lie in a declared span:
    the stream holds the declared ids there, not the samples, and the next step must be fed those."""
    sys_, doc = ("sys", 21), ("doc", 49)
    return Trace([Turn("a:0", "a", 0, 0.0, 0.0, 60, 9, prefix=(sys_,)),
                  Turn("a:1", "a", 1, None, 0.0, 30, 7, prefix=(sys_, doc)),
                  Turn("b:0", "b", 0, 0.0, 0.0, 35, 12, prefix=(sys_,)),
                  Turn("b:1", "b", 1, None, 0.0, 9, 10),
                  Turn("c:0", "c", 0, 0.0, 0.0, 41, 14),
                  Turn("c:1", "c", 1, None, 0.0, 17, 8),
                  Turn("d:0", "d", 0, 0.0, 0.0, 29, 16),
                  Turn("d:1", "d", 1, None, 0.0, 12, 11)])


def serve(model, cfg, mode, async_steps, pool_bytes, sampling=SamplingParams(), trace=None):
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = EngineConfig(mode=mode, page_size=4, heads_per_group=2, rho=0.5, alpha=1.0, chunk_size=16,
                       max_batched_tokens=24, kv_pool_bytes=pool_bytes, cuda_graph_max_bs=4)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=pool_bytes)
    tr = trace or mixed_trace()
    exe = Executor(model, sched, TokenSource.from_trace(tr, cfg.vocab, seed=3),
                   ExecutorOptions(record_logits=True, cuda_graphs="emulate", async_steps=async_steps,
                                   sampling=sampling))
    res = Cluster(tr, [(sched, exe)]).run()
    assert not exe._queue  # every launched step completed
    return sched, exe, res


def outcome(sched, res):
    """Everything the scheduler decided, no clock in it."""
    rep = res.replicas[0]
    recs = [(r.rid, r.status, r.preemptions, r.cached_tokens, r.prefill_tokens) for r in res.records]
    st = dataclasses.asdict(sched.stats)
    return recs, rep.steps, rep.reserved, rep.live, st


@pytest.mark.parametrize("mode,pool", [("full", 400_000), ("tangram", 400_000), ("tangram", 70_000),
                                       ("dynamic", 70_000)])
def test_async_steps_equal_the_synchronous_path(tiny, mode, pool):
    cfg, model = tiny
    s0, e0, r0 = serve(model, cfg, mode, False, pool)
    s1, e1, r1 = serve(model, cfg, mode, True, pool)
    assert all(r.status == "finished" for r in r0.records)
    assert e1.device_fed > 0 and e0.device_fed == 0  # the async run fed decode rows from the device
    assert e1.graphs.stats.replays == e0.graphs.stats.replays > 0
    assert e1.streams == e0.streams
    assert [(r, p) for r, p, _ in e1.logit_log] == [(r, p) for r, p, _ in e0.logit_log]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(e1.logit_log, e0.logit_log))
    assert outcome(s1, r1) == outcome(s0, r0)
    assert leak_check(s1)["ok"] and leak_check(s0)["ok"]
    if pool == 70_000:  # the small pool forces the scheduler's memory paths, in both runs alike
        assert s0.stats.preemptions + s0.stats.session_evictions > 0
    # a's first outputs lie in a's declared span: the streams hold the declared ids there (both paths)
    ref = TokenSource.from_trace(mixed_trace(), cfg.vocab, seed=3)
    assert e1.streams["a"][60:64] == ref.turn_ids(1, 4, start=60).tolist()
    # every step's duration is a measured positive time; overlapped host time is labelled, not added
    bd = r1.replicas[0].breakdown
    assert r1.replicas[0].busy_s > 0 and bd["engine_graph"] > 0 and bd.get("host_overlapped", 0.0) > 0


def test_async_steps_with_temperature_sampling(tiny):
    """Sampled (not greedy) tokens come from the sampler after the replay; one generator, same order: same draws."""
    cfg, model = tiny
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    _, e0, r0 = serve(model, cfg, "tangram", False, 400_000, sp)
    _, e1, r1 = serve(model, cfg, "tangram", True, 400_000, sp)
    assert e1.device_fed > 0 and e1.streams == e0.streams


def test_a_stale_or_host_token_cannot_be_fed(tiny, monkeypatch):
    """Poisoned inputs: the host placeholder of a row whose token is on the device is a wrong id, and the static
    token buffer is filled with another wrong id before every replay. The streams still equal the synchronous
    run's only if every pending row read the previous step's sample on the device, in stream order."""
    cfg, model = tiny
    _, e0, _ = serve(model, cfg, "full", False, 400_000)
    monkeypatch.setattr(executor_mod, "PENDING_TOKEN", 7)
    from tangram.engine.cuda_graphs import DecodeGraphs

    run = DecodeGraphs.run

    def poisoned(self, tokens, *a, **kw):
        self.bufs.tokens.fill_(13)
        return run(self, tokens, *a, **kw)

    monkeypatch.setattr(DecodeGraphs, "run", poisoned)
    _, e1, _ = serve(model, cfg, "full", True, 400_000)
    assert e1.device_fed > 0 and e1.streams == e0.streams


def test_the_poison_is_seen_when_the_device_gather_is_skipped(tiny, monkeypatch):
    """The check above can fail: without the device gather the placeholder reaches the model."""
    cfg, model = tiny
    _, e0, _ = serve(model, cfg, "full", False, 400_000)
    monkeypatch.setattr(executor_mod, "PENDING_TOKEN", 7)
    fwd = Executor._forward_graph
    monkeypatch.setattr(Executor, "_forward_graph", lambda self, plan, ids, pos, src=None, prev=None:
                        fwd(self, plan, ids, pos))
    _, e1, _ = serve(model, cfg, "full", True, 400_000)
    assert e1.device_fed > 0 and e1.streams != e0.streams


def test_launch_complete_contract(tiny):
    """Direct use: a launched decode step stays in flight until complete(); execute() refuses to run behind it;
    a prefill step launched behind it completes it first and runs synchronously; results come in launch order."""
    cfg, model = tiny
    tr = Trace([Turn("a:0", "a", 0, 0.0, 0.0, 20, 6), Turn("b:0", "b", 0, 0.0, 0.0, 12, 6)])
    prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.5, alpha=1.0, seed=0, model=cfg.name)
    eng = EngineConfig(mode="tangram", page_size=4, heads_per_group=2, rho=0.5, alpha=1.0, chunk_size=16,
                       max_batched_tokens=24, kv_pool_bytes=400_000, cuda_graph_max_bs=4)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=400_000)
    exe = Executor(model, sched, TokenSource.from_trace(tr, cfg.vocab, seed=3),
                   ExecutorOptions(cuda_graphs="emulate", async_steps=True))
    assert exe.runs_ahead
    for i, t in enumerate(tr.turns):
        sched.add_request(i, t.session_id, t.new_tokens, t.output_tokens)
    kinds = []
    while sched.has_work():
        plan = sched.schedule()
        flying = exe.launch(plan)
        kinds.append(flying)
        assert flying == (plan.num_prefill == 0)
        if flying:
            with pytest.raises(RuntimeError, match="complete"):
                exe.execute(plan)
        res = exe.complete()
        assert res.step == plan.step and res.duration_s > 0 and len(res.sampled) == plan.num_decode + \
            int(plan.prefill_last.sum())
        sched.update(plan, res)
    assert True in kinds and False in kinds and exe.streams["a"].__len__() == 26
    with pytest.raises(RuntimeError, match="without a launched step"):
        exe.complete()

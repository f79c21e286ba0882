"""Capacity search: early-stopped probes, saturation, brackets, simulated replica counts, the CLI's outputs."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from tangram.config import EngineConfig, get_gpu, get_model
from tangram.harness import capacity_search, meets_slo
from tangram.harness.capacity import replicas_search
from tangram.harness.slo import DEFAULT_SLO, SLOMonitor, parse_slo, slo_verdict, verdict_line, violations_needed
from tangram.sim.cli import main
from tangram.sim.run import capacity_search as capacity_search_sim, simulate
from tangram.spec import DeploymentSpec, default_profile
from tangram.traces import Trace, Turn, generate, save_trace

LLAMA, H100 = get_model("llama-3.1-8b"), get_gpu("h100-80gb")


def _spec(mode="tangram", replicas=1, router="session-affinity", **eng) -> DeploymentSpec:
    e = EngineConfig(mode=mode, **eng)
    return DeploymentSpec(LLAMA, H100, e, default_profile(LLAMA, e.rho, e.alpha), replicas, router)


@pytest.mark.parametrize("q", [50, 90, 99])
def test_violations_needed_is_where_numpy_percentile_crosses(q):
    """Against numpy itself: n values, m of them above the bound 1. With the others at 0 and the m just above 1
    (the case where interpolation helps least), the percentile exceeds 1 exactly when m >= needed: the count is
    sufficient whatever the values, and no smaller count is."""
    for n in range(1, 260):
        need = violations_needed(n, q)
        for m in range(0, n + 1):
            x = np.r_[np.zeros(n - m), np.full(m, 1.0 + 1e-9)]
            assert (np.percentile(x, q) > 1.0) == (m >= need), (n, m, q)
            if m >= need:  # any other values: still above
                y = np.r_[np.random.default_rng(n).uniform(-5, 1, n - m), np.full(m, 1.0 + 1e-9)]
                assert np.percentile(y, q) > 1.0


def test_monitor_counts_waiting_turns_once_their_deadline_passes():
    mon = SLOMonitor({"ttft_p99": 1.0, "tpot_p50": 0.1}, [10] * 100 + [1] * 100)
    for rid in range(200):
        mon.arrived(rid, 0.0)
    assert mon.check(0.5) is None
    # at t = 2 every turn still without a first token is certain to miss 1 s: 200 > 1% of 200
    assert "ttft_p99" in mon.check(2.0)
    mon2 = SLOMonitor({"tpot_p50": 0.1}, [11] * 10)
    for rid in range(10):
        mon2.arrived(rid, 0.0)
        mon2.first_token(rid, 0.0)
    assert mon2.check(0.99) is None  # 10 tokens at 0.1 s each may still finish by t = 1
    for rid in range(5):
        mon2.finished(rid, 0.5, 0.0)  # 0.05 s per token
    assert mon2.check(1.01) is None  # 5 of 10 over: not yet more than half (the median can still be <= 0.1)
    mon2.rejected(0)  # the most it can still finish drops to 9: 5 over certain
    assert mon2.check(1.01) is not None


def _overload_trace(n=40, rate=40.0, seed=2):
    return generate(n, "short", seed=seed, rate=rate, turns="uniform:1:2", output_tokens="uniform:50:200")


def test_a_tpot_term_is_met_when_no_request_decodes_a_second_token():
    """Every output one token long (prefill-only or scoring requests): no finished request has a TPOT, so a TPOT
    term has nothing to violate. The capacity search used to read the missing value as a miss at every load: 16
    replays a mode and "SLO missed even at 0.015 requests/s" for a 300-request trace of one-token outputs. A TTFT
    term without a value (nothing finished) is still a miss."""
    from tangram.harness.capacity import slo_usage

    slo = {"ttft_p99": 2.0, "tpot_p99": 0.1}
    summ = {"completed": 5, "ttft_p99_s": 1.0, "tpot_p99_s": None, "rejected_reasons": {}}
    v = slo_verdict(summ, slo)
    assert meets_slo(summ, slo) and v["met"] and v["terms"]["tpot_p99"]["met"]
    assert "no request decoded a second token" in verdict_line(v)
    assert not meets_slo({**summ, "ttft_p99_s": 3.0}, slo)
    assert not meets_slo({**summ, "completed": 0, "ttft_p99_s": None}, slo)
    assert not slo_verdict({**summ, "completed": 0}, slo)["terms"]["tpot_p99"]["met"]
    assert slo_usage(summ, slo) == {"ttft_p99": 0.5}
    # the simulated search on such a trace (overloaded, 11.8K-token prompts): a bracket of two replays
    tr = generate(60, "short", seed=3, rate=50.0, turns="uniform:1:1", output_tokens="uniform:1:1")
    assert all(t.output_tokens == 1 for t in tr.turns)
    slo = parse_slo("ttft_p99=3s,tpot_p99=0.5s")
    cap = capacity_search_sim(tr, _spec(), "tangram", slo)
    lo, hi = cap["bracket_rps"]
    assert cap["saturated"] and cap.get("note") is None and 0 < lo < hi <= lo * 1.08 * (1 + 1e-12)
    assert meets_slo(simulate(tr.scaled(lo / cap["offered_rps"]), _spec(), record_kv=False)[0], slo)


def test_early_stop_gives_the_full_runs_verdict_and_leaves_passing_runs_alone():
    spec = _spec()
    slo = parse_slo("ttft_p99=5s,tpot_p99=0.5s")
    heavy = _overload_trace()
    full, _ = simulate(heavy, spec, record_kv=False)
    early, res = simulate(heavy, spec, record_kv=False, stop_slo=slo)
    assert not meets_slo(full, slo) and not meets_slo(early, slo)
    assert res.stopped and early["stopped_early"] and early["steps"] < full["steps"]
    assert early["ttft_p99_at_stop_s"] > 5.0
    light = _overload_trace(n=6, rate=0.05)
    a, _ = simulate(light, spec, record_kv=False)
    b, rb = simulate(light, spec, record_kv=False, stop_slo=slo)
    assert meets_slo(a, slo) and rb.stopped is None
    assert {k: v for k, v in a.items()} == {k: v for k, v in b.items()}


def _fake_run(limit_rps: float, base: float, calls: list, served_rps: float = 0.0):
    """A replay whose TTFT p99 is 1 s below ``limit_rps`` offered and 100 s above it; it serves at most
    ``served_rps`` (the throughput a saturated run reports; 0: none reported)."""
    def run(trace):
        rate = _rate(trace)
        calls.append(rate)
        p99 = 1.0 if rate <= limit_rps else 100.0
        return {"ttft_p99_s": p99, "completed": 10, "rejected_reasons": {}, "throughput_rps": min(rate, served_rps)}
    return run


def _line_trace(n=20, gap=1.0):
    return Trace([Turn(f"s{i}:0", f"s{i}", 0, i * gap, 0.0, 100, 10) for i in range(n)])


@pytest.mark.parametrize("start,served", [(0.01, 0.0), (1.0, 0.0), (37.0, 0.0), (1.0, 9.5), (1.0, 0.2)])
def test_bracket_contains_the_limit_and_is_tight(start, served):
    """Whatever the first guess (the burst's served rate, else ``start``), the bracket holds the limit."""
    tr = _line_trace()
    base = 20 / 19
    calls = []
    cap = capacity_search(tr, _fake_run(7.3, base, calls, served), {"ttft_p99": 10.0}, start=start, iters=12)
    assert calls[0] > 1e6  # the burst first
    lo, hi = cap["bracket_rps"]
    assert cap["saturated"] and lo <= 7.3 < hi and hi / lo <= 1.08 + 1e-9
    assert cap["max_rate_rps"] == pytest.approx(lo)
    assert [p[2] for p in cap["probes"] if p[0] is not None] == sorted(
        [p[2] for p in cap["probes"] if p[0] is not None], reverse=True)  # ok below, missed above


def test_trace_too_small_to_saturate_is_said_so():
    calls = []
    cap = capacity_search(_line_trace(), _fake_run(float("inf"), 1.0, calls, 3.0), {"ttft_p99": 10.0})
    assert cap["saturated"] is False and cap["max_rate_rps"] is None
    assert "too small to saturate" in cap["note"] and cap["lower_bound_rps"] == 3.0
    assert len(calls) == 1  # the burst alone answers: no doublings


def test_slo_missed_at_any_rate_and_a_burst_only_trace_answer():
    cap = capacity_search(_line_trace(), _fake_run(0.0, 1.0, []), {"ttft_p99": 10.0})
    assert cap["max_rate_rps"] == 0.0 and "missed even at" in cap["note"]
    burst = Trace([Turn(f"s{i}:0", f"s{i}", 0, 0.0, 0.0, 100, 10) for i in range(5)])
    cap = capacity_search(burst, _fake_run(0.0, 1.0, []), {"ttft_p99": 10.0})
    assert cap["max_rate_rps"] is None and "no arrival rate" in cap["note"]


@pytest.mark.parametrize("start", [1, 3, 9])
def test_replicas_search_finds_the_fewest(start):
    seen = []

    def run_n(trace, n):
        seen.append(n)
        return {"ttft_p99_s": 1.0 if n >= 4 else 50.0, "completed": 1, "rejected_reasons": {}}

    out = replicas_search(_line_trace(), run_n, {"ttft_p99": 10.0}, 5.0, start)
    assert out["replicas_needed"] == 4 and 3 in seen and 4 in seen
    assert all(p[2] == (p[0] >= 4) for p in out["probes"])


@pytest.mark.parametrize("start,answer", [(256, 3), (256, 1), (1, 200), (100, 101), (7, 7), (256, 256)])
def test_replicas_search_takes_logarithmically_many_replays(start, answer):
    """A start far from the answer costs O(log) cluster replays, each replay of n replicas, not one replay per
    replica count in between (a start of 256 for a trace too small to saturate took hours)."""
    seen = []

    def run_n(trace, n):
        seen.append(n)
        return {"ttft_p99_s": 1.0 if n >= answer else 50.0, "completed": 1, "rejected_reasons": {}}

    out = replicas_search(_line_trace(), run_n, {"ttft_p99": 10.0}, 5.0, start)
    assert out["replicas_needed"] == answer
    assert answer in seen and (answer == 1 or answer - 1 in seen)
    assert len(seen) == len(set(seen)) <= 2 * math.ceil(math.log2(256)) + 2, seen


def test_replicas_needed_is_simulated_behind_the_router():
    """The count comes from simulating clusters: n replicas meet the SLO at the target rate, n - 1 do not."""
    spec = _spec(router="least-outstanding")
    slo = parse_slo("ttft_p99=3s")
    tr = _overload_trace(n=30, rate=1.0, seed=4)
    from tangram.sim.run import replicas_needed

    out = replicas_needed(tr, spec, "tangram", slo, 8.0, 1)
    n = out["replicas_needed"]
    assert n is not None and n >= 2
    import dataclasses

    scaled = tr.scaled(out["scale"])
    ok_n = meets_slo(simulate(scaled, dataclasses.replace(spec, replicas=n), record_kv=False)[0], slo)
    ok_less = meets_slo(simulate(scaled, dataclasses.replace(spec, replicas=n - 1), record_kv=False)[0], slo)
    assert ok_n and not ok_less


def _cli(tmp_path, *args, name="out"):
    out = tmp_path / name
    with pytest.raises(SystemExit) as e:
        main([*args, "--out", str(out), "--no-plots"])
    assert e.value.code == 0
    return out


def test_cli_capacity_default_slo_and_unsaturated_trace(tmp_path, capsys):
    tr = generate(3, "short", seed=1, rate=0.5, turns="uniform:1:1", output_tokens="uniform:8:16")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    out = _cli(tmp_path, str(p), "--mode", "tangram", "--capacity")
    txt = capsys.readouterr()
    assert DEFAULT_SLO in txt.err and "unsaturated" in txt.out and "too small to saturate" in txt.out
    m = json.loads((out / "metrics.json").read_text())["tangram"]
    assert m["capacity_saturated"] is False and m["max_rate_rps"] is None
    assert m["run"]["slo"] == parse_slo(DEFAULT_SLO)
    assert "too small to saturate" in (out / "report.md").read_text()


def test_cli_replicas_for_a_high_target_on_an_unsaturated_trace_answer_quickly(tmp_path):
    """A trace too small to saturate and a target far above it: the replica search starts at the spec's replicas
    (which met the SLO with the whole trace at once), not at target / the burst's served rate (256 replicas,
    then one replay per count below: hours); the answer is 1 replica after one replay."""
    tr = generate(3, "short", seed=1, rate=0.5, turns="uniform:1:1", output_tokens="uniform:8:16")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    out = _cli(tmp_path, str(p), "--mode", "tangram", "--capacity", "--target-rate", "1000")
    m = json.loads((out / "metrics.json").read_text())["tangram"]
    assert m["capacity_saturated"] is False
    assert m["replicas_needed"] == 1 and [r[0] for r in m["replicas_probes"]] == [1]


def test_cli_no_fast_forward_writes_the_same_metrics(tmp_path):
    tr = generate(6, "short", seed=2, rate=1.0, turns="uniform:1:3", output_tokens="uniform:40:160")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    a = _cli(tmp_path, str(p), "--mode", "tangram,full", name="a")
    b = _cli(tmp_path, str(p), "--mode", "tangram,full", "--no-fast-forward", name="b")
    assert (a / "metrics.json").read_bytes() == (b / "metrics.json").read_bytes()
    assert (a / "requests.csv").read_bytes() == (b / "requests.csv").read_bytes()


def test_cli_jobs_gives_the_same_files(tmp_path):
    tr = generate(5, "short", seed=3, rate=1.0, turns="uniform:1:2", output_tokens="uniform:40:160")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    a = _cli(tmp_path, str(p), "--mode", "tangram,full", "--capacity", "--slo", "ttft_p99=2s", name="a")
    b = _cli(tmp_path, str(p), "--mode", "tangram,full", "--capacity", "--slo", "ttft_p99=2s", "--jobs", "2",
             name="b")
    assert (a / "metrics.json").read_bytes() == (b / "metrics.json").read_bytes()


def test_jobs_auto_is_one_worker_per_mode_up_to_the_usable_cpus(monkeypatch):
    from tangram.sim import cli as sim_cli

    monkeypatch.setattr(sim_cli, "usable_cpus", lambda: 4)
    big, small = sim_cli.AUTO_JOBS_TURNS, sim_cli.AUTO_JOBS_TURNS - 1
    assert sim_cli.resolve_jobs(sim_cli.parse_jobs("auto"), 6, big) == 4
    assert sim_cli.resolve_jobs(sim_cli.parse_jobs("AUTO"), 2, big) == 2  # never more workers than modes
    assert sim_cli.resolve_jobs(None, 1, big) == 1
    assert sim_cli.resolve_jobs(None, 6, small) == 1  # a small trace stays in this process
    assert sim_cli.resolve_jobs(sim_cli.parse_jobs("3"), 6, small) == 3  # a count given is a count used
    assert sim_cli.resolve_jobs(sim_cli.parse_jobs(8), 6, big) == 6


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", ""])
def test_cli_bad_jobs_is_one_line_before_the_trace_is_read(tmp_path, capsys, bad):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing.jsonl"), "--jobs", bad, "--out", str(out), "--no-plots"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--jobs" in err[0], err


def test_cli_auto_jobs_runs_the_modes_in_workers_with_the_same_files(tmp_path, monkeypatch):
    """A trace of AUTO_JOBS_TURNS turns or more runs its modes in worker processes by default (two here: the
    usable CPUs are pinned), with files equal to a run in this process."""
    from tangram.sim import cli as sim_cli

    monkeypatch.setattr(sim_cli, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sim_cli, "AUTO_JOBS_TURNS", 10)
    tr = generate(12, "short", seed=4, rate=2.0, turns="uniform:1:2", output_tokens="uniform:20:60")
    assert len(tr.turns) >= 10
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    pools = []
    real = sim_cli._runs_then_searches
    monkeypatch.setattr(sim_cli, "_runs_then_searches", lambda *a, **k: pools.append(a[5]) or real(*a, **k))
    a = _cli(tmp_path, str(p), "--mode", "tangram,full", "--jobs", "1", name="a")
    assert pools == []
    b = _cli(tmp_path, str(p), "--mode", "tangram,full", name="b")
    assert pools == [2]  # the workers' path, with two of them
    assert (a / "metrics.json").read_bytes() == (b / "metrics.json").read_bytes()
    assert (a / "requests.csv").read_bytes() == (b / "requests.csv").read_bytes()


def test_cli_capacity_in_workers_writes_the_files_of_one_process(tmp_path, monkeypatch):
    """--capacity in worker processes, where each search's replays are tasks of their own taken by whichever worker
    is free (modes interleaved), writes the same files as the searches run one after the other in this process:
    each search sees its own replays in its own order. The --target-rate replica search runs as a task too."""
    from tangram.sim import cli as sim_cli

    monkeypatch.setattr(sim_cli, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sim_cli, "AUTO_JOBS_TURNS", 10)
    tr = generate(40, "short", seed=3, rate=4.0, turns="uniform:1:2", output_tokens="uniform:20:80")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    args = (str(p), "--mode", "tangram,full,uniform", "--capacity", "--slo", "ttft_p99=3s", "--target-rate", "20")
    a = _cli(tmp_path, *args, "--jobs", "1", name="a")
    b = _cli(tmp_path, *args, name="b")
    assert (a / "metrics.json").read_bytes() == (b / "metrics.json").read_bytes()
    m = json.loads((b / "metrics.json").read_text())
    for mode in ("tangram", "full", "uniform"):
        rep = m[mode]["capacity_replays"]
        assert m[mode]["capacity_saturated"] and rep["met"] >= 1 and rep["missed"] >= 1, rep
        assert m[mode]["replicas_needed"] >= 2 and len(m[mode]["replicas_probes"]) >= 2


def test_cli_capacity_runs_replays_ahead_on_idle_workers(tmp_path, monkeypatch, capsys):
    """One mode on two workers (auto with --capacity: twice the modes): while its search, on its way down, waits on
    a replay, the other worker runs the replay the search asks for next if that one misses. The files are those of
    one process (a replay run ahead is the replay of its scale, whenever it runs), some replays run ahead are used,
    and one no search asks for does not keep the tool alive. The chain run ahead follows misses, and the summaries
    of replays already run ahead where known."""
    from tangram.sim import cli as sim_cli

    monkeypatch.setattr(sim_cli, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sim_cli, "AUTO_JOBS_TURNS", 10)
    tr = generate(40, "short", seed=3, rate=4.0, turns="uniform:1:2", output_tokens="uniform:20:80")
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    args = (str(p), "--mode", "tangram", "--capacity", "--slo", "ttft_p99=1s")  # two misses, then a pass
    assert sim_cli.resolve_jobs(None, 1, 40, capacity=True) == 2  # one mode's search: the replay it waits on, one ahead
    a = _cli(tmp_path, *args, "--jobs", "1", name="a")
    assert "run ahead" not in capsys.readouterr().err  # one process: nothing idles
    b = _cli(tmp_path, *args, name="b")
    assert (a / "metrics.json").read_bytes() == (b / "metrics.json").read_bytes()
    got = re.search(r"capacity: (\d+) replays run ahead on idle workers, (\d+) of them used", capsys.readouterr().err)
    assert got and int(got[1]) >= 1 and int(got[2]) >= 1, got

    # the chain itself: after a miss the search steps down, and a replay known to have met ends the descent
    slo = {"ttft_p99": 3.0}
    spec = type("S", (), {"capacity_tol": 0.08})()
    at_load = {"completed": 40, "ttft_p99_s": 9.0, "throughput_rps": 3.0}
    first = sim_cli._search(tr, spec, slo, at_load)
    pending = next(first)
    chain = sim_cli._ahead_chain(tr, spec, slo, at_load, [], {})
    assert len(chain) == sim_cli.AHEAD_DEPTH and pending not in chain and chain == sorted(chain, reverse=True)
    assert first.send(sim_cli._MISSED) == chain[0]  # what the search asks for after a miss
    # a replay run ahead and done that met the SLO one step under the pending one's miss ends the search
    assert sim_cli._ahead_chain(tr, spec, slo, at_load, [], {chain[0]: {"completed": 40, "ttft_p99_s": 1.0}}) == []
    # one that missed: the chain goes on below it
    after = sim_cli._ahead_chain(tr, spec, slo, at_load, [], {chain[0]: {"completed": 40, "ttft_p99_s": 4.0}})
    assert after[:2] == chain[1:] and len(after) == sim_cli.AHEAD_DEPTH


def test_tuner_trial_on_a_trace_too_small_records_unsaturated():
    """A capacity trial on a three-request trace with a loose SLO: the tuner records saturated=False and the load
    as the burst's served rate (a lower bound), not a capped rate from doubling."""
    from tangram.budgets import synthetic_profile
    from tangram.tuning.objective import Evaluator
    from tangram.tuning.space import SearchSpace, paper_default_params

    tr = generate(3, "short", seed=1, rate=0.5, turns="uniform:1:1", output_tokens="uniform:8:16")
    space = SearchSpace.for_model(LLAMA, fixed={"mode": "tangram"})
    ev = Evaluator(LLAMA, H100, space, synthetic_profile(LLAMA.num_layers, LLAMA.num_kv_heads, 0.25, seed=0),
                   tr, parse_slo("ttft_p99=60s"), overflow_samples=8)
    out = ev(paper_default_params())
    assert out["saturated"] is False and out["load_rps"] > 0 and "too small" in out["capacity_note"]
    assert out["sims"] == 1


# --- the search's logic with fake replays: a known limit, a queueing-like SLO usage, noise, reused replays ---

from hypothesis import given, settings, strategies as st  # noqa: E402

from tangram.harness.capacity import predict_limit  # noqa: E402


def _rate(trace) -> float:
    """The offered rate of a fake replay's trace (infinite when every session arrives at once)."""
    arr = [t.arrival_s for t in trace.turns if t.turn == 0]
    return len(trace.turns) / (max(arr) - min(arr)) if max(arr) > min(arr) else float("inf")


def _queue_run(limit_rps: float, calls: list, *, served_rps: float | None = None, bound: float = 60.0,
               unloaded: float = 0.0, noise=None, flip=None):
    """A replay whose TTFT p99 grows like a queue's wait, ``unloaded + c / (mu - rate)``, with mu and c such that it
    crosses ``bound`` exactly at ``limit_rps``; infinite from mu on. ``served_rps``: what an overloaded replay
    reports as its throughput (default: mu). ``noise(rate)`` multiplies the p99; ``flip(rate)`` -> True inverts
    the verdict (a non-monotone replay)."""
    mu = limit_rps * 1.04
    c = (bound - unloaded) * (mu - limit_rps)
    served = mu if served_rps is None else served_rps

    def run(trace):
        rate = _rate(trace)
        calls.append(rate)
        p99 = unloaded + c / (mu - rate) if rate < mu else 1e9
        if noise is not None:
            p99 *= noise(rate)
        if flip is not None and flip(rate):
            p99 = bound / 2 if p99 > bound else bound * 2
        out = {"ttft_p99_s": p99, "completed": 10, "rejected_reasons": {}, "throughput_rps": min(rate, served)}
        if p99 > bound:
            out.update(stopped_early="certain", ttft_p99_at_stop_s=bound * 1.01)
        return out
    return run


@settings(max_examples=200, deadline=None)
@given(limit=st.floats(0.05, 50.0), served=st.floats(0.3, 3.0), unloaded=st.floats(0.0, 30.0),
       tol=st.sampled_from([0.02, 0.05, 0.08, 0.2]))
def test_bracket_holds_a_known_limit_from_any_guess(limit, served, unloaded, tol):
    """Monotone replays: the bracket [met, missed] holds the limit, is within 1 + tol, both ends are replays that
    met / missed, and every probe below the limit met while every one above missed."""
    tr = _line_trace()
    calls = []
    cap = capacity_search(tr, _queue_run(limit, calls, served_rps=served * limit, unloaded=unloaded),
                          {"ttft_p99": 60.0}, tol=tol, iters=30)
    lo, hi = cap["bracket_rps"]
    assert cap["saturated"] and cap.get("note") is None
    eps = 1e-9  # the fake's p99 at the limit itself is 60 s give or take a rounding
    assert lo <= limit * (1 + eps) and limit * (1 - eps) < hi and hi <= lo * (1 + tol) * (1 + 1e-12)
    rows = {p[0]: p for p in cap["probes"] if p[0] is not None}
    assert rows[lo][2] and not rows[hi][2]
    assert all(p[2] == (p[0] <= limit) for p in rows.values() if abs(p[0] / limit - 1) > eps)
    assert cap["replays"]["probe"] == len(calls) - 1 and cap["replays"]["burst"] == 1


@settings(max_examples=100, deadline=None)
@given(limit=st.floats(0.1, 20.0), err=st.floats(-0.25, 0.25))
def test_few_replays_when_the_first_guess_is_near(limit, err):
    """With the guess (the saturated replay's served rate) within 25 % of the limit and a queue-like p99, the
    search ends in at most 5 replays past the burst, at most 3 of them whole replays that meet the SLO (the others
    are misses, stopped early); the doubling-and-bisection search it replaced took 6-7 on the same kind of curve
    (the bound is what the model and the w-steps buy; a plain bisection fails it)."""
    tr = _line_trace()
    calls = []
    cap = capacity_search(tr, _queue_run(limit, calls, served_rps=limit * (1 + err), unloaded=5.0),
                          {"ttft_p99": 60.0}, tol=0.08)
    lo, hi = cap["bracket_rps"]
    assert lo <= limit * (1 + 1e-9) and limit * (1 - 1e-9) < hi <= lo * 1.08 * (1 + 1e-12)
    assert cap["replays"]["probe"] <= 5 and cap["replays"]["met"] <= 3, cap["probes"]


@pytest.mark.parametrize("unloaded", [5.0, 30.0])
def test_the_search_spends_less_than_the_guess_first_search(monkeypatch, unloaded):
    """A miss is stopped early (a third of a replay that meets the SLO on the Mooncake trace), so the search starts
    one w-step above the guess and steps down by w (capacity.FIRST_ABOVE_STEPS, DESCENT_STEPS). Over guesses 25%
    below to 25% above the limit (queue-like replays, a miss costing 0.35 of a meet), its expected cost is at least
    10% below the search that probed the guess first and gallopped down from the first miss (both constants 0),
    with the same brackets' guarantees."""
    import tangram.harness.capacity as capacity

    tr = _line_trace()

    def cost(first: int, descent: int) -> float:
        monkeypatch.setattr(capacity, "FIRST_ABOVE_STEPS", first)
        monkeypatch.setattr(capacity, "DESCENT_STEPS", descent)
        total = 0.0
        for limit in (0.13, 1.0, 7.7):
            for err in np.linspace(-0.25, 0.25, 41):
                cap = capacity_search(tr, _queue_run(limit, [], served_rps=limit * (1 + err), unloaded=unloaded),
                                      {"ttft_p99": 60.0}, tol=0.08)
                lo, hi = cap["bracket_rps"]
                assert lo <= limit * (1 + 1e-9) and limit * (1 - 1e-9) < hi <= lo * 1.08 * (1 + 1e-12)
                total += cap["replays"]["met"] + 0.35 * cap["replays"]["missed"]
        return total

    new, old = cost(capacity.FIRST_ABOVE_STEPS, capacity.DESCENT_STEPS), cost(0, 0)
    assert new <= 0.9 * old, (new, old)


def _curve_run(limit: float, shape: str):
    """A replay whose TTFT p99 crosses 60 s at ``limit``: ``queue`` (the limit model's own form, mu = 1.04 limit),
    ``hockey`` (flat, then exponential near the limit, as BurstGPT's replays rise) or ``linear``; a miss is stopped."""
    def p99(x: float) -> float:
        if shape == "queue":
            return 5.0 + 55.0 * 0.04 / (1.04 - x) if x < 1.04 else 1e9
        if shape == "hockey":
            return 0.3 + 59.7 * math.exp(min(12.0 * (x - 1.0), 50.0))
        return 60.0 * x

    def run(trace):
        rate = _rate(trace)
        p = p99(rate / limit) if math.isfinite(rate) else 1e9
        out = {"ttft_p99_s": p, "completed": 10, "rejected_reasons": {}, "throughput_rps": min(rate, limit / 2)}
        if p > 60.0:
            out.update(stopped_early="certain", ttft_p99_at_stop_s=60.6)
        return out
    return run


def test_probing_above_the_model_costs_less_when_it_underestimates(monkeypatch):
    """The trace's own load met the SLO (a known pass at scale 1, the limit 1.4-4.2x above it), so the search climbs
    from it; once two passes give a model of the limit L it probes L sqrt(w) (capacity.MODEL_AIM = 0.5), a miss
    that brackets the limit cheaply, not L / sqrt(w) (-0.5, the rule before). Where the SLO usage rises more steeply
    than a queue's (hockey, linear) the model underestimates and the old rule paid a whole replay per 8% step;
    the expected cost (a miss 0.35 of a meet) is >= 10% lower there, and within 6% on the queue curve the model
    fits exactly. Every bracket holds the limit."""
    import tangram.harness.capacity as capacity

    tr = _line_trace()
    base = 20 / 19

    def cost(aim: float, shape: str) -> float:
        monkeypatch.setattr(capacity, "MODEL_AIM", aim)
        total = 0.0
        for start in (0.3, 0.7):
            for m in np.exp(np.linspace(np.log(0.8 / start), np.log(1.25 / start), 13)):
                run = _curve_run(base * m, shape)
                cap = capacity_search(tr, run, {"ttft_p99": 60.0}, known={1.0: run(tr)})
                lo, hi = cap["bracket_rps"]
                assert cap.get("note") is None and lo <= base * m * (1 + 1e-9) < hi <= lo * 1.08 * (1 + 1e-12)
                total += cap["replays"]["met"] + 0.35 * cap["replays"]["missed"]
        return total

    steep = sum(cost(capacity.MODEL_AIM, s) for s in ("hockey", "linear"))
    assert steep <= 0.9 * sum(cost(-0.5, s) for s in ("hockey", "linear"))
    assert cost(capacity.MODEL_AIM, "queue") <= 1.06 * cost(-0.5, "queue")


@settings(max_examples=150, deadline=None)
@given(limit=st.floats(0.1, 20.0), seed=st.integers(0, 2**32 - 1), flip_p=st.floats(0.0, 0.4))
def test_noisy_non_monotone_replays_still_end_with_a_real_bracket(limit, seed, flip_p):
    """Replays whose verdict flips at random (a non-monotone, noisy deployment): the search still ends, within its
    replay budget, and what it reports is what it saw: the lower end a replay that met the SLO, the upper end one
    that missed, and hi within 1 + tol of lo unless it says it stopped early."""
    rng = np.random.default_rng(seed)
    tr = _line_trace()
    calls = []
    cap = capacity_search(tr, _queue_run(limit, calls, noise=lambda r: float(rng.uniform(0.7, 1.3)),
                                         flip=lambda r: bool(rng.random() < flip_p)),
                          {"ttft_p99": 60.0}, tol=0.08, iters=7)
    assert len(calls) <= 1 + 16 + 7
    if not cap["saturated"]:  # the burst itself came out met
        assert len(calls) == 1 and "too small to saturate" in cap["note"]
        return
    lo, hi = cap["bracket_rps"]
    rows = {p[0]: p for p in cap["probes"] if p[0] is not None}
    if lo:
        assert rows[lo][2]
    if hi is not None:
        assert not rows[hi][2] and hi > lo
    if cap.get("note") is None:
        assert lo > 0 and hi <= lo * 1.08 * (1 + 1e-12)


def test_a_reused_replay_that_missed_replaces_the_burst():
    """tangram-sim passes its run at the trace's own load: when that missed the SLO the trace saturates the
    deployment (no burst replay) and its served rate is the first guess; when it met it, it is a met end."""
    tr = _line_trace()
    base = 20 / 19
    calls = []
    run = _queue_run(0.4 * base, calls, served_rps=0.42 * base)
    at_load = run(tr)  # offered rate: above the limit, missed
    calls.clear()
    cap = capacity_search(tr, run, {"ttft_p99": 60.0}, known={1.0: at_load})
    assert all(c < 1e6 for c in calls)  # no burst
    assert calls[0] == pytest.approx(0.42 * base * 1.08)  # one w-step above the served rate first
    kinds = {p[4] for p in cap["probes"]}
    assert kinds == {"reused", "probe"} and cap["replays"]["reused"] == 1 and cap["replays"]["burst"] == 0
    lo, hi = cap["bracket_rps"]
    assert lo <= 0.4 * base < hi
    calls2 = []
    run2 = _queue_run(3.0 * base, calls2)
    met = run2(tr)
    calls2.clear()
    cap2 = capacity_search(tr, run2, {"ttft_p99": 60.0}, known={1.0: met})
    assert calls2[0] > 1e6  # nothing missed yet: the burst says whether the trace saturates at all
    lo2, hi2 = cap2["bracket_rps"]
    assert 1.0 * base <= lo2 <= 3.0 * base < hi2


def test_predict_limit_against_a_hand_solved_queue():
    """usage = 2 / (5 - s): at s = 1 and 3 it is 0.5 and 1.0 ... the model through (1, 0.5) and (4, 2) gives
    mu = 5 and the limit where 2 / (5 - s) = 1: s = 3 (by hand)."""
    assert predict_limit([(1.0, 0.5), (4.0, 2.0)]) is None  # usage past 1: the limit is below the higher point
    assert predict_limit([(1.0, 0.5), (2.0, 2 / 3)]) == pytest.approx(3.0)
    assert predict_limit([(1.0, 0.5)]) is None and predict_limit([(1.0, 0.5), (2.0, 0.4)]) is None


def test_cli_search_reuses_the_run_at_the_trace_load(tmp_path):
    """An overloaded trace: tangram-sim's run at the trace's load missed the SLO, so the search starts from it (no
    burst replay), and its bracket ends are replays in the probe table: the lower met, the upper missed, within 8 %.
    The reused row is that run: same TTFT p99 as the table's."""
    tr = _overload_trace(n=30, rate=30.0, seed=5)
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    out = _cli(tmp_path, str(p), "--mode", "tangram", "--capacity", "--slo", "ttft_p99=5s")
    m = json.loads((out / "metrics.json").read_text())["tangram"]
    kinds = [row[4] for row in m["capacity_probes"]]
    assert "burst" not in kinds and kinds.count("reused") == 1
    reused = next(row for row in m["capacity_probes"] if row[4] == "reused")
    assert reused[2] is False and reused[1] == pytest.approx(m["ttft_p99_s"])
    assert m["capacity_replays"]["reused"] == 1 and m["capacity_replays"]["probe"] == kinds.count("probe")
    lo, hi = m["capacity_bracket_rps"]
    rows = {row[0]: row for row in m["capacity_probes"]}
    # metrics.json rounds both ends to 6 significant digits (up to 5e-6 each): a bracket of exactly 1.08 may read
    # as 1.08 x (1 + 1.5e-6) (9.58656 -> 10.3535 here since 3ab558c's pricing)
    assert rows[lo][2] and not rows[hi][2] and hi <= lo * 1.08 * (1 + 1e-5)
    # the same bracket's ends, replayed afresh, give the same verdicts
    slo = parse_slo("ttft_p99=5s")
    base = m["run"]["offered_rps"]
    assert meets_slo(simulate(tr.scaled(lo / base), _spec(), record_kv=False)[0], slo)
    assert not meets_slo(simulate(tr.scaled(hi / base), _spec(), record_kv=False)[0], slo)


def test_cli_capacity_tol_sets_the_brackets_width(tmp_path, capsys):
    """--capacity-tol: the search stops once the met and missed loads are within 1 + TOL, so a coarse answer takes
    at most the replays of the default 8 %, its bracket is at most 25 % wide and still straddles the default
    answer; the tolerance is recorded in metrics.json. Out-of-range values are an error naming the flag before any
    replay, and given without --capacity it is reported as unused, not silently dropped."""
    tr = _overload_trace(n=30, rate=30.0, seed=5)
    p = tmp_path / "t.jsonl"
    save_trace(tr, p)
    fine = _cli(tmp_path, str(p), "--mode", "tangram", "--capacity", "--slo", "ttft_p99=5s", name="fine")
    coarse = _cli(tmp_path, str(p), "--mode", "tangram", "--capacity", "--slo", "ttft_p99=5s", "--capacity-tol",
                  "0.25", name="coarse")
    f = json.loads((fine / "metrics.json").read_text())["tangram"]
    c = json.loads((coarse / "metrics.json").read_text())["tangram"]
    assert f["run"]["capacity_tol"] == 0.08 and c["run"]["capacity_tol"] == 0.25
    assert "at most 25% apart" in (coarse / "report.md").read_text()
    assert "at most 8% apart" in (fine / "report.md").read_text()
    lo, hi = c["capacity_bracket_rps"]
    assert hi <= lo * 1.25 * (1 + 1e-5)
    assert lo <= f["capacity_bracket_rps"][1] and hi >= f["capacity_bracket_rps"][0]  # both hold the one limit
    assert c["capacity_replays"]["probe"] <= f["capacity_replays"]["probe"]
    capsys.readouterr()
    for bad in ("0", "-0.1", "nan", "inf", "1.5"):
        with pytest.raises(SystemExit) as e:
            main([str(p), "--mode", "tangram", "--capacity", "--capacity-tol", bad, "--out",
                  str(tmp_path / "bad"), "--no-plots"])
        assert e.value.code == 2
        assert "--capacity-tol" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    _cli(tmp_path, str(p), "--mode", "tangram", "--capacity-tol", "0.25", name="plain")
    assert "--capacity-tol only applies with --capacity: ignored" in capsys.readouterr().err


def test_a_flat_slo_key_does_not_hide_the_rising_one():
    """Two SLO keys: TPOT using 70-80 % of its bound and rising slowly with load (more than TTFT uses below ~0.95 of
    the limit), TTFT a queue crossing 60 s at the limit. With the guess within 25 % the search still ends in at most
    5 replays (a model on the largest usage over the keys follows the slow TPOT, predicts a far limit and
    overshoots: 9 replays at limit 5 / guess 20% low), and the prediction from two passes is the TTFT key's."""
    tr = _line_trace()
    for limit, err in [(1.9, -0.08), (0.7, 0.2), (5.0, -0.2)]:
        calls = []
        ttft = _queue_run(limit, calls, served_rps=limit * (1 + err), unloaded=5.0)

        def run(t):
            out = ttft(t)
            out["tpot_p99_s"] = 0.5 * (0.7 + 0.1 * min(calls[-1] / limit, 1.5))
            return out
        cap = capacity_search(tr, run, {"ttft_p99": 60.0, "tpot_p99": 0.5})
        lo, hi = cap["bracket_rps"]
        assert lo <= limit * (1 + 1e-9) and limit * (1 - 1e-9) < hi <= lo * 1.08 * (1 + 1e-12)
        assert cap["replays"]["probe"] <= 5, cap["probes"]
    from tangram.harness.capacity import _predict

    # ttft usage 2 / (5 - s) / ... at s = 1, 2: 0.5, 2/3 -> limit 3 (as in the hand-solved case); tpot flat 0.8
    assert _predict([(1.0, {"ttft_p99": 0.5, "tpot_p99": 0.8}), (2.0, {"ttft_p99": 2 / 3, "tpot_p99": 0.8})]) \
        == pytest.approx(3.0)

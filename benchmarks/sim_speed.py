"""Simulator speed on the Mooncake conversation trace's statistics: one run per mode, the capacity search, and the
fast-forward vs step-by-step identity.

The trace: ``generate_mooncake(12000, seed=0)`` (12,000 requests over 3,537 s, the public FAST'25 conversation
trace's statistics) imported with ``import_mooncake`` (~8,200 sessions, inputs mean 12K tokens, outputs mean 343,
3.39 req/s offered), served by one H100 with Llama-3.1-8B (presets), bundled cost tables. Every timing runs the
``tangram-sim`` command line in a fresh process (imports, trace loading and output files included) and reports
its wall time and CPU time (user + system of the child) side by side with the machine's load average, since the
2-core dev machine is shared: compare ratios measured in one run, never numbers across runs.

Run: ``python benchmarks/sim_speed.py [--what single,capacity,identity,probes] [--baseline-python
OLD/.venv/bin/python]`` (reports/traces/run.sh has the acceptance commands). The last line of output is one JSON
object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("full", "uniform", "dynamic", "br", "br+rp", "tangram")


def make_trace(path: Path, n_requests: int = 12_000, seed: int = 0) -> Path:
    """The Mooncake-format trace (seeded generator) imported to our format; cached at ``path``."""
    if path.exists():
        return path
    from tangram.traces import generate_mooncake, import_mooncake, save_trace, write_mooncake

    raw = path.with_suffix(".raw.jsonl")
    write_mooncake(generate_mooncake(n_requests, seed=seed).records, raw)
    save_trace(import_mooncake(raw), path)
    return path


def make_burstgpt_trace(path: Path, n_requests: int = 3000, seed: int = 0) -> Path:
    """A low-load trace in BurstGPT's published CSV schema (Timestamp, Model, Request tokens, Response tokens, Total
    tokens, Log Type; ~0.6 req/s, prompts U(1, 4000), responses U(1, 800) with 10% failed (0 tokens), seeded),
    imported with ``import_burstgpt``: one-turn sessions whose batches stay small, so most of a replay is decode
    runs of a few rows (the opposite regime of the saturated Mooncake trace); cached at ``path``."""
    if path.exists():
        return path
    from tangram.traces import import_burstgpt, save_trace

    csv = write_burstgpt_csv(path.with_suffix(".csv"), n_requests, seed)
    save_trace(import_burstgpt(csv), path)
    return path


def write_burstgpt_csv(csv: Path, n_requests: int, seed: int = 0) -> Path:
    """The raw CSV of :func:`make_burstgpt_trace` (also benchmarks/trace_io.py's, at ~1.4M rows)."""
    rng = np.random.default_rng(seed)
    ts = 5 + np.cumsum(rng.integers(0, 4, n_requests))
    req = rng.integers(1, 4001, n_requests)
    resp = np.where(rng.random(n_requests) < 0.1, 0, rng.integers(1, 801, n_requests))
    model = rng.choice(["ChatGPT", "GPT-4"], n_requests)
    kind = rng.choice(["Conversation log", "API log"], n_requests)
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{t},{m},{q},{r},{q + r},{k}" for t, m, q, r, k in zip(ts, model, req, resp, kind)]
    csv.write_text("\n".join(rows) + "\n")
    return csv


def run_cli(python: str, args: list[str], *, cwd: str | None = None, timeout: float | None = None) -> dict:
    """Time one ``tangram-sim`` process: wall, CPU (user + sys of the child), load average before and after."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        # -P: never import the package from the current folder (a baseline python run from this checkout's root
        # would otherwise mix this checkout's tangram/ with its own sim/)
        p = subprocess.run([python, "-P", "-m", "tangram.sim.cli", *args], capture_output=True, text=True, cwd=cwd,
                           timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", "timed out"
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc not in (0, None):
        raise SystemExit(f"tangram-sim failed ({rc}): {err.strip().splitlines()[-1] if err.strip() else out}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_before": round(load0, 2),
            "load_after": round(os.getloadavg()[0], 2), "timed_out": rc is None}


def _idle_cpu_s(res: dict, jobs, turns: int) -> float:
    """CPU-seconds a six-mode ``--capacity`` run's worker processes left unused: workers x wall - CPU (the time
    spent with fewer busy workers than there are, start-up and the main process's writing included); the workers
    as tangram-sim resolves ``--jobs`` for a trace of ``turns`` turns."""
    from tangram.sim.cli import parse_jobs, resolve_jobs

    n = resolve_jobs(parse_jobs(jobs), len(MODES), turns, capacity=True)
    return round(n * res["wall_s"] - res["cpu_s"], 2)


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def single(python: str, trace: Path, mode: str, work: Path, extra=(), repeat: int = 1, timeout=None) -> dict:
    runs = []
    for i in range(repeat):
        out = work / f"single_{mode}_{i}"
        runs.append(run_cli(python, [str(trace), "--mode", mode, "--no-plots", "--out", str(out), *extra],
                            timeout=timeout))
    res = {"mode": mode, "runs": runs, "median_wall_s": float(np.median([r["wall_s"] for r in runs])),
           "median_cpu_s": float(np.median([r["cpu_s"] for r in runs]))}
    if not runs[-1]["timed_out"]:
        m = _metrics(out)[mode]
        res.update(steps=m["steps"], completed=m["completed"], ttft_p99_s=m["ttft_p99_s"])
    return res


def identity(trace_path: Path, sessions: int, modes) -> dict:
    """Fast-forward vs step-by-step on the first ``sessions`` sessions: counts must be identical, times within
    0.1 % (in-process, the same functions the CLI calls)."""
    from tangram.config import EngineConfig, get_gpu, get_model
    from tangram.sim.run import simulate
    from tangram.spec import DeploymentSpec, default_profile
    from tangram.traces import load_trace

    tr = load_trace(trace_path)
    if sessions:
        tr = tr.head(sessions)
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100-80gb")
    out = {"sessions": tr.num_sessions, "requests": len(tr.turns), "modes": {}}
    for mode in modes:
        eng = EngineConfig(mode=mode)
        spec = DeploymentSpec(model, gpu, eng, default_profile(model, eng.rho, eng.alpha))
        t0 = time.process_time()
        a, ra = simulate(tr, spec, mode, fast_forward=True, record_kv=True)
        t1 = time.process_time()
        b, rb = simulate(tr, spec, mode, fast_forward=False, record_kv=True)
        t2 = time.process_time()
        counts = ("steps", "preemptions", "session_evictions", "pages_reclaimed", "completed", "rejected",
                  "peak_kv_bytes")
        same = all(a[k] == b[k] for k in counts) and all(
            sa.stats.pages_allocated == sb.stats.pages_allocated and sa.stats.pages_freed == sb.stats.pages_freed
            for sa, sb in zip(ra.schedulers, rb.schedulers))
        rel = 0.0
        for p, q in zip(ra.records, rb.records):
            same &= (p.status, p.replica, p.preemptions) == (q.status, q.replica, q.preemptions)
            for f in ("first_token_s", "finish_s"):
                x, y = getattr(p, f), getattr(q, f)
                if x is not None and y is not None:
                    rel = max(rel, abs(x - y) / max(abs(y), 1e-9))
        for k in ("kv_utilization", "fragmentation", "busy_s"):
            rel = max(rel, abs(a[k] - b[k]) / max(abs(b[k]), 1e-12))
        same &= all(x.reserved == y.reserved and x.live == y.live for x, y in zip(ra.replicas, rb.replicas))
        out["modes"][mode] = {"counts_identical": bool(same), "max_rel_time_diff": rel, "steps": a["steps"],
                              "runs": sum(r.runs for r in ra.replicas),
                              "steps_in_runs": sum(r.run_steps for r in ra.replicas),
                              "cpu_fast_forward_s": round(t1 - t0, 2), "cpu_step_by_step_s": round(t2 - t1, 2)}
    out["all_identical"] = all(v["counts_identical"] and v["max_rel_time_diff"] <= 1e-3 for v in out["modes"].values())
    return out


def probe_costs(trace_path: Path, modes) -> dict:
    """Where a capacity search's time goes, per mode, in this process: the run at the trace's own load (which the
    search reuses), then every replay the search runs, each with its CPU seconds, rate, verdict and whether the SLO
    monitor stopped it early. The same search as ``tangram-sim --capacity`` (default SLO, fast-forward, early stop),
    minus the worker processes."""
    from tangram.cli import from_cli, parse
    from tangram.harness import capacity_search, meets_slo, offered_rps
    from tangram.harness.capacity import BURST_SPAN_S
    from tangram.harness.slo import DEFAULT_SLO
    from tangram.sim.cli import _parser
    from tangram.sim.run import simulate

    out = {}
    for mode in modes:
        spec = from_cli(parse(_parser(), [str(trace_path), "--mode", mode]))
        trace, slo = spec.load_trace(), spec.slo_targets(DEFAULT_SLO)
        t0 = time.process_time()
        at_load = simulate(trace, spec, mode, record_kv=False)[0]
        rows = [{"kind": "at load", "cpu_s": round(time.process_time() - t0, 2), "rps": at_load.get("throughput_rps"),
                 "stopped_early": False}]

        def run(t):
            t1 = time.process_time()
            summ = simulate(t, spec, mode, record_kv=False, stop_slo=slo)[0]
            rps = offered_rps(t)
            burst = len(t.turns) / rps <= 2 * BURST_SPAN_S  # the search's whole-trace-at-once probe
            rows.append({"kind": "burst" if burst else "probe", "cpu_s": round(time.process_time() - t1, 2),
                         "offered_rps": round(rps, 4), "met": meets_slo(summ, slo),
                         "stopped_early": bool(summ.get("stopped_early"))})
            return summ

        cap = capacity_search(trace, run, slo, known={1.0: at_load})
        by = {"at load": rows[0]["cpu_s"],
              "met": round(sum(r["cpu_s"] for r in rows[1:] if r["met"]), 2),
              "missed": round(sum(r["cpu_s"] for r in rows[1:] if r["met"] is False), 2)}
        out[mode] = {"replays": rows, "cpu_s_by_kind": by, "max_rate_rps": cap["max_rate_rps"],
                     "bracket_rps": cap["bracket_rps"]}
        print(json.dumps({mode: out[mode]}), flush=True)
    return out


def alternate(me: str, base: str, trace: Path, mode: str, work: Path, rounds: int) -> dict:
    """``rounds`` x (this checkout's run, then the baseline's) of one mode, one process at a time: CPU-s of each,
    their min and median, the ratios (baseline / this), and whether the last runs' ``requests.csv`` are equal."""
    cpu: dict[str, list[float]] = {"this": [], "baseline": []}
    for _ in range(rounds):
        for who, py in (("this", me), ("baseline", base)):
            out = work / f"alt_{who}_{mode}"
            cpu[who].append(run_cli(py, [str(trace), "--mode", mode, "--no-plots", "--out", str(out)])["cpu_s"])
    med = {k: float(np.median(v)) for k, v in cpu.items()}
    return {"cpu_s": cpu, "min_cpu_s": {k: min(v) for k, v in cpu.items()}, "median_cpu_s": med,
            "speedup_min": round(min(cpu["baseline"]) / min(cpu["this"]), 3),
            "speedup_median": round(med["baseline"] / med["this"], 3),
            "requests_csv_identical": (work / f"alt_this_{mode}" / "requests.csv").read_bytes() ==
            (work / f"alt_baseline_{mode}" / "requests.csv").read_bytes()}


def _answers(out: Path) -> dict:
    """Per mode of a ``--capacity`` run: its max rate, bracket and replays by kind."""
    return {k: {"max_rate_rps": v.get("max_rate_rps"), "bracket_rps": v.get("capacity_bracket_rps"),
                "replays": v.get("capacity_replays")}
            for k, v in _metrics(out).items() if isinstance(v, dict) and "capacity_probes" in v}


def alternate_capacity(me: str, base: str, trace: Path, work: Path, rounds: int, jobs: str, turns: int) -> dict:
    """``rounds`` x (this checkout's ``--capacity`` run of all six modes, then the baseline's), one process at a time:
    wall and CPU seconds of each and the CPU its workers left unused (:func:`_idle_cpu_s`), the ratios (baseline /
    this) of their medians, the replays each search ran (met / missed, summed over the modes) and whether both
    found the same answers."""
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    for r in range(rounds):
        for who, py in (("this", me), ("baseline", base)):
            out = work / f"cap_{who}_{r}"
            res = run_cli(py, [str(trace), "--capacity", "--jobs", str(jobs), "--no-plots", "--out", str(out)])
            res["idle_cpu_s"] = _idle_cpu_s(res, jobs, turns)
            ans = _answers(out)
            res["met"] = sum(v["replays"]["met"] for v in ans.values())
            res["missed"] = sum(v["replays"]["missed"] for v in ans.values())
            res["answers"] = {k: [v["max_rate_rps"], v["bracket_rps"]] for k, v in ans.items()}
            runs[who].append(res)
    med = {who: {k: float(np.median([x[k] for x in v])) for k in ("wall_s", "cpu_s", "idle_cpu_s")}
           for who, v in runs.items()}
    return {"runs": runs, "median": med,
            "speedup_median_wall": round(med["baseline"]["wall_s"] / med["this"]["wall_s"], 3),
            "speedup_median_cpu": round(med["baseline"]["cpu_s"] / med["this"]["cpu_s"], 3),
            "same_answers": all(x["answers"] == runs["this"][0]["answers"] for v in runs.values() for x in v)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default="single,capacity,identity",
                    help="comma list of: single (one run of --single-modes), capacity (--capacity, all six modes), "
                         "identity (fast-forward vs step-by-step on --identity-sessions sessions), probes (the CPU "
                         "seconds of each replay of a capacity search, --probe-modes)")
    ap.add_argument("--trace", help="trace to use (default: generate and import the Mooncake-format trace, or with "
                                    "--burstgpt the BurstGPT-format one)")
    ap.add_argument("--burstgpt", action="store_true",
                    help="generate the low-load BurstGPT-format trace (make_burstgpt_trace) instead of the Mooncake one")
    ap.add_argument("--work", help="folder for the trace and outputs (default: a temporary folder)")
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--single-modes", default="tangram,full")
    ap.add_argument("--repeat", type=int, default=1, help="repeat each single run (median reported)")
    ap.add_argument("--jobs", default="auto", help="--jobs of the capacity command (default auto: tangram-sim's)")
    ap.add_argument("--probe-modes", default="full,tangram",
                    help="modes of --what probes (one capacity search each, in this process, every replay timed)")
    ap.add_argument("--identity-sessions", type=int, default=1500,
                    help="sessions of the trace for the identity check (0: all; the step-by-step path is slow)")
    ap.add_argument("--identity-modes", default="tangram,full,dynamic")
    ap.add_argument("--baseline-python", help="python of another checkout (e.g. the merge base) to time the same "
                                              "commands with, side by side")
    ap.add_argument("--baseline-sessions", type=int, default=0,
                    help="time the baseline on this many first sessions only (0: all), when it is too slow")
    ap.add_argument("--baseline-timeout", type=float, default=3600)
    ap.add_argument("--alternate", type=int, default=0,
                    help="with --baseline-python: N rounds of this checkout then the baseline, one process at a time "
                         "(min and median CPU-s of each; on a shared machine whose speed drifts by 20%% between "
                         "minutes, alternating is what makes the ratio mean something); for --what single and "
                         "capacity")
    a = ap.parse_args(argv)
    what = {w.strip() for w in a.what.split(",") if w.strip()}
    work = Path(a.work or tempfile.mkdtemp(prefix="sim_speed_"))
    work.mkdir(parents=True, exist_ok=True)
    trace = Path(a.trace) if a.trace else make_burstgpt_trace(work / "burstgpt_3000.jsonl") if a.burstgpt else \
        make_trace(work / f"mooncake_{a.requests}.jsonl", a.requests)
    from tangram.traces import load_trace

    tr = load_trace(trace)
    from tangram.harness import offered_rps

    res: dict = {"trace": str(trace), "requests": len(tr.turns), "sessions": tr.num_sessions,
                 "offered_rps": round(offered_rps(tr), 4), "model": "llama-3.1-8b", "gpu": "h100-80gb",
                 "cpus": os.cpu_count(), "python": sys.executable}
    me = sys.executable
    if "single" in what and a.alternate and a.baseline_python:
        res["alternate"] = {m: alternate(me, a.baseline_python, trace, m, work, a.alternate)
                            for m in a.single_modes.split(",")}
        print(json.dumps({"alternate": res["alternate"]}), flush=True)
        what.discard("single")
    if "single" in what:
        res["single"] = {m: single(me, trace, m, work, repeat=a.repeat) for m in a.single_modes.split(",")}
        print(json.dumps({"single": res["single"]}), flush=True)
        if a.baseline_python:
            btrace = trace
            if a.baseline_sessions:
                from tangram.traces import save_trace

                btrace = work / f"prefix_{a.baseline_sessions}.jsonl"
                save_trace(tr.head(a.baseline_sessions), btrace)
                res["single_prefix"] = {m: single(me, btrace, m, work / "prefix") for m in a.single_modes.split(",")}
            res["baseline_single"] = {m: single(a.baseline_python, btrace, m, work / "base",
                                                timeout=a.baseline_timeout) for m in a.single_modes.split(",")}
            ref = res.get("single_prefix", res["single"])
            res["speedup_single_cpu"] = {m: round(res["baseline_single"][m]["median_cpu_s"] /
                                                  max(ref[m]["median_cpu_s"], 1e-9), 2)
                                         for m in a.single_modes.split(",")}
            # same trace, same settings: the per-request results must be the same bytes (page ids never reach them)
            res["requests_csv_identical"] = {
                m: (work / "base" / f"single_{m}_0" / "requests.csv").read_bytes() ==
                ((work / "prefix") if a.baseline_sessions else work).joinpath(f"single_{m}_0", "requests.csv").read_bytes()
                for m in a.single_modes.split(",") if not res["baseline_single"][m]["runs"][-1]["timed_out"]}
            print(json.dumps({"baseline_single": res["baseline_single"],
                              "requests_csv_identical": res["requests_csv_identical"]}), flush=True)
    if "capacity" in what and a.alternate and a.baseline_python:
        res["alternate_capacity"] = alternate_capacity(me, a.baseline_python, trace, work, a.alternate, a.jobs,
                                                       len(tr.turns))
        print(json.dumps({"alternate_capacity": res["alternate_capacity"]}), flush=True)
        what.discard("capacity")
    if "capacity" in what:
        out = work / "capacity"
        r = run_cli(me, [str(trace), "--capacity", "--jobs", str(a.jobs), "--no-plots", "--out", str(out)])
        r["idle_cpu_s"] = _idle_cpu_s(r, a.jobs, len(tr.turns))
        m = _metrics(out)
        # per mode: the answer, and the replays behind it by kind ("probe": a replay of the whole trace the search
        # ran, met or missed, some stopped early by the SLO monitor; "burst": the whole trace at once; "reused": the
        # run at the trace's own load, which tangram-sim does anyway and the search reads instead of a burst)
        r["modes"] = {k: {"max_rate_rps": v.get("max_rate_rps"), "bracket_rps": v.get("capacity_bracket_rps"),
                          "saturated": v.get("capacity_saturated"), "probes": len(v.get("capacity_probes", [])),
                          "probes_stopped_early": sum(1 for p in v.get("capacity_probes", []) if p[3]),
                          "replays": v.get("capacity_replays"),
                          "probe_table": v.get("capacity_probes")}
                      for k, v in m.items()}
        r["replays_total"] = {key: sum((v.get("capacity_replays") or {}).get(key, 0) for v in m.values())
                              for key in ("probe", "met", "missed", "stopped_early", "burst", "reused")}
        res["capacity"] = r
        print(json.dumps({"capacity": r}), flush=True)
    if "probes" in what:
        res["probes"] = probe_costs(trace, a.probe_modes.split(","))
    if "identity" in what:
        res["identity"] = identity(trace, a.identity_sessions, a.identity_modes.split(","))
        print(json.dumps({"identity": res["identity"]}), flush=True)
    res["load_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""``tangram-sim``: capacity planning for multi-turn serving with per-head KV compression.

With no arguments it simulates the bundled default trace in every mode side by
side and prints one table; see docs/simulator.md for the options and formulas.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from tangram.cli import cli_main, from_cli, output_dir, parse, refuse_replacing_inputs, spec_overrides, spec_parser
from tangram.errors import ConfigError
from tangram.harness.slo import DEFAULT_SLO, meets_slo, slo_text, slo_verdict, verdict_line

DEFAULT_OUT = "tangram-sim-out"
OUTPUT_FILES = ("metrics.json", "requests.csv", "report.md", "throughput.png", "latency_cdf.png", "kv_memory.png",
                "capacity.png")  # what a run writes into --out
AUTO_JOBS_TURNS = 1000  # below this a worker's start-up (~0.6 s of imports) costs more than it saves
TABLE_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "kv_utilization", "fragmentation",
              "preemptions", "session_evictions"]


def _parser() -> argparse.ArgumentParser:
    p = spec_parser("tangram-sim", __doc__, ("deployment", "trace", "engine", "replay", "sim", "output"),
                    defaults={"out": DEFAULT_OUT})
    p.add_argument("--capacity", action="store_true", help="bisect the arrival-rate scale for the max load meeting "
                   f"--slo (default SLO '{DEFAULT_SLO}')")
    p.add_argument("--jobs", default="auto", metavar="N|auto",
                   help="worker processes for the modes (their runs and capacity searches); default auto: one per "
                        "mode (with --capacity two: a search's next replay may run ahead on an idle worker) up to the "
                        f"CPUs this process may use, when the trace has >= {AUTO_JOBS_TURNS} turns (a small trace "
                        "runs in this process). The results are the same for any N")
    p.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                   help="step every decode step one by one (the reference path; same results, slower)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def _mode_run(trace, spec, mode: str, fast_forward: bool, progress=None):
    """One mode at the trace's load: its summary and the records/KV samples the report needs."""
    from .run import simulate

    summ, res = simulate(trace, spec, mode, progress=progress, fast_forward=fast_forward)
    res.schedulers = [_LayoutOnly(sc.layout) for sc in res.schedulers]  # the report needs only the layout
    return summ, res


class _LayoutOnly:
    """What the report reads of a replica's scheduler (picklable, unlike the scheduler's block tables)."""

    def __init__(self, layout):
        self.layout = layout


def _mode_capacity(trace, spec, mode: str, slo: dict, target, at_load: dict | None, fast_forward: bool,
                   progress=None) -> dict:
    """The capacity search of one mode, then the replicas a target rate needs (simulated clusters). ``at_load``: the
    mode's summary at the trace's own load (scale 1), a replay of the whole trace the search reuses."""
    from tangram.harness.capacity import drive

    from .run import probe

    cap = drive(_search(trace, spec, slo, at_load),
                lambda scale: probe(trace, spec, mode, slo, scale, fast_forward=fast_forward), progress)
    if target is not None:
        cap["replicas"] = _replicas(trace, spec, mode, slo, target, cap, fast_forward, progress)
    return cap


def _search(trace, spec, slo: dict, at_load: dict | None):
    """A mode's capacity search (:func:`tangram.harness.capacity.capacity_steps`), reusing ``at_load``."""
    from tangram.harness.capacity import capacity_steps

    return capacity_steps(trace, slo, known={1.0: at_load} if at_load is not None else None, tol=spec.capacity_tol)


def _replicas(trace, spec, mode: str, slo: dict, target: float, cap: dict, fast_forward: bool, progress=None):
    """The replicas ``target`` requests/s need, searched from the capacity search's answer ``cap``."""
    from .run import replicas_needed

    if not cap["saturated"]:  # the whole trace at once met the SLO on spec.replicas: start there, search down
        first = spec.replicas  # (its served rate is no capacity: target / it would start hundreds too high)
    else:
        per_replica = (cap["max_rate_rps"] or 0.0) / spec.replicas
        first = math.ceil(target / per_replica - 1e-9) if per_replica > 0 else 1
    return replicas_needed(trace, spec, mode, slo, target, first, progress=progress, fast_forward=fast_forward)


_WORK: dict = {}  # a worker's trace, spec and fast-forward flag (set once by _init_worker, not sent per task)


def _init_worker(trace, spec, fast_forward: bool) -> None:
    _WORK.update(trace=trace, spec=spec, ff=fast_forward)


def _task_run(mode: str):
    return _mode_run(_WORK["trace"], _WORK["spec"], mode, _WORK["ff"])


def _task_probe(mode: str, scale: float | None, slo: dict) -> dict:
    from .run import probe

    return probe(_WORK["trace"], _WORK["spec"], mode, slo, scale, fast_forward=_WORK["ff"])


def _task_replicas(mode: str, slo: dict, target: float, cap: dict) -> dict:
    return _replicas(_WORK["trace"], _WORK["spec"], mode, slo, target, cap, _WORK["ff"])


_MISSED = {"completed": 0, "stopped_early": True}  # what a search is told of a replay assumed to miss (run ahead)
AHEAD_DEPTH = 3  # replays a search is followed ahead of the one it waits on, at most


def _ahead_chain(trace, spec, slo: dict, at_load: dict | None, sent: list, done: dict) -> list[float]:
    """The replays a mode's search would ask for after the one it waits on, if each one not yet run missed the SLO
    (those run ahead and done, ``done``: {scale: summary}, as they came out), in order; at most
    :data:`AHEAD_DEPTH`, fewer where it would end. A miss tells the search nothing but that it missed (a summary's
    numbers are only reported), so the chain is exact as far as the replays do miss, as most do on the way down to
    the limit. The search is rebuilt from the summaries it was sent (``sent``): it is deterministic in them, and
    rebuilding it runs no replay."""
    steps, chain = _search(trace, spec, slo, at_load), []
    try:
        next(steps)
        for summ in sent:
            steps.send(summ)
        nxt = steps.send(_MISSED)  # (its answer to the replay it waits on)
        while len(chain) < AHEAD_DEPTH:
            if nxt not in done:
                chain.append(nxt)
            nxt = steps.send(done.get(nxt, _MISSED))
    except StopIteration:
        pass
    return chain


def _descending(sent: list, slo: dict) -> bool:
    """Whether a search is on its way down to the limit: its own replays so far all missed the SLO (one at least).
    Its next replay is then a step below the last miss and misses more often than not; before its first replay,
    or once one has met the SLO (the search then brackets the limit), a replay run ahead is a coin toss."""
    return bool(sent) and not any(meets_slo(s, slo) for s in sent)


def _runs_then_searches(trace, spec, modes, ff: bool, capacity, jobs: int, bar=None):
    """Each mode's run at the trace's load and, with ``capacity`` = (slo, target), its capacity search, in ``jobs``
    worker processes. A search's replays are tasks of their own (:func:`tangram.harness.capacity.capacity_steps`
    says where each goes), so the workers take the next replay of any mode whose search waits on none: no worker
    idles while another runs a whole search to its end, and a mode's search starts as soon as its run is done.

    A worker that would idle (every search waiting on a replay in flight, the last searches of a run) runs a
    replay ahead: the one a search on its way down to the limit (:func:`_descending`) asks for next if its
    pending replay misses the SLO (:func:`_ahead_chain`). When the search does ask for it, it gets that replay's
    summary (or waits on it in flight); otherwise the replay is dropped, having used only a worker that had
    nothing to do. Such a search descends through misses, so this turns its chain of replays into pairs. Tasks
    are taken in the order they come (putting descents first left the long replays that meet the SLO for the end:
    slower, reports/traces).
    The same results as one process: each search sees its own replays, each one the replay of its scale, in its
    own order."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    runs, caps, searches, replays = {}, {}, {}, [0]
    sent: dict[str, list] = {}  # the summaries each search was sent, in order (to rebuild it: _ahead_chain)
    waits: dict[str, float] = {}  # the scale each search waits on
    ahead: dict[tuple, object] = {}  # (mode, scale) -> a replay run ahead: its future, or its summary once done
    used = [0, 0]  # replays run ahead: asked for by their search, run in all
    slo, target = capacity if capacity is not None else (None, None)
    with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(trace, spec, ff)) as ex:
        todo = {ex.submit(_task_run, m): ("run", m, None) for m in modes}

        def postfix() -> None:
            if bar is not None:
                extra = f" ({used[0]} of {used[1]} run ahead)" if used[1] else ""
                bar.set_postfix_str(f"{replays[0]} capacity replays{extra}", refresh=False)

        def advance(m: str, summ=None, first: bool = False) -> None:
            """The mode's search takes ``summ`` (its last replay) and names its next replay, or ends."""
            while True:
                try:
                    if first:
                        scale, first = next(searches[m]), False
                    else:
                        sent[m].append(summ)
                        scale = searches[m].send(summ)
                except StopIteration as stop:
                    waits.pop(m, None)
                    caps[m] = stop.value
                    if target is not None:
                        todo[ex.submit(_task_replicas, m, slo, target, caps[m])] = ("replicas", m, None)
                    elif bar is not None:
                        bar.update(1)
                    return
                waits[m] = scale
                replays[0] += 1
                got = ahead.pop((m, scale), None)
                if got is None:
                    todo[ex.submit(_task_probe, m, scale, slo)] = ("probe", m, scale)
                elif isinstance(got, dict):  # run ahead and done: the search goes on at once
                    used[0] += 1
                    summ = got
                    continue
                else:  # run ahead, still in flight: it is the search's replay now
                    used[0] += 1
                    todo[got] = ("probe", m, scale)
                postfix()
                return

        def run_ahead() -> None:
            """Give idle workers the replays the waiting searches would ask for next after misses, the searches
            with the fewest replays ahead first."""
            while len(todo) < jobs:
                picks = []
                for m in waits:
                    if not _descending(sent[m], slo):
                        continue
                    done = {x: v for (k, x), v in ahead.items() if k == m and isinstance(v, dict)}
                    chain = _ahead_chain(trace, spec, slo, runs[m][0], sent[m], done)
                    free = [x for x in chain if (m, x) not in ahead]
                    if free:
                        picks.append((len(chain) - len(free), m, free[0]))
                if not picks:
                    return
                _, m, nxt = min(picks, key=lambda p: p[0])
                fut = ex.submit(_task_probe, m, nxt, slo)
                ahead[(m, nxt)] = fut
                todo[fut] = ("ahead", m, nxt)
                used[1] += 1
                postfix()

        while any(kind != "ahead" for kind, _, _ in todo.values()):  # (what is left ahead, no search asks for)
            done, _ = wait(todo, return_when=FIRST_COMPLETED)
            for f in done:  # (in any order: each search sees only its own replays)
                kind, m, scale = todo.pop(f)
                if kind == "run":
                    runs[m] = f.result()
                    if bar is not None:
                        bar.update(1)
                    if capacity is not None:
                        searches[m], sent[m] = _search(trace, spec, slo, runs[m][0]), []
                        advance(m, first=True)
                elif kind == "probe":
                    waits.pop(m, None)
                    advance(m, f.result())
                elif kind == "ahead":
                    ahead[(m, scale)] = f.result()  # kept until its search asks for it (or the searches end)
                else:
                    caps[m]["replicas"] = f.result()
                    if bar is not None:
                        bar.update(1)
            if capacity is not None:
                run_ahead()
        if not all(f.cancel() or f.done() for f in todo):  # replays run ahead that no search asked for
            _stop_workers(ex)
    if used[1]:
        print(f"capacity: {used[1]} replays run ahead on idle workers, {used[0]} of them used", file=sys.stderr)
    return [runs[m] for m in modes], ([caps[m] for m in modes] if capacity is not None else None)


def _stop_workers(ex) -> None:
    """End a process pool's workers now, in the middle of their tasks (only replays nobody waits for are left)."""
    stop = getattr(ex, "terminate_workers", None)  # Python >= 3.14
    if stop is not None:
        stop()
        return
    for proc in list((getattr(ex, "_processes", None) or {}).values()):
        proc.terminate()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as a container or ``taskset`` sets it), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_jobs(jobs) -> int | None:
    """``--jobs``: a count >= 1, or None for ``auto``."""
    if isinstance(jobs, str) and jobs.strip().lower() == "auto":
        return None
    try:
        n = int(jobs)
    except (TypeError, ValueError):
        raise ConfigError(f"--jobs: expected a count >= 1 or 'auto', got {jobs!r}") from None
    if n < 1:
        raise ConfigError(f"--jobs must be >= 1 or 'auto', got {jobs}")
    return n


def resolve_jobs(jobs: int | None, modes: int, turns: int, capacity: bool = False) -> int:
    """Worker processes for ``modes`` modes: ``jobs`` (:func:`parse_jobs`; None: one per mode up to
    :func:`usable_cpus`, none for a trace under :data:`AUTO_JOBS_TURNS` turns), never more than the modes (a mode's
    capacity search waits for its own run), or with ``capacity`` twice the modes (a search's next replay can run
    ahead of the one it waits on: :func:`_runs_then_searches`). 1: everything in this process."""
    most = modes * (2 if capacity else 1)
    n = jobs if jobs is not None else (usable_cpus() if turns >= AUTO_JOBS_TURNS else 1)
    return max(1, min(n, most))


def run(args) -> dict:
    from tqdm import tqdm

    from tangram.metrics import records_frame, write_metrics, write_requests_csv

    from tangram.harness import offered_rps
    from tangram.traces import sanity_warnings
    from tangram.profiles.accuracy import AccuracyModel

    from .report import write_report

    spec = from_cli(args)
    out = output_dir(spec.out)  # before any work: an unwritable --out must not throw a finished run away
    # nor may the results replace the trace or config they are computed from
    refuse_replacing_inputs([out / n for n in OUTPUT_FILES], "--out",
                            {"the trace": spec.trace, "the --config file": getattr(args, "config", None)})
    jobs = parse_jobs(args.jobs)
    trace, modes = spec.load_trace(), spec.mode_list
    slo_default = bool(args.capacity and not spec.slo)  # the capacity search's documented default SLO
    unused = [f"--{k.replace('_', '-')}" for k in ("target_rate", "capacity_tol") if k in spec_overrides(args)]
    if unused and not args.capacity:  # (--slo alone still prints the verdict at the trace's load)
        verb = "applies" if len(unused) == 1 else "apply"
        print(f"note: {' and '.join(unused)} only {verb} with --capacity: ignored", file=sys.stderr)
    slo = spec.slo_targets(DEFAULT_SLO if args.capacity else None)
    accuracy, accuracy_label = AccuracyModel.for_run(spec.model.name, spec.profile, spec.accuracy_table)
    jobs = resolve_jobs(jobs, len(modes), len(trace.turns), args.capacity)
    ff = args.fast_forward
    # what `tangram-trace check` would warn about, for the model this run serves (a raw public file comes here
    # without passing through check: an importer that failed to split sessions shows up now, not as odd results)
    trace_warnings = sanity_warnings(trace, spec.model.max_context)
    for w in trace_warnings:
        print(f"warning: {trace.source}: {w}", file=sys.stderr)
    spans = {t.arrival_s for t in trace.turns if t.turn == 0}
    offered = offered_rps(trace) if len(spans) > 1 else None
    total = len(trace.turns) * len(modes)
    metrics, results, frames = {}, {}, []
    target = spec.target_rate
    if args.capacity and slo_default:
        print(f"capacity: SLO {DEFAULT_SLO} (the default; --slo to change it)", file=sys.stderr)
    caps = None
    if jobs > 1:
        n = len(modes) * (2 if args.capacity else 1)
        bar = tqdm(total=n, desc=f"tangram-sim ({jobs} workers)", unit="task", disable=None, file=sys.stderr,
                   leave=False)
        outs, caps = _runs_then_searches(trace, spec, modes, ff, (slo, target) if args.capacity else None,
                                         jobs, bar)
    else:
        bar = tqdm(total=total, desc="tangram-sim", unit="req", disable=None if total >= 1000 else True,
                   file=sys.stderr, leave=False)
        outs = [_mode_run(trace, spec, m, ff, bar.update) for m in modes]
    bar.close()
    for mode, (summ, res) in zip(modes, outs):
        metrics[mode] = summ
        results[mode] = res
        frames.append(records_frame(res.records, mode=mode))
    curves = {}
    if args.capacity:
        if caps is None:
            cbar = tqdm(desc="capacity", unit="sim", disable=None, file=sys.stderr, leave=False)
            caps = [_mode_capacity(trace, spec, m, slo, target, metrics[m], ff, progress=cbar.update) for m in modes]
            cbar.close()
        for mode, cap in zip(modes, caps):
            m = metrics[mode]
            m["max_rate_rps"] = cap["max_rate_rps"]
            m["max_rate_scale"] = cap["max_rate_scale"]
            m["capacity_bracket_rps"] = cap["bracket_rps"]
            m["capacity_saturated"] = cap["saturated"]
            for k in ("lower_bound_rps", "note"):
                if cap.get(k) is not None:
                    m[f"capacity_{k}"] = cap[k]
            m["capacity_probes"] = cap["probes"]
            m["capacity_replays"] = cap["replays"]
            curves[mode] = [p for p in cap["probes"] if p[0] is not None]
            if "replicas" in cap:
                rp = cap["replicas"]
                m["replicas_needed"] = rp["replicas_needed"]
                m["replicas_probes"] = rp["probes"]
                if rp.get("note"):
                    m["replicas_note"] = rp["note"]
    common = {"trace": str(spec.trace_path), "trace_format": trace.source_format, "model": spec.model.name,
              "gpu": spec.gpu.name, "seed": spec.seed,
              "tp": spec.engine.tp, "placement": spec.engine.placement if spec.engine.tp > 1 else None,
              "router": spec.router, "profile": spec.profile_label, "offered_rps": offered,
              "slo": slo, "target_rate": spec.target_rate,
              "capacity_tol": spec.capacity_tol if args.capacity else None, "trace_window": spec.trace_window,
              "rate_scale": spec.rate_scale}
    common["accuracy"] = accuracy_label
    common["trace_warnings"] = trace_warnings
    for mode, m in metrics.items():
        m["peak_kv_gib"] = m["peak_kv_bytes"] / 2**30
        m["run"] = common
        if slo:  # the verdict at the trace's own load, per term (with --capacity too: the search's first point)
            m["slo_verdict"] = slo_verdict(m, slo)
        if accuracy is not None:  # measured task accuracy at the mode's kept share
            e = spec.engine
            est = accuracy.estimate(mode, spec.profile, e.alpha, e.rho)
            m.update(kv_share=est.kv_share, accuracy=est.value, accuracy_rel=est.relative, accuracy_source=est.source)
        else:
            from tangram.profiles.accuracy import mode_kv_share
            m.update(kv_share=mode_kv_share(mode, spec.profile, spec.engine.alpha, spec.engine.rho), accuracy=None,
                     accuracy_rel=None, accuracy_source=accuracy_label)
    write_metrics(out / "metrics.json", metrics)
    write_requests_csv(out / "requests.csv", frames)
    write_report(out, metrics, results, curves, common, argv=getattr(args, "_argv", None),
                 plots=not args.no_plots)
    _print_table(metrics, args.capacity)
    if slo:
        w = max(len(k) for k in metrics)
        print(f"SLO at the trace's load ({slo_text(slo)}):")
        for mode, m in metrics.items():
            print(f"  {mode:<{w}}  {verdict_line(m['slo_verdict'])}")
    for mode, m in metrics.items():
        if m.get("capacity_note"):
            print(f"{mode}: {m['capacity_note']}")
    print(accuracy_label)
    print(f"wrote {out}/metrics.json, requests.csv, report.md")
    return metrics


def capacity_cell(m: dict) -> str:
    """The table's max_rate_rps: the rate, or why there is none (a trace too small to saturate)."""
    if not m.get("capacity_saturated", True):
        lb = m.get("capacity_lower_bound_rps")
        return "unsaturated" + (f" (> {lb:.4g})" if lb else "")
    v = m.get("max_rate_rps")
    return "n/a" if v is None else f"{v:.4g}"


def _print_table(metrics: dict, capacity: bool) -> None:
    import pandas as pd

    cols = TABLE_COLS + ["kv_share", "accuracy"] + (["max_rate_rps", "replicas_needed"] if capacity else [])
    if any("prefix_hit_rate_tokens" in v for v in metrics.values()):  # a trace with shared prefixes
        cols += ["prefix_hit_rate_requests", "prefix_hit_rate_tokens", "prefix_tokens_saved",
                 "prefix_shared_pages_peak"]
    df = pd.DataFrame({m: {c: v.get(c) for c in cols} for m, v in metrics.items()}).T
    if capacity:
        df["max_rate_rps"] = [capacity_cell(v) for v in metrics.values()]
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(df.to_string())


@cli_main
def main(argv=None) -> int:
    run(parse(_parser(), argv))
    return 0


if __name__ == "__main__":
    main()

"""report.md and its PNG plots for one tangram-sim run."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tangram.metrics import markdown_table, plot_capacity, plot_kv_over_time, plot_latency_cdfs, plot_throughput
from tangram.harness.slo import slo_text, verdict_line

REPORT_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
               "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "kv_utilization", "fragmentation", "preemptions",
               "session_evictions", "reclaim_share_of_prefill", "kv_share", "accuracy"]


def write_report(out: Path, metrics: dict, results: dict, curves: dict, common: dict, *, argv=None,
                 plots: bool = True) -> Path:
    out = Path(out)
    lines = ["# tangram-sim report", ""]
    if argv is not None:
        lines += ["Command: `tangram-sim " + " ".join(argv) + "`", ""]
    fmt = common.get("trace_format", "tangram")
    how = "" if fmt == "tangram" else \
        f" ({fmt} format as published, imported with `tangram-trace import {fmt}`'s defaults)"
    lines += [f"- trace: `{common['trace']}`{how}", f"- model: {common['model']}, GPU: {common['gpu']}, "
              f"router: {common['router']}, seed: {common['seed']}", f"- budget profile: {common['profile']}"]
    if common.get("trace_window"):
        lines.append(f"- trace window: `{common['trace_window']}` (the sessions arriving in it, from 0 s)")
    if common.get("rate_scale") is not None:
        lines.append(f"- arrival rate scaled x{common['rate_scale']:g}")
    lines += [f"- **trace warning**: {w}" for w in common.get("trace_warnings") or ()]
    if common.get("offered_rps"):
        lines.append(f"- offered load of the trace: {common['offered_rps']:.4g} requests/s")
    lines += ["", "## Results", ""]
    cols = REPORT_COLS + (["max_rate_rps", "replicas_needed"] if curves else [])
    lines.append(markdown_table(metrics, cols))
    if any("prefix_hit_rate_tokens" in m for m in metrics.values()):
        lines += ["Shared prefixes (docs/simulator.md, \"Shared prefixes\"):", "",
                  markdown_table(metrics, ["prefix_lookups", "prefix_hits", "prefix_hit_rate_requests",
                                           "prefix_hit_rate_tokens", "prefix_tokens_saved",
                                           "prefix_shared_pages_peak", "prefix_cached_pages_peak",
                                           "prefix_page_copies"])]
    lines += ["Throughput is completed requests over the span from the first arrival to the last finish.",
              "*kv_share*: kept share of the prompt's KV tokens; *accuracy*: measured task accuracy at that share "
              f"({common.get('accuracy') or 'not measured'}).", ""]
    if any("slo_verdict" in m for m in metrics.values()):
        lines += [f"SLO at the trace's load ({slo_text(common.get('slo'))}):", ""]
        lines += [f"- {mode}: {verdict_line(m['slo_verdict'])}" for mode, m in metrics.items() if "slo_verdict" in m]
        lines += [""]
    if any("capacity_probes" in m for m in metrics.values()):
        lines += _capacity_section(metrics, common)
    # where the time went
    ops = sorted({k for m in metrics.values() for k in m.get("share_of_busy", {})})
    if ops:
        lines += ["## Share of busy GPU+host time by operator", "",
                  markdown_table({mode: m.get("share_of_busy", {}) for mode, m in metrics.items()}, ops)]
    lines += ["## Cost model source per operator", ""]
    srcs = {}
    for mode, m in metrics.items():
        for op, s in m["cost_model_source"].items():
            srcs.setdefault(op, set()).add(s if op != "decode_attention" else s.split("; partition=")[0])
    for op, s in sorted(srcs.items()):
        lines.append(f"- **{op}**: " + " / ".join(sorted(s)))
    lines.append("")
    if plots:
        plot_throughput(out / "throughput.png", metrics)
        plot_latency_cdfs(out / "latency_cdf.png", {m: r.records for m, r in results.items()})
        series = {}
        for mode, r in results.items():
            tr, sc = r.replicas[0], r.schedulers[0]
            series[mode] = (np.asarray(tr.t), np.asarray(tr.reserved, float) * sc.layout.page_bytes,
                            np.asarray(tr.live, float) * sc.layout.head_token_bytes)
        plot_kv_over_time(out / "kv_memory.png", series)
        lines += ["## Plots", "", "![throughput](throughput.png)", "", "![latency CDFs](latency_cdf.png)", "",
                  "![KV memory over time (replica 0)](kv_memory.png)", ""]
        if curves:
            plot_capacity(out / "capacity.png", curves, common.get("slo") or {})
            lines += ["![capacity curve](capacity.png)", ""]
    p = out / "report.md"
    p.write_text("\n".join(lines))
    return p


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _tol_text(common: dict) -> str:
    """The bracket's width as run (``--capacity-tol``), in percent."""
    from tangram.harness.capacity import DEFAULT_TOL

    tol = common.get("capacity_tol")
    return f"{100 * (tol if tol is not None else DEFAULT_TOL):g}%"


def _capacity_section(metrics: dict, common: dict) -> list[str]:
    """Capacity search results: the limit and the bracket it lies in, whether the trace saturated the deployment,
    the simulated replicas for the target rate, and every probe (a probe stopped early once its SLO verdict was
    certain shows the TTFT p99 of the turns that had arrived, a lower bound)."""
    slo = slo_text(common.get("slo"))
    lines = ["## Capacity under the SLO", "", f"SLO: {slo}. The search scales the trace's session arrival rate until "
             "the SLO is met at one load and missed at another, then places replays where a queueing model of the "
             "passing ones predicts the limit; the limit lies in the bracket [met, missed], two replays of the whole "
             f"trace at most {_tol_text(common)} apart (docs/simulator.md, \"Capacity search\").", "",
             "| mode | max_rate_rps | bracket (met, missed) rps | saturated | replicas_needed | probes |",
             "|---|---|---|---|---|---|"]
    for mode, m in metrics.items():
        if "capacity_probes" not in m:
            continue
        lo, hi = m.get("capacity_bracket_rps") or [None, None]
        lines.append(f"| {mode} | {_fmt(m.get('max_rate_rps'))} | {_fmt(lo)}, {_fmt(hi) or 'none missed'} | "
                     f"{'yes' if m.get('capacity_saturated', True) else 'no'} | {_fmt(m.get('replicas_needed'))} | "
                     f"{len(m['capacity_probes'])} |")
    lines.append("")
    for mode, m in metrics.items():
        for k in ("capacity_note", "replicas_note"):
            if m.get(k):
                lines.append(f"- **{mode}**: {m[k]}")
    lines += ["", "Probes (offered rps, TTFT p99 s, SLO met, stopped early):", ""]
    for mode, m in metrics.items():
        if "capacity_probes" in m:
            pr = "; ".join(f"{_fmt(p[0]) or 'burst'}: {_fmt(p[1])} {'ok' if p[2] else 'miss'}"
                           f"{' (stopped)' if len(p) > 3 and p[3] else ''}"
                           f"{' (the run at the trace load, reused)' if len(p) > 4 and p[4] == 'reused' else ''}"
                           for p in m["capacity_probes"])
            lines.append(f"- {mode}: {pr}")
            if m.get("replicas_probes"):
                rp = "; ".join(f"{p[0]} replicas: {_fmt(p[1])} {'ok' if p[2] else 'miss'}"
                               f"{' (stopped)' if p[3] else ''}" for p in m["replicas_probes"])
                lines.append(f"  - at {_fmt(common.get('target_rate'))} rps: {rp}")
    lines.append("")
    return lines

"""report.md and its PNG plots for one tangram-sim run."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tangram.metrics import markdown_table, plot_capacity, plot_kv_over_time, plot_latency_cdfs, plot_throughput

REPORT_COLS = ["completed", "rejected", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
               "tpot_p99_s", "e2e_p99_s", "peak_kv_gib", "kv_utilization", "fragmentation", "preemptions",
               "session_evictions", "reclaim_share_of_prefill", "kv_share", "accuracy"]


def write_report(out: Path, metrics: dict, results: dict, curves: dict, common: dict, *, argv=None,
                 plots: bool = True) -> Path:
    out = Path(out)
    lines = ["# tangram-sim report", ""]
    if argv is not None:
        lines += ["Command: `tangram-sim " + " ".join(argv) + "`", ""]
    lines += [f"- trace: `{common['trace']}`", f"- model: {common['model']}, GPU: {common['gpu']}, "
              f"router: {common['router']}, seed: {common['seed']}", f"- budget profile: {common['profile']}"]
    if common.get("offered_rps"):
        lines.append(f"- offered load of the trace: {common['offered_rps']:.4g} requests/s")
    lines += ["", "## Results", ""]
    cols = REPORT_COLS + (["max_rate_rps", "replicas_needed"] if curves else [])
    lines.append(markdown_table(metrics, cols))
    lines += ["Throughput is completed requests over the span from the first arrival to the last finish.",
              "*kv_share*: kept share of the prompt's KV tokens; *accuracy*: measured task accuracy at that share "
              f"({common.get('accuracy') or 'not measured'}).", ""]
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

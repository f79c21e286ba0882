"""Tables for reports/sim/README.md from the metrics the simulator experiments wrote.

Run: ``python benchmarks/sim_summary.py [DIR]`` (DIR default reports/sim, after ``bash reports/sim/run.sh``).
"""
import json
import sys
from pathlib import Path

R = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "reports/sim")


def load(p):
    return json.loads((R / p / "metrics.json").read_text())


def fmt(v, nd=4):
    return "" if v is None else (f"{v:.{nd}g}" if isinstance(v, float) else str(v))


def main():
    cap = load("capacity")
    full = cap["full"]["max_rate_rps"]
    print("## Capacity under the SLO and saturation throughput (long_multiturn, Llama-3.1-8B, H100, rho 0.25)\n")
    print("| mode | max_rate_rps | x full | replicas for 1 req/s | throughput_rps at trace load | peak KV GiB "
          "| fragmentation | session evictions | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, v in cap.items():
        print(f"| {m} | {fmt(v['max_rate_rps'])} | {fmt(v['max_rate_rps'] / full if full else None, 3)} | "
              f"{v.get('replicas_needed')} | {fmt(v['throughput_rps'])} | {fmt(v['peak_kv_gib'])} | "
              f"{fmt(v['fragmentation'], 3)} | {v['session_evictions']} | {v['preemptions']} |")
    print("\nShare of busy time by operator at the trace's load:\n")
    ops = sorted({k for v in cap.values() for k in v["share_of_busy"]})
    print("| mode | " + " | ".join(ops) + " |\n|---|" + "---|" * len(ops))
    for m, v in cap.items():
        print(f"| {m} | " + " | ".join(fmt(v["share_of_busy"].get(o), 3) for o in ops) + " |")
    print("\n## Dynamic mode: reclaim vs eviction rate (rate scale 0.05)\n")
    print("| rho | eviction rate | pages reclaimed | reclaim s | prefill-step s | reclaim share of prefill |"
          " throughput_rps | preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for rho in ("0.75", "0.5", "0.25"):
        p = R / "reclaim" / f"rho_{rho}"
        if not (p / "metrics.json").exists():
            continue
        v = load(f"reclaim/rho_{rho}")["dynamic"]
        print(f"| {rho} | {1 - float(rho):g} | {v['pages_reclaimed']} | {fmt(v['time_by_operator_s'].get('reclaim'))} | "
              f"{fmt(v['prefill_step_s'])} | {fmt(v['reclaim_share_of_prefill'])} | {fmt(v['throughput_rps'])} | "
              f"{v['preemptions']} |")
    print("\n## H_p sweep (tangram, rho 0.25, trace load = saturation)\n")
    print("| H_p | page tables / request | fragmentation | host control-plane s | host share of busy | "
          "decode attention s | throughput_rps | ttft_p50_s | session evictions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hp in (1, 2, 4, 8):
        p = R / "hp" / f"hp_{hp}"
        if not (p / "metrics.json").exists():
            continue
        v = load(f"hp/hp_{hp}")["tangram"]
        print(f"| {hp} | {v['n_tables']} | {fmt(v['fragmentation'], 3)} | {fmt(v['control_plane_s'])} | "
              f"{fmt(v['share_of_busy'].get('host'), 3)} | {fmt(v['time_by_operator_s'].get('decode_attention'))} | "
              f"{fmt(v['throughput_rps'])} | {fmt(v['ttft_p50_s'])} | {v['session_evictions']} |")


if __name__ == "__main__":
    main()

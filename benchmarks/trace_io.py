"""Trace file I/O at public-trace scale: import a BurstGPT-format CSV of N rows (BurstGPT_1.csv has ~1.43M), save
the import as our JSON lines, compute the sanity warnings, load the saved file back. CPU seconds of each phase.

BurstGPT spans months and Azure's 2024 traces a week: users import the whole file, then simulate a slice, so
these phases run on millions of records while a replay never does. Every phase is this process's CPU time; run
it under two checkouts' pythons alternately to compare them (reports/traces/README.md has the loop).

Run: ``python benchmarks/trace_io.py --rows 1430000 --work DIR`` (the CSV is generated once, seeded, in DIR, by
sim_speed.py's BurstGPT-format generator).
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_speed import write_burstgpt_csv  # noqa: E402  (the low-load trace's generator, at this size)


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_430_000)
    ap.add_argument("--work", required=True, help="folder for the CSV and the saved trace")
    a = ap.parse_args(argv)
    from tangram.traces import load_trace, save_trace
    from tangram.traces.detect import import_trace
    from tangram.traces.stats import sanity_warnings

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    csv = work / f"burstgpt_{a.rows}.csv"
    if not csv.exists():
        write_burstgpt_csv(csv, a.rows)
    out = work / "imported.jsonl"
    cpu: dict[str, float] = {}
    t = _cpu()
    tr = import_trace("burstgpt", csv)
    cpu["import"], t = _cpu() - t, _cpu()
    save_trace(tr, out)
    cpu["save"], t = _cpu() - t, _cpu()
    sanity_warnings(tr, 131072)
    cpu["warnings"], t = _cpu() - t, _cpu()
    back = load_trace(out)
    cpu["load"] = _cpu() - t
    assert len(back) == len(tr)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"rows": a.rows, "turns": len(tr), "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
                      "peak_rss_gib": round(peak, 2), "saved": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

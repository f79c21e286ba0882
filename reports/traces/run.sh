#!/usr/bin/env bash
# Acceptance commands of the simulator-speed work (issue 14, items 3 and 4): see README.md in this folder.
# Usage: bash reports/traces/run.sh [OLD_PYTHON]
#   OLD_PYTHON: python of a checkout of the code before this work (e.g. `git worktree add /tmp/old <merge-base>`,
#   then `python3 -m venv --system-site-packages /tmp/old/.venv && /tmp/old/.venv/bin/pip install -q --no-deps -e /tmp/old`)
#   to time the same single runs with, side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=reports/traces
WORK=${WORK:-$OUT/work}
mkdir -p "$WORK"

# the trace: 12,000 requests in Mooncake's format with the public conversation trace's statistics, imported
tangram-trace gen-mooncake --requests 12000 --seed 0 -o "$WORK/mooncake_12000.raw.jsonl"
tangram-trace import mooncake "$WORK/mooncake_12000.raw.jsonl" -o "$WORK/mooncake_12000.jsonl"
tangram-trace stats "$WORK/mooncake_12000.jsonl" | head -3 > "$OUT/trace_stats.txt"

# one run per mode, --capacity for all six modes, fast-forward vs step-by-step (last line of each: JSON)
BASE=()
if [ $# -ge 1 ]; then BASE=(--baseline-python "$1"); fi
nice -n 5 python benchmarks/sim_speed.py --what single,identity --trace "$WORK/mooncake_12000.jsonl" \
    --work "$WORK" "${BASE[@]}" | tail -1 > "$OUT/sim_speed_single.json"
nice -n 5 python benchmarks/sim_speed.py --what capacity --trace "$WORK/mooncake_12000.jsonl" --work "$WORK" \
    | tail -1 > "$OUT/sim_speed_capacity.json"
cp "$WORK/capacity/metrics.json" "$OUT/capacity_metrics.json"
cp "$WORK/capacity/report.md" "$OUT/capacity_report.md"

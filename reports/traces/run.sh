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
if [ $# -ge 1 ]; then  # this checkout and OLD_PYTHON one process at a time, 3 rounds (the machine's speed drifts)
  python benchmarks/sim_speed.py --what single --trace "$WORK/mooncake_12000.jsonl" --work "$WORK/alt_mc" \
      "${BASE[@]}" --alternate 3 | tail -1 > "$OUT/sim_speed_alternate_mooncake.json"
  python benchmarks/sim_speed.py --what single --burstgpt --work "$WORK/alt_bg" "${BASE[@]}" --alternate 3 \
      | tail -1 > "$OUT/sim_speed_alternate_burstgpt.json"
  # --capacity for six modes, this checkout and OLD_PYTHON one process at a time, 2 rounds (~20 min)
  python benchmarks/sim_speed.py --what capacity --trace "$WORK/mooncake_12000.jsonl" --work "$WORK/alt_cap" \
      "${BASE[@]}" --alternate 2 | tail -1 > "$OUT/sim_speed_capacity_alternate_search.json"
fi
python benchmarks/sim_speed.py --what identity --trace "$WORK/mooncake_12000.jsonl" --work "$WORK/id" \
    | tail -1 > "$OUT/sim_speed_identity.json"
nice -n 5 python benchmarks/sim_speed.py --what capacity --trace "$WORK/mooncake_12000.jsonl" --work "$WORK" \
    | tail -1 > "$OUT/sim_speed_capacity.json"
cp "$WORK/capacity/metrics.json" "$OUT/capacity_metrics.json"
cp "$WORK/capacity/report.md" "$OUT/capacity_report.md"
# where a capacity search's time goes: every replay of the full and tangram searches timed, in one process
python benchmarks/sim_speed.py --what probes --trace "$WORK/mooncake_12000.jsonl" --work "$WORK/probes" \
    | tail -1 > "$OUT/sim_speed_probe_costs.json"
# a numba port of the decode wave model, bit for bit, timed against numpy (needs `pip install numba`; skipped without)
if python -c "import numba" 2> /dev/null; then
  python benchmarks/wave_model_jit.py "$WORK/mooncake_12000.jsonl" | tail -1 > "$OUT/wave_model_jit.json"
fi

# the six modes in one process and in tangram-sim's default worker processes (--jobs auto): wall time, same files
for j in 1 auto; do
  /usr/bin/time -f "--jobs $j: %e s wall, %U s user" tangram-sim "$WORK/mooncake_12000.jsonl" --no-plots --jobs "$j" \
      --out "$WORK/six_jobs_$j" > /dev/null
done
cmp "$WORK/six_jobs_1/requests.csv" "$WORK/six_jobs_auto/requests.csv"

# 62 tangram-sim configurations on the trace's first 90 s, each in its own process (models x GPUs, TP, routers, ...)
python benchmarks/sim_config_matrix.py "$WORK/mooncake_12000.jsonl" --out "$WORK/matrix" | tail -1 \
    > "$OUT/sim_config_matrix.json"

# why tangram ranked below br and dynamic (README): the cliff's two sides priced as before commit 3ab558c (the row
# term linear: the shipped tables without eager_rows_max; and with row_s = 0), then the compressed modes' capacity
# with the fix
for v in linear row0; do
  rm -rf "$WORK/tables_$v" && cp -r sim/tables/h100 "$WORK/tables_$v"
  python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); e = d['models']['llama-3.1-8b']
e['fit'].pop('eager_rows_max'); e['coefficients']['row_s'] = 0.0 if sys.argv[2] == 'row0' else e['coefficients']['row_s']
json.dump(d, open(p, 'w'), indent=1)" "$WORK/tables_$v/engine_overhead.json" $v
done
for run in linear:tangram:0.341633 linear:tangram:0.355308 linear:br:0.355308 row0:tangram:0.355308; do
  IFS=: read -r v m s <<< "$run"
  nice -n 10 tangram-sim "$WORK/mooncake_12000.jsonl" --mode "$m" --rate-scale "$s" --tables "$WORK/tables_$v" \
      --no-plots --out "$WORK/cliff_${v}_${m}_$s"
done
nice -n 10 tangram-sim "$WORK/mooncake_12000.jsonl" --mode tangram,br,dynamic --capacity --jobs 2 --no-plots \
    --out "$WORK/capacity_compressed"
cp "$WORK/capacity_compressed/metrics.json" "$OUT/capacity_metrics_compressed.json"

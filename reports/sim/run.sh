#!/usr/bin/env bash
# Acceptance experiments of the simulator (issue 3). Run from the repository root:
#   bash reports/sim/run.sh [capacity|reclaim|hp|hpcap|all]
# Every number quoted in reports/sim/README.md comes from the files these commands write; its tables are the output
# of `python benchmarks/sim_summary.py reports/sim`.
set -euo pipefail
source /work/venv/bin/activate 2>/dev/null || true
TRACE=traces/data/long_multiturn.jsonl
SIM="python -m tangram.sim.cli"
# pinned copy of the H100 tables (sim/tables/h100, then sim/calibration/h100, at commit cd3ebde), see
# calibration_h100/README.md
CAL="--tables reports/sim/calibration_h100"
what=${1:-all}
if [[ $what == capacity || $what == all ]]; then
  # all modes side by side at the trace's own load, plus the capacity search under the SLO
  $SIM $TRACE $CAL --model llama-3.1-8b --gpu h100 --rho 0.25 --slo 'ttft_p99=60s,tpot_p99=0.5s' --capacity \
    --target-rate 1 --out reports/sim/capacity
fi
if [[ $what == reclaim || $what == all ]]; then
  # dynamic mode: reclaim share of prefill time vs eviction rate 1 - rho (same load, same profile generator)
  for rho in 0.75 0.5 0.25; do
    $SIM $TRACE $CAL --model llama-3.1-8b --gpu h100 --mode dynamic --rho $rho --rate-scale 0.05 --no-plots \
      --out reports/sim/reclaim/rho_$rho
  done
fi
if [[ $what == hp || $what == all ]]; then
  # H_p sweep over the divisors of H = 8 (tangram mode, rho 0.25), at the trace's own (saturating) load
  for hp in 1 2 4 8; do
    $SIM $TRACE $CAL --model llama-3.1-8b --gpu h100 --mode tangram --rho 0.25 --hp $hp --no-plots \
      --out reports/sim/hp/hp_$hp
  done
fi
if [[ $what == hpcap || $what == all ]]; then
  # H_p sweep under the SLO: the highest load each H_p sustains (memory effects show here, not at saturation)
  for hp in 1 2 4 8; do
    $SIM $TRACE $CAL --model llama-3.1-8b --gpu h100 --mode tangram --rho 0.25 --hp $hp --no-plots \
      --slo 'ttft_p99=60s,tpot_p99=0.5s' --capacity --out reports/sim/hp_capacity/hp_$hp
  done
fi
if [[ $what == all ]]; then
  python benchmarks/sim_summary.py reports/sim
fi

#!/usr/bin/env bash
# Candidate engine-overhead fits with the opt-in terms (sim/engine_overhead.py EXTRA), refitted on the CPU from the two
# recorded calibrations, each priced against every measured machine (benchmarks/engine_fit_machines.py).
# Usage: bash reports/transfer/device_validation/engine_fit_terms_2026-11-25/run.sh   (about 2 CPU-minutes per fit)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=reports/transfer/device_validation/engine_fit_terms_2026-11-25
PY=${PY:-.venv/bin/python}
C="$(echo reports/validation/configs/*.json) reports/tuning/study/best_config.json"
S1633=reports/validation/h100_engine_fit_1633_2026-11-24            # the shipped fit's calibration (steps CSV)
S7FB3=reports/validation/h100_engine_fit_7fb3_2026-11-25/second_call # recorded plans
declare -A TERMS=([none]="" [row]="graph_row_s" [table_row]="graph_table_row_s" [token_table]="table_token_s"
                  [table_row+token_table]="graph_table_row_s table_token_s"
                  [row+token_table]="graph_row_s table_token_s"
                  [all]="graph_row_s graph_table_row_s table_token_s")
for src in 1633 7fb3; do
  for name in none row table_row token_table table_row+token_table row+token_table all; do
    d=$R/fits/${src}_$name; mkdir -p $d
    x=${TERMS[$name]}; extra=${x:+--extra-terms $x}
    if [ $src = 1633 ]; then
      cp $S1633/reference_probe.json $d/
      $PY -m tangram.sim.fit_engine --refit $S1633/engine_steps.csv.gz --configs $C --out-dir $d $extra > $d/fit.log
    else
      cp $S7FB3/reference_probe.json $d/
      $PY -m tangram.sim.fit_engine --refit $S7FB3/plans.pkl.gz --out-dir $d $extra > $d/fit.log
    fi
    echo "== fit ${src}, extra terms: ${x:-none}"
    grep -E "^fit over|^  " $d/fit.log
    $PY benchmarks/engine_fit_machines.py --fit $d > $d/machines.txt
    grep -v '^{' $d/machines.txt
  done
done

# How the shipped fit's predictions move when every step costs x F (the schedule branch: steps / session evictions)
for f in 0.97 0.99 1.0 1.01 1.03 1.05; do
  echo "== step scale $f"
  $PY benchmarks/engine_fit_machines.py --machines h100_7fb32f59 h100_c9de1c55 --step-scale $f | tail -1 | $PY -c "
import json, sys
for m, x in json.load(sys.stdin)['machines'].items():
    print(' ', m, ' '.join('%s %.3f (%d/%d)' % (n, x['predicted_rps'][n], *[x['schedule'][n][k][0] for k in ('steps', 'evictions')])
                          for n in x['errors']), '| max %.1f%% tau %.2f' % (100 * x['max_abs_err'], x['kendall_tau']))"
done

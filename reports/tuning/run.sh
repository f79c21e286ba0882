#!/usr/bin/env bash
# The tuning experiments of issue 6 (items 3 and the acceptance), run from the repository root:
#   bash reports/tuning/run.sh [study|pareto|verify|efficiency|all]
# Every number in reports/tuning/README.md comes from the files these commands write.
set -euo pipefail
source /work/venv/bin/activate 2>/dev/null || true
what=${1:-all}
if [[ $what == study || $what == all ]]; then
  # constrained study on the default trace: max sustained load s.t. overflow <= 0.05 (resumable: rerun continues)
  python -m tangram.tuning.cli --trials 24 --objective constrained --study default-constrained \
    --out reports/tuning/study --seed 0
fi
if [[ $what == pareto || $what == all ]]; then
  # two-objective study, two worker processes on one SQLite study
  python -m tangram.tuning.cli --trials 16 --n-jobs 2 --objective pareto --study default-pareto \
    --out reports/tuning/pareto --seed 0
fi
if [[ $what == verify || $what == all ]]; then
  # the tuned and the paper-default configs through tangram-sim's own capacity search (7 bisection steps)
  for c in best_config paper_default_config; do
    python -m tangram.sim.cli --config reports/tuning/study/$c.json --capacity --no-plots \
      --out reports/tuning/verify/$c
  done
fi
if [[ $what == efficiency || $what == all ]]; then
  python benchmarks/search_efficiency.py --jobs 2 --seeds 21 | tail -1 > reports/tuning/search_efficiency.json
fi

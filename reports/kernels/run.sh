#!/usr/bin/env bash
# Kernel microbenchmarks on the H100 and this folder's README (docs/kernels.md), from the repository root.
#   On the GPU (one device call): python -m tangram.kernels.bench --budget-s 530 --out $OUT
#     then copy its tables and meta.json into sim/tables/h100/ (the cost model's tables).
#   Here (CPU, seconds): bash reports/kernels/run.sh  -- the README and plots from sim/tables/h100, with the
#     closing-table row of the earlier 4-warp run (its meta.json is the pinned copy reports/sim/calibration_h100/).
set -euo pipefail
python -m tangram.kernels.report --calib sim/tables/h100 --out reports/kernels \
  --extra-meta "earlier run=reports/sim/calibration_h100/meta.json"

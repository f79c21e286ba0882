#!/usr/bin/env bash
# The fidelity report of this folder (CPU, about 20 minutes on the shared 2-core machine), from the repository root.
set -euo pipefail
OMP_NUM_THREADS=1 nice -n 10 python -m tangram.profiles.fidelity --samples-per-task 2 --box-samples-per-task 8 \
  --threads 1 -o reports/fidelity/agreement

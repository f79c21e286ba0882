#!/usr/bin/env bash
# How far apart the simulator puts the validated configurations on candidate validation traces (CPU, ~1 minute),
# from the repository root: bash reports/validation/trace_spread/run.sh  (writes README.md here)
set -euo pipefail
nice -n 10 python benchmarks/validation_spread.py --out reports/validation/trace_spread/README.md

#!/usr/bin/env bash
# The simulator's map of tangram / full over engine trace recipes (CPU, a few minutes), from the repository root:
#   bash reports/engine/predicted/run.sh [--quick]
set -euo pipefail
nice -n 10 python benchmarks/engine_recipes.py --out reports/engine/predicted "$@"

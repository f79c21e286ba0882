#!/usr/bin/env bash
# Every mode with and without shared prefixes on a Mooncake-like trace (benchmarks/prefix_cache.py); writes
# trace.jsonl, results.json and results.md here. About 10 minutes on the 2-core dev machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
python benchmarks/prefix_cache.py --sessions 400 --rate 8 --seed 0 --out reports/prefix_cache "$@"

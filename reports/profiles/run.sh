#!/usr/bin/env bash
# Regenerates every shipped SmolLM2-135M budget profile (tangram/profiles/data/) and profiles.md: all methods share
# one model forward per chunk; every (method, scope, rho) profile records its command, samples, date and the pass's
# seconds (provenance forward_*: the shared model forward; scorer_*: that method's scorer; pass_seconds).
# Run from the repository root; long (nice'd, one thread); the log (with per-sample progress) is calibration.log.
set -euo pipefail
LOG=reports/profiles/calibration.log
echo "== $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$LOG"
OMP_NUM_THREADS=1 nice -n 10 tangram-profile --model smollm2-135m --weights auto \
  --method ada-snapkv,pyramidkv,keydiff,tova,streaming-llm,expected-attention,kvzip --samples 50 \
  --rho 0.75,0.5,0.25,0.1 --scope per-layer,cross-layer --alpha 2 --corpus scbench-synth --split calib --threads 1 \
  -o 'tangram/profiles/data/smollm2-135m_{method}_{scope}_rho{rho}.npz' 2>&1 | tr '\r' '\n' | tee -a "$LOG"
echo "== $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
python -m tangram.profiles.registry > reports/profiles/profiles.md

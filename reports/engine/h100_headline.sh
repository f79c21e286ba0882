#!/bin/bash
# Issue-5 acceptance run in one device call (carry: [".whl"]): bash reports/engine/h100_headline.sh
# 1. correctness check (check.log: CHECK ok, GRAPHS ok)
# 2. the saturated long-context recipe chosen with reports/engine/predict_recipes.py (4 sessions x 6 turns, first
#    turns ~20K tokens, 64 output tokens, KV pool 4.5 GiB), the tuner's best_config.json: the cumulative ablation
#    full -> br -> br+rp -> tangram, and dynamic
# 3. the paper's default configuration (H_p 4, alpha 2) on the same trace: tangram only
# 4. the eager A/B (decode CUDA graphs off) for tangram and full
# Outputs: $OUT/check.{json,log}, $OUT/{tuned,paper,eager}.tgz (metrics.json, requests.csv, report.md, logs).
# PART=1 runs steps 1-2, PART=2 steps 3-4 (each fits one 600 s device call); unset runs all four.
export TRACE="${TRACE:---sessions 4 --turns 6 --first 20000 --out-tokens 64 --spread-s 0.5 --think-s 0.1 --seed 0}"
export POOL=${POOL:-4.5} MODE_LIMIT=${MODE_LIMIT:-120}
if [ "${PART:-1}" = 1 ] || [ -z "$PART" ]; then
TAG=tuned CONFIG=reports/tuning/study/best_config.json MODES="full tangram dynamic br+rp br" \
  bash reports/engine/h100_run.sh
fi
if [ "${PART:-2}" = 2 ]; then
CHECK=0 TAG=paper CONFIG=reports/validation/configs/paper_default_hp4_a2.json MODES="tangram" \
  bash reports/engine/h100_run.sh
CHECK=0 TAG=eager CONFIG=reports/tuning/study/best_config.json EXTRA="--cuda-graph-max-bs 0" MODES="tangram full" \
  bash reports/engine/h100_run.sh
fi
ls -la $OUT

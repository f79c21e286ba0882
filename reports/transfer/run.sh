#!/bin/bash
# Regenerates this folder's predictions on the CPU (no GPU): the validation trace of reports/validation (seed 0,
# KV pool 1.3 GiB), then the simulator side of tangram-validate for the seven validation configs on the H200 and
# the A100 (no tables of their own: the H100 tables transferred by datasheet) and on the H100 (its own tables).
#   bash reports/transfer/run.sh
set -e
cd "$(dirname "$0")/../.."
tangram-trace gen-sessions -o reports/transfer/validation_trace.jsonl --sessions 6 --first 6000 \
  --out-tokens 48 --spread-s 1 --think-s 0.3 --seed 0
C="reports/validation/configs/*.json reports/tuning/study/best_config.json"
for g in h200 a100-80gb h100-80gb; do
  python -m tangram.tuning.validate $C --trace reports/transfer/validation_trace.jsonl --kv-pool-gib 1.3 \
    --gpu $g --predict-only --out reports/transfer/${g%%-*}_prediction
done

#!/usr/bin/env bash
# The decode (and prefill) kernel sweep of this folder, on a GPU, from the repository root:
#   bash reports/kernels/regime_routing_2026-11-24/run.sh   (writes $OUT/kbench: decode_attention.csv,
#   prefill_attention.csv, meta.json)
set -euo pipefail
python -m tangram.kernels.bench --out ${OUT:?set OUT}/kbench --budget-s ${KB_BUDGET:-170} --tail-s ${KB_TAIL:-75} \
  --sections decode,prefill --sweep-batches 1,4,16,64,256 --sweep-contexts 1024,4096,8192,32768,131072 \
  --sweep-rhos 0.25,0.5,1.0 --sweep-hps 1,4

#!/bin/bash
# Decode split routing, new decode costs against old, one device call (nvidia-h100-x1, carry .whl and .oldcosts):
# the kernel bench's decode sweep (AOT vs FlashDecoding's static split vs the runtime plan on the same ragged
# layouts, interleaved graph replays) with the engine's tile, routed by sim/tables/h100/decode_costs.json (this
# tree) and then by OLD (a folder with the previous decode_costs.json), same machine, same call.
# Knobs: OLD (default .oldcosts/h100), WHL (default .whl), MODEL (default llama-3.1-8b), KB_NEW / KB_OLD (seconds
# of sweep each), SWEEP_*.
ROOT=$PWD
OLD=${OLD:-$ROOT/.oldcosts/h100}
. benchmarks/device_env.sh
SW="--sweep-batches ${SWEEP_BATCHES:-1,4,16,64,256} --sweep-contexts ${SWEEP_CONTEXTS:-1024,8192,32768,131072} \
  --sweep-rhos ${SWEEP_RHOS:-0.25,0.5,1.0} --sweep-hps ${SWEEP_HPS:-1,4} --tile engine --model ${MODEL:-llama-3.1-8b}"
timeout $(( ${KB_NEW:-230} + 60 )) python3 -m tangram.kernels.bench --out $R/new --budget-s ${KB_NEW:-230} --tail-s 5 \
  --sections decode $SW 2>&1 | tail -30 | tee $R/new.log
timeout $(( ${KB_OLD:-230} + 60 )) python3 -m tangram.kernels.bench --out $R/old --budget-s ${KB_OLD:-230} --tail-s 5 \
  --sections decode --decode-costs $OLD $SW 2>&1 | tail -30 | tee $R/old.log
python3 -m tangram.kernels.bench.ab $R/new $R/old > $R/ab.log 2>&1; grep -v "^{" $R/ab.log | tail -30
cd $OUT && tar czf routing_call.tgz r && rm -rf r

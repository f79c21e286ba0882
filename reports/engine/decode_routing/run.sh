#!/bin/bash
# Decode split routing, new decode costs against old, one device call (nvidia-h100-x1, carry .whl and .oldcosts):
# the kernel bench's decode sweep (AOT vs FlashDecoding's static split vs the runtime plan on the same ragged
# layouts, interleaved graph replays) with the engine's tile, routed by sim/tables/h100/decode_costs.json (this
# tree) and then by OLD (a folder with the previous decode_costs.json), same machine, same call.
# Knobs: OLD (default .oldcosts/h100), WHL (default .whl), KB_NEW / KB_OLD (seconds of sweep each), SWEEP_*.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
WHL=${WHL:-$ROOT/.whl}
OLD=${OLD:-$ROOT/.oldcosts/h100}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
mkdir -p /tmp/sa
printf "import sys; sys.path.insert(0, '%s')\nimport tangram; tangram.__path__.append('%s')\n" $ROOT $ROOT > /tmp/sa/sitecustomize.py
export PYTHONPATH=/tmp/sa:/tmp/site
R=$OUT/r
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $R/device.txt
SW="--sweep-batches ${SWEEP_BATCHES:-1,4,16,64,256} --sweep-contexts ${SWEEP_CONTEXTS:-1024,8192,32768,131072} \
  --sweep-rhos ${SWEEP_RHOS:-0.25,0.5,1.0} --sweep-hps ${SWEEP_HPS:-1,4} --tile engine --model llama-3.1-8b"
timeout $(( ${KB_NEW:-230} + 60 )) python3 -m tangram.kernels.bench --out $R/new --budget-s ${KB_NEW:-230} --tail-s 5 \
  --sections decode $SW 2>&1 | tail -30 | tee $R/new.log
timeout $(( ${KB_OLD:-230} + 60 )) python3 -m tangram.kernels.bench --out $R/old --budget-s ${KB_OLD:-230} --tail-s 5 \
  --sections decode --decode-costs $OLD $SW 2>&1 | tail -30 | tee $R/old.log
python3 -m tangram.kernels.bench.ab $R/new $R/old > $R/ab.log 2>&1; grep -v "^{" $R/ab.log | tail -30
cd $OUT && tar czf routing_call.tgz r && rm -rf r

#!/bin/bash
# Decode tile A/B on the decode-step roofline with asynchronous steps, one device call (carry .whl): each TILES
# entry (BLOCK_NxWARPSxSTAGES; "default" = the shipped tile) for full, the paper default and the tuned
# configuration at batch 32 and 64 x 8K, alternated over REPS, same machine, same call.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl/*.whl || exit 1
mkdir -p /tmp/sa
printf "import sys; sys.path.insert(0, '%s')\nimport tangram; tangram.__path__.append('%s')\n" $ROOT $ROOT > /tmp/sa/sitecustomize.py
export PYTHONPATH=/tmp/sa:/tmp/site
R=$OUT/r
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $R/device.txt
for rep in ${REPS:-a b}; do for t in ${TILES:-default 128x4x3 64x4x4}; do
  extra=""; [ "$t" != default ] && extra="--decode-tile $t"
  timeout ${LIMIT:-120} python3 -m tangram.engine.roofline --out $R/${t}_$rep --batches 32,64 --contexts 8192 \
    --steps ${STEPS:-30} --profile-steps 2 --no-mixed --config ${CONFIGS:-full --config paper --config tuned=reports/tuning/study/best_config.json} \
    --async-steps $extra > $R/${t}_$rep.log 2>&1
  echo "== $t $rep rc=$?"; tail -1 $R/${t}_$rep.log
done; done
cd $OUT && tar czf tile_ab.tgz r && rm -rf r

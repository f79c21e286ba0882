#!/bin/bash
# Asynchronous decode steps A/B on the decode-step roofline, one device call (carry .whl): the roofline of full,
# the paper default and the tuned configuration at batch 32 and 64 x 8K, synchronous and asynchronous steps
# alternated over REPS repetitions, same machine, same call. Knobs: REPS (default "a b"), STEPS, LIMIT (per run).
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
for rep in ${REPS:-a b}; do for f in --no-async-steps --async-steps; do
  timeout ${LIMIT:-130} python3 -m tangram.engine.roofline --out $R/${f#--}_$rep --batches 32,64 --contexts 8192 \
    --steps ${STEPS:-30} --profile-steps 2 --no-mixed --config full --config paper \
    --config tuned=reports/tuning/study/best_config.json $f > $R/${f#--}_$rep.log 2>&1
  echo "== ${f#--} $rep rc=$?"; tail -1 $R/${f#--}_$rep.log
done; done
cd $OUT && tar czf async_ab.tgz r && rm -rf r

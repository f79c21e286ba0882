#!/bin/bash
# Decode-step roofline A/B of engine options, one device call (carry .whl): the roofline of full, the paper default
# and the tuned configuration at batch 32 and 64 x 8K under each VARIANTS entry, alternated over REPS repetitions,
# same machine, same call. A variant is NAME=FLAGS with the roofline's flags comma-separated. Knobs: VARIANTS,
# REPS (default "a b"), STEPS, LIMIT (seconds per run).
#   asynchronous steps (default): VARIANTS="no-async-steps=--no-async-steps async-steps=--async-steps"
#   decode tile: VARIANTS="default=--async-steps 128x4x3=--async-steps,--decode-tile,128x4x3
#                          64x4x4=--async-steps,--decode-tile,64x4x4"
. benchmarks/device_env.sh
for rep in ${REPS:-a b}; do
  for v in ${VARIANTS:-no-async-steps=--no-async-steps async-steps=--async-steps}; do
    name=${v%%=*}; flags=${v#*=}
    timeout ${LIMIT:-130} python3 -m tangram.engine.roofline --out $R/${name}_$rep --batches 32,64 --contexts 8192 \
      --steps ${STEPS:-30} --profile-steps 2 --no-mixed --config full --config paper \
      --config tuned=reports/tuning/study/best_config.json ${flags//,/ } > $R/${name}_$rep.log 2>&1
    echo "== $name $rep rc=$?"; tail -1 $R/${name}_$rep.log
  done
done
cd $OUT && tar czf roofline_ab.tgz r && rm -rf r

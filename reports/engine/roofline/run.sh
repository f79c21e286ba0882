#!/bin/bash
# The decode-roofline experiment in one device call, run from the branch's tree with the merge-base tree beside it
# (BEFORE, default ../before) and the simpy wheel (WHL, default ../whl):
#   GPU checks (tests/gpu), the roofline of the engine after and before (same call, same machine), the kernel
#   sweeps (decode AOT vs static with the regime choice, compression at 512..4096-token chunks).
# Knobs: BATCHES, CONTEXTS, STEPS, SECTIONS (kernel bench), KB_BUDGET, KB_TAIL, SWEEP_*, SKIP (space list of: tests
# after before kbench kbench_before), FI (FlashInfer wheels for the headline section). The kernel bench runs on both
# trees (after, then before) and kbench_ab.log puts their acceptance lines side by side.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
BEFORE=${BEFORE:-$ROOT/../before}
WHL=${WHL:-$ROOT/../whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
# FI: a folder of wheels for the kernel bench's FlashInfer peer (flashinfer-python 0.2.14.post1 built from its
# sdist, JIT-compiled here with nvcc; ninja and requests with it), carried like WHL
if [ -n "$FI" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $FI/*.whl || exit 1
  export PATH=/tmp/site/bin:$PATH
fi
mk() { mkdir -p $1; printf "import sys; sys.path.insert(0, '%s')\nimport tangram; tangram.__path__.append('%s')\n" $2 $2 > $1/sitecustomize.py; }
mk /tmp/site_after $ROOT
mk /tmp/site_before $BEFORE
cp $ROOT/tangram/engine/roofline.py $BEFORE/tangram/engine/roofline.py  # the same measurement on both versions
R=$OUT/r
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $R/device.txt
skip() { [[ " $SKIP " == *" $1 "* ]]; }
ROOF="--batches ${BATCHES:-1,8,32,64} --contexts ${CONTEXTS:-2048,8192,32768} --steps ${STEPS:-15} --profile-steps 3"
CFGS="--config full --config paper --config tuned=reports/tuning/study/best_config.json"
if ! skip tests; then
  PYTHONPATH=/tmp/site_after:/tmp/site timeout ${TEST_LIMIT:-200} python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu 2>&1 | tail -60 | tee $R/gpu_tests.log
fi
if ! skip after; then
  PYTHONPATH=/tmp/site_after:/tmp/site timeout ${ROOF_LIMIT:-240} python3 -m tangram.engine.roofline --out $R/after \
    $ROOF $CFGS 2>&1 | tee $R/roofline_after.log | grep -v "^|"
fi
if ! skip before; then
  (cd $BEFORE && mkdir -p reports/tuning/study && cp $ROOT/reports/tuning/study/best_config.json reports/tuning/study/ &&
   PYTHONPATH=/tmp/site_before:/tmp/site timeout ${ROOF_LIMIT:-240} python3 -m tangram.engine.roofline --out $R/before \
   $ROOF $CFGS 2>&1 | tee $R/roofline_before.log | grep -v "^|")
fi
KB_ARGS="--budget-s ${KB_BUDGET:-150} --tail-s ${KB_TAIL:-50} --sections ${SECTIONS:-decode,prefill} \
  --sweep-batches ${SWEEP_BATCHES:-1,4,16,64,256} --sweep-contexts ${SWEEP_CONTEXTS:-1024,8192,32768,131072} \
  --sweep-rhos ${SWEEP_RHOS:-0.25,0.5,1.0} --sweep-hps ${SWEEP_HPS:-1,4}"
if ! skip kbench; then
  PYTHONPATH=/tmp/site_after:/tmp/site timeout $(( ${KB_BUDGET:-150} + 60 )) python3 -m tangram.kernels.bench \
    --out $R/kbench $KB_ARGS 2>&1 | tail -40 | tee $R/kbench.log
fi
if ! skip kbench_before; then  # the same sweep with the merge-base tree's kernels and bench, same call
  (cd $BEFORE && PYTHONPATH=/tmp/site_before:/tmp/site timeout $(( ${KB_BUDGET:-150} + 60 )) python3 -m \
    tangram.kernels.bench --out $R/kbench_before $KB_ARGS 2>&1 | tail -40 > $R/kbench_before.log)
fi
if ! skip kbench; then
  PYTHONPATH=/tmp/site_after:/tmp/site python3 -m tangram.kernels.bench.ab $R/kbench $R/kbench_before \
    > $R/kbench_ab.log 2>&1; grep -v "^{" $R/kbench_ab.log
fi
cat $R/after/roofline.md 2>/dev/null | head -50
cd $OUT && tar czf roofline_call.tgz r && rm -rf r

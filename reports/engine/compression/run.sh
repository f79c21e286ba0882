#!/usr/bin/env bash
# One device call (nvidia-h100-x1, carry .whl = simpy's wheel, and .old for the A/B): the GPU tests of the
# compression kernels and of the engine, then benchmarks/compress_phases.py (per layer-call: attention, full-mode
# copy, the per-layer fused launch and the deferred one-launch-per-step form). Files under $OUT/r.
#   OLD=.old: first the same benchmark on an older tree (the A/B of the current result:
#     mkdir -p .old && git archive 8ab8da3 kernels tangram benchmarks | tar -x -C .old), files under $OUT/old.
#   TEST_LIMIT (s, default 240) bounds the tests; CHUNKS / CACHED the benchmark's points.
set -uo pipefail
B=$PWD
TEST_LIMIT=${TEST_LIMIT:-240}
CHUNKS=${CHUNKS:-512,1024,4096}
CACHED=${CACHED:-0,8192}
if [ -n "${OLD:-}" ]; then
  (ROOT=$B/$OLD WHL=$B/.whl R=$OUT/old . benchmarks/device_env.sh >/dev/null; cd $B/$OLD &&
   python3 benchmarks/compress_phases.py --out $OUT/old --chunks 512,4096 --cached 0 2>&1 | grep "c=" | cut -c1-330)
fi
. benchmarks/device_env.sh
python3 benchmarks/compress_phases.py --out $R --chunks $CHUNKS --cached $CACHED 2>&1 | tail -30 > $R/compress_phases.log
grep "c=" $R/compress_phases.log | cut -c1-400
timeout $TEST_LIMIT python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings \
    tests/gpu/test_fused_compression_gpu.py tests/gpu/test_engine_gpu.py -k "every_layer or parallel or engine" 2>&1 | tail -5 > $R/gpu_tests.log
echo "gpu tests rc ${PIPESTATUS[0]}" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log

#!/usr/bin/env bash
# One device call (nvidia-h100-x1, carry .whl = simpy's wheel): the GPU tests of the compression kernels and of the
# engine, then benchmarks/compress_phases.py (per layer-call: attention, full-mode copy, the per-layer fused launch
# and the deferred one-launch-per-step form). Files under $OUT/r.
#   TEST_LIMIT (s, default 240) bounds the tests; CHUNKS / CACHED the benchmark's points.
set -uo pipefail
. benchmarks/device_env.sh
TEST_LIMIT=${TEST_LIMIT:-240}
CHUNKS=${CHUNKS:-512,1024,4096}
CACHED=${CACHED:-0,8192}
timeout $TEST_LIMIT python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused_compression_gpu.py \
    tests/gpu/test_engine_gpu.py 2>&1 | tail -40 > $R/gpu_tests.log
echo "gpu tests rc ${PIPESTATUS[0]}" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log
python3 benchmarks/compress_phases.py --out $R --chunks $CHUNKS --cached $CACHED 2>&1 | tail -30 > $R/compress_phases.log
tail -16 $R/compress_phases.log | cut -c1-400

# One device call (carry .whl, .old): compress_phases.py on the code of commit 8ab8da3 (layer-by-layer compression)
# and on this tree (with the deferred one-launch-per-step form), then the GPU tests of the stacked launch.
# .old: mkdir -p .old && git archive 8ab8da3 kernels tangram benchmarks | tar -x -C .old
set -uo pipefail
B=$PWD
(ROOT=$B/.old WHL=$B/.whl R=$OUT/old . benchmarks/device_env.sh >/dev/null; cd $B/.old && python3 benchmarks/compress_phases.py --out $OUT/old --chunks 512,4096 --cached 0 --models llama-3.1-8b,smollm2-135m 2>&1 | grep "c=" | cut -c1-330)
. benchmarks/device_env.sh >/dev/null
python3 benchmarks/compress_phases.py --out $R --chunks 512,1024,4096 --cached 0,8192 2>&1 | grep "c=" | cut -c1-400
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused_compression_gpu.py -k "every_layer or (parallel and bfloat16)" 2>&1 | tail -3

#!/bin/bash
# Issue-5 acceptance on the H100 (device calls with carry: [".whl"], simpy's wheel), from the repository root:
#   PART=1 MODE_LIMIT=105 bash reports/engine/h100_headline_2026-11-23/run.sh
#   PART=2 MODE_LIMIT=90 timeout 270 bash reports/engine/h100_headline_2026-11-23/run.sh
# PART=1: the GPU correctness tests (tests/gpu -> check.log), then the saturated long-context recipe (4 sessions x
#   6 turns, first turns ~20K tokens, 64 output tokens, KV pool 4.5 GiB) with the tuner's best_config.json: the
#   cumulative ablation full -> br -> br+rp -> tangram, and dynamic (tuned/).
# PART=2: the paper's default configuration (H_p 4, alpha 2) on the same trace, tangram only (paper/), and the
#   eager A/B, decode CUDA graphs off, tangram and full (eager/). Unset PART runs both (more than one 600 s call).
# Outputs under $OUT: device.txt, check.log, {tuned,paper,eager}.tgz (per mode: metrics.json, requests.csv,
# report.md, its log; the trace and the config). Knobs: TRACE (tangram-trace gen-sessions options), POOL (GiB),
# MODE_LIMIT (s per mode), WHL (wheel folder).
set -o pipefail
TRACE="${TRACE:---sessions 4 --turns 6 --first 20000 --out-tokens 64 --spread-s 0.5 --think-s 0.1 --seed 0}"
POOL=${POOL:-4.5}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# the package maps folders to tangram.* names; without an install, a sitecustomize adds the repo root to tangram's path
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
python3 -c "import tangram.sim, tangram.kernels, tangram.traces, torch, triton, simpy; print('imports ok', torch.__version__, triton.__version__, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/device.txt
python3 -m tangram.traces.cli gen-sessions $TRACE -o /tmp/trace.jsonl || exit 1

# bench TAG CONFIG MODES [EXTRA]: every mode of one configuration on the trace, into $OUT/TAG.tgz
bench() {
  local B=$OUT/$1
  mkdir -p $B
  cp $2 $B/config.json
  cp /tmp/trace.jsonl $B/trace.jsonl
  for mode in $3; do
    d=$B/$(echo $mode | tr + _)
    timeout ${MODE_LIMIT:-120} python3 -m tangram.engine.bench /tmp/trace.jsonl --mode $mode --model llama-3.1-8b \
      --weights random --config $2 --kv-pool-gib $POOL --no-plots $4 --out $d 2>&1 | grep -v "it/s\]" | tee $d.log
  done
  (cd $OUT && tar czf $1.tgz $1 && rm -rf $1)
}

if [ "${PART:-1}" = 1 ]; then
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu 2>&1 | tee $OUT/check.log
  bench tuned reports/tuning/study/best_config.json "full tangram dynamic br+rp br"
fi
if [ "${PART:-2}" = 2 ]; then
  bench paper reports/validation/configs/paper_default_hp4_a2.json "tangram"
  bench eager reports/tuning/study/best_config.json "tangram full" "--cuda-graph-max-bs 0"
fi
ls -la $OUT

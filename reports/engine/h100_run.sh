#!/bin/bash
# H100 acceptance: one device call. Usage (device tool, carry .whl: the simpy wheel): bash reports/engine/h100_run.sh
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# the package maps folders to tangram.* names; without an install, a sitecustomize adds the repo root to tangram's path
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
python3 -c "import tangram.sim, tangram.kernels, tangram.traces, torch, triton, simpy; print('imports ok', torch.__version__, triton.__version__, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/device.txt
if [ "${PHASE:-bench}" = validate ]; then
  python3 reports/engine/make_trace.py /tmp/vtrace.jsonl --sessions ${VSESSIONS:-4} --first ${VFIRST:-8000} --out-tokens ${VOUTTOK:-64}
  timeout ${VLIMIT:-540} python3 -m tangram.tuning.validate ${CONFIGS:-reports/validation/configs/*.json} --trace /tmp/vtrace.jsonl \
    --kv-pool-gib ${POOL:-2.5} --out $OUT/v 2>&1 | tee $OUT/validate.log
  cp /tmp/vtrace.jsonl $OUT/v/trace.jsonl
  exit 0
fi
# TAG names this call's output folder/archive (several runs in one call); CHECK=0 skips the correctness check;
# TRACE: make_trace.py options (default: the session-2/3 recipe from SESSIONS/FIRST/OUTTOK);
# CONFIG: a tangram-sim --config JSON (e.g. the tuner's best_config.json) instead of --rho 0.25 --alpha 2 --hp 4
B=$OUT/${TAG:-b}
mkdir -p $B
[ "${CHECK:-1}" = 1 ] && python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu 2>&1 | tee $OUT/check.log
python3 reports/engine/make_trace.py /tmp/trace.jsonl ${TRACE:---sessions ${SESSIONS:-8} --first ${FIRST:-12000} --out-tokens ${OUTTOK:-192}} || exit 1
if [ -n "$CONFIG" ]; then SPEC="--config $CONFIG"; cp $CONFIG $B/config.json; else SPEC="--rho 0.25 --alpha 2 --hp 4"; fi
cp /tmp/trace.jsonl $B/trace.jsonl
for mode in ${MODES:-tangram br+rp dynamic br full}; do
  d=$B/$(echo $mode | tr + _)
  timeout ${MODE_LIMIT:-170} python3 -m tangram.engine.bench /tmp/trace.jsonl --mode $mode --model llama-3.1-8b \
    --weights random $SPEC --kv-pool-gib ${POOL:-2.5} --no-plots $EXTRA --out $d 2>&1 \
    | grep -v "it/s\]" | tee $d.log
done
cd $OUT && tar czf ${TAG:-bench}.tgz ${TAG:-b} && rm -rf ${TAG:-b}

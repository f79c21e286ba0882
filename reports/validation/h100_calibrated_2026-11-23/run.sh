#!/bin/bash
# Issue 6, calibrated validation on the H100 in one device call (carry: [".whl"], simpy's wheel):
#   bash reports/validation/h100_calibrated_2026-11-23/run.sh   fit the engine overhead on a calibration trace
#     (seed 1), then tangram-validate on the validation trace (seed 0) with it
# PHASE=calibrate or PHASE=validate runs one half (PHASE=ops: per-operator timing of the CCONFIGS on the
# calibration trace, nothing fitted); CCONFIGS: config files to calibrate on (default: modes tangram,
# full, dynamic at H_p 4); FIT_ARGS: extra tangram-fit-engine options (--probe: record this machine's probe as the
# tables' reference_probe.json); OPS= (empty) times every operator in the engine runs. VTRACE: tangram-trace gen-sessions options of both traces (the seed is added:
# 1 for calibration, 0 for validation); POOL: the KV pool cap in GiB. The default recipe (6 sessions, first turns
# ~6K tokens, 1.3 GiB) binds memory for every mode, so the configs' predicted throughputs differ by 7-48% instead
# of the <1% of the first H100 validation's recipe (VTRACE="--sessions 4 --first 8000 --out-tokens 64" POOL=2.5), whose
# ranking noise decided Kendall's tau.
VTRACE=${VTRACE:---sessions 6 --first 6000 --out-tokens 48 --spread-s 1 --think-s 0.3}
POOL=${POOL:-1.3}
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# the package maps folders to tangram.* names; without an install, a sitecustomize adds the repo root to tangram's path
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
python3 -c "import tangram.sim, tangram.kernels, torch, triton, simpy; print('imports ok', torch.__version__, triton.__version__, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $OUT/device.txt
if [ "${PHASE:-both}" = ops ]; then
  # per-operator seconds (CUDA events, eager) next to the cost model's terms, per step of the calibration trace
  python3 -m tangram.traces.cli gen-sessions -o /tmp/ctrace.jsonl $VTRACE --seed 1
  timeout ${CLIMIT:-500} python3 -m tangram.sim.fit_engine /tmp/ctrace.jsonl --time-ops --weights random \
    --configs ${CCONFIGS:?PHASE=ops needs CCONFIGS} --kv-pool-gib $POOL --steps-csv $OUT/ops_steps.csv 2>&1 \
    | grep -v "it/s\]" | tee $OUT/ops.log
  exit 0
fi
if [ "${PHASE:-both}" != validate ]; then
  # calibration trace: seed 1 (the validation trace below is seed 0)
  python3 -m tangram.traces.cli gen-sessions -o /tmp/ctrace.jsonl $VTRACE --seed 1
  cp /tmp/ctrace.jsonl $OUT/calibration_trace.jsonl
  # CCONFIGS: config files to calibrate on (each its own H_p, alpha, chunk size, split map) instead of the three modes
  if [ -n "$CCONFIGS" ]; then RUNS="--configs $CCONFIGS"
  else RUNS="--modes tangram,full,dynamic --model llama-3.1-8b --rho 0.25 --alpha 2 --hp 4"; fi
  timeout ${CLIMIT:-500} python3 -m tangram.sim.fit_engine /tmp/ctrace.jsonl $RUNS --weights random \
    --kv-pool-gib $POOL --steps-csv $OUT/engine_steps.csv $FIT_ARGS 2>&1 | grep -v "it/s\]" | tee $OUT/calibrate.log
  cp sim/tables/h100/engine_overhead.json $OUT/
  [ -f sim/tables/h100/reference_probe.json ] && cp sim/tables/h100/reference_probe.json $OUT/
  [ "${PHASE:-both}" = calibrate ] && exit 0
fi
python3 -m tangram.traces.cli gen-sessions -o /tmp/vtrace.jsonl $VTRACE --seed 0
timeout ${VLIMIT:-540} python3 -m tangram.tuning.validate ${CONFIGS:-reports/validation/configs/*.json} \
  --trace /tmp/vtrace.jsonl --kv-pool-gib $POOL ${OPS---no-time-ops} --repeats ${REPEATS:-1} --out $OUT/v 2>&1 | grep -v "it/s\]" | tee $OUT/validate.log
cp /tmp/vtrace.jsonl $OUT/v/trace.jsonl
(cd $OUT && tar czf v.tgz v && rm -rf v)  # at most 8 files come back from a device call

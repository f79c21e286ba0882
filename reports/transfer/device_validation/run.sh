#!/bin/bash
# One device call (carry [".whl"]: simpy's wheel, as reports/validation/h100_calibrated_2026-11-23/run.sh): this machine's probe,
# then tangram-validate of the seven validation configs on reports/transfer/validation_trace.jsonl (KV pool
# 1.3 GiB), the engine measured once per config. The simulator side is priced twice: with the tables as they
# resolve for $GPU (on the H200: the H100 tables transferred by datasheet, i.e. the prediction committed in
# reports/transfer/h200_prediction) and with them rescaled by the probe (--probe).
#   GPU=h200 bash reports/transfer/device_validation/run.sh        on nvidia-h200, about 5 minutes
#   GPU=h100-80gb bash reports/transfer/device_validation/run.sh   on nvidia-h100-x1, about 5 minutes
# Files: $OUT/device.txt, validate.log, probe.json, v.tgz (tangram-validate's folder); the last line is JSON:
# per config the committed prediction, the in-run predictions (tables as resolved, rescaled by the probe), the
# measured throughput and the errors.
GPU=${GPU:-h100-80gb}
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/device.txt
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $OUT/device.txt
C="reports/validation/configs/*.json reports/tuning/study/best_config.json"
timeout ${VLIMIT:-500} python3 -m tangram.tuning.validate $C --trace reports/transfer/validation_trace.jsonl \
  --kv-pool-gib 1.3 --gpu $GPU --no-time-ops --repeats ${REPEATS:-1} --probe --out $OUT/v 2>&1 \
  | grep -v "it/s\]" | tee $OUT/validate.log
cp $OUT/v/probe.json $OUT/probe.json
OUT=$OUT GPU=$GPU python3 - <<'PY'
import json, os
import pandas as pd
out, fam = os.environ["OUT"], os.environ["GPU"].split("-")[0]
v = pd.read_csv(f"{out}/v/validation.csv").set_index("config")
committed = pd.read_csv(f"reports/transfer/{fam}_prediction/predicted.csv").set_index("config")["throughput_rps_pred"]
res = {}
for c, r in v.iterrows():
    m = r["throughput_rps_meas"]
    res[c] = {"committed_pred": round(committed.get(c, float("nan")), 4),
              "committed_err": round(committed.get(c, float("nan")) / m - 1, 4),
              "pred_tables": round(r["throughput_rps_pred_shipped"], 4), "pred_probe": round(r["throughput_rps_pred"], 4),
              "measured": round(m, 4), "err_probe": round(r["throughput_rps_relerr"], 4)}
print(json.dumps(res))
PY
(cd $OUT && tar czf v.tgz v && rm -rf v)

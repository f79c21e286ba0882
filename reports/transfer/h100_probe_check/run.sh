#!/bin/bash
# One device call (carry: the tree with .whl = simpy's wheel): tangram-probe twice on this GPU (the first with a
# cold Triton cache, the second warm) against the shipped H100 tables. Writes $OUT/probe1.json, probe2.json,
# probe*.log, device.txt; the last line is JSON: seconds, copy bandwidth and the scales each probe gives.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm,power.limit --format=csv | tee $OUT/device.txt
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $OUT/device.txt
for i in 1 2; do
  /usr/bin/time -f "wall %e s" python3 -m tangram.sim.probe --model ${MODEL:-llama-3.1-8b} --out $OUT/probe$i.json 2>&1 | tee $OUT/probe$i.log
done
python3 - <<'PY'
import json, os
from tangram.sim.probe import load_probe
from tangram.sim.tables import CostTables, tables_dir_for
from tangram.sim.transfer import rescale
t = CostTables.load(tables_dir_for("h100-80gb"))
out = {}
for i in (1, 2):
    p = load_probe(os.path.join(os.environ["OUT"], f"probe{i}.json"))
    r = rescale(t, p).provenance[-1]
    out[f"probe{i}"] = {"elapsed_s": round(p["elapsed_s"], 2), "phase_s": {k: round(v, 2) for k, v in p["phase_s"].items()},
                        "copy_gbps": round(p["copy"]["gbps"], 1), "skipped": p["skipped"], "label": r["label"]}
print(json.dumps(out))
PY

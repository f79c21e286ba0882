#!/bin/bash
# Throughput before/after on two trace recipes the tuned configuration was not chosen on (it was chosen by the
# simulator on traces/data/default.jsonl), one device call, both versions on the same machine:
#   R1 (whole GPU: the KV pool is what the 80 GB leave after the weights): 24 sessions x 2 turns, first prompts
#      15-25K tokens (ctx 20000 x U(0.75, 1.25)), later 256-768, outputs 48-144; full needs ~62 GB of KV for them;
#   R2 (capped 2.5 GiB pool, the engine recipe of the first H100 runs): 6 sessions x 3 turns, first prompts 9-15K.
# Modes tangram (reports/tuning/study/best_config.json), dynamic, full. Run from the branch's tree with the
# merge-base tree at BEFORE (default ../before) and the simpy wheel at WHL (default ../whl). AFTER_FLAGS: extra
# tangram-bench options for the branch's runs only (e.g. --async-steps).
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
BEFORE=${BEFORE:-$ROOT/../before}
WHL=${WHL:-$ROOT/../whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
mk() { mkdir -p $1; printf "import sys; sys.path.insert(0, '%s')\nimport tangram; tangram.__path__.append('%s')\n" $2 $2 > $1/sitecustomize.py; }
mk /tmp/site_after $ROOT
mk /tmp/site_before $BEFORE
T=$OUT/t
mkdir -p $T
PYTHONPATH=/tmp/site_after:/tmp/site python3 -m tangram.traces.cli gen-sessions -o $T/R1.jsonl --sessions 24 --turns 2 \
  --first 20000 --later 512 --out-tokens 96 --spread-s 3 --seed 17
PYTHONPATH=/tmp/site_after:/tmp/site python3 -m tangram.traces.cli gen-sessions -o $T/R2.jsonl --sessions 6 --turns 3 \
  --first 12000 --later 256 --out-tokens 96 --spread-s 4 --seed 23
cp reports/tuning/study/best_config.json $T/config.json
for tr in R1 R2; do
  POOL=""; [ $tr = R2 ] && POOL="--kv-pool-gib 2.5"
  for v in after before; do
    dir=$ROOT; [ $v = before ] && dir=$BEFORE
    (cd $dir && PYTHONPATH=/tmp/site_$v:/tmp/site timeout ${LIMIT:-150} python3 -m tangram.engine.bench $T/$tr.jsonl \
      --mode tangram,dynamic,full --config $T/config.json --model llama-3.1-8b --weights random $POOL --no-plots \
      $([ $v = after ] && echo "$AFTER_FLAGS") --out $T/${tr}_$v 2>&1 | grep -v "it/s\]" | tail -8)
  done
done
python3 - <<'PY'
import json, os
T = os.environ["OUT"] + "/t"
rows = []
for tr in ("R1", "R2"):
    for v in ("before", "after"):
        p = f"{T}/{tr}_{v}/metrics.json"
        if not os.path.exists(p):
            print(tr, v, "missing"); continue
        m = json.load(open(p))
        t = {k: m[k]["throughput_rps"] for k in m}
        print(f"{tr} {v}: " + ", ".join(f"{k} {x:.4f} req/s" for k, x in t.items()) +
              f"; tangram/full {t['tangram'] / t['full']:.2f}x, tangram/dynamic {t['tangram'] / t['dynamic']:.2f}x"
              + "; steps " + ", ".join(f"{k} {m[k]['steps']}" for k in m))
PY
cd $OUT && tar czf throughput_call.tgz t && rm -rf t

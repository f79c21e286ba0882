#!/bin/bash
# A/B on the H100 (one device call, carry .whl): tangram mode on the issue-5 trace under three code variants, to
# find what moved the engine's step time between two sessions.
#   A: this checkout (do_not_specialize on varying kernel ints, no empty_cache after warm-up)
#   B: A with plain @triton.jit (every int specialised, as before)
#   C: B plus torch.cuda.empty_cache() after warm-up (the code of reports/engine/h100 as first measured)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "import sys; sys.path.insert(0, '$PWD')
import tangram; tangram.__path__.append('$PWD')" > /tmp/site/sitecustomize.py
python3 reports/engine/make_trace.py /tmp/trace.jsonl --sessions 6 --first 12000 --out-tokens 96
run() {
  timeout ${LIMIT:-120} python3 -m tangram.engine.bench /tmp/trace.jsonl --mode ${MODE:-tangram} --model llama-3.1-8b \
    --weights random --rho 0.25 --alpha 2 --hp 4 --kv-pool-gib 2.5 --no-plots --out $OUT/$1 2>&1 | grep -v "it/s\]" | grep -E "^(tangram|full|dynamic|br)" | tee $OUT/$1.log
}
run A
python3 - <<'PY'
import re
for f in ("kernels/decode.py", "kernels/prefill.py"):
    s = open(f).read()
    s = re.sub(r"@triton\.jit\(do_not_specialize=\[[^\]]*\]\)", "@triton.jit", s, flags=re.S)
    open(f, "w").write(s)
PY
grep -c "do_not_specialize" kernels/decode.py kernels/prefill.py
run B
python3 - <<'PY'
f = "tangram/engine/bench.py"
s = open(f).read()
old = "        del wx, ws  # the caching allocator keeps their blocks, so the measured run does not cudaMalloc them again\n"
assert old in s
s = s.replace(old, "        del wx, ws\n        if device.type == 'cuda':\n            torch.cuda.empty_cache()\n")
open(f, "w").write(s)
PY
run C

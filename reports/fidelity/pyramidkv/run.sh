#!/usr/bin/env bash
# PyramidKV's rows re-measured after the evaluation was fixed to follow its layer schedule (see ../README.md):
# the same samples, lengths and arguments as ../run.sh, PyramidKV only (per-layer and uniform scopes).
set -euo pipefail
cd "$(dirname "$0")/../../.."
uptime
nice -n 10 tangram-accuracy \
  --tasks passkey=512,niah_single=1024,niah_multikey=768,vt=1024,mt_niah=512 --curve '' \
  --scorers pyramidkv --scopes per-layer,uniform \
  --samples 100 --kl-samples 100 --rhos 0.75,0.5,0.25,0.1 --alphas 2 --workers 2 --threads 1 \
  --table reports/fidelity/pyramidkv/accuracy_table.json -o reports/fidelity/pyramidkv "$@"
uptime

#!/usr/bin/env bash
# Task accuracy and KL of every serving mode on SmolLM2-135M (CPU), with 95% CIs; writes this folder's report.md,
# PNGs, results.json, comparisons.json, profiles/ (profiles the profile folders lacked) and the shipped accuracy table.
# Task lengths are chosen by the curve (calib split; tangram.profiles.accuracy_report.choose_length). Scorers and
# scopes default to every registered one; a rerun of the same configuration resumes from partial.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
uptime
nice -n 10 tangram-accuracy \
  --samples 100 --kl-samples 100 --curve 256,512,768,1024 --curve-samples 100 \
  --rhos 0.75,0.5,0.25,0.1 --alphas 2 --workers 2 --threads 1 \
  --table tangram/profiles/data/accuracy_smollm2-135m.json -o reports/fidelity "$@"
uptime

#!/usr/bin/env bash
# Regenerates every number in reports/tp/README.md (CPU only; about a minute on the 2-core dev machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=reports/tp
# 1. head placement: per-rank pages and decode reads, contiguous vs balanced, one 32K-token request
python -m tangram.placement --model llama-3.1-8b --tp 2 4 --hp 1 > $out/placement_llama-3.1-8b_hp1.txt
python -m tangram.placement --model llama-3.1-8b --tp 2 --hp 2 > $out/placement_llama-3.1-8b_hp2.txt
python -m tangram.placement --model llama-3.1-70b --tp 2 4 8 --hp 1 > $out/placement_llama-3.1-70b_hp1.txt
python -m tangram.placement --model smollm2-135m --tp 3 --hp 1 \
  --profile tangram/profiles/data/smollm2-135m_ada-snapkv_per-layer_rho0.25.npz > $out/placement_smollm2-135m.txt
# 2. simulator: the bundled default trace, tangram mode, H_p = 2, one H100 vs a TP-2 replica (ring-model all-reduce)
for cfg in "1 balanced" "2 contiguous" "2 balanced"; do
  set -- $cfg
  python -m tangram.sim.cli --mode tangram --hp 2 --tp "$1" --placement "$2" --no-plots \
    --out "/tmp/tangram-tp-sim-$1-$2" > "$out/sim_tp$1_$2.txt" 2>/dev/null
  cp "/tmp/tangram-tp-sim-$1-$2/metrics.json" "$out/sim_tp$1_$2.json"
done

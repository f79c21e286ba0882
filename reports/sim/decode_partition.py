"""Decode attention per step as the cost model prices it: AOT split map vs FlashDecoding's static split vs a
per-layer runtime plan, on lengths that follow the (synthetic, skewed) budgets of Llama-3.1-8B at rho = 0.25.

Run: ``python reports/sim/decode_partition.py > reports/sim/decode_partition.json``.
Also shows how the static/AOT ratio depends on the one assumed constant that governs stragglers
(``CostParams.cta_peak_bytes_per_s``, a lone CTA's streaming rate).
"""
import json
from pathlib import Path

import numpy as np

from tangram.budgets import synthetic_profile
from tangram.config import EngineConfig, get_gpu, get_model
from tangram.paging import KVLayout
from tangram.sim.costmodel import CostModel, CostParams

M, G = get_model("llama-3.1-8b"), get_gpu("h100-80gb")
CAL = Path(__file__).resolve().parent / "calibration_h100"  # pinned tables (see its README.md)
prof = synthetic_profile(M.num_layers, M.num_kv_heads, 0.25, model=M.name)
rows = []
for cap in ("table", 16e9, CostParams().cta_peak_bytes_per_s, 64e9):
    P = CostParams(cta_peak_bytes_per_s=cap if cap != "table" else CostParams().cta_peak_bytes_per_s)

    def cm(part):
        e = EngineConfig(mode="tangram", decode_partition=part)
        return CostModel(M, G, e, KVLayout.build(M, e, prof.B), prof, params=P,
                         calibration=CAL if cap == "table" else None)

    models = {p: cm(p) for p in ("aot", "static", "runtime")}
    B = models["aot"].layout.to_slots(prof.B)
    for batch in (1, 4, 16, 64):
        for ctx in (8192, 32768):
            lens = np.ceil(B[None] * ctx).astype(np.int64).repeat(batch, axis=0)
            t = {p: m._decode_attention(lens) for p, m in models.items()}
            src = "table fit" if cap == "table" else "roofline"
            rows.append({"source": src, "cta_peak_gbps": round(models["aot"].cta_bw / 1e9, 2), "batch": batch,
                         "context": ctx, "n_cta": models["aot"].n_cta,
                         "aot_ms": round(t["aot"][0] * 1e3, 4), "static_ms": round(t["static"][0] * 1e3, 4),
                         "runtime_kernel_ms": round(t["runtime"][0] * 1e3, 4),
                         "runtime_plan_ms": round(t["runtime"][1] * 1e3, 4),
                         "static_over_aot": round(t["static"][0] / t["aot"][0], 3),
                         "runtime_over_aot": round(sum(t["runtime"]) / t["aot"][0], 3)})
print(json.dumps({"command": "python reports/sim/decode_partition.py", "model": M.name, "gpu": G.name,
                  "decode_source_table": CostModel(M, G, EngineConfig(mode="tangram"),
                                                   KVLayout.build(M, EngineConfig(mode="tangram"), prof.B),
                                                   prof, calibration=CAL).sources["decode_attention"],
                  "rho": 0.25, "profile": "synthetic seed 0", "rows": rows}, indent=1))

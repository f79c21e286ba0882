"""``python -m tangram.kernels.bench.ab AFTER_DIR [BEFORE_DIR]``: the acceptance lines of two kernel-bench runs of
one device call side by side (AOT vs static at every decode point; compression vs attention at 512-token chunks),
last line JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def prefill_summary(path: Path) -> list[dict] | None:
    """Per (model, chunk, cached): attention, what compression adds, and its share of the attention."""
    import pandas as pd

    if not Path(path).exists():
        return None
    df = pd.read_csv(path)
    if df.empty:
        return None
    cols = [c for c in ("model", "chunk", "cached", "attention_ms", "compression_ms", "compress_vs_attention",
                        "fused_ms", "unfused_ms", "copy_ms", "launches_fused", "launches_unfused", "launches_copy")
            if c in df.columns]
    return [{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}
            for r in df[cols].to_dict("records")]


def main(argv=None) -> int:
    from tangram.kernels.bench import aot_vs_static

    args = sys.argv[1:] if argv is None else argv
    out = {}
    for name, d in zip(("after", "before"), args):
        d = Path(d)
        out[name] = {"aot_vs_static": aot_vs_static(d / "decode_attention.csv"),
                     "aot_vs_static_total": aot_vs_static(d / "decode_attention.csv", "total_ms"),
                     "prefill": prefill_summary(d / "prefill_attention.csv")}
        p = out[name]["prefill"] or []
        for r in p:
            if r.get("chunk") == 512:
                print(f"{name} prefill {r['model']} c=512 cached={r['cached']}: attention "
                      f"{r['attention_ms'] * 1e3:.1f} us, compression {r['compression_ms'] * 1e3:.1f} us = "
                      f"{r['compress_vs_attention']:.0%}")
        a = out[name]["aot_vs_static"] or {}
        print(f"{name} decode: AOT/static min {a.get('min_best_hp')} (best H_p), {a.get('min_any_hp')} (any H_p), "
              f"{a.get('below_0.98_best_hp')} of {a.get('points')} points below 0.98, baseline {a.get('baseline')}")
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

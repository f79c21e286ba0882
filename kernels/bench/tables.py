"""CSV tables of the kernel benchmark: one row per measurement, flushed as soon as it is measured (a run cut
short still leaves complete files); the column sets are the simulator's cost-table formats."""
from __future__ import annotations

import csv
from pathlib import Path


class Table:
    def __init__(self, path: Path, fields: list[str], common: dict):
        self.path, self.fields, self.common = path, fields, common
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=list(common) + fields, extrasaction="raise")
        self.w.writeheader()
        self.n = 0

    def add(self, **row):
        self.w.writerow({**self.common, **{k: row.get(k, "") for k in self.fields}})
        self.f.flush()
        self.n += 1


DECODE_FIELDS = ["kernel", "impl", "dtype", "model", "batch", "num_q_heads", "num_kv_heads", "head_dim", "page_size",
                 "heads_per_group", "rho", "profile_seed", "context", "n_calls", "kv_tokens", "bytes", "median_ms",
                 "p20_ms", "p80_ms", "plan_ms", "total_ms", "n_cta", "ctas_launched", "max_splits", "waves",
                 "achieved_gbps", "timer"]
PREFILL_FIELDS = ["model", "dtype", "mode", "heads_per_group", "rho", "chunk", "cached", "cached_tokens",
                  "kept_tokens", "attention_ms", "score_ms", "select_ms", "scatter_ms", "total_ms",
                  "select_dynamic_ms", "attn_tflops", "compression_ms", "compress_vs_attention", "per_chunk_path_ms",
                  "timer", "copy_ms", "fused_ms", "unfused_ms", "fused_vs_attention", "unfused_vs_attention",
                  "attn_copy_ms", "launches_copy", "launches_fused", "launches_unfused"]
GEMM_FIELDS = ["model", "dtype", "op", "tokens", "m", "n", "k", "median_ms", "p20_ms", "p80_ms", "tflops"]
ELEM_FIELDS = ["model", "dtype", "op", "impl", "tokens", "hidden", "median_ms", "p20_ms", "p80_ms", "gbps"]



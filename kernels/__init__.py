"""tangram.kernels: Triton decode/prefill kernels for ragged and monolithic paged KV, with float64 references.

Public API (see docs/kernels.md): :func:`paged_decode` (AOT split map),
:func:`static_split_decode` (baseline a), :func:`runtime_plan_decode` with
:func:`runtime_plan_schedules` (baseline b), :func:`decode_n_cta`, :func:`prefill_compress` and its stages,
the batched compression path (:mod:`tangram.kernels.compress`) and the fused element-wise kernels of the layer
loop (:mod:`tangram.kernels.fused`). The AOT split table is the engine's
(:class:`tangram.engine.split_table.AotSplitTable`). Everything
imports on a CPU-only machine; CPU tensors run the Triton interpreter under
``TRITON_INTERPRET=1`` and the float64 references otherwise (or inside
:func:`cpu_reference`, which engine-level tests use to keep whole-model runs fast).
"""
from tangram.kernels._triton import cpu_reference  # noqa: F401
from tangram.kernels.decode import (  # noqa: F401
    DecodeConfig, DeviceLimits, KernelResources, LayerSchedule, aot_n_cta,
    decode_n_cta, kernel_resources, launch_decode, monolithic_layer_view, occupancy_blocks_per_sm, paged_decode,
    runtime_plan_decode, runtime_plan_schedules, schedule_from_split_map, static_split_decode,
    static_split_num_splits,
)
from tangram.kernels.compress import (  # noqa: F401
    global_keep_counts, pool_scores, prefill_attention_varlen, score_width, select_scatter, snapkv_compress,
    snapkv_compress_layers, snapkv_scores_varlen,
)
from tangram.kernels.fused import add_rms_norm, rms_norm, rope_qkv, silu_mul  # noqa: F401
from tangram.kernels.prefill import (  # noqa: F401
    PrefillResult, keep_budget, prefill_attention, prefill_compress, scatter_kept, select_keep, snapkv_scores,
)

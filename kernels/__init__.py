"""tangram.kernels: Triton decode/prefill kernels for ragged and monolithic paged KV, with float64 references.

Public API (see docs/kernels.md): :func:`paged_decode` (AOT split map),
:func:`static_split_decode` (baseline a), :func:`runtime_plan_decode` with
:func:`runtime_plan_schedules` (baseline b), :class:`AotSplitTable`,
:func:`decode_n_cta`, :func:`prefill_compress` and its stages. Everything
imports on a CPU-only machine; CPU tensors run the Triton interpreter under
``TRITON_INTERPRET=1`` and the float64 references otherwise (or inside
:func:`cpu_reference`, which engine-level tests use to keep whole-model runs fast).
"""
from tangram.kernels._triton import cpu_reference  # noqa: F401
from tangram.kernels.decode import (  # noqa: F401
    AotSplitTable, DecodeConfig, DeviceLimits, KernelResources, LayerSchedule, aot_n_cta,
    decode_n_cta, kernel_resources, launch_decode, monolithic_layer_view, occupancy_blocks_per_sm, paged_decode,
    runtime_plan_decode, runtime_plan_schedules, schedule_from_split_map, static_split_decode,
    static_split_num_splits,
)
from tangram.kernels.prefill import (  # noqa: F401
    PrefillResult, keep_budget, prefill_attention, prefill_compress, scatter_kept, select_keep, snapkv_scores,
)

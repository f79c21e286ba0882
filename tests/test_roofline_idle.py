"""The roofline report's idle attribution: each gap inside a replayed step is charged to the kernel after it."""
from __future__ import annotations

import pytest

from tangram.engine.roofline import categorize, idle_before


def test_gaps_are_charged_to_the_kernel_that_waited():
    # a [0, 10), b [12, 20) overlaps c [15, 30), d [31, 40), e [45, 50): gaps 2 (b), 0 (c), 1 (d), 5 (e)
    starts = [0, 12, 15, 31, 45]
    ends = [10, 20, 30, 40, 50]
    got = idle_before(starts, ends, ["gemm", "norm", "gemm", "decode_attention", "norm"])
    assert got == pytest.approx({"norm": 2 + 5, "gemm": 0.0, "decode_attention": 1.0})
    # the step's idle (span minus the union of kernels) is the sum of the charged gaps
    assert sum(got.values()) == pytest.approx((50 - 0) - (10 + (30 - 12) + 9 + 5))


def test_a_kernel_inside_an_earlier_one_leaves_no_gap():
    # b [2, 4) runs inside a [0, 10); c starts at 12: its gap is from a's end (10), not b's (4)
    assert idle_before([0, 2, 12], [10, 4, 13], ["x", "y", "z"]) == pytest.approx({"y": 0.0, "z": 2.0})
    assert idle_before([5], [6], ["x"]) == {}


def test_kernel_names_map_to_the_report_categories():
    assert categorize("_decode_split_kernel") == "decode_attention"
    assert categorize("_decode_merge_kernel") == "decode_merge"
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert categorize("_silu_mul_kernel") == "activation"
    assert categorize("something_new") == "other"


def test_bare_configs_take_the_head_group_size_every_tool_defaults_to():
    """`--config tangram` on SmolLM2 (3 KV heads) was `H_p=4 must divide ... H=3`: bare names take the default
    rule (4, or the largest divisor below it of the model's KV heads), a file's heads_per_group still wins."""
    import types

    from tangram.config import get_model
    from tangram.engine.roofline import build_config

    args = types.SimpleNamespace(batches=[2], seed=0)
    assert build_config("tangram", None, get_model("smollm2-135m"), args)[0].heads_per_group == 3
    assert build_config("paper", None, get_model("llama-3.1-8b"), args)[0].heads_per_group == 4
    assert build_config("full", None, get_model("llama-3.1-8b"), args)[0].mode == "full"


def test_mixed_chunks_and_host_profile_options_parse():
    from tangram.engine.roofline import _parser

    a = _parser().parse_args(["--out", "x", "--mixed-chunks", "512,2048", "--host-profile", "2",
                              "--decode-order", "lpt"])
    assert a.mixed_chunks == "512,2048" and a.host_profile == 2 and a.decode_order == "lpt"

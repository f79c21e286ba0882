import numpy as np
import pytest

from tangram.budgets import head_groups
from tangram.errors import ConfigError
from tangram.planner import aot_split_map, flashdecoding_num_splits, runtime_plan

# Primer's worked example: budgets (tokens) per layer x head, H_p = 2, adjacent groups.
B = np.array([[3, 1, 2, 4], [5, 2, 1, 3]]) / 10
ADJ = head_groups(B, 2, clustered=False)


def test_algorithm1_ncta2():
    # round rule: layer 0 tau = 1/2, Phi = [.4, .6] -> 0.8, 1.2 -> [1, 1]; layer 1 tau = .55 -> 1.27, .73 -> [1, 1]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 2, "round"), [[1, 1], [1, 1]])
    # primer's ceil variant: [[1, 2], [2, 1]]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 2, "ceil"), [[1, 2], [2, 1]])


def test_algorithm1_ncta8():
    # layer 0: tau = 1.0/8 -> shares 3.2, 4.8 -> [3, 5]; layer 1: tau = 1.1/8 -> 5.09, 2.91 -> [5, 3]
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 8, "round"), [[3, 5], [5, 3]])
    np.testing.assert_array_equal(aot_split_map(B, ADJ, 2, 8, "ceil"), [[4, 5], [6, 3]])


def test_algorithm1_round_half_up_and_zero_layer():
    b = np.array([[0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0]])
    # share of each group = 2 * 0.5 / ... : N_CTA = 3 -> shares 1.5, 1.5 -> both round up to 2
    np.testing.assert_array_equal(aot_split_map(b, head_groups(b, 2, False), 2, 3), [[2, 2], [1, 1]])
    with pytest.raises(ConfigError):
        aot_split_map(b, head_groups(b, 2, False), 2, 0)


def test_flashdecoding_heuristic():
    assert flashdecoding_num_splits(128, 132, 512) == 1  # enough (batch x heads) to fill the GPU
    s = flashdecoding_num_splits(8, 132, 2048)
    assert 1 < s <= 128
    # wave efficiency of the chosen split is within 85% of the best
    waves = 8 * s / 132
    assert waves / np.ceil(waves) >= 0.85 * max((8 * k / 132) / np.ceil(8 * k / 132) for k in range(1, 129))


def test_runtime_plan_fits_ncta_and_counts_host_work():
    rng = np.random.default_rng()
    lens = rng.integers(1, 5000, size=(4, 3, 8))
    plan = runtime_plan(lens, n_cta=264)
    assert len(plan.splits) == 3 and plan.host_items > 3 * 32
    for l in range(3):
        assert plan.splits[l].sum() <= 264 or plan.chunk_tokens[l] == lens[:, l].max()
        assert np.all(plan.splits[l] * plan.chunk_tokens[l] >= lens[:, l])


def test_algorithm1_rejects_hp_not_dividing_h():
    with pytest.raises(ConfigError, match="must divide"):
        aot_split_map(np.full((2, 8), 0.3), np.tile(np.arange(8), (2, 1)), 3, 16)

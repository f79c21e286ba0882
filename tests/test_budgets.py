import numpy as np
import pytest

from tangram.budgets import (BudgetProfile, budget_ratios, calibrate, group_budgets, head_groups,
                             synthetic_profile)
from tangram.config import EngineConfig, get_model
from tangram.errors import ConfigError, InputError
from tangram.paging import KVLayout


def test_eq5_worked_example_and_clamp():
    # Primer's example (token budgets out of N = 8 -> ratios): B = min(1, mu + 1.5 sigma)
    mu = np.array([[4, 2], [3, 1]]) / 8
    sigma = np.array([[1, 0.5], [0.8, 0.2]]) / 8
    B = budget_ratios(mu, sigma, 1.5)
    np.testing.assert_allclose(B * 8, [[5.5, 2.75], [4.2, 1.3]])
    # clamp: 0.9 + 2 * 0.1 = 1.1 -> 1
    assert budget_ratios(np.array([[0.9]]), np.array([[0.1]]), 2.0)[0, 0] == 1.0


def test_calibrate_mean_std_ddof1():
    rng = np.random.default_rng()
    samples = rng.uniform(0.05, 0.6, size=(50, 3, 4))
    p = calibrate(samples, alpha=2.0, rho=0.3, method="m", model="x")
    np.testing.assert_allclose(p.mu, samples.mean(0))
    np.testing.assert_allclose(p.sigma, samples.std(0, ddof=1))
    np.testing.assert_allclose(p.B, np.minimum(1, samples.mean(0) + 2 * samples.std(0, ddof=1)))
    assert p.n_samples == 50
    with pytest.raises(ConfigError):
        calibrate(samples[0], alpha=2.0)
    with pytest.raises(ConfigError):
        calibrate(samples + 1.0, alpha=2.0)


def test_clustering_vs_adjacent_worked_example():
    # 8 heads, budgets x10 = [5, 1, 9, 6, 2, 10, 5, 7], H_p = 2, one chunk of 10 tokens, P = 1.
    B = np.array([[5, 1, 9, 6, 2, 10, 5, 7]]) / 10
    adj = head_groups(B, 2, clustered=False)
    clu = head_groups(B, 2, clustered=True)
    # adjacent groups (5,1) (9,6) (2,10) (5,7): maxes 5, 9, 10, 7 -> 31 tokens x 2 heads = 62 slots
    np.testing.assert_allclose(group_budgets(B, adj, 2) * 10, [[5, 9, 10, 7]])
    # clustered sorted 1 2 | 5 5 | 6 7 | 9 10: maxes 2, 5, 7, 10 -> 24 x 2 = 48 slots
    np.testing.assert_allclose(group_budgets(B, clu, 2) * 10, [[2, 5, 7, 10]])
    model = get_model("llama-3.1-8b")
    import dataclasses
    m = dataclasses.replace(model, num_layers=1, num_kv_heads=8, num_q_heads=8)
    for clustered, slots in [(False, 62), (True, 48)]:
        lay = KVLayout.build(m, EngineConfig(mode="tangram", heads_per_group=2, page_size=1, clustering=clustered), B)
        head_lens = np.ceil(lay.to_slots(B) * 10 - 1e-9).astype(int)[None]
        tl = lay.table_lens(head_lens)
        assert int(tl.sum()) * 2 == slots
        assert int(head_lens.sum()) == 45  # live tokens
    mono = KVLayout.build(m, EngineConfig(mode="br", page_size=1), B)
    assert int(mono.table_lens(np.ceil(B * 10 - 1e-9).astype(int)[None]).sum()) * 8 == 80


def test_hp_must_divide_h():
    B = np.full((2, 8), 0.5)
    with pytest.raises(ConfigError, match="must divide"):
        head_groups(B, 3)


def test_profile_roundtrip(tmp_path):
    p = synthetic_profile(4, 8, 0.25, seed=3, model="llama-3.1-8b")
    assert p.synthetic and p.provenance["seed"] == 3
    assert np.all((p.B > 0) & (p.B <= 1))
    # layer means of mu track rho
    np.testing.assert_allclose(p.mu.mean(1), 0.25, atol=0.03)
    for suffix in (".npz", ".json"):
        f = p.save(tmp_path / f"prof{suffix}")
        q = BudgetProfile.load(f)
        np.testing.assert_allclose(q.B, p.B)
        assert q.provenance == p.provenance and q.method == "synthetic" and q.n_samples == p.n_samples
    with pytest.raises(ConfigError, match="does not match"):
        p.check_model(32, 8, "llama-3.1-8b")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a profile")
    with pytest.raises(InputError):
        BudgetProfile.load(bad)


def test_sample_retention_layer_mean():
    p = synthetic_profile(3, 8, 0.3, seed=1)
    r = p.sample_retention(np.random.default_rng(), 20)
    assert r.shape == (20, 3, 8)
    assert np.all((r > 0) & (r <= 1))
    np.testing.assert_allclose(r.mean(-1), 0.3, atol=1e-3)

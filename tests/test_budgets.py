import numpy as np
import pytest

from tangram.budgets import (BudgetProfile, budget_ratios, calibrate, group_budgets, head_groups,
                             synthetic_profile)
from tangram.config import EngineConfig, get_gpu, get_model
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


# ------------------------------------------------------------------ budget scopes in profiles and the stack


def _layered_profile(scope="cross-layer", rho=0.38):
    """A profile whose per-layer means differ strongly (what a cross-layer threshold produces)."""
    rng = np.random.default_rng(7)
    layer = np.array([0.9, 0.5, 0.1, 0.02])[:, None]
    mu = np.clip(layer * rng.uniform(0.6, 1.4, size=(4, 8)), 0.005, 1.0)
    sigma = 0.1 * mu * (1 - mu)
    return BudgetProfile(mu, sigma, 2.0, rho, "keydiff", "llama-3.1-8b", {"scope": scope}, 50, scope)


def test_profile_scope_roundtrip_and_old_files(tmp_path):
    p = _layered_profile()
    for suffix in (".npz", ".json"):
        q = BudgetProfile.load(p.save(tmp_path / f"x{suffix}"))
        assert q.scope == "cross-layer" and q.method == "keydiff"
    # files written before scopes existed were per-layer
    import json
    f = tmp_path / "old.json"
    meta = json.loads(p.save(f).read_text())
    meta.pop("scope")
    f.write_text(json.dumps(meta))
    assert BudgetProfile.load(f).scope == "per-layer"
    with pytest.raises(ConfigError, match="unknown budget scope"):
        BudgetProfile(p.mu, p.sigma, 2.0, 0.3, "keydiff", "m", scope="global")


def test_draws_keep_what_the_scope_fixes():
    from tangram.budgets import pyramid_ratios, uniform_profile
    rng = np.random.default_rng()
    cross = _layered_profile()
    r = cross.sample_retention(rng, 40)
    np.testing.assert_allclose(r.reshape(40, -1).mean(-1), cross.rho, atol=1e-4)  # the total keeps rho
    lm = r.mean(axis=(0, 2))
    # layers keep their own, very different, shares (those calibrated), not rho each
    np.testing.assert_allclose(lm, cross.mu.mean(1), rtol=0.1)
    assert lm[0] > 0.7 and lm[3] < 0.05
    per = BudgetProfile(cross.mu, cross.sigma, 2.0, 0.3, "keydiff", "m", scope="per-layer")
    np.testing.assert_allclose(per.sample_retention(rng, 10).mean(-1), 0.3, atol=1e-4)
    pyr = BudgetProfile(cross.mu, cross.sigma, 2.0, 0.3, "pyramidkv", "m", scope="per-layer")
    np.testing.assert_allclose(pyr.sample_retention(rng, 10).mean(-1), np.broadcast_to(pyramid_ratios(4, 0.3),
                                                                                       (10, 4)), atol=1e-4)
    u = uniform_profile(4, 8, 0.3, "pyramidkv")
    np.testing.assert_allclose(u.B, np.repeat(pyramid_ratios(4, 0.3)[:, None], 8, 1))
    assert u.scope == "uniform" and np.allclose(u.with_alpha(5.0).B, u.B)


def test_cross_layer_profile_through_reservation_split_maps_and_simulator():
    """Budgets that differ per layer: the scheduler reserves exactly sum over (layer, group) of the group's
    longest head at ceil(B*C) per chunk, Algorithm 1 balances each layer on its own, and the simulator serves a
    trace with it in tangram and dynamic modes without leaking a page."""
    import dataclasses

    from tangram.planner import aot_split_map
    from tangram.scheduler import Scheduler
    from tangram.sim.run import simulate
    from tangram.spec import DeploymentSpec
    from tangram.traces.format import Trace, Turn

    prof = _layered_profile()
    model = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=4)
    eng = EngineConfig(mode="tangram", heads_per_group=2, page_size=16, chunk_size=256, alpha=2.0)
    sched = Scheduler(model, eng, prof, num_pages=4000)
    B = prof.B
    prompt = 700
    keep = 2 * np.ceil(B * 256 - 1e-9) + np.ceil(B * (prompt - 512) - 1e-9)  # two full chunks + the rest
    perm = np.argsort(B, axis=1, kind="stable")  # clustered groups: heads sorted by budget, 2 per group
    glen = np.take_along_axis(keep, perm, 1).reshape(4, 4, 2).max(-1)
    want = int(np.ceil(glen / 16).sum())
    assert sched.footprint_pages(prompt, 0) == want
    sched.add_request(0, "s", prompt, 3)
    sched.schedule()
    assert sched.pool.n_used == want  # the whole post-compression prefill reserved at admission
    S = aot_split_map(B, perm, 2, n_cta=64)
    phi = np.take_along_axis(B, perm, 1).reshape(4, 4, 2).sum(-1)
    for l in range(4):  # each layer splits its own N_CTA in proportion to its groups, whatever its mean
        assert abs(int(S[l].sum()) - 64) <= 4
        np.testing.assert_allclose(S[l], np.maximum(1, np.floor(phi[l] / phi[l].sum() * 64 + 0.5)))
    turns = []
    for s in range(4):
        turns += [Turn(f"s{s}:0", f"s{s}", 0, 0.01 * s, 0.0, 900 + 37 * s, 20),
                  Turn(f"s{s}:1", f"s{s}", 1, None, 0.05, 120, 20)]
    for mode in ("tangram", "dynamic"):
        spec = DeploymentSpec(model, get_gpu("h100"), eng.with_(mode=mode, kv_pool_bytes=2 * 2**30), prof, tables=None)
        summ, res = simulate(Trace(turns), spec)
        assert summ["completed"] == 8 and summ["rejected"] == 0
        sch = res.schedulers[0]
        assert sch.pool.n_used == 0 and sch.stats.pages_allocated == sch.stats.pages_freed + sch.stats.pages_reclaimed


def test_default_profile_registry(tmp_path):
    from tangram.profiles.registry import (default_profile, default_profile_path, profile_filename, shipped_profiles,
                                           summary_table)
    p = _layered_profile()
    p.save(tmp_path / profile_filename("llama-3.1-8b", "keydiff", "cross-layer", 0.38))
    (tmp_path / "notes.npz").write_bytes(b"")  # not the registry's pattern: ignored
    assert [s.rho for s in shipped_profiles(tmp_path)] == [0.38]
    assert default_profile_path("llama-3.1-8b", "keydiff", "cross-layer", 0.38, tmp_path).name == \
        "llama-3.1-8b_keydiff_cross-layer_rho0.38.npz"
    assert default_profile_path("llama-3.1-8b", "keydiff", "per-layer", 0.38, tmp_path) is None
    assert default_profile_path("llama-3.1-8b", "keydiff", "cross-layer", 0.4, tmp_path) is None
    table = summary_table(tmp_path).splitlines()
    assert len(table) == 3 and "| keydiff | cross-layer | 0.38 |" in table[2]
    prof, label = default_profile(get_model("llama-3.1-8b"), 0.25, 2.0, 3)
    assert prof.synthetic and "synthetic" in label and "seed 3" in label
    prof, label = default_profile(get_model("llama-3.1-8b"), 0.25, 2.0, 3, "ada-snapkv", "uniform")
    assert prof.scope == "uniform" and np.allclose(prof.B, 0.25) and "uniform" in label


def test_rescale_to_a_mean_is_exact():
    """The closed form against a root-finder per row: mean of min(1, s r) = rho, random rows and targets, with rows
    whose largest ratios saturate and rho = 1 (every head kept whole)."""
    from scipy.optimize import brentq

    from tangram.budgets import _rescale_layer_mean
    rng = np.random.default_rng()
    for _ in range(20):
        n, H = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        r = np.clip(rng.uniform(0, 1, (n, H)) ** rng.uniform(0.5, 4), 1e-3, 1.0)
        rho = rng.uniform(0.01, 1.0, (n, 1))
        rho[0] = 1.0 if rng.random() < 0.3 else rho[0]
        out = _rescale_layer_mean(r, rho)
        assert out.shape == r.shape and np.all((out > 0) & (out <= 1))
        for i in range(n):
            f = lambda s, i=i: np.minimum(1.0, r[i] * s).mean() - rho[i, 0]
            s = brentq(f, 0.0, 2.0 / r[i].min(), xtol=1e-15, rtol=1e-15) if rho[i, 0] < 1 else 1.0 / r[i].min()
            np.testing.assert_allclose(out[i], np.clip(np.minimum(1.0, r[i] * s), 1e-4, 1.0), rtol=1e-9, atol=1e-12)
            if (r[i] * s >= 1e-4).all():  # (the floor of 1e-4 raises the mean of rows scaled below it)
                np.testing.assert_allclose(out[i].mean(), rho[i, 0], rtol=1e-12)

"""tangram-tune: fidelity cost, search space, best-config round trip through tangram-sim, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.budgets import budget_ratios, synthetic_profile
from tangram.config import EngineConfig, get_model
from tangram.traces import generate, save_trace
from tangram.tuning.objective import OVERFLOW_TOL, Fidelity
from tangram.tuning.space import SearchSpace, paper_default_params


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    save_trace(generate(4, "short", seed=3, turns="uniform:1:2", output_tokens="lognormal:32:0.5:8:64"), p)
    return p


def test_fidelity_matches_direct_count_and_decreases_with_alpha():
    prof = synthetic_profile(4, 8, 0.25, seed=int(np.random.default_rng().integers(1 << 30)))
    fid = Fidelity(prof, n=64, seed=5)
    alpha = 1.3
    B = budget_ratios(prof.mu, prof.sigma, alpha)
    r = fid.r
    # direct float64 loop-free reference written differently: per-draw sums; a draw counts as an overflow only past
    # the budget by more than OVERFLOW_TOL (draws rescaled onto a budget sit on it to ~1e-6: tuning/objective.py).
    # Without the tolerance the reference disagreed on 21 of 400 profile seeds (a draw within 1e-5 above B).
    want = sum(float(r[i][r[i] > B + OVERFLOW_TOL].sum()) for i in range(r.shape[0])) / float(r.sum())
    got = fid(alpha)
    assert got["overflow"] == pytest.approx(want, rel=1e-12)
    # the tolerance itself: a draw just above its budget is not an overflow, one past the tolerance is
    fid.r = np.broadcast_to(B, (2,) + B.shape).copy()
    fid.r[0, 0, 0] = B[0, 0] + OVERFLOW_TOL / 2
    fid.r[1, 0, 0] = B[0, 0] + 2 * OVERFLOW_TOL
    fid.total = float(fid.r.sum())
    assert fid(alpha)["overflow"] == pytest.approx(fid.r[1, 0, 0] / fid.total, rel=1e-12)
    fid = Fidelity(prof, n=64, seed=5)
    assert 0 <= got["lost_share"] <= got["overflow"] <= 1
    vals = [fid(a)["overflow"] for a in np.linspace(0, 4, 9)]
    assert all(a >= b for a, b in zip(vals, vals[1:])) and vals[0] > vals[-1]


@settings(max_examples=25, deadline=None)
@given(st.floats(0, 4), st.floats(0, 4))
def test_overflow_monotone_in_alpha(a, b):
    fid = _FID
    lo, hi = sorted((a, b))
    assert fid(lo)["overflow"] >= fid(hi)["overflow"]


_FID = Fidelity(synthetic_profile(3, 4, 0.3, seed=11), n=32, seed=1)


def test_space_covers_paper_default_and_divisors():
    m = get_model("llama-3.1-8b")
    sp = SearchSpace.for_model(m, fixed={"mode": "tangram"})
    assert sp.heads_per_group == (1, 2, 4, 8)
    p = paper_default_params()
    assert sp.contains(p)
    e = sp.engine(p)
    assert (e.heads_per_group, e.alpha, e.mode) == (4, 2.0, "tangram")
    assert e.with_(heads_per_group=EngineConfig().heads_per_group, alpha=EngineConfig().alpha) == EngineConfig()
    assert not sp.contains({**p, "page_size": 7})
    assert not sp.contains({**p, "alpha": 4.5})


def _tune(args, **kw):
    return subprocess.run([sys.executable, "-m", "tangram.tuning.cli", *args], capture_output=True, text=True,
                          timeout=240, **kw)


def test_tune_writes_a_config_tangram_sim_accepts(tmp_path, tiny_trace):
    out = tmp_path / "out"
    r = _tune([str(tiny_trace), "--trials", "4", "--out", str(out), "--objective-fast", "--slo", "ttft_p99=60s",
               "--objective", "constrained", "--seed", "3"])
    assert r.returncode == 0, r.stderr
    summ = json.loads((out / "summary.json").read_text())
    assert summ["n_complete"] >= 4 and summ["paper_default_trial"] == 0
    for f in ("best_config.json", "report.md", "trials.csv", "history.png"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "best_config.json").read_text())
    assert cfg["alpha"] == summ["best_params"]["alpha"] and cfg["heads_per_group"] == summ["best_params"]["heads_per_group"]
    sim = subprocess.run([sys.executable, "-m", "tangram.sim.cli", "--config", str(out / "best_config.json"),
                          "--no-plots", "--out", str(tmp_path / "sim")], capture_output=True, text=True, timeout=240)
    assert sim.returncode == 0, sim.stderr
    got = json.loads((tmp_path / "sim" / "metrics.json").read_text())["tangram"]
    # the simulator run from the file reproduces the trial's measurement (same seed, same profile, same rate)
    assert got["throughput_rps"] == pytest.approx(summ["best_metrics"]["throughput_rps"], rel=1e-5)
    assert got["engine"]["heads_per_group"] == cfg["heads_per_group"]
    # a resumed run with a different setup on the same study is refused in one line
    r2 = _tune([str(tiny_trace), "--trials", "5", "--out", str(out), "--objective-fast", "--slo", "ttft_p99=30s",
                "--objective", "constrained", "--seed", "3"])
    assert r2.returncode == 2 and "different setup" in r2.stderr and "Traceback" not in r2.stderr


@pytest.mark.parametrize("args,needle", [
    (["--trials", "0"], "--trials"),
    (["--slo", "ttft_p99=fast"], "--slo"),
    (["--storage", "nosuchdb://x"], "--storage"),
    (["--model", "gpt-9"], "unknown model"),
    (["--out", "/proc/tangram-nope"], "--out /proc/tangram-nope: cannot write there"),
    (["--capacity-tol", "3"], "--capacity-tol must be in [0.005, 1]"),
])
def test_bad_input_one_line_exit_2(tmp_path, tiny_trace, args, needle):
    r = _tune([str(tiny_trace), "--out", str(tmp_path / "o"), "--objective-fast", *args])  # (a later --out wins)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_capacity_tol_reaches_the_trials_capacity_search(tmp_path, tiny_trace):
    """--capacity-tol (the deployment spec's option, as tangram-sim's) sets the tolerance each trial's capacity
    search ends at; default 0.08."""
    from tangram.tuning.cli import _build, _parser

    for extra, want in (([], 0.08), (["--capacity-tol", "0.2"], 0.2)):
        args = _parser().parse_args([str(tiny_trace), "--out", str(tmp_path / "o"), *extra])
        ev = _build(args)[0]
        assert ev.capacity_tol == want


def test_bad_trace_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "a", "turn": 0, "arrival_s": 0, "new_tokens": 10, "output_tokens": 4}\n{oops\n')
    r = _tune([str(bad), "--out", str(tmp_path / "o"), "--objective-fast"])
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr


def test_n_jobs_spawns_workers_on_one_sqlite_study(tmp_path, tiny_trace):
    out = tmp_path / "out"
    r = _tune([str(tiny_trace), "--trials", "5", "--out", str(out), "--objective-fast", "--slo", "ttft_p99=60s",
               "--n-jobs", "2"])
    assert r.returncode == 0, r.stderr
    import optuna

    study = optuna.load_study(study_name="tangram-tune", storage=f"sqlite:///{out / 'study.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert 5 <= len(done) <= 6  # at most n_jobs - 1 extra: the trial the other worker was running
    assert json.loads((out / "summary.json").read_text())["n_complete"] == len(done)
    assert (out / "pareto.png").is_file()  # the default objective is the two-objective Pareto study


def test_a_study_resumed_with_another_capacity_tol_is_refused(tmp_path):
    """Trials whose capacity searches ended at different bracket widths do not mix in one study: the tolerance is
    part of the setup (a study stored before the option existed holds the default, so it resumes as before)."""
    from tangram.errors import ConfigError
    from tangram.tuning import study as st_mod

    space = SearchSpace(heads_per_group=(1, 2, 4, 8))
    url = f"sqlite:///{tmp_path / 's.db'}"
    base = ("m", "g", "t", "", "pareto", 0.1, 0, False, None)
    st_mod.open_study(url, "s", st_mod.Setup(*base, capacity_tol=0.2), None, create=True, space=space)
    st_mod.open_study(url, "s", st_mod.Setup(*base, capacity_tol=0.2), None, create=True, space=space)
    with pytest.raises(ConfigError, match=r"capacity_tol: stored 0.2 vs now 0.08\)"):
        st_mod.open_study(url, "s", st_mod.Setup(*base), None, create=True, space=space)
    old = f"sqlite:///{tmp_path / 'old.db'}"  # a study stored before the key existed
    study = st_mod.open_study(old, "s", st_mod.Setup(*base), None, create=True, space=space)
    attrs = dict(study.user_attrs["setup"])
    attrs.pop("capacity_tol")
    study.set_user_attr("setup", attrs)
    st_mod.open_study(old, "s", st_mod.Setup(*base), None, create=True, space=space)


def test_best_config_carries_a_non_default_capacity_tol(tmp_path):
    """The best configuration file reproduces the study's measurement with `tangram-sim --config F --capacity`: a
    study searched at another bracket width writes it (the default stays implicit)."""
    from tangram.spec import load
    from tangram.tuning import study as st_mod

    space = SearchSpace(heads_per_group=(1, 2, 4, 8))
    params = {"heads_per_group": 4, "alpha": 2.0}
    for tol, want in ((0.08, 0.08), (0.2, 0.2)):
        setup = st_mod.Setup("llama-3.1-8b", "h100-80gb", "t", "ttft_p99=60s", "pareto", 0.05, 0, False, None,
                             capacity_tol=tol)
        d = st_mod.best_config_dict(params, space, setup, "auto")
        assert ("capacity_tol" in d) == (tol != 0.08)
        f = tmp_path / "best.json"
        f.write_text(json.dumps(d))
        assert load(f).capacity_tol == want
    d = st_mod.best_config_dict(params, space, setup, "sim/tables/h100")  # a tables folder given relative
    assert Path(d["tables"]).is_absolute()


def test_worker_goes_on_after_a_trial_another_worker_completed(monkeypatch):
    """Two SQLite workers can pop the same enqueued trial; the slower one's tell then finds it COMPLETE. The
    worker must carry on (the other stored the result) and still stop at n_trials; other errors propagate."""
    import optuna

    from tangram.tuning import study as st_mod

    space = SearchSpace(heads_per_group=(1, 2, 4, 8))
    setup = st_mod.Setup("m", "g", "t", "", "single", 0.1, 0, True, None)
    ev = lambda params: {"load_rps": params["alpha"], "overflow": 0.0}  # noqa: E731
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    real = study.optimize
    raised = []

    def flaky(*a, **kw):
        if not raised:  # first call: one trial completes, then the duplicate tell of another worker's trial
            real(*a, **{**kw, "n_trials": 1})
            raised.append(1)
            raise ValueError("Cannot tell a COMPLETE trial.")
        return real(*a, **kw)

    monkeypatch.setattr(study, "optimize", flaky)
    st_mod.run_worker(study, ev, space, setup, 4)
    assert raised and st_mod.n_complete(study) == 4

    def broken(*a, **kw):
        raise ValueError("something else")

    monkeypatch.setattr(study, "optimize", broken)
    with pytest.raises(ValueError, match="something else"):
        st_mod.run_worker(study, ev, space, setup, 6)


@pytest.mark.parametrize("storage", ["memory", "sqlite"])
def test_worker_goes_on_after_its_trial_was_failed_as_stale(tmp_path, storage):
    """A worker whose heartbeats came late (a loaded machine) finds its trial failed by another worker's stale
    check when it tells the result: Optuna raises UpdateFinishedTrialError from an RDB storage (seen in CI,
    2026-12-08, ending a two-worker tuning run with exit 1), "Cannot tell a FAIL trial" from memory. The worker must
    carry on and still stop at n_trials."""
    import optuna
    from optuna.trial import TrialState

    from tangram.tuning import study as st_mod

    space = SearchSpace(heads_per_group=(1, 2, 4, 8))
    setup = st_mod.Setup("m", "g", "t", "", "single", 0.1, 0, True, None)
    url = None if storage == "memory" else st_mod.make_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_s=None)
    study = optuna.create_study(storage=url, direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    failed = []

    def ev(params):
        if not failed:  # meanwhile another worker's stale check fails this worker's running trial
            t = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))[0]
            study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            failed.append(t.number)
        return {"load_rps": params["alpha"], "overflow": 0.0}

    st_mod.run_worker(study, ev, space, setup, 3)
    assert failed and st_mod.n_complete(study) == 3
    assert study.trials[failed[0]].state == TrialState.FAIL


def test_accuracy_floor_picks_a_configuration_that_meets_it(tmp_path, tiny_trace):
    """With a measured accuracy table the trials record accuracy at their kept share, the best configuration
    meets the floor and the report states its accuracy; without a table a floor is refused in one line."""
    from tangram.spec import default_profile
    from tangram.tuning.space import SearchSpace as SS

    model = get_model("llama-3.1-8b")
    e = SS.for_model(model, fixed={"mode": "tangram"}).engine({})
    prof = default_profile(model, e.rho, e.alpha, 3)
    shares = [float(prof.with_alpha(a).B.mean()) for a in (0.0, 2.0, 4.0)]
    rows = [{"task": "mean", "metric": "accuracy", "policy": "full", "kv_share": 1.0, "value": 0.92}]
    rows += [{"task": "mean", "metric": "accuracy", "policy": "tangram", "scorer": "synthetic", "scope": "per-layer",
              "kv_share": x, "value": y} for x, y in zip(shares, (0.5, 0.8, 0.9))]
    table = tmp_path / "acc.json"
    table.write_text(json.dumps({"format": "tangram-accuracy-table", "version": 1, "model": "llama-3.1-8b",
                                 "rows": rows}))
    out = tmp_path / "out"
    r = _tune([str(tiny_trace), "--trials", "4", "--out", str(out), "--objective-fast", "--slo", "ttft_p99=60s",
               "--objective", "constrained", "--seed", "3", "--accuracy-table", str(table), "--accuracy-floor", "0.8"])
    assert r.returncode == 0, r.stderr
    summ = json.loads((out / "summary.json").read_text())
    bm = summ["best_metrics"]
    assert bm["accuracy_rel"] >= 0.8 and bm["kv_share"] == pytest.approx(
        float(prof.with_alpha(summ["best_params"]["alpha"]).B.mean()), rel=1e-9)
    md = (out / "report.md").read_text()
    assert "Accuracy of the tuned configuration" in md and "meets it" in md
    cfg = json.loads((out / "best_config.json").read_text())
    assert cfg["accuracy_table"] == str(table.resolve())
    sim = subprocess.run([sys.executable, "-m", "tangram.sim.cli", "--config", str(out / "best_config.json"),
                          "--no-plots", "--out", str(tmp_path / "sim")], capture_output=True, text=True, timeout=240)
    assert sim.returncode == 0, sim.stderr
    got = json.loads((tmp_path / "sim" / "metrics.json").read_text())["tangram"]
    assert got["accuracy"] == pytest.approx(bm["accuracy"], rel=1e-9)  # the simulator states the same accuracy
    r2 = _tune([str(tiny_trace), "--trials", "2", "--out", str(tmp_path / "o2"), "--objective-fast",
                "--accuracy-floor", "0.9"])
    assert r2.returncode == 2 and "accuracy not measured for llama-3.1-8b" in r2.stderr
    assert len(r2.stderr.strip().splitlines()) == 1


def test_paper_default_stands_in_for_models_without_hp4():
    """SmolLM2 has 3 KV heads (H_p in {1, 3}): the enqueued paper default must be a point of its space (H_p 3),
    or Optuna rejects the enqueued trial; Llama's space keeps the paper's H_p 4."""
    from tangram.config import get_model
    from tangram.tuning.space import SearchSpace, paper_default_params

    small = SearchSpace.for_model(get_model("smollm2-135m"))
    assert small.heads_per_group == (1, 3) and paper_default_params(small)["heads_per_group"] == 3
    assert paper_default_params(SearchSpace.for_model(get_model("llama-3.1-8b")))["heads_per_group"] == 4
    assert paper_default_params()["heads_per_group"] == 4


def test_operating_point_search_prices_each_point_with_its_own_profile(tmp_path, tiny_trace):
    """--rho/--score-method/--budget-scope with several values: each trial takes the shipped profile of its
    (rho, scorer, scope), records the KV share of that profile at its alpha and the accuracy the measured table
    has on that scorer's and scope's curve; the best configuration names its point and an impossible combination
    (pyramidkv cross-layer) is pruned, never simulated."""
    import dataclasses
    from tangram.profiles.accuracy import AccuracyModel
    from tangram.profiles.registry import default_profile_path
    from tangram.budgets import BudgetProfile
    from tangram.tuning.space import SearchSpace as SS, paper_default_params

    model = get_model("smollm2-135m")
    sp = SS.for_model(model, rho=(0.75, 0.25), score_method=("kvzip", "pyramidkv"),
                      budget_scope=("per-layer", "cross-layer"), fixed={"mode": "tangram"})
    assert {"rho", "score_method", "budget_scope"} <= set(sp.searched) and sp.rho == (0.25, 0.75)
    assert paper_default_params(sp)["rho"] == 0.25 and paper_default_params(sp)["score_method"] == "kvzip"
    one = SS.for_model(model, rho=(0.5,), fixed={"mode": "tangram"})
    assert "rho" not in one.searched and one.engine({}).rho == 0.5

    out = tmp_path / "out"
    r = _tune([str(tiny_trace), "--model", "smollm2-135m", "--trials", "8", "--out", str(out), "--objective-fast",
               "--slo", "ttft_p99=60s", "--objective", "constrained", "--seed", "1", "--rho", "0.25", "0.75",
               "--score-method", "kvzip", "pyramidkv", "--budget-scope", "per-layer", "cross-layer",
               "--accuracy-floor", "0.5"])
    assert r.returncode == 0, r.stderr
    import optuna
    st = optuna.load_study(study_name="tangram-tune", storage=f"sqlite:///{out / 'study.db'}")
    done = [t for t in st.trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in st.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert done and all(not (t.params["score_method"] == "pyramidkv" and t.params["budget_scope"] == "cross-layer")
                        for t in done)
    assert all(t.params.get("score_method") == "pyramidkv" and t.params.get("budget_scope") == "cross-layer"
               for t in pruned)
    acc0, _ = AccuracyModel.for_run(model.name, None)
    for t in done:
        p = t.params
        path = default_profile_path(model.name, p["score_method"], p["budget_scope"], p["rho"])
        prof = BudgetProfile.load(path)
        assert p["score_method"] in t.user_attrs["profile"] and path.name in t.user_attrs["profile"]
        assert t.user_attrs["kv_share"] == pytest.approx(float(prof.with_alpha(p["alpha"]).B.mean()), rel=1e-9)
        want = dataclasses.replace(acc0, scorer=p["score_method"], scope=p["budget_scope"]).estimate(
            "tangram", prof, p["alpha"], p["rho"])
        assert t.user_attrs["accuracy"] == pytest.approx(want.value, rel=1e-9)
    cfg = json.loads((out / "best_config.json").read_text())
    summ = json.loads((out / "summary.json").read_text())
    for k in ("rho", "score_method", "budget_scope"):
        assert cfg[k] == summ["best_params"][k]
    assert "operating point" in (out / "report.md").read_text()


def test_constant_budgets_never_overflow():
    """A profile without spread (TOVA's per-layer budgets are equal over a layer's heads): every draw equals its
    budget, rescaled to the layer's target only up to rounding, so nothing overflows at any alpha."""
    from tangram.budgets import BudgetProfile
    L, H = 4, 3
    prof = BudgetProfile(np.full((L, H), 0.75), np.zeros((L, H)), alpha=2.0, rho=0.75, method="tova", model="x")
    fid = Fidelity(prof, n=64, seed=int(np.random.default_rng().integers(1 << 30)))
    for a in (0.0, 2.0):
        assert fid(a) == {"overflow": 0.0, "overflow_unweighted": 0.0, "lost_share": 0.0}


def test_pareto_importance_ranks_what_raises_the_load(tmp_path, monkeypatch):
    """optuna's PED-ANOVA importance ranks what makes its target low; the Pareto study's load is maximised, so the
    report hands it the negated load (and no "achieve low target values" warning reaches the user)."""
    import warnings

    import optuna
    import optuna.visualization.matplotlib as ovm

    from tangram.tuning import report

    study = optuna.create_study(directions=["maximize", "minimize"])
    for x in (0.1, 0.5, 0.9):
        study.enqueue_trial({"x": x})
        study.optimize(lambda t: (t.suggest_float("x", 0, 1), 0.0), n_trials=1)
    seen = {}

    def fake(st, *, target=None, target_name="", **kw):
        seen["values"] = [target(t) for t in st.trials]
        import matplotlib.pyplot as plt
        return plt.subplots()[1]
    monkeypatch.setattr(ovm, "plot_param_importances", fake)
    setup = type("S", (), {"objective": "pareto"})()
    report._plots(study, setup, tmp_path)
    assert seen["values"] == [-0.1, -0.5, -0.9]
    monkeypatch.undo()  # the real evaluator: its direction warning is filtered, the plot is drawn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = report._plots(study, setup, tmp_path)
    assert "importance.png" in made
    assert not [w for w in caught if "achieve low" in str(w.message)]

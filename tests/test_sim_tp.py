"""The simulator's tensor-parallel replica (sim/tp.py): pool, communication, per-rank attention, whole replays.

Truths: hand arithmetic from the model shape and the GPU preset; a single-GPU cost model of one rank's shape (a
rank that is the slowest on every layer sets the decode time alone); the step-by-step replay for fast-forward."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tangram.budgets import BudgetProfile
from tangram.config import GIB, EngineConfig, get_gpu, get_model, kv_pool_bytes
from tangram.errors import ConfigError, InputError
from tangram.paging import KVLayout
from tangram.sim.costmodel import CostModel, CostParams
from tangram.sim.run import build_replica, simulate
from tangram.sim.tp import AllReduceTable, TPCostModel, tp_pool_bytes
from tangram.spec import DeploymentSpec, default_profile
from tangram.traces import generate

LLAMA, H100 = get_model("llama-3.1-8b"), get_gpu("h100-80gb")


def _profile(B: np.ndarray) -> BudgetProfile:
    return BudgetProfile(B, np.zeros_like(B), 0.0, float(B.mean()), "hand", LLAMA.name)


def test_pool_bytes_by_hand():
    e = EngineConfig(tp=2)
    w = LLAMA.param_count() * 2
    assert kv_pool_bytes(LLAMA, H100, e) == int(80e9 * 0.9 - w / 2 - 2 * GIB)
    # one layer of hand budgets, H_p = 1, contiguous: rank 0 holds 0.9+0.8 of 1.9 -> pool = per rank x 1.9 / 1.7
    m = dataclasses.replace(LLAMA, num_layers=1, num_kv_heads=4, num_q_heads=16)
    B = np.array([[0.9, 0.8, 0.1, 0.1]])
    ec = EngineConfig(mode="tangram", tp=2, heads_per_group=1, placement="contiguous", kv_pool_bytes=10**9)
    lay = KVLayout.build(m, ec, B)
    assert tp_pool_bytes(m, H100, ec, lay, B) == int(10**9 * 1.9 / 1.7)
    eb = ec.with_(placement="balanced")  # {0.9, 0.1} | {0.8, 0.1}: rank 0 holds 1.0 of 1.9
    assert tp_pool_bytes(m, H100, eb, KVLayout.build(m, eb, B), B) == int(10**9 * 1.9 / 1.0)
    em = EngineConfig(mode="br", tp=2, kv_pool_bytes=10**9)  # monolithic: every rank holds 1/2 of every page
    assert tp_pool_bytes(m, H100, em, KVLayout.build(m, em, B), B) == 2 * 10**9


def _tpcm(mode="tangram", tables=None, **kw) -> TPCostModel:
    e = EngineConfig(mode=mode, tp=2, **kw)
    prof = default_profile(LLAMA, e.rho, e.alpha)
    lay = KVLayout.build(LLAMA, e, prof.B)
    return TPCostModel(LLAMA, H100, e, lay, prof, tables=tables, params=CostParams(engine_overhead=False))


def test_ring_allreduce_by_hand():
    cm = _tpcm()
    # one decode token: 65 all-reduces of 4096 x 2 bytes, ring factor 2(2-1)/2 = 1, 0.8 x 450 GB/s, 10 us each;
    # all-gather of one logit row: 128256 x 4 bytes x (1/2)
    ar = 10e-6 + 8192 / 360e9
    gather = 10e-6 + 128256 * 4 * 0.5 / 360e9
    assert float(cm._comm(1, 1)) == pytest.approx(65 * ar + gather, rel=1e-12)
    assert "ring model" in cm.sources["allreduce"]


def test_allreduce_csv_is_read_with_provenance(tmp_path):
    (tmp_path / "allreduce.csv").write_text(
        "tp,bytes,median_us,backend,gpu,date,command\n"
        "2,8192,20,nccl,FAKE-GPU,2026-01-01,fake\n2,1048576,40,nccl,FAKE-GPU,2026-01-01,fake\n"
        "4,8192,99,nccl,FAKE-GPU,2026-01-01,fake\n")
    cm = _tpcm(tables=tmp_path)
    assert "table:allreduce.csv" in cm.sources["allreduce"] and "FAKE-GPU" in cm.sources["allreduce"]
    gather = 10e-6 + 128256 * 4 * 0.5 / 360e9  # the logits gather stays on the ring model
    assert float(cm._comm(1, 1)) == pytest.approx(65 * 20e-6 + gather, rel=1e-9)  # a measured point, exactly
    assert float(cm._comm(128, 0)) == pytest.approx(65 * 40e-6, rel=1e-9)  # 128 x 4096 x 2 = 1 MiB
    (tmp_path / "allreduce.csv").write_text("tp,bytes,median_us\n2,8192,20\n2,abc,30\n")
    with pytest.raises(InputError, match=r"allreduce.csv:3: bytes: not a number"):
        AllReduceTable(tmp_path / "allreduce.csv")
    (tmp_path / "allreduce.csv").write_text("tp,bytes,median_us\n1,8192,20\n")
    with pytest.raises(InputError, match="tp must be >= 2"):
        AllReduceTable(tmp_path / "allreduce.csv")


def test_gemms_are_the_tables_full_shape_over_tp():
    e1 = EngineConfig(mode="tangram")
    prof = default_profile(LLAMA, e1.rho, e1.alpha)
    cm1 = CostModel(LLAMA, H100, e1, KVLayout.build(LLAMA, e1, prof.B), prof, params=CostParams(engine_overhead=False))
    cm2 = _tpcm(tables="auto")
    if cm1._gemm_interp["qkv"] is None:
        pytest.skip("no gemm table installed")
    assert cm2.sources["gemm_qkv"] == "table:gemm.csv at the full shape / tp=2"
    assert cm2._dense(64, 64)[0] == pytest.approx(cm1._dense(64, 64)[0] / 2, rel=1e-12)


def test_decode_is_the_slowest_rank_as_one_gpu_prices_it():
    """Rank 0's heads are long on every layer: the step's decode attention is what a one-GPU cost model of the
    rank's shape (16 q / 4 KV heads) gives for rank 0's lengths."""
    e = EngineConfig(mode="br", tp=2, placement="contiguous")  # monolithic, static partition
    B = np.full((LLAMA.num_layers, 8), 0.5)
    lay = KVLayout.build(LLAMA, e, B)
    tp = TPCostModel(LLAMA, H100, e, lay, _profile(B), tables=None, params=CostParams(engine_overhead=False))
    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(3000, 5000, (6, LLAMA.num_layers, 4)),
                           rng.integers(10, 100, (6, LLAMA.num_layers, 4))], axis=2)
    rank_model = dataclasses.replace(LLAMA, name="rank", num_q_heads=16, num_kv_heads=4)
    e1 = EngineConfig(mode="br")
    one = CostModel(rank_model, H100, e1, KVLayout.build(rank_model, e1, B[:, :4]),
                    BudgetProfile(B[:, :4], np.zeros((LLAMA.num_layers, 4)), 0.0, 0.5, "hand", "rank"),
                    tables=None, params=CostParams(engine_overhead=False))
    assert tp._decode_attention(lens)[0] == pytest.approx(one._decode_attention(lens[:, :, :4])[0], rel=1e-12)
    # swap the halves: rank 1 is now the slow one, same time
    assert tp._decode_attention(lens[:, :, ::-1].copy())[0] == pytest.approx(
        one._decode_attention(lens[:, :, :4])[0], rel=1e-12)


def test_balanced_placement_prices_decode_no_slower():
    e = EngineConfig(mode="tangram", tp=2, heads_per_group=1)
    prof = default_profile(LLAMA, e.rho, e.alpha)
    times = {}
    for pl in ("contiguous", "balanced"):
        ee = e.with_(placement=pl)
        lay = KVLayout.build(LLAMA, ee, prof.B)
        cm = TPCostModel(LLAMA, H100, ee, lay, prof, tables=None, params=CostParams(engine_overhead=False))
        lens = np.ceil(lay.to_slots(prof.B)[None] * 32768).astype(np.int64).repeat(16, axis=0)
        times[pl] = cm._decode_attention(lens, 32768)[0]
    assert times["balanced"] <= times["contiguous"]


@pytest.mark.parametrize("mode,part,tp", [("tangram", None, 2), ("tangram", None, 4), ("br+rp", "static", 2),
                                          ("full", None, 8), ("dynamic", "runtime", 2)])
@pytest.mark.parametrize("fitted", [True, False])
def test_tp_prices_of_a_runs_steps_at_once_equal_each_step_alone(mode, part, tp, fitted):
    """A TP replica prices a run's decode steps per rank and launch shape, all points at once (contexts crossing a
    bucket, the static split's block count changing on the way): each point equals pricing that step alone, bit for
    bit, with the fitted decode costs and with the fallback, and leaves the same fixed part for the rescale cache."""
    e = EngineConfig(mode=mode, decode_partition=part, tp=tp, heads_per_group=1)
    prof = default_profile(LLAMA, e.rho, e.alpha)
    lay = KVLayout.build(LLAMA, e, prof.B)
    cm = TPCostModel(LLAMA, H100, e, lay, prof, params=CostParams() if fitted else CostParams(decode_model="capped"))
    rng = np.random.default_rng()
    kd = int(rng.integers(1, 5))
    ratio = {"full": np.ones_like(prof.B)}.get(mode, prof.B)
    lens0 = np.ceil(lay.to_slots(ratio)[None] * rng.integers(3800, 4000, size=(kd, 1, 1))).astype(np.int64)
    offs = np.array([1, 2, 40, 90, 130, 200, 260, 300])  # the longest context crosses 4096 on the way
    ctx = 4000 + offs
    for contexts in (ctx, None):
        t, fixed = cm._decode_prices(lens0, offs, contexts)
        for i, o in enumerate(offs.tolist()):
            alone = cm._decode_attention(lens0 + o, None if contexts is None else int(contexts[i]))[0]
            assert t[i] == alone and fixed[i] == cm._dec_fixed, (i, t[i], alone)


@pytest.mark.parametrize("mode", ["tangram", "br"])
def test_tp_replay_fast_forward_identical_and_leak_free(mode):
    from test_fast_forward import assert_same_replay

    e = EngineConfig(mode=mode, tp=2, heads_per_group=2)
    spec = DeploymentSpec(LLAMA, H100, e, default_profile(LLAMA, e.rho, e.alpha), 1, "session-affinity", 0, "auto")
    tr = generate(10, "short", seed=5, rate=3.0, turns="uniform:1:3", output_tokens="uniform:30:120")
    a, ra = assert_same_replay(tr, spec, mode)
    assert a["completed"] == len(tr.turns)
    assert "allreduce" in a["time_by_operator_s"]
    sched = ra.schedulers[0]
    for sid in list(getattr(sched, "sessions", {})):
        sched.end_session(sid)
    sched.clear_prefix_cache()
    assert sched.pool.n_used == 0  # every page back once the sessions end


def test_build_replica_tp_and_errors():
    e = EngineConfig(mode="tangram", tp=2, heads_per_group=2)
    spec = DeploymentSpec(LLAMA, H100, e, default_profile(LLAMA, e.rho, e.alpha))
    sched, cm = build_replica(spec, e, 0)
    assert isinstance(cm, TPCostModel) and sched.layout.tp == 2
    per_rank_pages = kv_pool_bytes(LLAMA, H100, e) // sched.layout.page_bytes
    assert per_rank_pages < sched.pool.num_pages <= 2 * per_rank_pages
    with pytest.raises(ConfigError, match="H_p=4 must divide the 2 KV heads of a rank"):
        KVLayout.build(LLAMA, EngineConfig(mode="tangram", tp=4, heads_per_group=4), spec.profile.B)


def test_cli_tp(tmp_path, capsys):
    from tangram.sim.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["--tp", "3", "--mode", "tangram", "--out", str(tmp_path)])
    assert ex.value.code == 2 and "tp=3 must divide the 8 KV heads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:
        main(["--tp", "2", "--hp", "8", "--mode", "tangram", "--out", str(tmp_path)])
    assert ex.value.code == 2 and "H_p=8 must divide" in capsys.readouterr().err


def test_tuner_space_with_tp():
    import optuna

    from tangram.tuning.space import SearchSpace

    base = SearchSpace.for_model(LLAMA)
    assert base.searched == ("clustering", "n_cta_scale", "split_rounding", "page_size", "chunk_size",
                             "max_batched_tokens")  # studies without TP keep their parameter names
    fixed2 = SearchSpace.for_model(LLAMA, tp=(2,), placement=("contiguous",))
    assert fixed2.heads_per_group == (1, 2, 4) and fixed2.fixed == {"tp": 2, "placement": "contiguous"}
    sp = SearchSpace.for_model(LLAMA, tp=(1, 2), placement=("contiguous", "balanced"), fixed={"mode": "tangram"})
    assert sp.heads_per_group == (1, 2, 4, 8) and "tp" in sp.distributions() and "placement" in sp.distributions()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        t = study.ask()
        try:
            p = sp.suggest(t)
        except optuna.TrialPruned:
            assert t.params["tp"] == 2 and t.params["heads_per_group"] == 8
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
            seen.add("pruned")
            continue
        e = sp.engine(p)
        KVLayout.build(LLAMA, e, default_profile(LLAMA, e.rho, e.alpha).B)  # every drawn config is buildable
        assert sp.contains(p)
        seen.add((e.tp, e.placement))
        study.tell(t, 0.0)
    assert {(1, "balanced"), (2, "contiguous"), (2, "balanced"), "pruned"} <= seen


def test_h200_prices_tp_with_the_shipped_allreduce_and_transferred_kernel_tables():
    """sim/tables/h200 holds only the H200 x2 all-reduce measurement: the kernel tables stay the H100's transferred
    by datasheet (the folder does not shadow them), and TP = 2 reads the measured all-reduce (values from the CSV)."""
    import csv

    from tangram.sim.tables import TABLES_ROOT

    h200 = get_gpu("h200")
    e = EngineConfig(mode="tangram", tp=2)
    prof = default_profile(LLAMA, e.rho, e.alpha)
    cm = TPCostModel(LLAMA, h200, e, KVLayout.build(LLAMA, e, prof.B), prof,
                     params=CostParams(engine_overhead=False))
    assert cm.tables.directory.name == "h100" and any(p.get("kind") == "transfer" for p in cm.tables.provenance)
    assert "table:allreduce.csv" in cm.sources["allreduce"] and "H200" in cm.sources["allreduce"]
    rows = [r for r in csv.DictReader(open(TABLES_ROOT / "h200" / "allreduce.csv")) if r["tp"] == "2"]
    b = np.array([float(r["bytes"]) for r in rows])
    us = np.array([float(r["median_us"]) for r in rows])
    for i in range(len(rows)):  # a smaller message never costs more than a larger one: the suffix minimum
        got = float(cm.allreduce.seconds(2, [b[i]])[0])
        assert got == pytest.approx(us[b >= b[i]].min() * 1e-6, rel=1e-9)
    e4 = EngineConfig(mode="tangram", tp=4, heads_per_group=2)
    cm4 = TPCostModel(LLAMA, h200, e4, KVLayout.build(LLAMA, e4, prof.B), prof,
                      params=CostParams(engine_overhead=False))
    assert "ring model" in cm4.sources["allreduce"]  # no tp = 4 rows measured

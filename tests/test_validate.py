"""tangram-validate on the CPU: SmolLM2 GGUF, two configs, a two-request trace; the table and tau are written."""
import json

import pandas as pd
import pytest

from tangram.kernels import cpu_reference
from tangram.tuning.validate import main, rel_err, term_table


def test_rel_err_and_terms():
    assert rel_err(1.1, 1.0) == pytest.approx(0.1)
    assert rel_err(1.0, 0) is None
    rows = term_table({"gemm": 1.0, "elementwise": 0.5, "decode_attention": 2.0},
                      {"dense": 1.0, "lm_head_sampling": 0.2, "kv_write": 0.3, "decode_attention": 1.0})
    d = {r["term"]: r for r in rows}
    assert d["dense (gemm + elementwise)"]["rel_err"] == pytest.approx(0.0)
    assert d["decode_attention"]["rel_err"] == pytest.approx(1.0)


def test_validate_cli_cpu(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"session_id": "a", "turn": 0, "arrival_s": 0.0, "new_tokens": 24, "output_tokens": 3}\n'
                     '{"session_id": "b", "turn": 0, "arrival_s": 0.1, "new_tokens": 17, "output_tokens": 2}\n')
    cfgs = []
    for name, mode in (("a", "tangram"), ("b", "full")):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"model": "smollm2-135m", "gpu": "h100", "mode": mode, "heads_per_group": 3,
                                 "chunk_size": 16, "kv_pool_bytes": 8 * 2**20}))
        cfgs.append(str(p))
    out = tmp_path / "v"
    # the 30-layer model runs on the float64 reference kernels: the Triton interpreter would take minutes here
    with cpu_reference(), pytest.raises(SystemExit) as e:
        main(cfgs + ["--trace", str(trace), "--weights", "auto", "--out", str(out), "--repeats", "2"])
    assert e.value.code == 0
    df = pd.read_csv(out / "validation.csv")
    assert list(df["config"]) == ["a", "b"] and df["leak_ok"].all()
    assert (df["throughput_rps_meas"] > 0).all() and (df["throughput_rps_pred"] > 0).all()
    # two runs per config, the mean compared: it lies within the runs' spread, which is reported
    assert (df["repeats"] == 2).all() and df["throughput_rps_meas_cv"].notna().all()
    assert ((df["throughput_rps_meas_min"] <= df["throughput_rps_meas"] + 1e-12)
            & (df["throughput_rps_meas"] <= df["throughput_rps_meas_max"] + 1e-12)).all()
    assert "mean of 2 engine runs" in (out / "report.md").read_text()
    s = json.loads((out / "validation.json").read_text())
    assert s["kendall_tau_throughput"] is not None
    # the work done on both sides, and every run's own metrics, are kept for diagnosis
    assert (df["steps_pred"] > 0).all() and (df["steps_meas"] > 0).all()
    assert "## Work done, predicted vs measured" in (out / "report.md").read_text()
    assert [len(s["runs"][c]["measured"]) for c in ("a", "b")] == [2, 2]
    runs_a = [m["throughput_rps"] for m in s["runs"]["a"]["measured"]]
    assert df.loc[df["config"] == "a", "throughput_rps_meas"].item() == pytest.approx(sum(runs_a) / 2)
    assert "Kendall tau" in (out / "report.md").read_text()
    # measured on the CPU against H100 predictions: said on stderr, in the report and in validation.json
    assert "measuring on the cpu" in s["device_mismatch"] and "h100" in s["device_mismatch"]
    assert "**warning: measuring on the cpu" in (out / "report.md").read_text()


def test_device_mismatch_rules(monkeypatch):
    import torch

    from tangram.config import get_gpu
    from tangram.tuning.validate import device_mismatch

    h100 = get_gpu("h100")
    assert device_mismatch(None, h100, False) is None  # --predict-only: nothing measured
    assert "cpu" in device_mismatch(torch.device("cpu"), h100, True)  # a probe does not make the CPU an H100
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert "NVIDIA H200 against predictions for h100" in device_mismatch(cuda, h100, False)
    assert device_mismatch(cuda, h100, True) is None  # the probe rescales the H100 tables to this machine
    assert device_mismatch(cuda, get_gpu("h200"), False) is None


def test_validate_bad_config_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main([str(bad), "--trace", str(tmp_path / "none.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def _configs(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"session_id": "a", "turn": 0, "arrival_s": 0.0, "new_tokens": 300, "output_tokens": 6}\n'
                     '{"session_id": "b", "turn": 0, "arrival_s": 0.1, "new_tokens": 170, "output_tokens": 4}\n')
    cfgs = []
    for name, mode in (("a", "tangram"), ("b", "full")):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"model": "llama-3.1-8b", "gpu": "h100", "mode": mode, "heads_per_group": 4,
                                 "chunk_size": 128, "kv_pool_bytes": 256 * 2**20}))
        cfgs.append(str(p))
    return trace, cfgs


def test_predict_only_on_a_gpu_without_tables_says_transferred(tmp_path):
    """--predict-only needs no device; --gpu h200 prices the configs with the H100 tables transferred by datasheet,
    and the saved prediction names that (a memory-bound decode step is faster on the H200's bandwidth)."""
    from tangram.sim.tables import tables_dir_for

    if not (tables_dir_for("h100-80gb") / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    trace, cfgs = _configs(tmp_path)
    preds = {}
    for gpu in ("h100", "h200"):
        out = tmp_path / gpu
        with pytest.raises(SystemExit) as e:
            main(cfgs + ["--trace", str(trace), "--predict-only", "--gpu", gpu, "--out", str(out)])
        assert e.value.code == 0
        s = json.loads((out / "predicted.json").read_text())
        preds[gpu] = pd.read_csv(out / "predicted.csv").set_index("config")["throughput_rps_pred"]
        if gpu == "h200":
            assert s["gpu"] == "h200" and s["tables_provenance"][0]["label"].startswith(
                "transferred from h100 by datasheet")
            assert "transferred from h100 by datasheet" in s["cost_model_source"]["gemm_qkv"]
        else:
            assert s["tables_provenance"] == []
    assert (preds["h200"] > preds["h100"]).all()


def test_validate_prices_with_the_probe_and_keeps_the_shipped_prediction(tmp_path):
    """--probe FILE: the simulator side is priced with tables rescaled by the probe (GEMMs 1.5x slower here, so
    the prediction drops), the unscaled prediction and the scales are kept."""
    from tangram.sim.probe import gemm_shapes
    from tangram.sim.tables import CostTables, tables_dir_for
    from tangram.config import get_model

    d = tables_dir_for("h100-80gb")
    if not (d / "gemm.csv").exists():
        pytest.skip("no H100 cost tables installed")
    t, m = CostTables.load(d), get_model("llama-3.1-8b")
    if t.reference_probe is not None:  # scales are stated against the probe the tables were fitted with
        gemm = [{**g, "median_ms": 1.5 * g["median_ms"]} for g in t.reference_probe["gemm"]]
    else:
        gemm = [dict(model=m.name, op=op, n=n, k=k, tokens=tk, median_ms=1.5e3 * float(t.gemm_interp(m, op, n, k)(tk)))
                for op, (n, k) in gemm_shapes(m).items() for tk in (1, 128, 2048)]
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"kind": "tangram-probe", "version": 1, "device": {"name": "slow test GPU"},
                                 "copy": None, "gemm": gemm, "decode": [], "prefill": []}))
    trace, cfgs = _configs(tmp_path)
    out = tmp_path / "p"
    with pytest.raises(SystemExit) as e:
        main(cfgs + ["--trace", str(trace), "--predict-only", "--probe", str(probe), "--out", str(out)])
    assert e.value.code == 0
    df = pd.read_csv(out / "predicted.csv")
    assert (df["throughput_rps_pred"] < df["throughput_rps_pred_shipped"]).all()
    s = json.loads((out / "predicted.json").read_text())
    assert s["probe"]["device"]["name"] == "slow test GPU"
    sc = s["tables_provenance"][-1]["scales"]["gemm"]
    assert all(r == pytest.approx(1.5) for v in sc.values() for r in v["time_ratio"])


def _call(d, runs):
    """A tangram-validate output folder holding only what --pool reads: per config, the prediction and the runs."""
    d.mkdir()
    (d / "validation.json").write_text(json.dumps({"runs": {
        name: {"predicted": {"throughput_rps": pred},
               "measured": [{"throughput_rps": m, "triton_compiles_in_run": {"seconds": cs}} for m, cs in meas]}
        for name, (pred, meas) in runs.items()}}))
    return str(d)


def test_pool_runs_of_several_calls(tmp_path, capsys):
    # two calls of the same three configs; c's run in the second call compiled a kernel inside its timed loop
    d1 = _call(tmp_path / "call_a", {"a": (3.0, [(2.8, 0.0)]), "b": (2.0, [(2.2, 0.0)]), "c": (1.0, [(0.8, 0.0)])})
    d2 = _call(tmp_path / "call_b", {"a": (3.0, [(3.0, 0.0)]), "b": (2.0, [(2.0, 0.0), (2.1, 0.0)]),
                                     "c": (1.0, [(0.5, 0.9)])})
    out = tmp_path / "pooled.md"
    with pytest.raises(SystemExit) as e:
        main(["--pool", d1, d2, "--out", str(out)])
    assert e.value.code == 0
    text = out.read_text()
    # by hand: means a (2.8 + 3.0) / 2 = 2.9, b (2.2 + 2.0 + 2.1) / 3 = 2.1, c (0.8 + 0.5) / 2 = 0.65; errors
    # (pred - mean) / mean = +3.4%, -4.8%, +53.8%; predictions and means rank alike: tau 1
    assert "| a | 3.000 | 2.900 | 2 | 2.800 | 3.000 | +3.4% |" in text
    assert "| b | 2.000 | 2.100 | 3 | 2.000 | 2.200 | -4.8% |" in text
    assert "| c | 1.000 | 0.650 | 2 | 0.500 | 0.800 | +53.8% |" in text
    assert "Kendall tau = 1.000; largest |error| 53.8% (outside 10%)" in text
    # without the compiling run, c is its first call's 0.8: (1 - 0.8) / 0.8 = +25.0%
    no_compile = text.split("## Runs without Triton compiles")[1].split("## Per call")[0]
    assert "| c | 1.000 | 0.800 | 1 | 0.800 | 0.800 | +25.0% |" in no_compile
    # each call on its own: a measured 2.8 in the first, (3 - 2.8) / 2.8 = +7.1%
    assert "| a | 3.000 | 2.800 (+7.1%) | 3.000 (+0.0%) |" in text
    assert "Command: `tangram-validate --pool" in text
    assert text.count("| call_b |") == 4  # every run listed once


def test_pool_kendall_tau_counts_discordant_pairs(tmp_path):
    # predictions 3 > 2 > 1, means 2.0 < 2.5 > 1.0: pairs (a,b) discordant, (a,c) and (b,c) concordant, so
    # tau = (2 - 1) / 3; the per-config error of a is (3 - 2) / 2 = +50.0%
    d = _call(tmp_path / "v", {"a": (3.0, [(2.0, 0.0)]), "b": (2.0, [(2.5, 0.0)]), "c": (1.0, [(1.0, 0.0)])})
    from tangram.tuning.pooling import pool_report

    text, numbers = pool_report([d])
    assert numbers["all"]["kendall_tau_throughput"] == pytest.approx(1 / 3)
    assert numbers["all"]["configs"]["a"]["relerr"] == pytest.approx(0.5)
    assert "## Per call" not in text


def test_pool_refuses_folders_that_disagree_or_are_missing(tmp_path, capsys):
    d1 = _call(tmp_path / "x", {"a": (3.0, [(2.8, 0.0)]), "b": (1.0, [(1.0, 0.0)])})
    d2 = _call(tmp_path / "y", {"a": (2.5, [(2.8, 0.0)]), "b": (1.0, [(1.0, 0.0)])})
    with pytest.raises(SystemExit) as e:
        main(["--pool", d1, d2, "--out", str(tmp_path / "p.md")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "y/validation.json" in err and "predicted 2.5 here but 3.0" in err
    # --predicted-from prices both calls with x's predictions: then they pool
    with pytest.raises(SystemExit) as e:
        main(["--pool", d1, d2, "--predicted-from", d1, "--out", str(tmp_path / "p.md")])
    assert e.value.code == 0 and "| a | 3.000 | 2.800 | 2 |" in (tmp_path / "p.md").read_text()
    with pytest.raises(SystemExit) as e:
        main(["--pool", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.md")])
    assert e.value.code == 2 and "nowhere/validation.json: not found" in capsys.readouterr().err
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "validation.json").write_text(json.dumps({"runs": {"a": {"predicted": {"throughput_rps": 1},
                                                                               "measured": [{"tps": 1}]}}}))
    with pytest.raises(SystemExit) as e:
        main(["--pool", str(tmp_path / "z")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "runs.a.measured[0].throughput_rps: missing" in err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "some.json"), "--pool", d1])
    assert e.value.code == 2 and "give no CONFIG" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "some.json")])
    assert e.value.code == 2 and "--trace is required" in capsys.readouterr().err

"""The deployment spec and the command-line flags generated from it: one loader, one declaration and one default
per option, old flag spellings and config-file keys kept, bad values located."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from tangram.cli import DEST, from_cli, parse, spec_parser
from tangram.config import GIB, MODES, EngineConfig, get_gpu, get_model
from tangram.errors import ConfigError, InputError
from tangram.spec import ENGINE_OPTIONS, OPTIONS, SPEC_OPTIONS, DeploymentSpec, load

ROOT = Path(__file__).resolve().parents[1]


def _tools() -> dict[str, argparse.ArgumentParser]:
    """Every tool's parser that takes spec options."""
    from tangram import memory, placement
    from tangram.engine import bench
    from tangram.sim import cli as sim_cli
    from tangram.sim import fit_engine
    from tangram.tuning import cli as tune_cli
    from tangram.tuning import validate

    return {"tangram-sim": sim_cli._parser(), "tangram-bench": bench._parser(), "tangram-mem": memory._parser(),
            "tangram-tune": tune_cli._parser(), "tangram-validate": validate._parser(),
            "tangram-fit-engine": fit_engine._parser(), "tangram-placement": placement._parser()}


def test_every_config_field_is_an_option_with_help():
    """A new EngineConfig/DeploymentSpec field without a docstring would silently be no option: every field is
    one, but the mode (the spec's --mode) and the spec's engine and report label."""
    eng = {f.name for f in dataclasses.fields(EngineConfig)} - {"mode"}
    assert {s.name for s in ENGINE_OPTIONS} == eng
    spec = {f.name for f in dataclasses.fields(DeploymentSpec)} - {"engine", "profile_label"}
    assert {s.name for s in SPEC_OPTIONS} == spec
    for s in OPTIONS.values():
        assert len(s.help) > 8, s.name


def test_defaults_are_the_dataclasses_defaults():
    """No option given anywhere: the spec is the one built by hand from the presets and EngineConfig()."""
    spec = load()
    assert spec.engine == EngineConfig()
    assert (spec.model, spec.gpu) == (get_model("llama-3.1-8b"), get_gpu("h100-80gb"))
    assert (spec.replicas, spec.router, spec.seed, spec.tables, spec.engine_overhead) == (1, "session-affinity", 0,
                                                                                          "auto", True)
    assert spec.mode_list == list(MODES) and spec.modes is None and spec.slo_targets() is None


def test_every_tool_declares_no_default_of_its_own_for_an_engine_option():
    """Engine flags were declared four times with different defaults (rho 0.3 in tangram-mem): now no parser holds
    a default for a spec option (absent = not given), so every tool's spec without flags has the same engine."""
    for name, p in _tools().items():
        spec_actions = [a for a in p._actions if a.dest.startswith(DEST)]
        assert spec_actions, name
        for a in spec_actions:
            assert a.default is argparse.SUPPRESS, (name, a.dest)
    eng = {}
    for name, argv in (("tangram-sim", []), ("tangram-bench", []), ("tangram-mem", []),
                       ("tangram-fit-engine", ["t.jsonl"])):
        eng[name] = from_cli(parse(_tools()[name], argv)).engine.with_(mode="tangram")
    assert all(e == EngineConfig() for e in eng.values()), eng


def test_flags_and_config_keys_give_the_same_spec(tmp_path):
    """The same options through flags (old spellings included) and through a config file (old keys included)."""
    argv = ["--hp", "2", "--alpha", "1", "--chunk", "512", "--max-batched-tokens", "4096", "--kv-pool-gib", "1.5",
            "--no-clustering", "--calibration", "none", "--mode", "tangram", "--seed", "3", "--no-engine-overhead",
            "--score-method", "keydiff", "--rho", "0.5", "--tp", "2", "--placement", "contiguous"]
    a = from_cli(parse(_tools()["tangram-sim"], argv))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"heads_per_group": 2, "alpha": 1, "chunk_size": 512, "max_batched_tokens": 4096,
                               "kv_pool_bytes": int(1.5 * GIB), "clustering": False, "calibration": "none",
                               "mode": "tangram", "seed": 3, "engine_overhead": False, "score_method": "keydiff",
                               "rho": 0.5, "tp": 2, "placement": "contiguous"}))
    b = load(cfg)
    assert a.engine == b.engine == EngineConfig(mode="tangram", heads_per_group=2, alpha=1.0, chunk_size=512,
                                                max_batched_tokens=4096, kv_pool_bytes=int(1.5 * 2**30),
                                                clustering=False, score_method="keydiff", rho=0.5, tp=2,
                                                placement="contiguous")
    assert (a.tables, a.seed, a.engine_overhead, a.modes) == (b.tables, b.seed, b.engine_overhead, b.modes) == \
        (None, 3, False, ("tangram",))


def test_precedence_tool_default_file_command_line(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"rho": 0.5, "out": "from-file", "weights": "random"}))
    p = spec_parser("t", None, ("engine", "run", "output"), defaults={"out": "tool-out", "weights": "auto"})
    s = from_cli(parse(p, ["--config", str(cfg), "--rho", "0.75"]))
    assert (s.engine.rho, s.out, s.weights) == (0.75, "from-file", "random")
    s = from_cli(parse(p, []))
    assert (s.engine.rho, s.out, s.weights) == (0.25, "tool-out", "auto")


def test_bad_values_are_located(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text('{\n "model": "llama-3.1-8b",\n "page_size": 16.5\n}\n')
    with pytest.raises(InputError, match=r"c\.json:3: page_size: expected an integer, got 16\.5"):
        load(cfg)
    cfg.write_text('{\n "alpha": 1.0,\n "heads_per_grp": 2\n}\n')
    with pytest.raises(InputError, match=r"c\.json:3: heads_per_grp: unknown option"):
        load(cfg)
    cfg.write_text('{"clustering": "yes"}')
    with pytest.raises(InputError, match="clustering: expected true or false"):
        load(cfg)
    with pytest.raises(ConfigError, match="--rho: expected a number"):
        load(None, {"rho": "0.3"})
    from tangram.sim.cli import main

    for argv, needle in ((["--page-size", "16.5"], "argument --page-size: expected an integer, got '16.5'"),
                         (["--rho", "nan"], "argument --rho: expected a finite number"),
                         (["--router", "random"], "argument --router: expected one of"),
                         (["--rho", "1.5"], "rho must be in (0, 1]"),
                         (["--hp", "3"], "--hp 3 must divide llama-3.1-8b's 8 KV heads"),
                         (["--mod", "full"], "unrecognized arguments: --mod")):  # no abbreviations
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count("\n") == 1, (argv, err)


def test_a_config_paths_are_read_from_the_working_directory_and_a_miss_beside_it_is_explained(tmp_path,
                                                                                                monkeypatch):
    """A relative path in a config file is read from the working directory, as the flag is. A config written for its
    own folder (the trace beside it, missing from the working directory) fails at its key's line saying where the
    file is, not later with a bare "no such file"."""
    from tangram.traces import save_trace
    from tangram.traces.generate import generate

    d = tmp_path / "cfgs"
    d.mkdir()
    save_trace(generate(2, "short", seed=0), tmp_path / "t.jsonl")
    (d / "c.json").write_text('{\n "mode": "full",\n "trace": "../t.jsonl"\n}\n')
    monkeypatch.chdir(d)
    assert load("c.json").trace == "../t.jsonl"  # found from the working directory
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"c\.json:3: trace: '\.\./t\.jsonl' is not in the working directory .* "
                                         r"write 't\.jsonl' or run from 'cfgs'"):
        load("cfgs/c.json")
    (d / "c.json").write_text('{"trace": "t.jsonl"}')  # present from here: nothing to say
    assert load("cfgs/c.json").trace == "t.jsonl"


def test_help_lists_each_option_once_with_its_docstring_and_default():
    text = _tools()["tangram-sim"].format_help()
    for s in ENGINE_OPTIONS:
        assert text.count(s.flag + " ") + text.count(s.flag + ",") + text.count(s.flag + "\n") >= 1, s.flag
    assert "heads per group H_p of ragged paging" in " ".join(text.split())
    assert "(default: 4)" in text and "(default: 0.25)" in text


def _private_parser_imports() -> list[str]:
    """``from X import _parser`` (or any private name ending in parser) across modules, and ArgumentParser
    subclasses outside tangram/cli.py."""
    bad = []
    for d in ("tangram", "sim", "tuning", "traces", "kernels"):
        for f in (ROOT / d).rglob("*.py"):
            tree = ast.parse(f.read_text(), str(f))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    bad += [f"{f.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                            if a.name.startswith("_") and "parser" in a.name.lower()]
                if isinstance(node, ast.ClassDef) and f.relative_to(ROOT) != Path("tangram/cli.py"):
                    bad += [f"{f.relative_to(ROOT)}:{node.lineno} subclasses ArgumentParser" for b in node.bases
                            if (isinstance(b, ast.Attribute) and b.attr == "ArgumentParser")
                            or (isinstance(b, ast.Name) and b.id == "ArgumentParser")]
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "ArgumentParser":
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} builds a plain argparse.ArgumentParser")
    return bad


def test_no_module_imports_another_modules_private_parser():
    assert _private_parser_imports() == []


def test_configuration_doc_lists_the_generated_options():
    from tangram.cli import options_markdown

    assert options_markdown() in (ROOT / "docs" / "configuration.md").read_text(), \
        "docs/configuration.md is stale: regenerate its table with python -m tangram.cli"


def test_sweep_flags_take_the_options_type_choices_and_default(capsys):
    """tangram-tune's --tp/--placement (the degrees and placements searched) are EngineConfig's tp and placement
    options taking several values: the same type check and choices, EngineConfig's default when absent."""
    p = _tools()["tangram-tune"]
    a = parse(p, [])
    assert (a.tp, a.placement) == ([EngineConfig().tp], [EngineConfig().placement]) == ([1], ["balanced"])
    a = parse(p, ["--tp", "1", "2", "--placement", "contiguous", "balanced"])
    assert (a.tp, a.placement) == ([1, 2], ["contiguous", "balanced"])
    for argv, needle in ((["--tp", "1", "1.5"], "argument --tp: expected an integer, got '1.5'"),
                         (["--placement", "random"], "argument --placement: expected one of contiguous, balanced")):
        with pytest.raises(SystemExit) as e:
            parse(p, argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count("\n") == 1, (argv, err)


def test_placement_tool_groups_a_ranks_heads_unless_hp_is_given(capsys):
    """tangram-placement without --hp groups all KV heads of a rank: 8 KV heads of Llama-3.1-8B over 2 and 4 ranks
    are groups of 4 and 2; --hp 1 (a generated flag) applies to every degree."""
    from tangram.placement import main

    for argv, hps in ((["--tp", "2", "4"], [4, 2]), (["--tp", "2", "4", "--hp", "1"], [1, 1])):
        with pytest.raises(SystemExit) as e:
            main(["--model", "llama-3.1-8b", "--context", "1024", "--json", *argv])
        assert e.value.code == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert [(r["tp"], r["hp"]) for r in rows] == [(2, hps[0]), (2, hps[0]), (4, hps[1]), (4, hps[1])]


def test_default_head_group_size_divides_a_ranks_kv_heads():
    """Without H_p given, 4 or the largest divisor below it of a rank's KV heads (a group lives on one rank): every
    default deployment is valid; an H_p given that does not divide them is still the error."""
    assert load(None, {}).engine.heads_per_group == 4
    assert load(None, {"model": "smollm2-135m"}).engine.heads_per_group == 3
    assert load(None, {"tp": 4}).engine.heads_per_group == 2
    assert load(None, {"tp": 8}).engine.heads_per_group == 1
    with pytest.raises(ConfigError, match="H_p=4 must divide the 1 KV heads of a rank"):
        load(None, {"tp": 8, "heads_per_group": 4})
    with pytest.raises(ConfigError, match="--hp 4 must divide smollm2-135m's 3 KV heads"):
        load(None, {"model": "smollm2-135m", "heads_per_group": 4})

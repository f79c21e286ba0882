"""The folder layout installs under the tangram namespace, both as a wheel and editable."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tangram", "tangram.harness", "tangram.sim", "tangram.kernels", "tangram.traces", "tangram.tuning", "tangram.engine",
           "tangram.profiles"]


def _import_from(tmp_path, env_extra):
    code = ("import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in %r}))"
            % (MODULES,))
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def test_no_generic_top_level_names():
    """Importing every tangram module, even from the repository root (where ``kernels/`` etc. are plain folders on
    ``sys.path``), binds none of the generic names: our code only ever imports ``tangram.*``."""
    code = ("import importlib, json, sys; [importlib.import_module(m) for m in %r]; "
            "print(json.dumps(sorted(n for n in ('sim', 'kernels', 'traces', 'tuning') if n in sys.modules)))"
            % (MODULES,))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_regular_install_imports(tmp_path):
    import shutil
    # build from a clean copy: a stale build/ of a dev checkout would hide files the package config leaves out
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", ".venv", ".git", "__pycache__",
                                                             ".hypothesis", ".pytest_cache", "tangram-sim-out"))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(r.stderr[-2000:])
    files = _import_from(tmp_path, {"PYTHONPATH": str(target)})
    for m, f in files.items():
        assert f.startswith(str(target)), (m, f)
    assert files["tangram.sim"].endswith(os.path.join("tangram", "sim", "__init__.py"))
    assert (target / "tangram" / "traces" / "data" / "default.jsonl").exists()
    # the simulator's measured coefficients and tables travel with the wheel (else it silently uses defaults)
    for data in ("tables/host_coeffs.json", "tables/h100/meta.json", "tables/h100/engine_overhead.json"):
        assert (target / "tangram" / "sim" / data).exists(), data


def test_editable_install_maps_folders():
    # The development install (pip install -e .) maps each folder to its tangram.* name.
    import tangram.kernels
    import tangram.sim
    import tangram.traces
    import tangram.tuning
    if not str(Path(tangram.sim.__file__).resolve()).startswith(str(ROOT)):
        pytest.skip("tangram is installed non-editable in this environment")
    assert Path(tangram.sim.__file__).resolve() == ROOT / "sim" / "__init__.py"
    assert Path(tangram.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(tangram.traces.__file__).resolve() == ROOT / "traces" / "__init__.py"
    assert Path(tangram.tuning.__file__).resolve() == ROOT / "tuning" / "__init__.py"


SCRIPTS = ["tangram-sim", "tangram-trace", "tangram-mem", "tangram-bench", "tangram-profile", "tangram-calibrate",
           "tangram-fidelity", "tangram-fit-engine", "tangram-fit-host", "tangram-probe", "tangram-placement",
           "tangram-tune", "tangram-validate", "tangram-kernels-bench", "tangram-accuracy"]


def test_console_scripts_are_declared_and_run():
    """Every command the README and docs name is an installed console script whose --help works."""
    import shutil
    import tomllib
    from importlib.metadata import entry_points

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(declared) == sorted(SCRIPTS)
    installed = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    for name in SCRIPTS:
        assert installed.get(name) == declared[name], f"{name} is not installed from this checkout (pip install -e .)"
        exe = shutil.which(name) or str(Path(sys.executable).parent / name)
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage:" in r.stdout, (name, r.stderr[-1500:])

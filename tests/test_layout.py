"""The architecture's import rules, checked on the source (an AST walk: nothing is imported or run).

* The control plane (every module of ``tangram/`` outside ``tangram.engine`` and ``tangram.profiles``) imports no
  torch/triton and nothing from the engine, the simulator, the kernels, the profiles (but their torch-free
  registry of shipped data files, ``tangram.profiles.registry``) or the tuner; only the
  trace-replay harness (``tangram.harness``) may use SimPy, as its event loop.
* The engine never imports the simulator; the simulator never imports the engine except its fitting code
  (``tangram.sim.fit_engine``). Any other module that imports both is a command-line entry point (``tangram-bench``
  records the machine probe and the scales it gives the simulator's tables).
* The kernels see only the control plane (their benchmark CLI, ``tangram.kernels.bench``, also the engine's split
  table, to time the maps the engine launches); the traces package only the control plane too.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _modules() -> dict[str, Path]:
    """Module name -> source file, from pyproject's package-dir mapping (tangram.sim lives in sim/, ...)."""
    out: dict[str, Path] = {}
    for pkg, d in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for f in (ROOT / d).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / d).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


MODULES = _modules()
ENTRY_POINTS = {v.split(":")[0] for v in PYPROJECT["project"]["scripts"].values()}


def imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import statement, at any depth, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            out.append((mod, names, node.lineno))
            if node.module is None:  # from . import x: x is a module
                out += [(f"{mod}.{n}", [], node.lineno) for n in names]
    return out


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def is_core(name: str) -> bool:
    return name.startswith("tangram") and not _under(name, "tangram.engine", "tangram.profiles", "tangram.sim",
                                                     "tangram.kernels", "tangram.traces", "tangram.tuning")


def violations(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    bad = []
    for name, path in sorted(modules.items()):
        imps = imports_of(name, path)
        where = lambda line: f"{path.relative_to(root)}:{line} ({name})"  # noqa: E731
        uses_engine = _under(name, "tangram.engine")
        uses_sim = _under(name, "tangram.sim")
        for mod, names, line in imps:
            if is_core(name):
                if _under(mod, "torch", "triton", "tangram.engine", "tangram.sim", "tangram.kernels",
                          "tangram.profiles", "tangram.tuning") and mod != "tangram.profiles.registry":
                    bad.append(f"{where(line)}: the control plane imports {mod}")
                if _under(mod, "simpy") and not _under(name, "tangram.harness"):
                    bad.append(f"{where(line)}: only tangram.harness may use SimPy, not {name}")
            if _under(name, "tangram.engine") and _under(mod, "tangram.sim") and name not in ENTRY_POINTS:
                bad.append(f"{where(line)}: the engine imports the simulator ({mod})")
            if _under(name, "tangram.sim") and _under(mod, "tangram.engine") and name != "tangram.sim.fit_engine":
                bad.append(f"{where(line)}: the simulator imports the engine ({mod})")
            # the kernels' benchmark CLI times the kernels as the engine launches them (its split table)
            engine_ok = _under(name, "tangram.kernels.bench") and _under(mod, "tangram.engine")
            if _under(name, "tangram.kernels", "tangram.traces") and not engine_ok and _under(
                    mod, "tangram.engine", "tangram.sim", "tangram.profiles", "tangram.tuning"):
                bad.append(f"{where(line)}: {name.split('.')[1]} imports {mod}")
            uses_engine |= _under(mod, "tangram.engine")
            uses_sim |= _under(mod, "tangram.sim")
        if uses_engine and uses_sim and name not in ENTRY_POINTS and name != "tangram.sim.fit_engine":
            bad.append(f"{path.relative_to(root)} ({name}): imports both the engine and the simulator but is "
                       "neither the fitting code nor a command-line entry point")
    return bad


def test_every_package_is_walked():
    names = set(MODULES)
    for must in ("tangram.scheduler", "tangram.harness.cluster", "tangram.spec", "tangram.sim.costmodel",
                 "tangram.sim.fit_engine", "tangram.engine.executor", "tangram.kernels.decode",
                 "tangram.traces.format", "tangram.tuning.validate", "tangram.profiles.scoring"):
        assert must in names, must
    assert not any(n.startswith("tangram.tests") for n in names)


def test_import_rules_hold():
    bad = violations(MODULES)
    assert not bad, "import rule violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,line,needle", [
    ("tangram.scheduler", "import torch", "control plane imports torch"),
    ("tangram.harness.summary", "from tangram.sim.costmodel import CostModel", "control plane imports tangram.sim"),
    ("tangram.paging", "import simpy", "only tangram.harness may use SimPy"),
    ("tangram.engine.executor", "from tangram.sim.run import simulate", "the engine imports the simulator"),
    ("tangram.sim.run", "from tangram.engine.executor import Executor", "the simulator imports the engine"),
    ("tangram.tuning.objective", "from tangram.engine.bench import run_mode",
     "imports both the engine and the simulator"),
])
def test_a_forbidden_import_is_caught(tmp_path, module, line, needle):
    """The checker itself: adding one forbidden import to a copy of a module is reported."""
    src = MODULES[module]
    f = tmp_path / src.relative_to(ROOT)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(src.read_text() + f"\n\ndef _added():\n    {line}\n")
    assert not violations({module: src})
    bad = violations({module: f}, tmp_path)
    assert any(needle in b for b in bad), bad

"""``reports/`` holds data, Markdown and one ``run.sh`` per experiment (issue 17 item 4), checked on the git tree.

* No path under ``reports/`` is named by a run counter (``session``, ``callN``, ``runN``): a folder says what it
  measures (and, for a device measurement, the date), and a superseded result lives in git history.
* No Python under ``reports/``: the logic of an experiment is in the package or in ``benchmarks/``; a ``run.sh``
  calls it from there.
* Every relative link and backquoted repository path in a ``reports/**/README.md`` points at a file that exists.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COUNTER = re.compile(r"session|call\d|run\d", re.IGNORECASE)


def _tracked(under: str) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", under], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.splitlines() if (ROOT / p).exists()]


def counter_names(paths: list[str]) -> list[str]:
    """The paths with a folder or file name that counts runs (the whole path is reported once)."""
    return sorted(p for p in paths if any(COUNTER.search(part) for part in Path(p).parts[1:]))


def python_files(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if p.endswith(".py"))


def test_counter_names_are_found():
    paths = ["reports/validation/h100_session6/run2_call4/report.md", "reports/kernels/run4/meta.json",
             "reports/kernels/regime_routing/decode_attention_call3.csv", "reports/engine/predicted/run.sh",
             "reports/tuning/study/trials.csv", "reports/validation/h100_calibrated_2026-11-23/ops_timed/ops.log"]
    assert counter_names(paths) == sorted(paths[:3])


def test_reports_are_not_named_by_run_counters():
    bad = counter_names(_tracked("reports"))
    assert not bad, f"{len(bad)} paths under reports/ named by a run counter, e.g. {bad[:5]}"


def test_no_python_under_reports():
    bad = python_files(_tracked("reports"))
    assert not bad, f"Python under reports/ (move it into the package or benchmarks/): {bad}"


def test_every_experiment_folder_has_one_run_sh():
    """A folder with a run.sh is an experiment; no other shell script sits beside or below it."""
    scripts = [p for p in _tracked("reports") if p.endswith(".sh")]
    bad = [p for p in scripts if Path(p).name != "run.sh"]
    assert not bad, f"shell scripts under reports/ other than run.sh: {bad}"


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"`((?:reports|docs|sim|tangram|tuning|kernels|traces|benchmarks|tests)/[A-Za-z0-9_./-]+)`")


def broken_links(readme: Path) -> list[str]:
    """Relative Markdown links (from the README's folder) and backquoted repo paths that name no file."""
    text = readme.read_text()
    bad = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (readme.parent / target).exists():
            bad.append(target)
    for target in _PATH.findall(text):
        if any(c in target for c in "*{") or "/tmp/" in target:
            continue
        if not (ROOT / target.rstrip(".")).exists():
            bad.append(target)
    return bad


def test_report_readmes_have_no_broken_links():
    bad = {p: b for p in _tracked("reports") if p.endswith("README.md") for b in [broken_links(ROOT / p)] if b}
    assert not bad, f"broken links in report READMEs: {bad}"

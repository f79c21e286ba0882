"""Kill-and-resume acceptance of tangram-tune (issue 6): SQLite, and PostgreSQL with two workers.

A worker is SIGKILLed while one of its trials runs (after >= 2 trials completed); the study is restarted
on the same storage. Every trial completed before the kill must still be there with the same values and
parameters, the study must reach the requested number of completed trials, and the killed trial must end
FAIL (heartbeat older than the grace period -> failed by the next worker, retried with the same params).
Trials use --objective-fast on a 4-session trace, so each takes well under 2 s; the storage, heartbeat and
resume code is the CLI's own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

from tangram.traces import generate, save_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT, GRACE = 1, 2


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    save_trace(generate(4, "short", seed=3, turns="uniform:1:2", output_tokens="lognormal:32:0.5:8:64"), p)
    return p


def _worker(trace, url, study, out, trials, idx=None, report=False):
    args = [sys.executable, "-m", "tangram.tuning.cli", str(trace), "--trials", str(trials), "--storage", url,
            "--study", study, "--out", str(out), "--objective-fast", "--slo", "ttft_p99=60s", "--no-plots",
            "--heartbeat", str(HEARTBEAT), "--grace", str(GRACE)]
    if idx is not None:
        args += ["--worker-index", str(idx)]
    if not report:
        args += ["--no-report"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _trials(url, study):
    from tangram.tuning.study import make_storage
    storage = make_storage(url, heartbeat_s=None)  # the CLI's opener: safe while a worker creates the schema
    try:
        return optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=True)
    except KeyError:  # study not created yet
        return []
    finally:
        storage.remove_session()
        storage.engine.dispose()


def _kill_mid_trial(proc, url, study, timeout=120.0):
    """SIGKILL ``proc`` while one of its trials is RUNNING, once >= 2 trials completed; returns (completed, killed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"worker ended before it could be killed: {proc.communicate()[1][-2000:]}")
        ts = _trials(url, study)
        done = [t for t in ts if t.state == TrialState.COMPLETE]
        mine = [t for t in ts if t.state == TrialState.RUNNING and t.user_attrs.get("worker_pid") == proc.pid]
        if len(done) >= 2 and mine:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            ts = _trials(url, study)
            running = [t for t in ts if t.state == TrialState.RUNNING and t.user_attrs.get("worker_pid") == proc.pid]
            if running:  # the kill landed inside a trial (not in the gap after it completed)
                return {t.number: (t.values, t.params) for t in ts if t.state == TrialState.COMPLETE}, running[0].number
            return None, None
        time.sleep(0.05)
    pytest.fail("no trial was seen running within the timeout")


def _check_resumed(url, study, before, killed, trials):
    ts = {t.number: t for t in _trials(url, study)}
    for n, (values, params) in before.items():
        assert ts[n].state == TrialState.COMPLETE, f"trial {n} lost its COMPLETE state"
        assert ts[n].values == values and ts[n].params == params, f"trial {n} changed"
    assert sum(t.state == TrialState.COMPLETE for t in ts.values()) >= trials
    assert ts[killed].state == TrialState.FAIL
    assert not [t for t in ts.values() if t.state == TrialState.RUNNING]
    # the retry of the killed trial re-runs its parameters (COMPLETE, or WAITING if the study was already full);
    # a kill that lands while the trial is still suggesting leaves it a subset, which the retry completes
    retries = [t for t in ts.values() if t.system_attrs.get("failed_trial") == killed]
    kp = ts[killed].params
    assert retries and all(t.state == TrialState.WAITING or {k: t.params.get(k) for k in kp} == kp for t in retries)


def _finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_sqlite_sigkill_and_resume(tmp_path, tiny_trace):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    # enough trials that the worker is still running when two have completed and the poll (an SQLite open, tens of
    # ms) sees one RUNNING: with 7 fast trials a faster simulator finished the study between polls
    study, trials = "resume", 25
    for _ in range(3):  # retried only if the kill fell in the few ms between two trials
        w = _worker(tiny_trace, url, study, tmp_path / "out", trials)
        before, killed = _kill_mid_trial(w, url, study)
        if killed is not None:
            break
    else:
        pytest.fail("could not kill the worker inside a trial in 3 attempts")
    time.sleep(GRACE + HEARTBEAT)  # the killed trial's heartbeat is now stale
    out = _finish(_worker(tiny_trace, url, study, tmp_path / "out", trials, report=True))
    assert "completed trials" in out
    _check_resumed(url, study, before, killed, trials)
    assert (tmp_path / "out" / "best_config.json").is_file()


def _pg_url() -> str | None:
    url = os.environ.get("TANGRAM_PG_URL")
    if url:
        return url
    script = ROOT / ".ci" / "postgres.sh"
    try:
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = [x for x in r.stdout.splitlines() if x.startswith("export TANGRAM_PG_URL=")]
    return line[-1].split("=", 1)[1] if r.returncode == 0 and line else None


def test_postgres_two_workers_kill_one(tmp_path, tiny_trace):
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    try:
        import psycopg  # noqa: F401  (SQLAlchemy 2.1's default driver for postgresql:// URLs)
    except ImportError:
        (pytest.fail if in_ci else pytest.skip)("psycopg is not installed: pip install 'psycopg[binary]'")
    url = _pg_url()
    if url is None:  # never a silent skip in CI
        (pytest.fail if in_ci else pytest.skip)(
            "PostgreSQL unavailable: set TANGRAM_PG_URL or let .ci/postgres.sh start a server")
    # A starts first and the study has room for both: if B started first it could run every trial before A has
    # one running (seen once on a loaded machine: "worker ended before it could be killed")
    # 40 trials: with 16 the two fast workers once finished the study before a poll saw A running a trial
    study, trials = f"pg-{uuid.uuid4().hex[:10]}", 40
    b = None
    for _ in range(3):
        a = _worker(tiny_trace, url, study, tmp_path / "out", trials, idx=0)
        if b is None:
            b = _worker(tiny_trace, url, study, tmp_path / "out", trials, idx=1)
        before, killed = _kill_mid_trial(a, url, study)
        if killed is not None:
            break
    else:
        pytest.fail("could not kill worker A inside a trial in 3 attempts")
    # worker B keeps going; A is restarted on the same storage after its heartbeat went stale
    time.sleep(GRACE + HEARTBEAT)
    a2 = _worker(tiny_trace, url, study, tmp_path / "out", trials, idx=2)
    _finish(a2)
    _finish(b)
    out = _finish(_worker(tiny_trace, url, study, tmp_path / "out", trials, report=True))
    assert "completed trials" in out
    _check_resumed(url, study, before, killed, trials)
    # both workers really shared the study: A's killed trial and B's completed ones are rows of the same study
    ts = {t.number: t for t in _trials(url, study)}
    assert ts[killed].user_attrs.get("worker_pid") == a.pid
    assert any(t.state == TrialState.COMPLETE and t.user_attrs.get("worker_pid") == b.pid for t in ts.values())


def test_stale_trial_failed_even_when_study_already_complete(tmp_path, tiny_trace):
    """A restart that has no trial left to run must still fail the killed worker's RUNNING trial."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    # 25 trials, as in test_sqlite_sigkill_and_resume: with 6 a fast worker finished the whole study between two
    # polls of the storage (CI, "worker ended before it could be killed")
    for _ in range(3):
        w = _worker(tiny_trace, url, "stale", tmp_path / "out", 25)
        before, killed = _kill_mid_trial(w, url, "stale")
        if killed is not None:
            break
    else:
        pytest.fail("could not kill the worker inside a trial in 3 attempts")
    time.sleep(GRACE + HEARTBEAT)
    _finish(_worker(tiny_trace, url, "stale", tmp_path / "out", len(before), report=True))  # nothing to run
    ts = {t.number: t for t in _trials(url, "stale")}
    assert ts[killed].state == TrialState.FAIL
    assert sum(t.state == TrialState.COMPLETE for t in ts.values()) == len(before)


def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_retried(tmp_path):
    """A worker killed between creating a trial and its first heartbeat leaves a RUNNING trial without a heartbeat
    row; Optuna's stale check skips it, so fail_stale must fail it (and enqueue its retry) once the grace period
    has passed, and leave a trial with a fresh heartbeat alone."""
    import optuna
    from optuna.trial import TrialState
    from tangram.tuning.study import fail_stale, make_storage

    storage = make_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_s=1, grace_s=2)
    study = optuna.create_study(storage=storage, study_name="orphan")
    orphan = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})  # RUNNING, no heartbeat recorded
    alive = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    assert fail_stale(study) == []  # within the grace period: nothing failed
    time.sleep(2.5)
    storage.record_heartbeat(alive._trial_id)  # a live worker's trial
    assert fail_stale(study) == [orphan.number]
    ts = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert ts[orphan.number].state == TrialState.FAIL and ts[alive.number].state == TrialState.RUNNING
    retries = [t for t in ts.values() if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retries) == 1 and retries[0].state == TrialState.WAITING and retries[0].params == orphan.params

"""tangram.metrics: records, summaries and byte-stable files shared by the engine and the simulator."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from tangram.metrics import (REQUEST_COLUMNS, RequestRecord, latency_summary, records_frame, rnd,
                             time_weighted_mean, write_metrics, write_requests_csv)


def _rec(i, status="finished", arrival=0.0, first=1.0, finish=2.0, out=5, reason=""):
    r = RequestRecord(f"s{i}:0", i, f"s{i}", 0, 100, out, status=status, reason=reason, arrival_s=arrival)
    if status == "finished":
        r.admitted_s, r.first_token_s, r.finish_s = arrival, first, finish
    return r


def test_derived_latencies():
    r = _rec(0, arrival=1.0, first=1.5, finish=3.5, out=5)
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(2.5)
    assert r.tpot_s == pytest.approx(2.0 / 4)
    assert _rec(1, out=1).tpot_s is None  # a single output token has no inter-token time
    rej = _rec(2, status="rejected", reason="too big")
    assert rej.ttft_s is None and rej.tpot_s is None and rej.e2e_s is None


def test_latency_summary_counts_every_request():
    rng = np.random.default_rng()
    recs = [_rec(i, arrival=float(i), first=i + rng.uniform(0.1, 1), finish=i + 2.0) for i in range(20)]
    recs.append(_rec(20, status="rejected", reason="turn needs 9 KV pages (0.01 GiB) but the whole pool holds 3"))
    recs.append(_rec(21, status="rejected", reason="previous turn rejected"))
    s = latency_summary(recs)
    assert s["requests"] == 22 and s["completed"] == 20 and s["rejected"] == 2
    assert s["rejected_reasons"] == {"previous turn rejected": 1, "turn larger than the KV pool": 1}
    ttft = np.array([r.ttft_s for r in recs[:20]])
    assert s["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    assert s["throughput_rps"] == pytest.approx(20 / (21.0 - 0.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=30), st.floats(0, 1e3))
def test_time_weighted_mean_bounds(vals, extra):
    t = np.cumsum(np.r_[0.0, np.ones(len(vals) - 1)])
    m = time_weighted_mean(t, np.array(vals), t[-1] + extra)
    assert min(vals) - 1e-6 <= m <= max(vals) + 1e-6


def test_time_weighted_mean_weights_by_duration():
    assert time_weighted_mean(np.array([0.0, 1.0]), np.array([10.0, 0.0]), 4.0) == pytest.approx(2.5)


def test_metrics_json_is_byte_stable_and_rounded(tmp_path):
    x = float(np.random.default_rng().uniform(0, 1))
    a = write_metrics(tmp_path / "a.json", {"b": {"v": x, "n": np.int64(3), "nan": float("nan")}, "a": [np.float32(1.5)]})
    b = write_metrics(tmp_path / "b.json", {"a": [1.5], "b": {"nan": None, "n": 3, "v": x * (1 + 1e-12)}})
    assert a.read_bytes() == b.read_bytes()
    d = json.loads(a.read_text())
    assert list(d) == ["a", "b"] and d["b"]["nan"] is None and d["b"]["v"] == rnd(x)
    assert rnd(123456789.123) == 123457000.0 and rnd(None) is None and rnd(True) is True


def test_requests_csv_schema(tmp_path):
    recs = [_rec(0), _rec(1, status="rejected", reason="previous turn rejected")]
    p = write_requests_csv(tmp_path / "r.csv", [records_frame(recs, mode="tangram")])
    df = pd.read_csv(p)
    assert list(df.columns) == ["mode"] + REQUEST_COLUMNS
    assert len(df) == 2 and df.loc[1, "reason"] == "previous turn rejected" and np.isnan(df.loc[1, "ttft_s"])

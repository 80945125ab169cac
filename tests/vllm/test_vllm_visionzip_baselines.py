"""Issue 31's VisionZip baselines in vLLM (``scope=request``, the bundle path): ``visionzip.method=random`` and
``pool`` give the HF engine's tokens token for token, at VisionZip's budget, and differ from VisionZip
(attention) in what they keep. Two engines: ``random`` (``first`` takes the same top-k-on-scores path in the
bundle, and ``random`` also checks that the seed reaches the workers) and ``pool`` (its own branch: each image
average-pooled to its share of the budget); every method is tested against its reference in the main suite,
tests/techniques/test_visionzip_baselines.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_lane_helpers import engine_cfg, gen_cfg

NEW = 8


def _vz(method):
    return SimpleNamespace(keep=0.5, contextual=0.0, scope="request", layer=-1, min_per_image=1, method=method,
                           seed=3)


@pytest.fixture(scope="module", params=["random", "pool"])
def method_run(request, tiny_model_path, requests_text_images):
    from harness.engines.vllm.engine import VLLMEngine

    _, images = requests_text_images
    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(NEW), max_images_per_prompt=4,
                     visionzip_cfg=_vz(request.param))
    try:
        yield request.param, images, eng.generate_batch(images)
    finally:
        eng.close()


def test_baseline_equals_hf_and_is_not_visionzip(method_run, hf_ref):
    from harness.techniques.visionzip.pruning import budget

    method, requests, gens = method_run
    by_uid = {g.uid: g for g in gens}
    differs_from_attention = False
    for req in requests:
        gen, ref = by_uid[req.uid], hf_ref.generate_visionzip(req, _vz(method), max_new_tokens=NEW)
        assert gen.error is None, gen.error
        assert gen.extra["token_ids"] == ref["ids"], (method, req.uid)
        assert gen.visual_tokens == ref["visual_tokens"]
        sizes = [int(g.prod()) // 4 for g in hf_ref.inputs(req)["image_grid_thw"]]
        assert gen.visual_tokens == budget(0.5, sum(sizes))  # VisionZip's budget
        attention = hf_ref.generate_visionzip(req, _vz("attention"), max_new_tokens=NEW)
        differs_from_attention |= attention["ids"] != ref["ids"]
    assert differs_from_attention  # a baseline that silently ran VisionZip would fail here

"""VisionZip in vLLM, per-image fixed ratio: the plugin's model subclass keeps budget(keep, n) tokens per
image chosen by the same importance as HF, with their original mRoPE positions and deepstack pruned alike —
HF VisionZip (scope=image) and vLLM produce the same tokens, also when chunked prefill splits an image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_lane_helpers import engine_cfg, gen_cfg

VZ = SimpleNamespace(keep=0.5, contextual=0.0, scope="image", layer=-1, min_per_image=1)
BUDGET = 20  # max_num_batched_tokens: prompts of 26-36 tokens are prefilled in two chunks


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(), max_images_per_prompt=2, visionzip_cfg=VZ,
                     engine_kwargs={"max_num_batched_tokens": BUDGET})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def references(hf_ref, requests_text_images):
    _, images = requests_text_images
    return {r.uid: hf_ref.generate_visionzip(r, VZ) for r in images}


def test_fixed_ratio_token_for_token(engine, hf_ref, requests_text_images, references):
    from harness.techniques.visionzip.pruning import budget

    _, images = requests_text_images
    changed = 0
    for r in images:
        gen = engine.generate_batch([r])[0]
        ref = references[r.uid]
        assert gen.error is None, gen.error
        assert gen.extra["token_ids"] == ref["ids"], r.uid
        assert gen.visual_tokens == ref["visual_tokens"] and gen.prompt_tokens == ref["prompt_tokens"], r.uid
        full = hf_ref.generate(r)
        # budget(keep, n) per image, n = the image's unpruned token count
        sizes = [int(g.prod()) // 4 for g in hf_ref.inputs(r)["image_grid_thw"]]
        assert gen.visual_tokens == sum(budget(VZ.keep, n) for n in sizes) < full["visual_tokens"]
        vz = gen.extra["visionzip"]  # the HF engine's per-request fields
        assert vz["tokens_per_image"] == sizes and sum(sizes) == full["visual_tokens"]
        assert vz["kept_per_image"] == [budget(VZ.keep, n) for n in sizes]
        assert vz["visual_tokens_after"] == gen.visual_tokens
        changed += ref["ids"] != full["ids"]
    assert changed, "VisionZip changed no output: the comparison would not notice a no-op"


def test_batch_of_image_requests(engine, requests_text_images, references):
    _, images = requests_text_images
    for gen in engine.generate_batch(images):
        assert gen.extra["token_ids"] == references[gen.uid]["ids"], gen.uid


def test_text_only_requests_are_untouched(engine, hf_ref, requests_text_images):
    text, _ = requests_text_images
    for r in text[:2]:
        assert engine.generate_batch([r])[0].extra["token_ids"] == hf_ref.generate(r)["ids"]


def test_describe(engine):
    info = engine.describe()["visionzip"]
    assert info["keep"] == VZ.keep and info["scope"] == "image"


@pytest.mark.parametrize("over, match", [({"contextual": 0.1}, "contextual"), ({"min_per_image": 0}, "min_per_image")])
def test_unsupported_settings_are_refused(over, match):
    from harness.engines.vllm.techniques import resolve_visionzip

    assert resolve_visionzip(SimpleNamespace(**{**vars(VZ), "keep": 1.0})) is None
    with pytest.raises(NotImplementedError, match=match):
        resolve_visionzip(SimpleNamespace(**{**vars(VZ), **over}))
    # with one budget per request (the bundle item), both are supported
    st = resolve_visionzip(SimpleNamespace(**{**vars(VZ), **over, "scope": "request"}))
    assert st.scope == "request" and st.arch != resolve_visionzip(VZ).arch

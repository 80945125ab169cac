"""VisionZip in vLLM with ONE budget per request (``scope=request``, the default): the image span as one
multimodal item (harness.engines.vllm.visionzip_request) gives the HF engine's tokens.

One engine for the module (vLLM on two CPU cores is slow): keep 0.5 with contextual tokens (the dominant
and merged tokens, main and deepstack channels), up to 4 images, and a 24-token prefill budget so that
chunked prefill cuts the bundle (and images) across steps. Against HF VisionZip (scope=request, same
settings): the same ids, prompt length and visual-token count for one image, two images of different
sizes (text between and after them) and four images, batched, and the four-image request alone; text-only
requests untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_lane_helpers import _image, engine_cfg, gen_cfg

VZ = SimpleNamespace(keep=0.5, contextual=0.25, scope="request", layer=-1, min_per_image=1)
BUDGET = 24  # max_num_batched_tokens: the 26-60-token prompts are prefilled in several chunks
NEW = 16  # generated tokens (fewer than the lane's default: this module's time stays small)


@pytest.fixture(scope="module")
def many_images():
    import numpy as np

    from harness.engines.base import Request

    rng = np.random.default_rng(7)
    sizes = [(64, 96), (128, 64), (48, 48), (96, 96)]
    content = []
    for i in range(4):
        content += [{"type": "image"}, {"type": "text", "text": f"view {i}"}]
    content.append({"type": "text", "text": "which differ"})
    return Request("img4-0", content, [_image(rng, h, w) for h, w in sizes])


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(NEW), max_images_per_prompt=4, visionzip_cfg=VZ,
                     engine_kwargs={"max_num_batched_tokens": BUDGET})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def requests(requests_text_images, many_images):
    _, images = requests_text_images
    return [*images, many_images]


@pytest.fixture(scope="module")
def references(hf_ref, requests):
    return {r.uid: hf_ref.generate_visionzip(r, VZ, max_new_tokens=NEW) for r in requests}


@pytest.fixture(scope="module")
def batched(engine, requests):
    return engine.generate_batch(requests)


def test_request_budget_token_for_token(batched, hf_ref, requests, references):
    from harness.techniques.visionzip.pruning import budget

    by_uid = {r.uid: r for r in requests}
    assert sorted(g.uid for g in batched) == sorted(by_uid)
    for gen in batched:
        ref = references[gen.uid]
        assert gen.error is None, gen.error
        assert gen.extra["token_ids"] == ref["ids"], gen.uid
        assert gen.prompt_tokens == ref["prompt_tokens"] and gen.visual_tokens == ref["visual_tokens"], gen.uid
        sizes = [int(g.prod()) // 4 for g in hf_ref.inputs(by_uid[gen.uid])["image_grid_thw"]]
        assert gen.visual_tokens == budget(VZ.keep, sum(sizes))  # one budget over all images
        vz = gen.extra["visionzip"]
        assert vz["tokens_per_image"] == sizes and vz["visual_tokens_after"] == gen.visual_tokens
    # the comparison must notice a no-op: pruning changes some request's output
    assert any(references[r.uid]["ids"] != hf_ref.generate(r, max_new_tokens=NEW)["ids"] for r in requests)


def test_alone_equals_reference(engine, many_images, references):
    """Four images alone in the engine: the bundle is cut by every prefill chunk boundary of its own."""
    gen = engine.generate_batch([many_images])[0]
    assert gen.extra["token_ids"] == references[many_images.uid]["ids"]


def test_request_scope_is_not_the_per_image_split(hf_ref, requests):
    """The comparison above must be able to tell the request-wide budget from per-image budgets: for some
    request, HF's request-wide selection keeps other per-image counts than budget(keep, n_i) each."""
    from harness.engines.hf.visionzip import prepare_visionzip_inputs
    from harness.techniques.visionzip.pruning import budget

    differs = 0
    for r in requests:
        _, ctx = prepare_visionzip_inputs(hf_ref.model, hf_ref.inputs(r), VZ)
        stats = ctx.requests[0]
        differs += stats.kept_per_image != [budget(VZ.keep, n) for n in stats.tokens_per_image]
    assert differs


def test_text_only_requests_are_untouched(engine, hf_ref, requests_text_images):
    text, _ = requests_text_images
    r = text[0]
    assert engine.generate_batch([r])[0].extra["token_ids"] == hf_ref.generate(r, max_new_tokens=NEW)["ids"]


def test_describe_and_settings(engine):
    from harness.engines.vllm.settings import VZ_REQUEST_ARCH, VisionZipSettings

    info = engine.describe()["visionzip"]
    assert info["scope"] == "request" and info["contextual"] == VZ.contextual
    st = VisionZipSettings.from_env(engine.visionzip.env())
    assert st == engine.visionzip and st.arch == VZ_REQUEST_ARCH


def test_the_profiled_image_is_capped_so_its_bundle_fits_max_model_len(engine, batched):
    """The encoder profile's largest image (``BundleInfo.get_image_size_with_most_features``) shrinks when one image's
    bundle would not fit ``max_model_len`` (session 14: Qwen3-VL's pixel range on an 8,192-token server)."""
    import copy

    from vllm.multimodal import MULTIMODAL_REGISTRY

    from harness.engines.vllm.visionzip_request import fitting_image_tokens
    from harness.techniques.visionzip.bundle import request_total

    mc = engine._llm.llm_engine.model_config
    info = MULTIMODAL_REGISTRY.create_processor(mc).info
    assert type(info).__name__ == "BundleInfo"
    full = info.get_max_image_tokens()  # the tiny processor's 128 px cap: 16 tokens, fits 1024 as is
    assert full == 16 and info.get_image_size_with_most_features() == (128, 128)
    small = copy.copy(mc)
    small.max_model_len = 512 + 2 + 4  # HARNESS_VZ_SPAN_TEXT 512 + start/end + 4 kept tokens: 8 tokens at keep 0.5
    capped = MULTIMODAL_REGISTRY.create_processor(small).info
    want = fitting_image_tokens(full, lambda s: request_total(s, VZ.keep, VZ.min_per_image), 512, small.max_model_len)
    assert want == 8 and capped.get_max_image_tokens() == want

"""HF = vLLM token for token on the *trained* embedded checkpoint (model=tiny), float32 greedy: held-out
requests of the three task families (OCR, MCQ, the long RAG-IGBench prompt with several images) and a batch."""

from __future__ import annotations

import random

import pytest

from vllm_lane_helpers import HFReference, engine_cfg, gen_cfg

MAX_NEW = 48


@pytest.fixture(scope="module")
def trained_path():
    from harness.engines import compat

    compat.install()
    from harness.models.trained import trained_checkpoint

    return str(trained_checkpoint()[0])


@pytest.fixture(scope="module")
def requests():
    from harness.engines.base import Request
    from harness.models.train_data import make_example

    rng = random.Random(0)
    out = []
    for task in ("ocr", "mcq", "rag", "ocr_mix"):
        ex = make_example(task, rng, "heldout")
        out.append(Request(f"{task}-0", ex.content, ex.images))
    return out


@pytest.fixture(scope="module")
def engine(trained_path):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(trained_path, engine_cfg(max_model_len=4096), gen_cfg(MAX_NEW), max_images_per_prompt=8)
    yield eng
    eng.close()


def test_trained_model_same_tokens_in_both_engines(engine, trained_path, requests):
    hf = HFReference(trained_path)
    refs = {r.uid: hf.generate(r, MAX_NEW) for r in requests}
    for gen in engine.generate_batch(requests):
        ref = refs[gen.uid]
        assert gen.error is None, gen.error
        assert gen.extra["token_ids"] == ref["ids"], gen.uid
        assert gen.prompt_tokens == ref["prompt_tokens"] and gen.visual_tokens == ref["visual_tokens"], gen.uid

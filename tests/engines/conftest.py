"""What the HF engine tests share: the tiny random model loaded once per module (the recorder of routing
decisions is ``routing_capture.capture``), its path, and three test images of different sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.models.tiny import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory) -> SimpleNamespace:
    """model (float32, eval), processor (left padding, as the engine batches), ``chat(parts)`` -> prompt text."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("tiny"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    proc.tokenizer.padding_side = "left"

    def chat(parts):
        return proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)

    return SimpleNamespace(model=model, proc=proc, path=path, chat=chat)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The tiny random Qwen3-VL-MoE saved once per module (a test module may define its own)."""
    return ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def images():
    """A text-dense, a plain-scene and a small text-dense image (rows of different token counts)."""
    import random

    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image

    rng = random.Random(0)
    return [text_dense_image(rng, 128, 96), plain_scene_image(rng, 96, 64), text_dense_image(rng, 64, 64)]

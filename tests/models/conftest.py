"""Fixtures shared by the embedded-model training tests (recipes v2-v6)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from harness.datasets.synthetic import tasks as st


@pytest.fixture
def generator2():
    """Draw with the task suite's generator 2 for one test, then restore the process-wide choice."""
    before = st.generator_version()
    st.use_generator("2")
    yield
    st.use_generator(before)


@pytest.fixture
def tiny_batch():
    """A factory: a fresh seeded training-size model (TRAINED_SPEC) and one collated training batch of ``tasks``
    (with their mRoPE positions), as ``train_tiny`` builds it."""

    def make(tasks: tuple[str, ...], seed: int = 0, train: bool = True) -> SimpleNamespace:
        import torch
        from transformers import Qwen3VLMoeForConditionalGeneration

        from harness.models import train_tiny as tt
        from harness.models.tiny import build_config, build_tokenizer
        from harness.models.train_data import encode, make_example
        from harness.models.trained import TRAINED_SPEC

        spec = dataclasses.replace(TRAINED_SPEC, seed=0)
        tok = build_tokenizer(spec)
        cfg = build_config(spec, tok)
        cfg.text_config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3VLMoeForConditionalGeneration(cfg).float()
        model.train(train)
        rng = random.Random(seed)
        exs = []
        for task in tasks:
            e = encode(make_example(task, rng), tok, cfg.image_token_id)
            e["pos"] = tt.rope_positions(model, e["ids"], e["images"])
            exs.append(e)
        return SimpleNamespace(model=model, tok=tok, cfg=cfg, exs=exs, batch=tt.collate(exs, tok.pad_token_id, "cpu"))

    return make

"""``engine.decode_attention``: decode steps through the Triton GQA kernel give SDPA's greedy tokens.

CPU: the kernel runs in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``) on the tiny
Qwen3-VL-MoE in float32, left-padded batches with and without images, through ``model.generate`` (dynamic
cache) and the static decoder (static cache: the mask hides the unwritten tail). The kernel must actually run
on every decode step and never on a prefill. GPU (skipped without CUDA): the same under real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_graphs import (CUDA, EngineConfig, GenerationConfig, decoder, image_batch, load, requests, stock,
                            text_batch)

from harness.engines.hf import attention_decode as decode_attn
from harness.kernels import decode_attention as kernel_module

NEW = 8
interpreter = pytest.mark.skipif(not kernel_module.triton_available("cpu"),
                                 reason="the CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, "
                                        "set by tests/conftest.py on machines without CUDA)")




@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel's calls (by the query length each call saw)."""
    seen: list[int] = []
    real = kernel_module.decode_attention

    def counting(query, key, value, mask, scale):
        seen.append(query.shape[2])
        return real(query, key, value, mask, scale)

    monkeypatch.setattr(kernel_module, "decode_attention", counting)
    return seen


def switched(model):
    """Install the kernel on ``model``'s text decoder; returns the undo."""
    cfg = decode_attn.text_config(model)
    before = cfg._attn_implementation
    assert decode_attn.install(model) is None
    return lambda: setattr(cfg, "_attn_implementation", before)


@interpreter
@pytest.mark.parametrize("kind", ["text", "images"])
def test_generate_tokens_equal_sdpa(tiny_path, images, kind, kernel_calls):
    model, proc = load(tiny_path)
    inputs = text_batch(proc) if kind == "text" else image_batch(proc, images)
    want = stock(model, proc, inputs, n=NEW)
    vision_impl = model.config.vision_config._attn_implementation
    undo = switched(model)
    try:
        assert decode_attn.text_config(model)._attn_implementation == decode_attn.NAME
        assert model.config.vision_config._attn_implementation == vision_impl     # the tower keeps its own
        got = stock(model, proc, inputs, n=NEW)
    finally:
        undo()
    assert got == want
    layers = model.config.text_config.num_hidden_layers
    assert kernel_calls and set(kernel_calls) == {1}, "only one-query (decode) passes take the kernel"
    assert len(kernel_calls) == layers * (NEW - 1)                               # every decode step, every layer


@interpreter
def test_static_decoder_tokens_equal_sdpa(tiny_path, images, kernel_calls):
    model, proc = load(tiny_path)
    inputs = image_batch(proc, images)
    want = decoder(model, proc, use_graphs=False).generate(inputs, NEW)
    undo = switched(model)
    try:
        got = decoder(model, proc, use_graphs=False).generate(inputs, NEW)
    finally:
        undo()
    assert got.tokens == want.tokens
    assert len(kernel_calls) == model.config.text_config.num_hidden_layers * (NEW - 1)


def test_install_only_replaces_sdpa(tiny_path):
    model, _ = load(tiny_path)
    cfg = decode_attn.text_config(model)
    cfg._attn_implementation = "eager"
    assert "eager" in decode_attn.install(model)
    assert cfg._attn_implementation == "eager"


def test_resolve_choices():
    assert decode_attn.resolve("auto", "cpu") is False
    assert decode_attn.resolve("sdpa", "cuda") is False
    assert decode_attn.resolve("auto", "cuda:0") is True
    if kernel_module.triton_available("cpu"):
        assert decode_attn.resolve("triton", "cpu") is True      # the interpreter is on in CPU tests
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attn.resolve("flash", "cpu")


@interpreter
def test_engine_records_its_choice(tiny_path, images):
    from harness.engines.hf.engine import HFEngine

    for choice, want in (("triton", "triton"), ("sdpa", "sdpa")):
        cfg = EngineConfig(device="cpu", dtype="float32", batch_size=3, decode_attention=choice)
        engine = HFEngine(str(tiny_path), cfg, GenerationConfig(max_new_tokens=4))
        try:
            info = engine.describe()
            assert info["decode_attention"] == want and info["decode_attention_reason"] is None
            assert engine.generate(requests(images)[:2])[0].error is None
        finally:
            engine.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_generate_tokens_equal_sdpa(tiny_path, images, kernel_calls):
    model, proc = load(tiny_path, "cuda")
    inputs = image_batch(proc, images, "cuda")
    want = stock(model, proc, inputs, n=16)
    undo = switched(model)
    try:
        got = stock(model, proc, inputs, n=16)
    finally:
        undo()
    assert got == want and len(kernel_calls) == model.config.text_config.num_hidden_layers * 15


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (real CUDA graphs)")
def test_gpu_graph_tokens_equal_sdpa(tiny_path, images):
    model, proc = load(tiny_path, "cuda")
    inputs = image_batch(proc, images, "cuda")
    want = decoder(model, proc, use_graphs=True).generate(inputs, 16)
    undo = switched(model)
    try:
        got = decoder(model, proc, use_graphs=True).generate(inputs, 16)
    finally:
        undo()
    assert got.tokens == want.tokens
    torch.cuda.synchronize()

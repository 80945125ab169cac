"""``engine.decode_router``: the Triton router on decode passes gives transformers' greedy tokens (interpreter, CPU)."""

from __future__ import annotations

import pytest
from test_hf_graphs import decoder, image_batch, load, sere, stock

from harness.engines.hf import router as hf_router
from harness.kernels import router as router_kernel

NEW = 8
interpreter = pytest.mark.skipif(not router_kernel.triton_available("cpu"),
                                 reason="the CPU tests run the kernel in Triton's interpreter")




@pytest.fixture
def kernel_tokens(monkeypatch):
    seen: list[int] = []
    real = router_kernel.moe_router
    monkeypatch.setattr(router_kernel, "moe_router", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    return seen


@interpreter
@pytest.mark.parametrize("with_sere", [False, True])
def test_tokens_equal_transformers_router(tiny_path, images, with_sere, kernel_tokens, monkeypatch):
    monkeypatch.setattr(hf_router, "MAX_TOKENS", 16)          # below the prompts: prefill keeps transformers' router
    model, proc = load(tiny_path)
    inputs = image_batch(proc, images)
    handle = sere(model, 1) if with_sere else None
    try:
        want = stock(model, proc, inputs, n=NEW)
        want_static = decoder(model, proc, use_graphs=False).generate(inputs, NEW).tokens
        stats_before = handle.stats() if handle else None
        if handle:
            handle.reset_stats()
        n = hf_router.install(model)
        assert n == model.config.text_config.num_hidden_layers
        got = stock(model, proc, inputs, n=NEW)
        got_static = decoder(model, proc, use_graphs=False).generate(inputs, NEW).tokens
        if handle:
            after = handle.stats()
            assert stats_before["steps"] > 0
            for key in ("steps", "expert_union_before", "expert_union_after", "moved_fraction"):
                assert after[key] == stats_before[key], key
    finally:
        hf_router.uninstall(model)
        if handle:
            handle.remove()
    assert got == want and got_static == want_static
    assert kernel_tokens and max(kernel_tokens) <= 3 < inputs["input_ids"].shape[1]   # decode passes only
    assert len(kernel_tokens) == 2 * model.config.text_config.num_hidden_layers * (NEW - 1)


def test_resolve():
    assert hf_router.resolve("auto", "cpu") is False and hf_router.resolve("auto", "cuda") is True
    assert hf_router.resolve("torch", "cuda") is False
    with pytest.raises(ValueError, match="decode_router"):
        hf_router.resolve("fast", "cpu")

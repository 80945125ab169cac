"""Triton MoE router (``harness.kernels.router``) = transformers' Qwen3 router, and its HF hook (``hf_router``).

CPU: the kernels run in Triton's interpreter (tests/conftest.py). The reference is checked against transformers'
own router modules; the kernel against the reference (same ids, weights and logits within rounding); the hook gives
the same greedy tokens on the tiny Qwen3-VL-MoE, with SERE's router hooks on, and leaves prefill passes alone.
"""

from __future__ import annotations

import pytest
import torch

from harness.kernels.router import moe_router, router_reference, router_triton, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="Triton needs CUDA or TRITON_INTERPRET=1")


def make(t, e, h, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g).to(DEVICE, dtype),
            (torch.randn(e, h, generator=g) / h ** 0.5).to(DEVICE, dtype))


@pytest.mark.parametrize("renorm", [True, False])
def test_reference_is_transformers_router(renorm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renorm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 32)
    for got, want in zip(router_reference(x, router.weight, 4, renorm), router(x), strict=True):
        assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("shape", [(1, 16, 32, 4), (3, 128, 64, 8), (7, 12, 48, 2), (2, 8, 16, 8)])
@pytest.mark.parametrize("renorm", [True, False])
def test_kernel_matches_reference(shape, renorm):
    t, e, h, k = shape
    x, w = make(t, e, h, seed=t * e)
    logits, weights, ids = router_triton(x, w, k, renorm)
    r_logits, r_weights, r_ids = router_reference(x, w, k, renorm)
    assert ids.dtype == torch.int64 and torch.equal(ids, r_ids)
    torch.testing.assert_close(logits, r_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, r_weights, rtol=1e-5, atol=1e-6)


@needs_triton
def test_ties_take_the_lowest_expert_and_bf16_rounds_like_linear():
    x = torch.ones(1, 16, device=DEVICE)
    w = torch.zeros(8, 16, device=DEVICE)
    w[[1, 5, 6]] = 1.0                                  # three equal best experts
    _, weights, ids = router_triton(x, w, 2)
    assert ids.tolist() == [[1, 5]] and torch.allclose(weights, torch.full_like(weights, 0.5))
    xb, wb = make(4, 32, 64, dtype=torch.bfloat16, seed=3)
    logits, weights, ids = router_triton(xb, wb, 4)
    r_logits, r_weights, r_ids = router_reference(xb.float(), wb.float(), 4)
    assert logits.dtype == weights.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), r_logits, rtol=2e-2, atol=2e-2)
    assert (ids == r_ids).float().mean() >= 0.75       # bf16 logits may swap near-ties


@needs_triton
def test_custom_op_and_dispatcher():
    x, w = make(3, 16, 32)
    a = torch.ops.harness.moe_router(x, w, 4, True)
    b = moe_router(x, w, 4, True)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    torch.library.opcheck(torch.ops.harness.moe_router.default, (x, w, 4, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_arguments_are_refused():
    x, w = make(2, 8, 16)
    with pytest.raises(ValueError, match="top_k"):
        router_triton(x, w, 9)
    with pytest.raises(ValueError, match="must be"):
        router_triton(x, w[:, :8], 2)

"""LSE reuse: the attention's own log-sum-exp feeds the importance (kernel pass 2 / its torch twin).

Runs without Triton for the torch paths; the kernel cases need CUDA or ``TRITON_INTERPRET=1``.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from harness.kernels.attention_lse import packed_lse, sdpa_with_lse, varlen_attention_with_lse
from harness.kernels.importance import compute_importance, reference_colsums_from_lse, triton_available
from harness.techniques.visionzip.pruning import attention_received

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEGMENTS = [5, 17, 33]
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


def packed(seqlens, heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(seqlens)
    q, k, v = (torch.randn(n, heads, head_dim, generator=g) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), cu.to(DEVICE)


def true_lse(q, k, cu, scale):
    out = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        logits = torch.einsum("ihd,jhd->hij", q[s:e].double().cpu(), k[s:e].double().cpu()) * scale
        out[:, s:e] = torch.logsumexp(logits, dim=-1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_returns_sdpa_output_and_true_lse(dtype):
    q, k, v, cu = packed(SEGMENTS, 3, 72, dtype=dtype, seed=1)
    scale = 0.11
    out, lse = varlen_attention_with_lse(q, k, v, cu, scale=scale)
    if DEVICE == "cuda" and dtype == torch.float32:
        assert lse is None  # no fp32 flash kernel: the caller falls back to the kernel's own pass
    else:
        assert lse is not None and lse.shape == (3, q.shape[0]) and lse.dtype == torch.float32
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(lse.double().cpu(), true_lse(q, k, cu, scale), rtol=tol, atol=tol)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        ref = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), scale=scale)
        torch.testing.assert_close(out[s:e], ref[0].transpose(0, 1))


def test_sdpa_with_lse_equals_sdpa_bit_for_bit_on_cpu():
    q, k, v, _ = (t.cpu() for t in packed([40], 2, 24, seed=2))  # a CPU test also where a GPU is visible
    qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
    out, lse = sdpa_with_lse(qb, kb, vb, 0.2)
    assert torch.equal(out, F.scaled_dot_product_attention(qb, kb, vb, scale=0.2))  # same op SDPA runs
    assert lse.shape == (1, 2, 40)


def test_packed_lse_accepts_both_flash_layouts():
    bounds = [0, 3, 8]
    flat = torch.arange(16.0).reshape(2, 8)
    assert torch.equal(packed_lse(flat, bounds, 2), flat)
    padded = torch.full((2, 2, 5), float("nan"))
    padded[0, :, :3] = flat[:, :3]
    padded[1, :, :5] = flat[:, 3:]
    assert torch.equal(packed_lse(padded, bounds, 2), flat)
    with pytest.raises(ValueError):
        packed_lse(torch.zeros(3, 8), bounds, 2)


def test_reference_from_lse_equals_softmax_colsums_and_uses_the_lse():
    q, k, v, cu = packed(SEGMENTS, 2, 16, seed=3)
    _, lse = varlen_attention_with_lse(q, k, v, cu)
    if lse is None:
        pytest.skip("no LSE-returning op for fp32 on this device")
    ref = attention_received(q.double(), k.double(), cu)
    got = reference_colsums_from_lse(q, k, cu, lse).mean(dim=0)
    torch.testing.assert_close(got.double().cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)
    # an LSE shifted by log 2 halves every probability: proof that the given LSE is what is used
    halved = reference_colsums_from_lse(q, k, cu, lse + math.log(2.0)).mean(dim=0)
    torch.testing.assert_close(halved.double().cpu(), ref.cpu() / 2, rtol=1e-5, atol=1e-5)


def test_dispatcher_reference_path_takes_the_lse(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEVICE == "cuda":
        pytest.skip("the reference path is the CPU fallback")
    q, k, v, cu = packed(SEGMENTS, 2, 16, seed=4)
    _, lse = varlen_attention_with_lse(q, k, v, cu)
    ref = attention_received(q, k, cu)
    torch.testing.assert_close(compute_importance(q, k, cu, lse=lse), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compute_importance(q, k, cu, lse=lse + math.log(2.0)), ref / 2, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.bfloat16])
def test_kernel_with_attention_lse_matches_reference(dtype):
    q, k, v, cu = packed(SEGMENTS, 2, 72, dtype=dtype, seed=5)
    _, lse = varlen_attention_with_lse(q, k, v, cu)
    assert lse is not None
    with_lse = compute_importance(q, k, cu, lse=lse)
    without = compute_importance(q, k, cu)
    ref = attention_received(q.double(), k.double(), cu)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = ((with_lse.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()
    assert err < tol
    torch.testing.assert_close(with_lse, without, rtol=tol, atol=tol)
    shifted = compute_importance(q, k, cu, lse=lse + math.log(2.0))
    torch.testing.assert_close(shifted, with_lse / 2, rtol=1e-4, atol=1e-5)

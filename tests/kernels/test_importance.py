"""Triton importance kernel vs the torch reference (Triton's interpreter on CPU: tiny shapes only)."""

import itertools
import math

import pytest
import torch

from harness.kernels.importance import (
    attention_colsums,
    attention_importance,
    attention_lse,
    compute_importance,
    triton_available,
)
from harness.techniques.visionzip.pruning import attention_received

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")

SEGMENTS = [5, 17, 33]  # odd lengths: partial tiles everywhere, segments inside one tile and across tiles


def packed(seqlens, heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(seqlens)
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(n, heads, head_dim, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), cu.to(DEVICE)


def rel_err(out, ref):
    """Relative error on the CPU in float64 (the reference may have run on the GPU)."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


def reference_colsums(q, k, cu, scale=None):
    """Per-head column sums in float64, one segment at a time."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, bounds = q.double().cpu(), k.double().cpu(), cu.tolist()
    out = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for s, e in zip(bounds[:-1], bounds[1:]):
        p = torch.softmax(torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * scale, dim=-1)
        out[:, s:e] = p.sum(dim=1)
    return out


@pytest.mark.parametrize("head_dim", [72, 64])
@pytest.mark.parametrize("heads", [1, 4])
def test_fp32_matches_reference(head_dim, heads):
    q, k, cu = packed(SEGMENTS, heads, head_dim)
    out = torch.full((heads, q.shape[0]), float("nan"), device=DEVICE)  # poisoned
    colsums = attention_colsums(q, k, cu, out=out)
    assert colsums.data_ptr() == out.data_ptr()
    ref = reference_colsums(q, k, cu)
    assert rel_err(colsums.cpu(), ref) < 1e-5
    imp = attention_importance(q, k, cu)
    assert imp.dtype == torch.float32 and imp.shape == (q.shape[0],)
    assert rel_err(imp.cpu(), attention_received(q.double(), k.double(), cu)) < 1e-5


def test_lse_matches_logsumexp():
    q, k, cu = packed(SEGMENTS, 2, 72, seed=1)
    out = torch.full((2, q.shape[0]), float("nan"), device=DEVICE)
    lse = attention_lse(q, k, cu, out=out).cpu().double()
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        logits = torch.einsum("ihd,jhd->hij", q[s:e].double().cpu(), k[s:e].double().cpu()) / math.sqrt(72)
        torch.testing.assert_close(lse[:, s:e], torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    q32, k32, cu = packed(SEGMENTS, 2, 72, seed=2)
    q, k = q32.to(dtype), k32.to(dtype)
    imp = attention_importance(q, k, cu)
    assert imp.dtype == torch.float32
    # Against the same (rounded) inputs in float64: only accumulation error is left.
    assert rel_err(imp.cpu(), attention_received(q.double(), k.double(), cu)) < 1e-3
    # Against the unrounded inputs: the input rounding itself, bounded.
    assert rel_err(imp.cpu(), attention_received(q32.double(), k32.double(), cu)) < 3e-2


def test_each_segment_sums_to_its_length_and_scale_is_used():
    q, k, cu = packed([3, 16, 1, 20], 3, 40, seed=3)
    colsums = attention_colsums(q, k, cu, scale=0.5).cpu().double()
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        torch.testing.assert_close(colsums[:, s:e].sum(dim=1), torch.full((3,), float(e - s), dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)  # fp32 accumulation on the GPU
    assert rel_err(colsums, reference_colsums(q, k, cu, scale=0.5)) < 1e-5


def test_empty_segment_and_strided_inputs():
    # q and k as views of one fused qkv projection, the way Qwen3-VL's vision attention builds them.
    g = torch.Generator().manual_seed(4)
    n, heads, head_dim = 22, 2, 24
    qkv = torch.randn(n, 3, heads, head_dim, generator=g).to(DEVICE)
    q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 5, 5, 22], dtype=torch.int32, device=DEVICE)
    out = torch.full((heads, n), float("nan"), device=DEVICE)
    colsums = attention_colsums(q, k, cu, out=out)
    assert rel_err(colsums.cpu(), reference_colsums(q, k, cu)) < 1e-5


def test_given_lse_skips_pass_one():
    q, k, cu = packed(SEGMENTS, 2, 72, seed=5)
    lse = attention_lse(q, k, cu)
    torch.testing.assert_close(attention_importance(q, k, cu, lse=lse), attention_importance(q, k, cu))


def test_dispatcher(monkeypatch):
    q, k, cu = packed(SEGMENTS, 2, 72, seed=6)
    ref = attention_received(q, k, cu)
    torch.testing.assert_close(compute_importance(q, k, cu), ref, rtol=1e-5, atol=1e-5)
    if DEVICE == "cpu":  # interpreter off → the reference path
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not triton_available("cpu")
        torch.testing.assert_close(compute_importance(q, k, cu), ref)


def test_rejects_bad_inputs():
    q, k, cu = packed([4], 1, 16)
    with pytest.raises(ValueError):
        attention_importance(q, k[:, :, :8], cu)
    with pytest.raises(ValueError):
        attention_importance(q, k.double() if DEVICE == "cpu" else k.half(), cu)

"""Decode attention Triton kernel (``harness.kernels.decode_attention``) against its float32 reference and SDPA.

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``): small
shapes. The reference itself is checked against ``torch.nn.functional.scaled_dot_product_attention`` with the
grouped heads repeated, so the kernel is tied to what transformers' SDPA path computes.
"""

from __future__ import annotations

import pytest
import torch

from harness.kernels import decode_attention as da
from harness.kernels.decode_attention import (decode_attention, decode_attention_reference, decode_attention_triton,
                                              triton_available, unsupported_reason)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(DEVICE),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")

# (B, Hq, Hkv, L, D): MHA, GQA groups 2 and 4, a cache that is not a multiple of the block, head_dim 24 (padded)
CASES = [(1, 4, 4, 16, 16), (2, 4, 2, 40, 32), (3, 8, 2, 33, 24), (1, 8, 1, 70, 16)]


def inputs(b, hq, hkv, length, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=g)
    k = torch.randn(b, hkv, length, d, generator=g)
    v = torch.randn(b, hkv, length, d, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def decode_mask(b, length, lengths, pads, kind="bool"):
    """SDPA-style [B, 1, 1, L] mask: row i attends to positions pads[i] .. lengths[i]-1 (left padding + the
    unwritten tail of a static cache)."""
    pos = torch.arange(length)
    keep = torch.stack([(pos >= p) & (pos < n) for p, n in zip(pads, lengths)])[:, None, None, :]
    if kind == "bool":
        return keep.to(DEVICE)
    return torch.where(keep, 0.0, torch.finfo(torch.float32).min).to(DEVICE)


def sdpa_grouped(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k2, v2 = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k2, v2, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_reference_is_sdpa_with_repeated_heads(kind):
    q, k, v = inputs(3, 8, 2, 33, 24)
    mask = decode_mask(3, 33, lengths=[33, 20, 7], pads=[0, 5, 2], kind=kind)
    want = sdpa_grouped(q, k, v, mask, 0.3)
    got = decode_attention_reference(q, k, v, mask, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
@pytest.mark.parametrize("splits", [1, None, 3])
def test_kernel_matches_reference(case, kind, splits):
    b, hq, hkv, length, d = case
    q, k, v = inputs(b, hq, hkv, length, d, seed=sum(case))
    lengths = [length - 3 * i for i in range(b)]
    mask = None if kind == "none" else decode_mask(b, length, lengths, pads=[i for i in range(b)], kind=kind)
    got = decode_attention_triton(q, k, v, mask, d ** -0.5, splits=splits)
    want = decode_attention_reference(q, k, v, mask, d ** -0.5)
    assert got.shape == (b, 1, hq, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_broadcast_mask_and_noncontiguous_cache_views():
    """A [1, 1, 1, L] mask broadcasts over rows; K/V given as strided views (a cache's leading positions)."""
    q, k, v = inputs(2, 4, 2, 48, 16)
    mask = decode_mask(1, 40, lengths=[30], pads=[3])
    k_view, v_view = k[:, :, :40], v[:, :, :40]
    got = decode_attention_triton(q, k_view, v_view, mask, 0.25, splits=2)
    want = decode_attention_reference(q, k_view, v_view, mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_fully_masked_chunks_are_skipped_but_exact():
    """Only the first 5 of 64 positions are visible: every other chunk holds nothing (the static cache's tail is
    garbage here: NaN, which a read would spread into the output)."""
    q, k, v = inputs(1, 4, 2, 64, 16)
    k[:, :, 16:] = float("nan")
    v[:, :, 16:] = float("nan")
    mask = decode_mask(1, 64, lengths=[5], pads=[0])
    got = decode_attention_triton(q, k, v, mask, 0.25, splits=4)
    want = decode_attention_reference(q, k[:, :, :5], v[:, :, :5], None, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_all_masked_row_gives_zeros():
    q, k, v = inputs(2, 4, 2, 32, 16)
    mask = decode_mask(2, 32, lengths=[32, 0], pads=[0, 0])
    got = decode_attention_triton(q, k, v, mask, 0.25, splits=2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, decode_attention_reference(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


@needs_triton
def test_bfloat16_error_is_bounded_by_torch_own():
    q, k, v = inputs(2, 8, 2, 40, 32, dtype=torch.bfloat16)
    mask = decode_mask(2, 40, lengths=[40, 25], pads=[0, 4])
    exact = decode_attention_reference(q.double(), k.double(), v.double(), mask, 32 ** -0.5).double()
    got = decode_attention_triton(q, k, v, mask, 32 ** -0.5).double()
    torch_bf16 = sdpa_grouped(q, k, v, mask, 32 ** -0.5).to(torch.bfloat16).double()
    err = (got - exact).norm() / exact.norm()
    base = (torch_bf16 - exact).norm() / exact.norm()
    assert err <= 3 * base + 1e-3, (float(err), float(base))


def test_unsupported_inputs_are_named():
    q, k, v = inputs(1, 4, 2, 16, 16)
    assert unsupported_reason(q, k, v, None) is None
    assert "queries per row" in unsupported_reason(q.expand(1, 4, 2, 16), k, v, None)
    assert "grouped-query" in unsupported_reason(q, k[:, :1].expand(1, 3, 16, 16), v[:, :1].expand(1, 3, 16, 16), None)
    assert "mask" in unsupported_reason(q, k, v, torch.ones(1, 1, 2, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="queries per row"):
        decode_attention_triton(q.expand(1, 4, 2, 16), k, v, None, 1.0)


@needs_triton
def test_custom_op_and_dispatcher_agree():
    q, k, v = inputs(2, 4, 2, 24, 16)
    mask = decode_mask(2, 24, lengths=[24, 10], pads=[0, 1])
    a = torch.ops.harness.decode_attention(q, k, v, mask, 0.25)
    b = decode_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(a, b)
    torch.library.opcheck(torch.ops.harness.decode_attention.default, (q, k, v, mask, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_split_count_is_a_function_of_shapes():
    cpu = torch.device("cpu")
    assert da.num_splits(1, 4, 16, 16, cpu) == 1
    assert da.num_splits(1, 4, 64, 16, cpu) == 2


@pytest.mark.parametrize("use_kernel", [True, False])
def test_static_cache_write_equals_transformers_update(use_kernel, monkeypatch):
    """One token written at the device position, position advanced: exactly ``StaticLayer.update``."""
    from transformers.cache_utils import StaticLayer

    if use_kernel and not triton_available(DEVICE):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    if not use_kernel:
        monkeypatch.setattr(da, "triton_available", lambda device: False)
    b, h, length, d = 2, 3, 10, 24
    ref = StaticLayer(max_cache_len=length)
    ours = StaticLayer(max_cache_len=length)
    prompt = torch.randn(b, h, 4, d, device=DEVICE), torch.randn(b, h, 4, d, device=DEVICE)
    ref.update(*prompt)
    ours.update(*prompt)
    for _ in range(3):
        k, v = torch.randn(b, h, 1, d, device=DEVICE), torch.randn(b, h, 1, d, device=DEVICE)
        ref.update(k, v)
        da.static_cache_write(k, v, ours.keys, ours.values, ours.cumulative_length)
    assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
    assert int(ours.cumulative_length) == int(ref.cumulative_length) == 7
    with pytest.raises(ValueError, match="static_cache_write"):
        da.static_cache_write(torch.randn(b, h, 2, d), torch.randn(b, h, 2, d), ours.keys, ours.values,
                              ours.cumulative_length)

"""Parts of the vLLM engine that need no vLLM (run in the main venv): load-mode arrival times as
``vllm bench serve`` draws them, and VisionZip settings vLLM cannot honour."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from harness.engines.vllm.load import arrival_offsets
from harness.engines.vllm.techniques import resolve_visionzip


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_arrivals_follow_vllm_bench_serve(burstiness):
    n, qps, seed = 64, 8.0, 3
    offsets = arrival_offsets(n, qps, burstiness, seed)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1 / (qps * burstiness), size=n)
    want = np.cumsum(gaps) * (n / qps) / gaps.sum()
    np.testing.assert_allclose(offsets, want, rtol=1e-12)
    assert offsets[0] > 0                                        # the first request waits its gap too
    assert offsets[-1] == pytest.approx(n / qps, rel=1e-12)     # rescaled: total = n / qps exactly
    assert np.all(np.diff(offsets) >= 0)
    assert np.array_equal(offsets, arrival_offsets(n, qps, burstiness, seed))      # seeded


def test_arrivals_poisson_law_and_constant_rate():
    big = arrival_offsets(20000, 4.0, 1.0, 0)
    gaps = np.diff(np.concatenate([[0.0], big]))
    assert gaps.mean() == pytest.approx(0.25, rel=1e-9)        # exactly n/qps over n gaps
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)   # exponential: coefficient of variation 1
    const = arrival_offsets(5, 2.0, float("inf"))
    np.testing.assert_allclose(const, [0.5, 1.0, 1.5, 2.0, 2.5])
    for bad in ((0, 1.0, 1.0), (3, 0.0, 1.0), (3, 1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(*bad)


def test_vllm_refuses_min_per_image_zero():
    cfg = SimpleNamespace(keep=0.5, scope="image", contextual=0.0, layer=-1, min_per_image=0)
    with pytest.raises(NotImplementedError, match="min_per_image=0.*placeholder"):
        resolve_visionzip(cfg)
    assert resolve_visionzip(SimpleNamespace(**{**vars(cfg), "min_per_image": 1})).min_per_image == 1
    from harness.engines.vllm.settings import VisionZipSettings

    with pytest.raises(RuntimeError, match="at least one token"):
        VisionZipSettings.from_env({"HARNESS_VZ_KEEP": "0.5", "HARNESS_VZ_MIN_PER_IMAGE": "0"})


def test_vllm_visionzip_scope_request_settings():
    """scope=request (the default) resolves to the bundle architecture, contextual and min_per_image=0
    included, and its environment round-trips to the same settings in vLLM's processes."""
    from harness.engines.vllm.settings import VZ_ARCH, VZ_REQUEST_ARCH, VisionZipSettings

    cfg = SimpleNamespace(keep=0.5, scope="request", contextual=0.2, layer=-1, min_per_image=0)
    st = resolve_visionzip(cfg)
    assert st.scope == "request" and st.arch == VZ_REQUEST_ARCH and st.contextual == 0.2
    assert VisionZipSettings.from_env(st.env()) == st
    assert st.total([10, 3]) == 7 and st.total([1, 1, 1]) == 2  # budget(0.5, 13) = 7 (half up), budget(0.5, 3)
    per_image = resolve_visionzip(SimpleNamespace(**{**vars(cfg), "scope": "image", "contextual": 0.0,
                                                     "min_per_image": 1}))
    assert per_image.arch == VZ_ARCH and VisionZipSettings.from_env(per_image.env()) == per_image
    assert per_image.total([10, 3]) == 5 + 2
    with pytest.raises(NotImplementedError, match="contextual"):
        resolve_visionzip(SimpleNamespace(**{**vars(cfg), "scope": "image", "min_per_image": 1}))
    with pytest.raises(RuntimeError, match="contextual"):
        VisionZipSettings.from_env({"HARNESS_VZ_KEEP": "0.5", "HARNESS_VZ_CONTEXTUAL": "0.2"})


def test_float32_on_cuda_asks_triton_for_ieee_dots_and_keeps_a_users_choice(monkeypatch):
    """vLLM's fused MoE (Triton) would run float32 expert matmuls in TF32: a float32 CUDA run sets IEEE dots."""
    from harness.engines.vllm.precision import float32_dot_precision

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert float32_dot_precision("float32", "cpu") is None and float32_dot_precision("bfloat16", "cuda") is None
    assert "TRITON_F32_DEFAULT" not in os.environ
    assert float32_dot_precision("float32", "cuda") == "ieee"
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    assert float32_dot_precision("float32", "cuda") == "tf32x3"

"""Plain top-K truncation (``moe.top_k``): the reference equals the model's own router built with top-K."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.techniques.moe_topk import check_moe_config, moe_settings, pad_routing, truncate_routing


def routers(k: int, kk: int, norm: bool, dtype=torch.float32):
    """(Qwen3-VL-MoE router top-k, the same with top-K), (Qwen3-MoE router top-k, top-K) sharing weights."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g).to(dtype)
    out = []
    for cfg_cls, cls, extra in ((Qwen3VLMoeTextConfig, Qwen3VLMoeTextTopKRouter, {}),
                                (Qwen3MoeConfig, Qwen3MoeTopKRouter, {"norm_topk_prob": norm})):
        pair = []
        for top in (k, kk):
            r = cls(cfg_cls(hidden_size=32, num_experts=16, num_experts_per_tok=top, **extra)).to(dtype)
            r.weight.data.copy_(w)
            pair.append(r)
        out.append(pair)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("kk", [1, 2, 3])
def test_truncation_equals_router_with_top_k(kk, norm, dtype):
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    (vl_k, vl_kk), (moe_k, moe_kk) = routers(4, kk, norm, dtype)
    for full, small, renorm in ((vl_k, vl_kk, True), (moe_k, moe_kk, norm)):
        logits, _, ids = full(x)
        _, want_w, want_ids = small(x)
        w, got_ids = truncate_routing(logits, ids, kk, renorm)
        assert torch.equal(got_ids, want_ids)
        assert w.dtype == want_w.dtype and torch.equal(w, want_w)
        if renorm:
            assert torch.allclose(w.float().sum(-1), torch.ones(40), atol=1e-2)


def test_top_k_at_least_k_reproduces_the_router():
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(2))
    (vl_k, _), _ = routers(4, 2, True)
    logits, weights, ids = vl_k(x)
    for kk in (4, 6):
        w, i = truncate_routing(logits, ids, kk, True)
        assert torch.equal(i, ids) and torch.equal(w, weights)


def test_pad_routing_computes_the_same_moe_output():
    """Zero-weight padding slots naming the row's first expert: the same weighted sum, no new expert."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=g)
    ids = torch.softmax(logits, -1).topk(4).indices
    w, i = truncate_routing(logits, ids, 2, True)
    pw, pi = pad_routing(w, i, 4)
    assert pw.shape == pi.shape == (6, 4)
    assert torch.equal(pw[:, 2:], torch.zeros(6, 2)) and torch.equal(pi[:, 2:], i[:, :1].expand(-1, 2))
    outs = torch.randn(16, 5, generator=g)  # one output vector per expert
    assert torch.allclose((outs[pi] * pw[..., None]).sum(1), (outs[i] * w[..., None]).sum(1))
    assert all(set(pi[r].tolist()) == set(i[r].tolist()) for r in range(6))


def test_settings_and_refusals():
    assert moe_settings(SimpleNamespace(top_k=None, scope="decode")) is None
    assert moe_settings(SimpleNamespace(top_k=2, scope="all")) == (2, "all")
    assert moe_settings({"top_k": 2}) == (2, "decode")
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="moe.top_k"):
            moe_settings(SimpleNamespace(top_k=bad, scope="decode"))
    with pytest.raises(ValueError, match="moe.scope"):
        moe_settings(SimpleNamespace(top_k=2, scope="prefill"))
    with pytest.raises(NotImplementedError, match="sere.k"):
        moe_settings(SimpleNamespace(top_k=2, scope="decode"), SimpleNamespace(k=2))
    check_moe_config(SimpleNamespace(moe=SimpleNamespace(top_k=2, scope="decode"), sere=SimpleNamespace(k=None)))
    with pytest.raises(NotImplementedError):
        check_moe_config({"moe": {"top_k": 1}, "sere": {"k": 1}})

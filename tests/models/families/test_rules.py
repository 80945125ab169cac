"""Each family's routing rule (plain torch, ``harness.models.families``) against the real transformers router of a
tiny random model of that family: the stock routing (slots sorted by the rank key), and ``moe.top_k``'s truncation
against the family's own router built with ``num_experts_per_tok = K`` (same weights and bias)."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.models.families import all_families, family_of, get
from harness.models.families.base import RoutingRule

FAMILIES = [f.name for f in all_families() if f.tiny is not None]


def _model(name: str):
    import transformers

    from harness.models.families.build import init_family_weights

    config, cls = get(name).tiny(0)
    model = getattr(transformers, cls)(config).eval()
    init_family_weights(model, 0)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    from harness.models.moe_blocks import find_moe_blocks

    model = _model(request.param)
    return request.param, model, find_moe_blocks(model)


def test_every_family_is_found_by_its_model_type_and_its_blocks_by_its_router(built):
    name, model, refs = built
    assert family_of(model).name == name and family_of(model.config).name == name
    assert refs and all(ref.family.name == name for ref in refs)
    if name.startswith("deepseek"):
        assert [r.layer for r in refs] == [1]  # first_k_dense_replace = 1: layer 0 is dense
    if name == "gpt_oss":
        assert all(ref.gate is ref.block.router for ref in refs)


@torch.inference_mode()
def test_stock_rule_equals_the_hf_router(built):
    name, model, refs = built
    ref = refs[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, model.config.hidden_size, generator=gen)
    logits, w_hf, ids_hf = ref.gate(x)[:3]
    k = ids_hf.shape[1]
    rule = ref.rule
    w_sorted, ids_sorted = rule.sort_slots(logits, w_hf, ids_hf, ref.bias())
    w, ids = rule.stock(logits, k, ref.bias())
    assert torch.equal(ids, ids_sorted), name
    assert w.dtype == w_hf.dtype
    torch.testing.assert_close(w, w_sorted, rtol=1e-6, atol=1e-7)
    if rule.sorted_slots:
        assert torch.equal(ids_hf, ids_sorted) and torch.equal(w_hf, w_sorted)
    key = rule.rank_key(logits, ids, ref.bias())
    assert bool((key[:, :-1] >= key[:, 1:]).all())


@torch.inference_mode()
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_truncation_equals_the_family_router_built_with_k(built, top_k):
    name, model, refs = built
    ref = refs[0]
    text = copy.deepcopy(model.config.get_text_config())
    text.num_experts_per_tok = top_k
    small = type(ref.gate)(text).eval()
    small.load_state_dict(ref.gate.state_dict())
    x = torch.randn(96, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logits, w_hf, ids_hf = ref.gate(x)[:3]
    _, ids_sorted = ref.rule.sort_slots(logits, w_hf, ids_hf, ref.bias())
    w_k, ids_k = ref.rule.truncate(logits, ids_sorted, top_k, ref.bias())
    logits_k, w_small, ids_small = small(x)[:3]
    assert torch.equal(logits_k, logits)
    w_small, ids_small = ref.rule.sort_slots(logits, w_small, ids_small, ref.bias())
    assert torch.equal(ids_k, ids_small), name
    torch.testing.assert_close(w_k, w_small, rtol=1e-6, atol=1e-7)


def test_deepseek_v3_selection_uses_the_bias_and_the_weights_do_not():
    rule = get("deepseek_v3").routing_rule(get("deepseek_v3").tiny(0)[0])
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0])
    w, ids = rule.stock(logits, 2, bias)
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5 * rule.scaling))  # s = sigmoid(0), renormalised, scaled


def test_rule_rejects_unknown_names():
    with pytest.raises(ValueError, match="scoring"):
        RoutingRule(scoring="relu")
    with pytest.raises(KeyError, match="known"):
        get("nope")

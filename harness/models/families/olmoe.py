"""OLMoE: softmax top-k, sorted, renormalised iff ``norm_topk_prob`` (OLMoE-1B-7B: False), weights cast to the
logits' dtype. vLLM's ``olmoe`` hard-codes ``renormalize=False``; the plugin's routing function applies this
rule instead, so a hooked vLLM follows HF for either setting. vLLM: ``olmoe``."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule


def _tiny(seed: int):
    from transformers import OlmoeConfig

    return OlmoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
                       norm_topk_prob=False, max_position_embeddings=4096, tie_word_embeddings=False), \
        "OlmoeForCausalLM"


OLMOE = register(MoeFamily(
    name="olmoe", model_types=("olmoe",),
    rule=lambda c: RoutingRule(renormalize=bool(getattr(c, "norm_topk_prob", False))),
    vllm_modules=("olmoe",), router_kernel=True, tiny=_tiny,
    real={"olmoe_1b_7b": "allenai/OLMoE-1B-7B-0924-Instruct"}))

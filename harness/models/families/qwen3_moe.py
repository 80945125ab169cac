"""Qwen3-MoE and Qwen3-VL-MoE: softmax top-k, sorted, renormalised when ``norm_topk_prob`` (the VL text
router always renormalises), weights cast to the logits' dtype. vLLM: ``qwen3_moe`` (Qwen3-VL-MoE's decoder
reuses its block)."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule


def _tiny(seed: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                          num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=True,
                          decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=False), \
        "Qwen3MoeForCausalLM"


QWEN3_MOE = register(MoeFamily(
    name="qwen3_moe", model_types=("qwen3_moe",),
    rule=lambda c: RoutingRule(renormalize=bool(getattr(c, "norm_topk_prob", True))),
    vllm_modules=("qwen3_moe",), router_kernel=True, tiny=_tiny,
    real={"qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B"}))

QWEN3_VL_MOE = register(MoeFamily(
    name="qwen3_vl_moe", model_types=("qwen3_vl_moe", "qwen3_vl_moe_text"),
    rule=lambda c: RoutingRule(renormalize=True), auto_class="AutoModelForImageTextToText", vision=True,
    vllm_modules=("qwen3_moe",), router_kernel=True, tiny=None,  # tiny: harness.models.tiny (the embedded model)
    real={"qwen3_vl_30b_a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct"}))

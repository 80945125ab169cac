"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen3 rule (softmax, sorted, renormalise iff
``norm_topk_prob``, default False) plus one sigmoid-gated shared expert that every token uses (outside the
routed ids: SERE and ``moe.top_k`` leave it alone). A layer is MoE iff it is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``. vLLM: ``qwen2_moe``."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule


def _tiny(seed: int):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
                          moe_intermediate_size=48, shared_expert_intermediate_size=96, norm_topk_prob=False,
                          max_position_embeddings=4096, tie_word_embeddings=False), "Qwen2MoeForCausalLM"


QWEN2_MOE = register(MoeFamily(
    name="qwen2_moe", model_types=("qwen2_moe",),
    rule=lambda c: RoutingRule(renormalize=bool(getattr(c, "norm_topk_prob", False))),
    shared="shared_expert + sigmoid shared_expert_gate", vllm_modules=("qwen2_moe",), router_kernel=True,
    tiny=_tiny,
    real={"qwen2_57b_a14b": "Qwen/Qwen2-57B-A14B-Instruct", "qwen1_5_moe_a2_7b": "Qwen/Qwen1.5-MoE-A2.7B"}))

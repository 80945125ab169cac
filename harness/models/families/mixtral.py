"""Mixtral: softmax (float32) top-k, sorted, always renormalised, weights left in float32 (no cast back).
The real models are top-2, so SERE's only point there is K=1; the tiny test model is top-4. vLLM: ``mixtral``
(checkpoint names w1/w2/w3)."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule


def _tiny(seed: int):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=1024, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                         num_experts_per_tok=4, max_position_embeddings=4096, tie_word_embeddings=False), \
        "MixtralForCausalLM"


MIXTRAL = register(MoeFamily(
    name="mixtral", model_types=("mixtral",), rule=lambda c: RoutingRule(renormalize=True, cast_weights=False),
    vllm_modules=("mixtral",), tiny=_tiny,
    real={"mixtral_8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1"}))

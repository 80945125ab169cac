"""GPT-OSS: the router is ``mlp.router`` (a Linear with bias: the logits include it); top-k on the logits
(sorted), softmax over the k selected logits (= the renormalised softmax, in exact arithmetic). The experts are
interleaved gate/up, transposed, with biases and a clamped SwiGLU (alpha 1.702): the harness's fused experts
kernel and the expert offload do not read that layout (refused). vLLM: ``gpt_oss`` (swigluoai)."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule

_LAYOUT = ("GPT-OSS experts are interleaved, transposed and biased (gate_up_proj [E, H, 2I], clamped SwiGLU): "
           "the harness's {what} reads only the fused [E, 2I, H] layout")


def _tiny(seed: int):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=16, tie_word_embeddings=False), "GptOssForCausalLM"


GPT_OSS = register(MoeFamily(
    name="gpt_oss", model_types=("gpt_oss",), rule=lambda c: RoutingRule(scoring="softmax_topk", renormalize=True),
    router_attr="router", expert_layout="interleaved_transposed_bias", vllm_modules=("gpt_oss",),
    refuse={"offload": _LAYOUT.format(what="expert offload"),
            "harness_fused_moe": _LAYOUT.format(what="fused MoE kernel (engine.experts_implementation)")},
    attention="eager", tiny=_tiny, real={"gpt_oss_20b": "openai/gpt-oss-20b"}))

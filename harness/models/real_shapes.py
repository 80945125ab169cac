"""Random-initialised models with the shapes of real checkpoints, for latency benchmarks on a GPU.

Why: the GPU machine has no network, so real weights cannot be loaded there; but time depends on shapes,
not on values (except MoE routing, which for random weights is near-uniform, unlike a trained model's —
every result built on these models says ``weights: random-init`` and that caveat). Shapes are taken from the
checkpoints' ``config.json`` (``shared/notes/engines.md``, ``techniques.md``).

Weights are created directly on the target device (a 30B model initialised on a CPU takes minutes) with
``normal_(0, std)``; norms are 1. Only torch and transformers are imported.
"""

from __future__ import annotations

from typing import Any

QWEN3_30B_A3B_TEXT: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
)

QWEN3_VL_30B_A3B_VISION: dict[str, Any] = dict(
    depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)


def _init_on_device(model, std: float = 0.02, seed: int = 0) -> None:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def random_qwen3_moe(num_layers: int | None = None, device: str = "cuda", dtype: str = "bfloat16",
                     experts_implementation: str | None = None, seed: int = 0):
    """``Qwen3MoeForCausalLM`` with Qwen3-30B-A3B shapes (optionally fewer layers), random weights."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(QWEN3_30B_A3B_TEXT)
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    config = Qwen3MoeConfig(**cfg, rope_theta=1_000_000.0)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=getattr(torch, dtype), **kwargs)
    _init_on_device(model, seed=seed)
    return model.eval()


def random_qwen3_vl_moe(token_ids: dict[str, int], num_layers: int | None = None, device: str = "cuda",
                        dtype: str = "bfloat16", seed: int = 0):
    """``Qwen3VLMoeForConditionalGeneration`` with Qwen3-VL-30B-A3B shapes, random weights.

    ``token_ids`` maps ``image``, ``video``, ``vision_start``, ``vision_end``, ``eos``, ``pad`` to the ids of
    the tokenizer the prompts come from (any tokenizer whose ids fit the 151,936-token vocabulary).
    """
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(QWEN3_30B_A3B_TEXT)
    if num_layers:
        text["num_hidden_layers"] = num_layers
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True},
                eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"])
    config = Qwen3VLMoeConfig(
        text_config=text, vision_config=dict(QWEN3_VL_30B_A3B_VISION), image_token_id=token_ids["image"],
        video_token_id=token_ids["video"], vision_start_token_id=token_ids["vision_start"],
        vision_end_token_id=token_ids["vision_end"], tie_word_embeddings=False,
    )
    with torch.device(device):
        model = Qwen3VLMoeForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    _init_on_device(model, seed=seed)
    return model.eval()

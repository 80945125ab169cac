"""Random-initialised models with the shapes of real checkpoints, for latency benchmarks on a GPU.

Why: the GPU machine has no network, so real weights cannot be loaded there; but time depends on shapes,
not on values (except MoE routing, which for random weights is near-uniform, unlike a trained model's —
every result built on these models says ``weights: random-init`` and that caveat). Shapes are the checkpoints'
``config.json`` values, one entry of :data:`ARCHS` per checkpoint (``model.shapes.arch``); the model class and the
config class come from its ``architectures`` / ``model_type``, so every family of ``harness.models.families`` with an
entry here builds the same way (``conf/model/<arch>_shapes*.yaml``; docs/real_shapes.md, docs/families.md).

Weights are created directly on the target device (a 30B model initialised on a CPU takes minutes) with
``normal_(0, std)``; norms are 1. Only torch and transformers are imported (inside the functions).
"""

from __future__ import annotations

from typing import Any

from harness.models.families import get

__all__ = ["ARCHS", "QWEN_SPECIAL_IDS", "ShapesProcessor", "ShapesTokenizer", "build_shapes_model", "config_special_ids",
           "family_settings", "shapes_config", "shapes_hf_config", "shapes_model_for_engine", "special_ids",
           "synthetic_ids", "text_parameters"]

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

#: mistralai/Mixtral-8x7B-Instruct-v0.1: 32 layers, 8 experts of 14336, top-2, GQA 32/8 (46.70 B parameters)
MIXTRAL_8X7B_TEXT: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
    sliding_window=None, router_aux_loss_coef=0.02, tie_word_embeddings=False,
)

#: deepseek-ai/DeepSeek-V2-Lite(-Chat): 27 layers (layer 0 dense), MLA (kv_lora_rank 512, no q LoRA), 64 routed
#: experts of 1408 + 2 shared, top-6 greedy softmax, YaRN x40 (15.71 B parameters)
DEEPSEEK_V2_LITE_TEXT: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax",
    norm_topk_prob=False, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6, attention_bias=False,
    tie_word_embeddings=False,
)

#: allenai/OLMoE-1B-7B-0924-Instruct: 16 layers, 64 experts of 1024, top-8, no renormalisation (6.92 B parameters)
OLMOE_1B_7B_TEXT: dict[str, Any] = dict(
    vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5,
    clip_qkv=None, tie_word_embeddings=False,
)

#: openai/gpt-oss-20b: 24 layers alternating sliding (128) / full attention with sinks, 64 heads of 64 (GQA 8),
#: 32 experts of 2880, top-4, YaRN x32 (20.91 B parameters). The checkpoint's experts are MXFP4; the shapes model
#: is plain bf16/fp32 (4x the expert bytes of the real one: a decode step moves more than the checkpoint's would)
GPT_OSS_20B_TEXT: dict[str, Any] = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
)

#: Qwen/Qwen2-57B-A14B-Instruct: 28 layers, 64 experts of 2560 + a shared expert of 20480, top-8, GQA 28/4,
#: q/k/v biases (57.41 B parameters)
QWEN2_57B_A14B_TEXT: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-6, decoder_sparse_step=1,
    mlp_only_layers=[], use_sliding_window=False, tie_word_embeddings=False,
)

#: Qwen/Qwen3.5-35B-A3B's text model (its config.json ``text_config``): 40 layers, three Gated DeltaNet (linear
#: attention) layers to every gated full-attention layer, 256 experts of 512 + a gated shared expert of 512, top-8
#: (renormalised), GQA 16/2 of head_dim 256 with a quarter of each head rotated (34.66 B parameters; the checkpoint's
#: ~35 B add the vision tower and the multi-token-prediction layer, which the shapes model does not build)
QWEN3_5_35B_A3B_TEXT: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
    num_experts_per_tok=8, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
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


# ------------------------------------------------------------------------------------------------------------
# The run path: ``model=<arch>_shapes`` (harness/conf/model/*_shapes*) in engine=hf (built here) or engine=vllm
# (harness.engines.vllm.shapes: the same config.json, vLLM's dummy weights)
# ------------------------------------------------------------------------------------------------------------

#: The checkpoints' real special-token ids (Qwen2/Qwen3 tokenizer): the image/vision markers are what the
#: real model's embedding rows expect; ``eos`` is ``<|im_end|>``, ``pad`` ``<|endoftext|>``.
QWEN_SPECIAL_IDS: dict[str, int] = dict(image=151655, video=151656, vision_start=151652, vision_end=151653,
                                        eos=151645, pad=151643)

_YARN = {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}

#: ``model.shapes.arch`` → what the real ``config.json`` says: the model class and ``model_type``, the family
#: (``harness.models.families``), the text block (and the vision block of a VL checkpoint), rope, the context
#: length, the special ids (their names in :func:`special_ids`) and ``layer_pattern`` for per-layer attention
#: types (repeated over however many layers are built).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_30b_a3b": {"checkpoint": "Qwen/Qwen3-30B-A3B", "family": "qwen3_moe", "model_type": "qwen3_moe",
                      "architecture": "Qwen3MoeForCausalLM", "text": QWEN3_30B_A3B_TEXT, "vision": None,
                      "rope": {"rope_type": "default", "rope_theta": 1_000_000.0}, "max_position_embeddings": 40960,
                      "special": QWEN_SPECIAL_IDS},
    "qwen3_vl_30b_a3b": {"checkpoint": "Qwen/Qwen3-VL-30B-A3B-Instruct", "family": "qwen3_vl_moe",
                         "model_type": "qwen3_vl_moe", "architecture": "Qwen3VLMoeForConditionalGeneration",
                         "text": QWEN3_30B_A3B_TEXT, "vision": QWEN3_VL_30B_A3B_VISION,
                         "rope": {"rope_type": "default", "rope_theta": 5_000_000.0},
                         "max_position_embeddings": 262144, "special": QWEN_SPECIAL_IDS},
    "mixtral_8x7b": {"checkpoint": "mistralai/Mixtral-8x7B-Instruct-v0.1", "family": "mixtral",
                     "model_type": "mixtral", "architecture": "MixtralForCausalLM", "text": MIXTRAL_8X7B_TEXT,
                     "vision": None, "rope": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "max_position_embeddings": 32768, "special": {"bos": 1, "eos": 2}},
    "deepseek_v2_lite": {"checkpoint": "deepseek-ai/DeepSeek-V2-Lite-Chat", "family": "deepseek_v2",
                         "model_type": "deepseek_v2", "architecture": "DeepseekV2ForCausalLM",
                         "text": DEEPSEEK_V2_LITE_TEXT, "vision": None,
                         "rope": {**_YARN, "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                                  "mscale_all_dim": 0.707},
                         "max_position_embeddings": 163840, "special": {"bos": 100000, "eos": 100001}},
    "olmoe_1b_7b": {"checkpoint": "allenai/OLMoE-1B-7B-0924-Instruct", "family": "olmoe", "model_type": "olmoe",
                    "architecture": "OlmoeForCausalLM", "text": OLMOE_1B_7B_TEXT, "vision": None,
                    "rope": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 4096,
                    "special": {"pad": 1, "eos": 50279}},
    "gpt_oss_20b": {"checkpoint": "openai/gpt-oss-20b", "family": "gpt_oss", "model_type": "gpt_oss",
                    "architecture": "GptOssForCausalLM", "text": GPT_OSS_20B_TEXT, "vision": None,
                    "rope": {**_YARN, "rope_theta": 150000.0, "factor": 32.0, "truncate": False},
                    "max_position_embeddings": 131072, "special": {"pad": 199999, "eos": 200002},
                    "layer_pattern": ("sliding_attention", "full_attention"),
                    "note": "the checkpoint's experts are MXFP4; the shapes model's are in engine.dtype"},
    "qwen2_57b_a14b": {"checkpoint": "Qwen/Qwen2-57B-A14B-Instruct", "family": "qwen2_moe",
                       "model_type": "qwen2_moe", "architecture": "Qwen2MoeForCausalLM",
                       "text": QWEN2_57B_A14B_TEXT, "vision": None,
                       "rope": {"rope_type": "default", "rope_theta": 1_000_000.0}, "max_position_embeddings": 32768,
                       "special": {"eos": 151645, "pad": 151643}},
    "qwen3_5_35b_a3b": {"checkpoint": "Qwen/Qwen3.5-35B-A3B", "family": "qwen3_5_moe", "model_type": "qwen3_5_moe_text",
                        "architecture": "Qwen3_5MoeForCausalLM", "text": QWEN3_5_35B_A3B_TEXT, "vision": None,
                        "rope": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
                        "max_position_embeddings": 262144, "special": {"eos": 248046, "pad": 248044},
                        "layer_pattern": ("linear_attention",) * 3 + ("full_attention",),
                        "note": "the text model of a multimodal checkpoint (no vision tower, no MTP layer)"},
}

#: a VL checkpoint's text model as a causal LM (what :func:`text_parameters` counts)
_TEXT_ONLY = {"qwen3_vl_moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}


def _arch(arch: str) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"model.shapes.arch={arch!r}: expected one of {sorted(ARCHS)}")
    return ARCHS[arch]


def special_ids(vocab_size: int, arch: str | None = None) -> dict[str, int]:
    """The checkpoint's special ids (``arch``; None: the Qwen ids) when they fit the vocabulary; a shrunken test
    vocabulary gets them, in their order, at its top."""
    ids = dict(_arch(arch)["special"] if arch else QWEN_SPECIAL_IDS)
    if max(ids.values()) < vocab_size:
        return ids
    return {name: vocab_size - len(ids) + i for i, name in enumerate(ids)}


def _fit_layers(t: dict[str, Any], spec: dict[str, Any]) -> None:
    """Per-layer lists follow the built layer count: ``layer_types`` repeats the checkpoint's pattern, dense-layer
    lists keep only layers that exist. A model built shallower than its pattern keeps one full-attention layer (its
    last): transformers' cache of a hybrid model reads the sequence length from an attention layer, so Qwen3.5's
    two-layer test model would otherwise be two linear-attention layers that cannot decode."""
    n = int(t["num_hidden_layers"])
    if spec.get("layer_pattern"):
        pattern = spec["layer_pattern"]
        t["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
        if "full_attention" in pattern and "full_attention" not in t["layer_types"]:
            t["layer_types"][-1] = "full_attention"
    if t.get("mlp_only_layers"):
        t["mlp_only_layers"] = [i for i in t["mlp_only_layers"] if i < n]


def shapes_config(arch: str, num_layers: int | None = None, text: dict[str, Any] | None = None,
                  vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json``-like dict of a shapes model: the real values, ``num_layers`` / ``text`` / ``vision``
    overrides on top (tests shrink the hidden size; the GPU runs use the real values). Validation
    (``harness.run.validate.validate_model``) reads the same dict a real checkpoint's ``config.json`` would give."""
    spec = _arch(arch)
    text, vision = _plain(text or {}), _plain(vision or {})
    t = {**spec["text"], "max_position_embeddings": spec["max_position_embeddings"], **(text or {})}
    if num_layers is not None:
        if int(num_layers) < 1:
            raise ValueError(f"model.shapes.num_layers={num_layers}: expected >= 1")
        t["num_hidden_layers"] = int(num_layers)
    _fit_layers(t, spec)
    ids = special_ids(int(t["vocab_size"]), arch)
    t.update(eos_token_id=ids["eos"], pad_token_id=ids.get("pad"), bos_token_id=ids.get("bos"))
    if spec["vision"] is None:
        if vision:
            raise ValueError(f"model.shapes.vision overrides given for the text-only {arch!r}")
        return {"architectures": [spec["architecture"]], "model_type": spec["model_type"], **t,
                "rope_parameters": dict(spec["rope"])}
    t["rope_parameters"] = {**spec["rope"], "mrope_section": _mrope_section(int(t["head_dim"])),
                            "mrope_interleaved": True}
    v = {**spec["vision"], **(vision or {})}
    v["out_hidden_size"] = t["hidden_size"]
    return {"architectures": [spec["architecture"]], "model_type": spec["model_type"],
            "text_config": t, "vision_config": v, "image_token_id": ids["image"], "video_token_id": ids["video"],
            "vision_start_token_id": ids["vision_start"], "vision_end_token_id": ids["vision_end"],
            "tie_word_embeddings": False}


def _hf_config(config: dict[str, Any]):
    """The transformers config of a :func:`shapes_config` dict (the class its ``model_type`` names)."""
    from transformers import AutoConfig

    body = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(config["model_type"], **body)


def shapes_hf_config(shapes_cfg: Any):
    """The transformers config of ``model.shapes`` (what a real checkpoint's ``AutoConfig`` would be): engines ask
    the model family of it before anything is built."""
    get = (lambda k: shapes_cfg.get(k)) if isinstance(shapes_cfg, dict) else (lambda k: getattr(shapes_cfg, k, None))
    return _hf_config(shapes_config(get("arch"), get("num_layers"), _plain(dict(get("text") or {})),
                                    _plain(dict(get("vision") or {}))))


def text_parameters(config: dict[str, Any]) -> int:
    """Parameters of the text model of a :func:`shapes_config` dict, counted on the meta device (no memory: an
    engine that never builds the model in this process — vLLM's dummy weights — reports this): the causal LM of
    the config's ``architectures`` (a VL checkpoint: its text model as a causal LM, embeddings and head
    included). Qwen3-30B-A3B: 30.53 B."""
    import torch
    import transformers

    if "text_config" in config:
        arch, model_type = _TEXT_ONLY[config["model_type"]]
        config = {"architectures": [arch], "model_type": model_type,
                  **{k: v for k, v in config["text_config"].items() if k != "rope_parameters"},
                  "rope_parameters": {k: v for k, v in config["text_config"]["rope_parameters"].items()
                                      if not k.startswith("mrope")}}
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])._from_config(_hf_config(config))
    return sum(p.numel() for p in model.parameters())


def _plain(value: Any) -> Any:
    """Plain dicts / lists / scalars from OmegaConf containers (transformers' strict config fields refuse them)."""
    from collections.abc import Mapping, Sequence

    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _mrope_section(head_dim: int) -> list[int]:
    """[24, 20, 20] at the real head_dim 128; the same proportions (sum = head_dim / 2) for a test head_dim."""
    if head_dim == 128:
        return [24, 20, 20]
    half = head_dim // 2
    t = half - 2 * (half * 20 // 64)
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def build_shapes_model(config: dict[str, Any], device: str, dtype, experts_implementation: str | None = None,
                       seed: int = 0, attn_implementation: str = "sdpa"):
    """Build the model of :func:`shapes_config` on ``device`` with random weights (``_init_on_device``)."""
    import torch
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    hf_config = _hf_config(config)
    hf_config._attn_implementation = attn_implementation
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device(device):
        model = cls._from_config(hf_config, dtype=dtype)
    _init_on_device(model, seed=seed)
    if experts_implementation:
        model.set_experts_implementation(experts_implementation)
    ids = config_special_ids(config)
    model.generation_config.eos_token_id = ids["eos"]
    model.generation_config.pad_token_id = ids.get("pad")
    model.generation_config.bos_token_id = ids.get("bos")
    return model.eval().requires_grad_(False)


def config_special_ids(config: dict[str, Any]) -> dict[str, int]:
    """The special ids a :func:`shapes_config` dict carries (eos, pad, bos; a VL one also its image markers)."""
    t = config.get("text_config") or config
    ids = {"eos": t.get("eos_token_id"), "pad": t.get("pad_token_id"), "bos": t.get("bos_token_id"),
           **{n: config.get(f"{n}_token_id") for n in ("image", "video", "vision_start", "vision_end")}}
    return {k: int(v) for k, v in ids.items() if isinstance(v, int)}


def _special_set(model_config: Any) -> set[int]:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    ids = {getattr(model_config, n, None) for n in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                    "vision_end_token_id")}
    ids |= {getattr(text, n, None) for n in ("eos_token_id", "pad_token_id", "bos_token_id")}
    return {int(i) for i in ids if isinstance(i, int)}


def synthetic_ids(n: int, seed: int, model_config: Any) -> list[int]:
    """``n`` seeded ids drawn uniformly from the longest run of ordinary ids of the vocabulary: the ids below the
    lowest special id where the specials sit at the top (Qwen, DeepSeek, GPT-OSS, the tiny models), above the
    highest low one where they sit at the bottom (Mixtral's bos 1 / eos 2). ``model_config``: a transformers
    config or any object with ``vocab_size`` and the ``*_token_id`` attributes."""
    import torch

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    vocab = int(text.vocab_size)
    bounds = sorted({-1, vocab, *(i for i in _special_set(model_config) if 0 <= i < vocab)})
    low, high = max(((a + 1, b) for a, b in zip(bounds, bounds[1:])), key=lambda r: (r[1] - r[0], -r[0]))
    if high <= low:
        raise ValueError(f"no ordinary token ids in a vocabulary of {vocab} (special ids {sorted(bounds[1:-1])})")
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(low, high, (int(n),), generator=g)).tolist()


class ShapesTokenizer:
    """Tokenizer-free text path of a shapes model: UTF-8 bytes → ids ``BYTE_OFFSET + byte`` (so any dataset's text,
    and SERE's calibration text, becomes ids a random model can read), decode = the ids as text. No download;
    meaningless as language, which is all random weights need. ``ids``: the model's special ids
    (:func:`config_special_ids`; None: the Qwen ids of :func:`special_ids`)."""

    BYTE_OFFSET = 1000

    def __init__(self, vocab_size: int, ids: dict[str, int] | None = None):
        ids = dict(ids) if ids is not None else special_ids(vocab_size)
        self.vocab_size = vocab_size
        self.special = set(ids.values())
        self.eos_token_id, self.pad_token_id = ids["eos"], ids.get("pad")
        self.padding_side = "left"
        if vocab_size < self.BYTE_OFFSET + 256 + len(ids):
            self.BYTE_OFFSET = 0
        if self.special & set(range(self.BYTE_OFFSET, self.BYTE_OFFSET + 256)):
            raise ValueError(f"byte ids {self.BYTE_OFFSET}..{self.BYTE_OFFSET + 255} overlap the special ids "
                             f"{sorted(self.special)} of a {vocab_size}-token vocabulary")

    def encode(self, text: str) -> list[int]:
        return [self.BYTE_OFFSET + b for b in text.encode("utf-8")]

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) in self.special))

    def __len__(self) -> int:
        return self.vocab_size


class ShapesProcessor:
    """Stands where an ``AutoProcessor`` would: only ``.tokenizer``; images are patchified by
    :mod:`harness.engines.hf.direct` from the model's vision config."""

    tokenizer_free = True

    def __init__(self, vocab_size: int, ids: dict[str, int] | None = None):
        self.tokenizer = ShapesTokenizer(vocab_size, ids)


def family_settings(arch: str, experts_implementation: str | None, attn_implementation: str
                    ) -> tuple[str | None, str, dict[str, str]]:
    """(experts implementation, attention implementation, notes) a shapes model of ``arch`` can run with: its
    family's attention where transformers has no SDPA path (GPT-OSS: eager), transformers' experts where the
    family refuses the harness's fused kernel (GPT-OSS's layout) — what the HF engine does for a checkpoint of
    that family with ``engine.experts_implementation=auto``; ``notes`` says what was changed and why."""
    family = get(_arch(arch)["family"])
    notes: dict[str, str] = {}
    if family.attention and attn_implementation == "sdpa":
        attn_implementation = family.attention
        notes["attn_implementation"] = f"{family.attention} ({family.name}: transformers has no SDPA path for it)"
    if experts_implementation == "harness_fused_moe" and family.refusal("harness_fused_moe"):
        experts_implementation = None
        notes["experts_implementation"] = f"transformers' ({family.refusal('harness_fused_moe')})"
    return experts_implementation, attn_implementation, notes


_BUILT: dict[tuple, Any] = {}


def shapes_model_for_engine(shapes_cfg: Any, device: str, dtype, experts_implementation: str | None,
                            seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, ShapesProcessor, dict]:
    """(model, processor, info) for the HF engine. With ``model.shapes.reuse`` (default) a model built earlier in
    this process with the same spec is handed out again: a Hydra sweep (``-m``, basic launcher: one process)
    builds a 30B model once, not once per job. ``info`` records the build time, whether it was reused, and what
    the family changed (:func:`family_settings`)."""
    import time

    import torch

    def plain(d):
        return {str(k): v for k, v in dict(d or {}).items()}

    config = shapes_config(shapes_cfg.arch, getattr(shapes_cfg, "num_layers", None), plain(getattr(shapes_cfg, "text", None)),
                           plain(getattr(shapes_cfg, "vision", None)))
    experts_implementation, attn_implementation, notes = family_settings(shapes_cfg.arch, experts_implementation,
                                                                         attn_implementation)
    key = (repr(config), str(device), str(dtype), int(seed), attn_implementation)
    reuse = bool(getattr(shapes_cfg, "reuse", True))
    t0 = time.perf_counter()
    model = _BUILT.get(key) if reuse else None
    reused = model is not None
    if model is None:
        _BUILT.clear()  # one shapes model alive at a time (a 30B model is 57 GiB)
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
        model = build_shapes_model(config, device, dtype, None, seed, attn_implementation)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
        if reuse:
            _BUILT[key] = model
    if experts_implementation:
        model.set_experts_implementation(experts_implementation)
    text = config.get("text_config") or config
    spec = ARCHS[shapes_cfg.arch]
    info = {"arch": shapes_cfg.arch, "checkpoint_shapes_of": spec["checkpoint"], "family": spec["family"],
            "num_layers": text["num_hidden_layers"], "hidden_size": text["hidden_size"],
            "parameters": sum(p.numel() for p in model.parameters()), "weights": "random-init",
            "build_s": round(time.perf_counter() - t0, 3), "reused": reused, "config": config,
            **({"family_settings": notes} if notes else {}), **({"note": spec["note"]} if spec.get("note") else {})}
    return model, ShapesProcessor(int(text["vocab_size"]), config_special_ids(config)), info

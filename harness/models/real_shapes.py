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


# ------------------------------------------------------------------------------------------------------------
# The run path: ``model=qwen3_30b_a3b_shapes`` / ``model=qwen3_vl_30b_a3b_shapes`` (harness/conf/model/*_shapes*)
# ------------------------------------------------------------------------------------------------------------

#: The checkpoints' real special-token ids (Qwen2/Qwen3 tokenizer): the image/vision markers are what the
#: real model's embedding rows expect; ``eos`` is ``<|im_end|>``, ``pad`` ``<|endoftext|>``.
QWEN_SPECIAL_IDS: dict[str, int] = dict(image=151655, video=151656, vision_start=151652, vision_end=151653,
                                        eos=151645, pad=151643)

#: ``model.shapes.arch`` → what the real ``config.json`` says (text and vision blocks; rope per checkpoint).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_30b_a3b": {"checkpoint": "Qwen/Qwen3-30B-A3B", "text": QWEN3_30B_A3B_TEXT, "vision": None,
                      "rope_theta": 1_000_000.0, "max_position_embeddings": 40960},
    "qwen3_vl_30b_a3b": {"checkpoint": "Qwen/Qwen3-VL-30B-A3B-Instruct", "text": QWEN3_30B_A3B_TEXT,
                         "vision": QWEN3_VL_30B_A3B_VISION, "rope_theta": 5_000_000.0,
                         "max_position_embeddings": 262144},
}


def special_ids(vocab_size: int) -> dict[str, int]:
    """The real ids when the vocabulary is the real one; a shrunken test vocabulary gets its top six ids."""
    if vocab_size > max(QWEN_SPECIAL_IDS.values()):
        return dict(QWEN_SPECIAL_IDS)
    names = list(QWEN_SPECIAL_IDS)
    return {name: vocab_size - len(names) + i for i, name in enumerate(names)}


def shapes_config(arch: str, num_layers: int | None = None, text: dict[str, Any] | None = None,
                  vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json``-like dict of a shapes model: the real values, ``num_layers`` / ``text`` / ``vision``
    overrides on top (tests shrink the hidden size; the GPU runs use the real values). Validation
    (``harness.run.validate.validate_model``) reads the same dict a real checkpoint's ``config.json`` would give."""
    if arch not in ARCHS:
        raise ValueError(f"model.shapes.arch={arch!r}: expected one of {sorted(ARCHS)}")
    text, vision = _plain(text or {}), _plain(vision or {})
    spec = ARCHS[arch]
    t = {**spec["text"], "max_position_embeddings": spec["max_position_embeddings"], **(text or {})}
    if num_layers is not None:
        if int(num_layers) < 1:
            raise ValueError(f"model.shapes.num_layers={num_layers}: expected >= 1")
        t["num_hidden_layers"] = int(num_layers)
    ids = special_ids(int(t["vocab_size"]))
    t.update(eos_token_id=ids["eos"], pad_token_id=ids["pad"], bos_token_id=None)
    if spec["vision"] is None:
        if vision:
            raise ValueError(f"model.shapes.vision overrides given for the text-only {arch!r}")
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **t,
                "rope_parameters": {"rope_type": "default", "rope_theta": spec["rope_theta"]}}
    t["rope_parameters"] = {"rope_type": "default", "rope_theta": spec["rope_theta"],
                            "mrope_section": _mrope_section(int(t["head_dim"])), "mrope_interleaved": True}
    v = {**spec["vision"], **(vision or {})}
    v["out_hidden_size"] = t["hidden_size"]
    return {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
            "text_config": t, "vision_config": v, "image_token_id": ids["image"], "video_token_id": ids["video"],
            "vision_start_token_id": ids["vision_start"], "vision_end_token_id": ids["vision_end"],
            "tie_word_embeddings": False}


def text_parameters(config: dict[str, Any]) -> int:
    """Parameters of the text model of a :func:`shapes_config` dict, counted from the config (an engine that
    never builds the model in this process — vLLM's dummy weights — reports this): embeddings, untied head,
    per layer the q/k/v/o projections, q/k norms, two RMS norms and either the MoE block (router + experts) or
    the dense MLP (``mlp_only_layers`` / ``decoder_sparse_step``), final norm. Qwen3-30B-A3B: 30.53 B."""
    t = config.get("text_config") or config
    h, v, hd = int(t["hidden_size"]), int(t["vocab_size"]), int(t["head_dim"])
    nq, nkv, e = int(t["num_attention_heads"]), int(t["num_key_value_heads"]), int(t["num_experts"])
    attn = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + ((nq + 2 * nkv) * hd + h if t.get("attention_bias") else 0)
    per_layer_common = attn + 2 * hd + 2 * h
    moe = h * e + 3 * e * int(t["moe_intermediate_size"]) * h
    dense = 3 * h * int(t["intermediate_size"])
    step, dense_layers = int(t.get("decoder_sparse_step", 1) or 1), set(t.get("mlp_only_layers") or [])
    total = v * h * (1 if t.get("tie_word_embeddings") else 2) + h
    for layer in range(int(t["num_hidden_layers"])):
        sparse = layer not in dense_layers and e > 0 and (layer + 1) % step == 0
        total += per_layer_common + (moe if sparse else dense)
    return total


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

    arch = config["architectures"][0]
    cls = getattr(transformers, arch)
    cfg_cls = getattr(transformers, "Qwen3MoeConfig" if arch == "Qwen3MoeForCausalLM" else "Qwen3VLMoeConfig")
    body = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf_config = cfg_cls(**body)
    hf_config._attn_implementation = attn_implementation
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device(device):
        model = cls._from_config(hf_config, dtype=dtype)
    _init_on_device(model, seed=seed)
    if experts_implementation:
        model.set_experts_implementation(experts_implementation)
    ids = special_ids(int((config.get("text_config") or config)["vocab_size"]))
    model.generation_config.eos_token_id = ids["eos"]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.bos_token_id = None
    return model.eval().requires_grad_(False)


class ShapesTokenizer:
    """Tokenizer-free text path of a shapes model: UTF-8 bytes → ids ``BYTE_OFFSET + byte`` (so any dataset's text,
    and SERE's calibration text, becomes ids a random model can read), decode = the ids as text. No download;
    meaningless as language, which is all random weights need."""

    BYTE_OFFSET = 1000

    def __init__(self, vocab_size: int):
        ids = special_ids(vocab_size)
        self.vocab_size = vocab_size
        self.eos_token_id, self.pad_token_id = ids["eos"], ids["pad"]
        self.padding_side = "left"
        if vocab_size < self.BYTE_OFFSET + 256 + len(ids):
            self.BYTE_OFFSET = 0

    def encode(self, text: str) -> list[int]:
        return [self.BYTE_OFFSET + b for b in text.encode("utf-8")]

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        special = set(special_ids(self.vocab_size).values())
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) in special))

    def __len__(self) -> int:
        return self.vocab_size


class ShapesProcessor:
    """Stands where an ``AutoProcessor`` would: only ``.tokenizer``; images are patchified by
    :mod:`harness.engines.hf.direct` from the model's vision config."""

    tokenizer_free = True

    def __init__(self, vocab_size: int):
        self.tokenizer = ShapesTokenizer(vocab_size)


_BUILT: dict[tuple, Any] = {}


def shapes_model_for_engine(shapes_cfg: Any, device: str, dtype, experts_implementation: str | None,
                            seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, ShapesProcessor, dict]:
    """(model, processor, info) for the HF engine. With ``model.shapes.reuse`` (default) a model built earlier in
    this process with the same spec is handed out again: a Hydra sweep (``-m``, basic launcher: one process)
    builds a 30B model once, not once per job. ``info`` records the build time and whether it was reused."""
    import time

    import torch

    def plain(d):
        return {str(k): v for k, v in dict(d or {}).items()}

    config = shapes_config(shapes_cfg.arch, getattr(shapes_cfg, "num_layers", None), plain(getattr(shapes_cfg, "text", None)),
                           plain(getattr(shapes_cfg, "vision", None)))
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
    info = {"arch": shapes_cfg.arch, "checkpoint_shapes_of": ARCHS[shapes_cfg.arch]["checkpoint"],
            "num_layers": text["num_hidden_layers"], "hidden_size": text["hidden_size"],
            "parameters": sum(p.numel() for p in model.parameters()), "weights": "random-init",
            "build_s": round(time.perf_counter() - t0, 3), "reused": reused, "config": config}
    return model, ShapesProcessor(int(text["vocab_size"])), info

"""Where a model comes from and where it runs: the checkpoint to load, the device, the dtype.

Why a module of its own: the HF engine, SERE calibration and protection, the OpenCompass runner and the
``python -m`` tools all resolve the same three things; living here (below engines and techniques) they do so
without a technique importing an engine or a tool importing the run loop (``shared/notes/layout.md``).
``harness.engines.hf.engine`` (resolve_device, resolve_dtype), ``harness.run.experiment`` (resolve_model) and
``harness.techniques.sere.calibration`` (load_model_for_calibration) keep re-exporting the old names.

Only the standard library is imported at module level (torch and transformers inside the functions).
"""

from __future__ import annotations

from typing import Any

from harness.models.families import family_of
from harness.models.families.build import ensure_tiny_family, tiny_family_fingerprint
from harness.models.real_shapes import shapes_config, ARCHS
from harness.models.tiny import ensure_tiny_model, TinyModelSpec
from harness.models.trained import trained_checkpoint

__all__ = ["TextProcessor", "load_model_for_calibration", "load_processor", "model_class_for", "resolve_device",
           "resolve_dtype", "resolve_model"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str):
    """``auto`` → bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow or unsupported on many CPUs)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"engine.dtype={dtype!r}: expected auto or one of {sorted(_DTYPES)}")
    return getattr(torch, _DTYPES[dtype])


def resolve_model(model_cfg: Any) -> tuple[str, dict[str, Any]]:
    """The checkpoint path to load and the ``run.model`` block (the embedded model is built on first use)."""
    if model_cfg.embedded and model_cfg.weights == "trained-synthetic":  # the committed trained checkpoint
        path, info = trained_checkpoint()
        return str(path), {"name": model_cfg.name, "path": str(path), "fingerprint": info["sha256"][:12],
                           "weights": "trained-synthetic", "weights_meaning": info["meaning"]}
    shapes = model_cfg.get("shapes") if hasattr(model_cfg, "get") else getattr(model_cfg, "shapes", None)
    if shapes is not None and shapes.get("arch"):  # a real checkpoint's shapes, random weights built on the device
        config = shapes_config(shapes.arch, shapes.num_layers, dict(shapes.text or {}), dict(shapes.vision or {}))
        return f"shapes:{shapes.arch}", {"name": model_cfg.name, "path": None, "weights": "random-init",
                                         "shapes_of": ARCHS[shapes.arch]["checkpoint"], "config": config}
    family = model_cfg.get("family") if hasattr(model_cfg, "get") else getattr(model_cfg, "family", None)
    if model_cfg.embedded and family:  # a family's tiny random checkpoint (harness.models.families.build)
        multimodal = bool(model_cfg.get("multimodal", False) if hasattr(model_cfg, "get")
                          else getattr(model_cfg, "multimodal", False))
        path = ensure_tiny_family(str(family), int(model_cfg.seed), multimodal=multimodal)
        return str(path), {"name": model_cfg.name, "path": str(path), "family": str(family), "multimodal": multimodal,
                           "fingerprint": tiny_family_fingerprint(str(family), int(model_cfg.seed), multimodal),
                           "weights": "random-init"}
    if model_cfg.embedded:
        spec = TinyModelSpec(seed=model_cfg.seed)
        path = ensure_tiny_model(spec)
        return str(path), {"name": model_cfg.name, "path": str(path), "fingerprint": spec.fingerprint(),
                           "weights": "random-init"}
    if not model_cfg.path:
        raise ValueError(f"model {model_cfg.name!r}: model.path is not set")
    return model_cfg.path, {"name": model_cfg.name, "path": model_cfg.path, "weights": model_cfg.weights}


def model_class_for(config: Any):
    """The transformers auto class that loads a checkpoint of ``config``: image-text-to-text when the config has
    a vision part (Qwen3-VL-MoE, multimodal Qwen3.5-MoE), else the family's class (``harness.models.families``;
    text-only families: causal LM)."""
    import transformers

    if hasattr(config, "vision_config"):
        return transformers.AutoModelForImageTextToText
    family = family_of(config)
    return getattr(transformers, family.auto_class if family is not None else "AutoModelForCausalLM")


class TextProcessor:
    """``AutoProcessor``'s stand-in for a text-only model: ``.tokenizer`` (left padding), the tokenizer's chat
    template with the message parts joined into one string (text-only chat templates want a string), and
    ``__call__(text=..., return_tensors=..., padding=...)``. An image refuses with one line."""

    tokenizer_free = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def _no_images(what: str) -> ValueError:
        return ValueError(f"{what}: this is a text-only model (no vision tower): use a text dataset "
                          "(e.g. dataset=synthetic_load, or an OpenCompass text task)")

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        flat = []
        for msg in messages:
            content = msg.get("content")
            if not isinstance(content, str):
                if any(part.get("type") == "image" for part in content):
                    raise self._no_images("an image in the prompt")
                content = "".join(part.get("text", "") for part in content)
            flat.append({**msg, "content": content})
        return self.tokenizer.apply_chat_template(flat, **kwargs)

    def __call__(self, text: Any = None, images: Any = None, **kwargs: Any) -> Any:
        if images:
            raise self._no_images("images given")
        kwargs.setdefault("add_special_tokens", False)  # the chat template wrote the special tokens
        return self.tokenizer(text, **kwargs)


def load_processor(path: str, config: Any = None, trust_remote_code: bool = False) -> Any:
    """``AutoProcessor`` for a multimodal checkpoint, :class:`TextProcessor` over ``AutoTokenizer`` otherwise."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = config if config is not None else AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "vision_config"):
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return TextProcessor(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def load_model_for_calibration(path: str, device: str = "auto", dtype: str = "auto"):
    """(model, tokenizer) for a local directory or hub id, with :func:`model_class_for`'s auto class."""
    from transformers import AutoConfig, AutoTokenizer

    dev = resolve_device(device)
    cfg = AutoConfig.from_pretrained(path)
    model = model_class_for(cfg).from_pretrained(path, dtype=resolve_dtype(dtype, dev)).to(dev).eval()
    return model, AutoTokenizer.from_pretrained(path)

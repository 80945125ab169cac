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

__all__ = ["load_model_for_calibration", "resolve_device", "resolve_dtype", "resolve_model"]

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
        from harness.models.trained import trained_checkpoint

        path, info = trained_checkpoint()
        return str(path), {"name": model_cfg.name, "path": str(path), "fingerprint": info["sha256"][:12],
                           "weights": "trained-synthetic", "weights_meaning": info["meaning"]}
    shapes = model_cfg.get("shapes") if hasattr(model_cfg, "get") else getattr(model_cfg, "shapes", None)
    if shapes is not None and shapes.get("arch"):  # a real checkpoint's shapes, random weights built on the device
        from harness.models.real_shapes import ARCHS, shapes_config

        config = shapes_config(shapes.arch, shapes.num_layers, dict(shapes.text or {}), dict(shapes.vision or {}))
        return f"shapes:{shapes.arch}", {"name": model_cfg.name, "path": None, "weights": "random-init",
                                         "shapes_of": ARCHS[shapes.arch]["checkpoint"], "config": config}
    if model_cfg.embedded:
        from harness.models.tiny import TinyModelSpec, ensure_tiny_model

        spec = TinyModelSpec(seed=model_cfg.seed)
        path = ensure_tiny_model(spec)
        return str(path), {"name": model_cfg.name, "path": str(path), "fingerprint": spec.fingerprint(),
                           "weights": "random-init"}
    if not model_cfg.path:
        raise ValueError(f"model {model_cfg.name!r}: model.path is not set")
    return model_cfg.path, {"name": model_cfg.name, "path": model_cfg.path, "weights": model_cfg.weights}


def load_model_for_calibration(path: str, device: str = "auto", dtype: str = "auto"):
    """(model, tokenizer) for a local directory or hub id: image-text-to-text when the config has a
    vision part, causal LM otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    dev = resolve_device(device)
    cfg = AutoConfig.from_pretrained(path)
    cls = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=resolve_dtype(dtype, dev)).to(dev).eval()
    return model, AutoTokenizer.from_pretrained(path)

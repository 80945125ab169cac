"""HF engine: decode steps' attention through the project's Triton kernel (``engine.decode_attention``).

Why: transformers' SDPA path repeats the grouped K/V for every query head whenever a mask is passed, which a
static cache always does, and then runs a general masked kernel; at Qwen3-30B-A3B shapes that was most of the
attention block's time (``harness.kernels.decode_attention``'s doc). The kernel reads each KV head once.

How: an attention function registered with transformers' ``AttentionInterface`` as :data:`NAME`, with SDPA's
mask function registered under the same name (so the mask a layer receives is exactly SDPA's), set on the *text*
model's config only: the vision tower keeps its implementation. The function sends one-query passes (decode
steps) that the kernel supports to it and everything else — prefill, a pass with dropout, a softcap or a
sliding window — to transformers' own ``sdpa_attention_forward``, so prompts and TTFT are unchanged.

``engine.decode_attention``: ``auto`` = the kernel on CUDA, SDPA elsewhere; ``triton`` = the kernel wherever
Triton runs (CPU only under ``TRITON_INTERPRET=1``: tests); ``sdpa`` = transformers' SDPA throughout.
Greedy tokens equal SDPA's up to floating-point summation order (``tests/engines/hf/test_hf_attention_decode.py``).
With the kernel, the engine also gives Qwen3-family attention layers the packed-QKV decode forward
(:mod:`harness.engines.hf.decode_forward`): one GEMM for q/k/v and one compiled norm/RoPE region per decode step.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.engines.hf import decode_forward as hf_decode_forward

NAME = "harness_decode_attention"
CHOICES = ("auto", "triton", "sdpa")
_REGISTERED = False


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """``AttentionInterface`` function: the Triton kernel for a supported decode pass, SDPA otherwise."""
    from harness.kernels.decode_attention import decode_attention, triton_available, unsupported_reason

    plain = (not dropout and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
             and kwargs.get("position_bias") is None and not getattr(module, "training", False))
    if plain and query.shape[2] == 1 and triton_available(query.device) \
            and unsupported_reason(query, key, value, attention_mask) is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention(query, key, value, attention_mask, float(scale)), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register() -> None:
    """Register :data:`NAME` (attention and mask functions) with transformers; idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _REGISTERED = True


def resolve(choice: str | None, device: str) -> bool:
    """Whether ``engine.decode_attention=choice`` puts the kernel in on ``device``."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise ValueError(f"engine.decode_attention={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "sdpa":
        return False
    if choice == "auto":                     # decided before importing the kernel: a CPU venv may lack triton
        return str(device).startswith("cuda")
    from harness.kernels.decode_attention import triton_available

    if not triton_available(device):
        raise ValueError(f"engine.decode_attention=triton: Triton cannot run on {device} (CUDA, or "
                         "TRITON_INTERPRET=1 set before triton's import)")
    return True


def text_config(model: torch.nn.Module) -> Any:
    """The config the text decoder's attention modules read (``text_config`` of a VLM, else the config)."""
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def install(model: torch.nn.Module) -> str | None:
    """Switch the text decoder of ``model`` to :data:`NAME` when it uses SDPA; returns why not, or None.

    Only SDPA is replaced (the kernel reproduces SDPA; eager or flash users chose something else on purpose)."""
    cfg = text_config(model)
    current = getattr(cfg, "_attn_implementation", None)
    if current == NAME:
        return None
    if current != "sdpa":
        return f"the text model's attention is {current!r}, not sdpa"
    register()
    cfg._attn_implementation = NAME
    return None


def install_decode_path(model: torch.nn.Module) -> tuple[str | None, int]:
    """The kernel (:func:`install`) plus the packed-QKV decode forward of ``hf_decode_forward``: (why the kernel is
    not in, or None; how many attention layers took the packed forward)."""
    why_not = install(model)
    return why_not, (hf_decode_forward.install(model) if why_not is None else 0)

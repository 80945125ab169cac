"""HF engine: the VisionZip scoring block's attention returns its log-sum-exp (LSE reuse).

Why: the importance kernel needs each query row's softmax LSE; the scoring block computes exactly that
attention anyway, and flash attention produces the LSE for free. Instead of a second QKᵀ pass in the kernel,
the block runs through an attention function registered with transformers' ``AttentionInterface``
(:data:`ATTN_NAME`) that calls the flash op returning the LSE (``harness.kernels.attention_lse.sdpa_with_lse``:
the op SDPA itself dispatches to for these inputs, so the block's output is SDPA's) and keeps it.

Only that block: its ``config`` attribute is swapped, inside :func:`capture_block_lse`, for a read-through view
whose ``_attn_implementation`` is :data:`ATTN_NAME`; every other block keeps the model's implementation. The
vision attention then takes its per-segment path (one call per ``cu_seqlens`` segment, [1, H, n, D]), so
the captured LSE chunks concatenate to ``[heads, N]`` in packed order. Where no op returns the LSE (fp32 on
CUDA, a mask, dropout), the function falls back to SDPA and the capture yields None: the kernel then computes
the LSE itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from harness.kernels.attention_lse import sdpa_with_lse

ATTN_NAME = "harness_lse_capture"
_REGISTERED = False


class _ConfigView:
    """Read-through view of a config whose ``_attn_implementation`` is :data:`ATTN_NAME`."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_harness_config", config)

    @property
    def _attn_implementation(self) -> str:
        return ATTN_NAME

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_harness_config"), name)


def lse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: SDPA's result, plus the LSE appended to ``module._harness_lse``."""
    store = getattr(module, "_harness_lse", None)
    if attention_mask is None and not dropout and query.shape[1] == key.shape[1]:
        out, lse = sdpa_with_lse(query, key, value, scaling)
    else:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if store is not None:
            store.append(None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if store is not None:
        store.append(lse[0] if lse is not None and lse.shape[0] == 1 else None)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`ATTN_NAME` with transformers (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, lse_attention_forward)
    _REGISTERED = True


@contextmanager
def capture_block_lse(attn: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Within the ``with``, ``attn`` (one vision block's attention) records its LSE.

    Yields a dict whose ``"lse"`` is, after the block ran, ``[heads, N]`` float32 (natural log) or None when
    some segment went through the fallback (or the block did not run).
    """
    register()
    had = "config" in attn.__dict__
    saved = attn.__dict__.get("config")
    got: dict[str, Any] = {"lse": None}
    attn.__dict__["config"] = _ConfigView(attn.config)
    attn._harness_lse = []
    try:
        yield got
    finally:
        chunks = attn.__dict__.pop("_harness_lse", [])
        if had:
            attn.__dict__["config"] = saved
        else:
            attn.__dict__.pop("config", None)
        if chunks and all(c is not None for c in chunks):
            got["lse"] = torch.cat(chunks, dim=1).float()

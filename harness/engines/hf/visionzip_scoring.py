"""VisionZip in the Hugging Face engine, step 1: run the vision tower once and score its patches.

:func:`encode_and_score` runs ``get_image_features`` (the model's own method, so the vision output is exactly
stock) with two hooks on the scoring block's attention — a pre-hook for ``cu_seqlens`` and the rotary
``position_embeddings``, a forward hook on ``attn.qkv`` for its output — so q and k are exactly what that
block's attention consumes, after the rotary embedding, at no extra matmul. The block's own log-sum-exp comes
along through :mod:`harness.engines.hf.attention_lse`, and :func:`harness.kernels.importance.compute_importance`
turns q, k (and the LSE) into one score per patch.

Why a module of its own: this is the one place that reaches into the tower's internals (the attention's call
signature, the ``apply_rotary_pos_emb_vision`` beside the attention class, the qkv layout), the part that
breaks when transformers changes the vision tower. :mod:`harness.engines.hf.visionzip` only consumes the
scores: it selects tokens and rebuilds the inputs and positions for ``generate``. :func:`_base` (where the
tower lives on the model) sits here, under both, because scoring is the first thing that needs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from harness.engines.hf.attention_lse import capture_block_lse

__all__ = ["encode_and_score"]


def _base(model: Any) -> Any:
    """The ``Qwen3VLModel``-like module holding ``visual``, ``get_image_features`` and ``get_rope_index``."""
    for cand in (getattr(model, "model", None), model):
        if cand is not None and hasattr(cand, "visual") and hasattr(cand, "get_rope_index"):
            return cand
    raise NotImplementedError(f"VisionZip: {type(model).__name__} has no Qwen-VL vision tower")


def _rotary_fn(attn: Any) -> Callable:
    """The tower's own ``apply_rotary_pos_emb_vision``, read from the module that defines the attention class,
    so that the scored q and k are rotated exactly as the block rotates them (no copy of the formula)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb_vision", None)
    if fn is None:
        raise NotImplementedError(f"VisionZip: no apply_rotary_pos_emb_vision beside {type(attn).__name__}")
    return fn


def encode_and_score(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, layer: int = -1,
                     want_keys: bool = False, timings: dict[str, Any] | None = None, reuse_lse: bool = True):
    """Run the vision tower once and score its patches at block ``layer``.

    Returns ``(vision_output, patch_scores [N] float32, cu_seqlens, patch_keys [N, heads, head_dim] or
    None)``: ``vision_output`` is what ``model.model.get_image_features`` returned (untouched);
    ``patch_keys`` are the block's keys before the rotary embedding (the contextual-merge metric).
    ``reuse_lse``: the block's attention runs through :mod:`harness.engines.hf.attention_lse` and its
    log-sum-exp goes to the importance kernel (pass 2 only); False, or where no op returns it, the kernel's
    own LSE pass runs (``timings["lse_reused"]`` says which).
    """
    from harness.kernels.importance import compute_importance

    base = _base(model)
    blocks = base.visual.blocks
    depth = len(blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"visionzip.layer={layer} out of range for a vision tower of depth {depth}")
    attn = blocks[layer].attn
    rotary = _rotary_fn(attn)
    captured: dict[str, Any] = {}

    def pre_hook(module, args, kwargs):
        captured["cu_seqlens"] = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        captured["position_embeddings"] = kwargs.get("position_embeddings", args[2] if len(args) > 2 else None)

    def qkv_hook(module, args, output):
        captured["qkv"] = output

    handles = [attn.register_forward_pre_hook(pre_hook, with_kwargs=True), attn.qkv.register_forward_hook(qkv_hook)]
    try:
        with capture_block_lse(attn) as got_lse:  # the block's own attention hands over its LSE
            vision_output = base.get_image_features(pixel_values, image_grid_thw, return_dict=True)
    finally:
        for h in handles:
            h.remove()
    if "qkv" not in captured or captured.get("cu_seqlens") is None or captured.get("position_embeddings") is None:
        raise RuntimeError("VisionZip: the scoring block's attention did not see cu_seqlens / position_embeddings")
    qkv = captured.pop("qkv")
    n = qkv.shape[0]
    q, k, _ = qkv.reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    keys = k.detach().clone() if want_keys else None
    cos, sin = captured["position_embeddings"]
    q_rot, k_rot = rotary(q, k, cos, sin)
    cu = captured["cu_seqlens"]
    # Timed with a device synchronisation on each side so that the importance cost can be reported apart
    # from the vision tower it rides on (summary.json visionzip.importance_ms).
    sync = torch.cuda.synchronize if q_rot.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    lse = got_lse["lse"] if reuse_lse else None
    if lse is not None and tuple(lse.shape) != (q_rot.shape[1], n):
        raise RuntimeError(f"VisionZip: captured LSE {tuple(lse.shape)}, expected {(q_rot.shape[1], n)}")
    scores = compute_importance(q_rot.contiguous(), k_rot.contiguous(), cu, scale=getattr(attn, "scaling", None),
                                lse=lse)
    sync()
    if timings is not None:
        timings["importance_ms"] = timings.get("importance_ms", 0.0) + (time.perf_counter() - t0) * 1e3
        timings["lse_reused"] = lse is not None
    return vision_output, scores.float(), cu, keys


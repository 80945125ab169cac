"""VisionZip's importance score, plain-torch reference of the kernel ``harness.kernels.importance``: the
attention each patch receives at one vision layer (column sums over queries, mean over heads; each segment
averages 1 — the convention is described in :mod:`harness.techniques.visionzip.pruning`, which re-exports
:func:`attention_received`). It lives beside the kernel so that a kernel imports no technique
(``shared/notes/layout.md``). Imports: torch only.
"""

from __future__ import annotations

import torch

__all__ = ["attention_received"]


def _check_packed(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor) -> list[int]:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [N, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}")
    bounds = [int(b) for b in cu_seqlens.reshape(-1).tolist()]
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N={q.shape[0]}, got {bounds}")
    if any(b > e for b, e in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds


def attention_received(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention each patch receives at one vision layer: column sums over queries, mean over heads.

    ``q``, ``k``: [N, heads, head_dim] for a packed batch of images (after the layer's rotary embedding,
    exactly what its attention consumes); ``cu_seqlens``: [n_segments + 1] segment bounds, attention full
    within a segment. ``scale`` defaults to ``head_dim ** -0.5``. Returns [N] float32 (float64 for float64
    inputs); each segment's scores average 1. Reference implementation: materialises one segment's
    [heads, n, n] attention at a time (use :mod:`harness.kernels.importance` on a GPU).
    """
    bounds = _check_packed(q, k, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(q.shape[0], dtype=dtype, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs = q[start:end].to(dtype).transpose(0, 1)  # [H, n, D]
        ks = k[start:end].to(dtype).transpose(0, 1)
        probs = torch.softmax(torch.matmul(qs, ks.transpose(1, 2)) * scale, dim=-1)  # [H, n(q), n(k)]
        out[start:end] = probs.sum(dim=1).mean(dim=0)
    return out

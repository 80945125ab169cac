"""SERE re-routing, plain-torch reference of the fused kernel ``harness.kernels.reroute`` (which must equal
it id for id, ties included): the argument check both share, the primary set and the re-routing itself.

The algorithm and its conventions (float32 comparisons, NaN/-inf never attract, out-of-range ids, protection,
``row_mask``) are described in :mod:`harness.techniques.sere.reroute`, which re-exports these names; they live here,
beside the kernel, so that a kernel imports no technique (``shared/notes/layout.md``).

No host synchronisation and no data-dependent shapes (the primary set is built with a scatter), so this is
also a valid CPU / CUDA-graph fallback. Imports: torch only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_reroute_args", "primary_mask", "reroute"]


def check_reroute_args(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
                       protected: torch.Tensor | None, row_mask: torch.Tensor | None) -> None:
    """Shape/dtype checks shared by the reference and the kernel wrapper (no tensor values are read)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a [T, k] int32/int64 tensor, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if similarity.dim() != 2 or similarity.shape[0] != similarity.shape[1] \
            or not similarity.dtype.is_floating_point:
        raise ValueError(f"similarity must be a square [E, E] float tensor, got {tuple(similarity.shape)} "
                         f"{similarity.dtype}")
    num_experts = similarity.shape[0]
    if isinstance(k_primary, bool) or not isinstance(k_primary, int) or k_primary < 1:
        raise ValueError(f"k_primary must be an int >= 1, got {k_primary!r}")
    if isinstance(rho, torch.Tensor) or math.isnan(float(rho)):
        raise ValueError(f"rho must be a Python number (not a tensor: reading one syncs), got {rho!r}")
    for name, mask, length in (("protected", protected, num_experts),
                               ("row_mask", row_mask, topk_ids.shape[0])):
        if mask is None:
            continue
        if mask.dtype != torch.bool or mask.shape != (length,):
            raise ValueError(f"{name} must be a bool tensor of shape ({length},), got "
                             f"{tuple(mask.shape)} {mask.dtype}")
    for name, t in (("similarity", similarity), ("protected", protected), ("row_mask", row_mask)):
        if t is not None and t.device != topk_ids.device:
            raise ValueError(f"{name} is on {t.device}, topk_ids on {topk_ids.device}")


def primary_mask(topk_ids: torch.Tensor, num_experts: int, k_primary: int,
                 row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [E]: experts in the first ``k_primary`` slots of masked-in rows (ids outside [0, E) ignored)."""
    prim = topk_ids[:, :k_primary]
    valid = (prim >= 0) & (prim < num_experts)
    if row_mask is not None:
        valid = valid & row_mask[:, None]
    # Invalid slots scatter into a spare bin E, dropped afterwards: no data-dependent shapes.
    index = torch.where(valid, prim, torch.full_like(prim, num_experts)).reshape(-1).long()
    mask = torch.zeros(num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    return mask.index_fill_(0, index, True)[:num_experts]


def reroute(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
            protected: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SERE re-routing of ``topk_ids`` [T, k]; returns new ids, same shape and dtype (see module doc).

    ``similarity`` [E, E] float, ``protected`` bool [E] or None, ``row_mask`` bool [T] or None.
    ``k_primary >= k`` returns an unchanged copy.
    """
    check_reroute_args(topk_ids, similarity, k_primary, rho, protected, row_mask)
    num_tokens, k = topk_ids.shape
    num_experts = similarity.shape[0]
    if k_primary >= k or num_tokens == 0:
        return topk_ids.clone()

    in_p = primary_mask(topk_ids, num_experts, k_primary, row_mask)
    sec = topk_ids[:, k_primary:]                                   # [T, S]
    valid = (sec >= 0) & (sec < num_experts)
    src = torch.where(valid, sec, torch.zeros_like(sec)).long()     # safe gather index

    # Candidate similarities: row of the source expert, restricted to P; NaN/-inf never attract.
    sim = similarity.float()[src]                                   # [T, S, E]
    sim = sim.masked_fill(~in_p | torch.isnan(sim), -math.inf)
    best = sim.amax(dim=-1)                                         # [T, S]
    expert = torch.arange(num_experts, device=sim.device)
    # Lowest expert id among the maxima (explicit, so the tie rule does not rest on argmax internals).
    target = torch.where(sim == best[..., None], expert, num_experts).amin(dim=-1)

    rho32 = torch.full((), float(rho), dtype=torch.float32, device=sim.device)  # a fill: graph-capturable
    move = valid & ~in_p[src] & (best > -math.inf) & (best >= rho32)
    if protected is not None:
        move &= ~protected[src]
    if row_mask is not None:
        move &= row_mask[:, None]

    out = topk_ids.clone()
    out[:, k_primary:] = torch.where(move, target.to(topk_ids.dtype), sec)
    return out

"""SERE: similarity-based expert re-routing (plain-torch reference).

At a decode step the experts a batch activates grow with the batch (Qwen3-30B-A3B, top-8: 8 experts at
batch 1, ~93 of 128 at batch 128), and a bandwidth-bound MoE layer pays for every one of them. SERE
(arXiv 2602.07616) keeps each token's first ``k_primary`` experts and moves the remaining ("secondary")
slots onto an expert that the batch loads anyway, when a calibrated similarity says the two are close:

    P = union over the batch of every token's first k_primary ids            (the primary set)
    for each secondary slot (columns k_primary .. k-1) holding expert e:
        e in P                                   -> keep e
        e protected                              -> keep e
        p* = argmax_{p in P} similarity[e, p]    (ties: the lowest expert id)
        similarity[e, p*] >= rho                 -> the slot now names p*
        otherwise                                -> keep e ("critical" expert, still computed)

Routing weights are not touched: the slot's gate weight now multiplies p*'s output, so only ids are
returned. ``similarity[e, p]`` is read row = source expert, column = candidate; it need not be symmetric.

Conventions shared with the fused kernel (``harness.kernels.reroute``), which must match id for id:

- Comparisons are done in float32: ``similarity`` is upcast (exact for bf16/fp16) and ``rho`` is rounded to
  float32, as a Triton ``float`` argument is.
- NaN and -inf similarities never attract. If no candidate in P has a finite similarity (e.g. P is empty),
  nothing moves, whatever ``rho``.
- Ids outside ``[0, E)`` (e.g. ``-1`` for "no expert", as expert-parallel routers emit) are left as they are
  and do not join P.
- ``protected`` only stops a *source* expert from moving; it neither adds experts to P nor makes an expert
  an attraction target (a protected expert attracts only if it is in P anyway).
- ``row_mask`` (mixed prefill/decode batches, where only decode rows are re-routed): rows where it is False
  are left unchanged **and do not contribute to P**; P is the union over the masked-in rows' primary slots.
  Chosen because it is the simplest well-defined rule and keeps a decode row's result independent of
  which prefill chunks the scheduler happens to co-batch with it (the same as decode-only SERE, which sees
  the decode rows alone). Experts that prefill rows load anyway would be free attraction targets too; a
  caller wanting that can build its own primary set and is free to extend the rule later, but it makes
  decode quality depend on scheduling, so it is not the default here.

The reference avoids host synchronisation and data-dependent shapes (the primary set is built with a
scatter), so it is also a valid CPU / CUDA-graph fallback; only the statistics helpers synchronise.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_reroute_args", "expert_union", "primary_mask", "reroute", "reroute_stats"]


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


def expert_union(ids: torch.Tensor) -> int:
    """Number of distinct experts named in ``ids`` (negative ids, i.e. "no expert", are ignored). Syncs."""
    ids = ids.reshape(-1)
    return int(torch.unique(ids[ids >= 0]).numel())


def reroute_stats(old_ids: torch.Tensor, new_ids: torch.Tensor, k_primary: int | None = None) -> dict:
    """Statistics of one re-routing: distinct experts before/after and how many slots moved. Syncs.

    ``moved_fraction`` is over the secondary slots (``T * (k - k_primary)``) when ``k_primary`` is given,
    else over all ``T * k`` slots.
    """
    if old_ids.shape != new_ids.shape:
        raise ValueError(f"shape mismatch: {tuple(old_ids.shape)} vs {tuple(new_ids.shape)}")
    num_tokens, k = old_ids.shape
    moved = int((old_ids != new_ids).sum())
    slots = num_tokens * (k - min(k_primary, k) if k_primary is not None else k)
    before, after = expert_union(old_ids), expert_union(new_ids)
    return {
        "experts_before": before,
        "experts_after": after,
        "experts_saved": before - after,
        "slots_moved": moved,
        "slots_considered": slots,
        "moved_fraction": moved / slots if slots else 0.0,
    }

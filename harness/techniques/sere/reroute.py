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
``check_reroute_args``, ``primary_mask`` and ``reroute`` live beside the kernel, in
``harness.kernels.reroute_reference`` (a kernel imports no technique), and are re-exported here.
"""

from __future__ import annotations

import torch

from harness.kernels.reroute_reference import check_reroute_args, primary_mask, reroute

__all__ = ["check_reroute_args", "expert_union", "primary_mask", "reroute", "reroute_stats"]


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

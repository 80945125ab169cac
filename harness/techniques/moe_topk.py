"""Plain top-K truncation of a MoE router (``moe.top_k``): the baseline SERE is compared against.

The seed reports three OpenCompass rows for Qwen3-30B-A3B (top-8): top-8 82.24, SERE K=2 ρ=0.5 80.37 and
"plain top-2" 14.30 — the last one shows that SERE's quality comes from re-routing secondary slots onto
similar experts the batch loads anyway, not from computing fewer experts. This module is that plain top-K:

    ids_K     = the router's first K ids (its K highest-probability experts; the router's top-k is sorted)
    weights_K = softmax(logits)[ids_K]                      (float32, as the router computes probabilities)
                / their sum        if the router renormalises (Qwen3-VL-MoE always; Qwen3-MoE when
                                   ``norm_topk_prob``), else unchanged
                cast to the logits' dtype

i.e. exactly what the model's router returns when built with ``num_experts_per_tok = K`` (the test builds
such a router and compares bit for bit). The weights are recomputed from the logits rather than rescaled
from the top-k weights, so a bf16 model gets one rounding, as its own router would.

**Where** (``moe.scope``): ``decode`` (default) truncates decode steps only and keeps the full top-k in
prefill — SERE's rule (the seed re-routes in decode only), so that ``moe.top_k=2`` and ``sere.k=2`` differ
*only* in what happens to the secondary slots (dropped vs re-routed) and their TPOT/quality are
comparable; ``all`` truncates every pass, prefill included (a model that simply runs with top-K).

**Combination with SERE** (``moe.top_k=K'`` with ``sere.k=K``): defined as *SERE on a top-K' model* — the
router is truncated to K' first, then SERE (decode steps) re-routes the truncated routing's secondary slots
K..K'-1 onto the batch's primary union; K >= K' leaves nothing to re-route (= plain top-K'). So a sweep
``sere.k=null,2,1 moe.top_k=null,2`` runs every cell, and each cell means one thing.

Only torch is imported (lazily).
"""

from __future__ import annotations

from typing import Any

from harness.config.access import setting  # (re-exported: its old home)

__all__ = ["SCOPES", "check_moe_config", "moe_settings", "pad_routing", "setting", "truncate_routing"]

SCOPES = ("decode", "all")


def moe_settings(moe_cfg: Any, sere_cfg: Any = None) -> tuple[int, str] | None:
    """``(top_k, scope)`` from the ``moe`` config group, or None when ``moe.top_k`` is null. Raises
    ``ValueError`` for a bad value. ``sere_cfg`` is accepted for symmetry: the combination is defined
    (module doc)."""
    top_k = setting(moe_cfg, "top_k")
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"moe.top_k={top_k!r}: expected null or an int >= 1")
    scope = str(setting(moe_cfg, "scope", "decode"))
    if scope not in SCOPES:
        raise ValueError(f"moe.scope={scope!r}: expected one of {', '.join(SCOPES)}")
    return top_k, scope


def check_moe_config(cfg: Any) -> None:
    """Config-level check (``cfg`` has ``moe``): raises as :func:`moe_settings` does (for the validator)."""
    moe_settings(setting(cfg, "moe"), setting(cfg, "sere"))


def truncate_routing(logits, ids, top_k: int, renormalize: bool):
    """``(weights [T, K], ids [T, K])``: the router's K highest experts with the router's weights for a
    top-K router (module doc). ``logits`` [T, E] (any float dtype), ``ids`` [T, k] the router's sorted top-k.
    ``top_k >= k`` returns the first ``k`` columns recomputed the same way (= the router's own output)."""
    import torch

    kk = min(int(top_k), ids.shape[-1])
    ids_k = ids[:, :kk]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, ids_k.long())
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids_k


def pad_routing(weights_k, ids_k, width: int):
    """``(weights, ids)`` of ``width`` columns computing exactly the truncated routing: the dropped slots get
    weight 0 and the row's first expert (an expert the row loads anyway, so no expert is added). For engines
    whose MoE kernels are sized for the model's top-k (vLLM)."""
    import torch

    extra = width - ids_k.shape[1]
    if extra <= 0:
        return weights_k, ids_k
    ids = torch.cat([ids_k, ids_k[:, :1].expand(-1, extra)], dim=1)
    weights = torch.cat([weights_k, torch.zeros_like(weights_k[:, :1]).expand(-1, extra)], dim=1)
    return weights, ids

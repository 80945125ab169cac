"""``moe.top_k`` in vLLM: plain top-K truncation as a per-layer ``custom_routing_function`` of the plugin.

Same mechanism as SERE in :mod:`harness.engines.vllm.sere` (read its module doc): the engine exports
``HARNESS_MOE_TOP_K`` (and ``HARNESS_MOE_SCOPE``, ``decode`` by default) before vLLM starts; in every vLLM
process :func:`harness.engines.vllm.plugin.register` wraps ``qwen3_moe.FusedMoEFactory`` so each MoE layer gets
:func:`make_topk_routing_function`, and publishes the step's decode rows (the runner wrapper).

The routing function computes the stock top-k exactly as transformers does (``stock_topk``), then, for the
rows it applies to (``scope=decode``: the step's decode rows, prefill rows of a mixed chunked-prefill batch
untouched; ``scope=all``: every row), the truncation of :func:`harness.techniques.moe_topk.truncate_routing`
— the router's K highest experts, weights recomputed from the logits and renormalised when vLLM says the
model renormalises (``renormalize`` = ``norm_topk_prob``; Qwen3-VL-MoE: true). vLLM's fused-MoE kernels
are sized for the layer's top-k, so the result is handed over in the padded form
(:func:`harness.techniques.moe_topk.pad_routing`): the dropped slots get weight 0 and the row's first expert,
which the row computes anyway — the same MoE output and the same set of experts as a top-K router.

Statistics (``harness_moe_stats`` on the workers, ``summary.json`` ``moe``): distinct experts per layer and
decode step before (top-k) and after (top-K), over the rows the rule applies to, as the HF engine's
``TopKHandle.stats()``.

With SERE (``HARNESS_SERE_K`` too; :mod:`harness.techniques.moe_topk` defines it): SERE's routing function
applies :func:`apply_topk` first and re-routes the truncated routing's first K' columns (the padded slots
name the row's first expert, which is primary, and are left alone), as the HF engine chains the two hooks.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from harness.engines.vllm import routing as _routing
from harness.engines.vllm.routing import LayerStats, layer_index, layer_stats_summary, stock_topk
from harness.engines.vllm.settings import MoeSettings

MOE_STATS_METHOD = "harness_moe_stats"


_MOE_STATS: dict[int, Any] = {}


def apply_topk(gating_output, weights, ids, renormalize: bool, top_k: int, scope: str = "decode",
               stats: Any = None):
    """The stock routing ``(weights, ids)`` [T, k] truncated to ``top_k`` on the rows ``scope`` names, in the
    padded [T, k] form; returns ``(weights, ids, K)`` with K = min(top_k, k) (the meaningful columns)."""
    import torch

    from harness.techniques.moe_topk import pad_routing, truncate_routing

    topk = ids.shape[1]
    rows = gating_output.shape[0]
    if scope == "all":
        mask = None if _routing.DECODE.dummy else torch.ones(rows, dtype=torch.bool, device=gating_output.device)
        n_rows = rows
    else:
        mask = _routing.DECODE.rows(gating_output.device, rows)
        n_rows = _routing.DECODE.n_decode
    if mask is None or top_k >= topk:
        new_w, new_ids = weights, ids
    else:
        w_k, ids_k = truncate_routing(gating_output, ids, top_k, renormalize)
        pad_w, pad_ids = pad_routing(w_k, ids_k, topk)
        new_w = torch.where(mask[:, None], pad_w, weights)
        new_ids = torch.where(mask[:, None], pad_ids, ids)
    if stats is not None and mask is not None and n_rows > 0 and not _routing.DECODE.dummy:
        stats.add(ids, new_ids, mask, min(top_k, topk), n_rows)
    return new_w, new_ids, min(top_k, topk)


def make_topk_routing_function(layer: int, top_k: int, scope: str = "decode", stats: Any = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (module doc)."""
    import torch

    def routing(hidden_states, gating_output, topk, renormalize):
        weights, ids = stock_topk(gating_output, topk, renormalize)
        new_w, new_ids, _ = apply_topk(gating_output, weights, ids, renormalize, top_k, scope, stats)
        return new_w, new_ids.to(torch.int32)

    routing.harness_layer = layer  # type: ignore[attr-defined]
    return routing


class TopKRouting:
    """``routing_for(prefix, num_experts)`` for the plugin's factory wrapper (as ``sere.SereArtifacts``)."""

    def __init__(self, settings: MoeSettings) -> None:
        self.settings = settings

    def routing_for(self, prefix: str, num_experts: int | None) -> Callable:
        layer = layer_index(prefix)
        if layer is None:
            raise RuntimeError(f"moe.top_k: cannot find the layer index in the MoE prefix {prefix!r}")
        return make_topk_routing_function(layer, self.settings.top_k, self.settings.scope,
                                          layer_stats(layer, num_experts, prefix))


def layer_stats(layer: int, num_experts: int | None, prefix: str = "") -> Any:
    """A fresh ``moe.top_k`` statistics object for one layer (registered for :func:`moe_stats`)."""
    if num_experts is None:
        raise RuntimeError(f"moe.top_k: the MoE layer {prefix!r} was built without num_experts")
    stats = _MOE_STATS[layer] = LayerStats(layer, int(num_experts), None)
    return stats


def moe_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's ``moe.top_k`` statistics (the HF engine's ``TopKHandle.stats()`` keys)."""
    from harness.engines.vllm.plugin import _STATE

    settings = _STATE.get("moe")
    summary = layer_stats_summary(_MOE_STATS, reset)
    per_layer = [{k: row[k] for k in ("layer", "steps", "tokens", "expert_union_before", "expert_union_after")}
                 for row in summary["per_layer"]]
    return {"top_k": settings.top_k if settings else None, "scope": settings.scope if settings else None,
            "layers": summary["layers"], "steps": summary["steps"], "tokens_per_step": summary["tokens_per_step"],
            "expert_union_before": summary["expert_union_before"],
            "expert_union_after": summary["expert_union_after"], "experts_saved": summary["experts_saved"],
            "per_layer": per_layer, "pid": os.getpid()}

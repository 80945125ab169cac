"""``moe.top_k`` in vLLM: plain top-K truncation as a per-layer ``custom_routing_function`` of the plugin.

Same mechanism as SERE in :mod:`harness.engines.vllm.sere` (read its module doc): the engine exports
``HARNESS_MOE_TOP_K`` (and ``HARNESS_MOE_SCOPE``, ``decode`` by default) before vLLM starts; in every vLLM
process :func:`harness.engines.vllm.plugin.register` wraps ``qwen3_moe``'s MoE constructor so each MoE layer
gets :func:`make_topk_routing_function`, and publishes the step's decode rows (the runner wrapper).

The routing function is one launch (two beyond 16 rows) of ``harness.kernels.fused_routing``: the stock top-k exactly as
transformers computes it, then, for the rows it applies to (``scope=decode``: the step's decode rows, prefill rows of a mixed chunked-prefill batch
untouched; ``scope=all``: every row), the truncation of :func:`harness.techniques.moe_topk.truncate_routing`
— the router's K highest experts, weights recomputed from the logits and renormalised when vLLM says the
model renormalises (``renormalize`` = ``norm_topk_prob``; Qwen3-VL-MoE: true). vLLM's fused-MoE kernels
are sized for the layer's top-k, so the result is handed over in the padded form
(:func:`harness.techniques.moe_topk.pad_routing`): the dropped slots get weight 0 and the row's first expert,
which the row computes anyway — the same MoE output and the same set of experts as a top-K router.

Statistics (``harness_moe_stats`` on the workers, ``summary.json`` ``moe``): distinct experts per layer and
decode step before (top-k) and after (top-K), over the rows the rule applies to (scope ``all``: the step's
real rows, dummy runs excluded), as the HF engine's ``TopKHandle.stats()`` — device counters the kernel
advances, so CUDA-graph replays count.

With SERE (``HARNESS_SERE_K`` too; :mod:`harness.techniques.moe_topk` defines it): SERE's routing function
truncates first and re-routes the truncated routing's first K' columns (the padded slots
name the row's first expert, which is primary, and are left alone), as the HF engine chains the two hooks.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from harness.engines.vllm.routing import counters_summary, layer_index, make_fused_routing_function, stock_topk, DECODE
from harness.engines.vllm.settings import routing_stats_enabled, MoeSettings
from harness.engines.vllm.state import STATE
from harness.techniques.moe_routing import random_p, top_p, ROUTINGS
from harness.techniques.sere.graphs import RoutingCounters

MOE_STATS_METHOD = "harness_moe_stats"

_MOE_STATS: dict[int, RoutingCounters] = {}


def make_topk_routing_function(layer: int, top_k: int, scope: str = "decode", stats: Any = None,
                               op: Callable | None = None, rule: Any = None, bias: Any = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (module doc); ``rule``/``bias``: the model family's
    (``harness.engines.vllm.routing.make_fused_routing_function``)."""
    return make_fused_routing_function(layer, trunc_k=top_k, trunc_all=scope == "all", topk_counters=stats, op=op,
                                       rule=rule, bias=bias)


def make_baseline_routing_function(layer: int, routing: str, k_primary: int = 2, p: float = 0.5,
                                   seed: int = 0) -> Callable:
    """``moe.routing`` (random_p | top_p, issue 31) as a ``custom_routing_function``: the fused routing kernel
    does not implement these baselines, so this is the torch path — the stock top-k
    (:func:`harness.engines.vllm.routing.stock_topk`), then :func:`harness.techniques.moe_routing.random_p` /
    :func:`~harness.techniques.moe_routing.top_p` on the step's decode rows (P over decode rows only; prefill
    rows keep the stock routing), in vLLM's padded form (weights float32, ids int32). One generator per
    device, seeded with ``seed``. Not graph-safe (``random_p`` draws; eager or prefill-only use)."""
    import torch

    if routing not in ROUTINGS:
        raise ValueError(f"moe.routing={routing!r}: expected one of {ROUTINGS}")
    generators: dict[Any, Any] = {}

    def fn(hidden_states, gating_output, topk, renormalize):
        weights, ids = stock_topk(gating_output, int(topk), bool(renormalize))
        decode = DECODE.rows(gating_output.device, gating_output.shape[0]).bool()
        if routing == "random_p":
            gen = generators.get(gating_output.device)
            if gen is None:
                gen = generators[gating_output.device] = torch.Generator(device=gating_output.device).manual_seed(seed)
            new_ids = random_p(ids, k_primary, gating_output.shape[-1], gen, decode)
            new_weights = weights
        else:
            w, moved = top_p(gating_output, ids, p)
            new_ids = torch.where(decode[:, None], moved, ids)
            new_weights = torch.where(decode[:, None], w, weights)
        return new_weights.float(), new_ids.to(torch.int32)

    fn.harness_layer = layer  # type: ignore[attr-defined]
    return fn


class TopKRouting:
    """``routing_for(prefix, num_experts)`` for the plugin's factory wrapper (as ``sere.SereArtifacts``)."""

    def __init__(self, settings: MoeSettings) -> None:
        self.settings = settings

    def routing_for(self, prefix: str, num_experts: int | None, rule: Any = None, bias: Any = None) -> Callable:
        layer = layer_index(prefix)
        if layer is None:
            raise RuntimeError(f"moe.top_k: cannot find the layer index in the MoE prefix {prefix!r}")
        s = self.settings
        if s.routing:  # issue 31's baselines: the torch path (the fused kernel has none); no device counters
            return make_baseline_routing_function(layer, s.routing, s.k_primary, s.p, s.seed)
        stats = layer_stats(layer, num_experts, prefix) if routing_stats_enabled() else None
        return make_topk_routing_function(layer, self.settings.top_k, self.settings.scope, stats, rule=rule, bias=bias)


def layer_stats(layer: int, num_experts: int | None, prefix: str = "") -> RoutingCounters:
    """A fresh ``moe.top_k`` counter for one layer (registered for :func:`moe_stats`)."""
    if num_experts is None:
        raise RuntimeError(f"moe.top_k: the MoE layer {prefix!r} was built without num_experts")
    stats = _MOE_STATS[layer] = RoutingCounters(layer, int(num_experts))
    return stats


def moe_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's ``moe.top_k`` statistics (the HF engine's ``TopKHandle.stats()`` keys)."""
    settings = STATE.get("moe")
    summary = counters_summary(_MOE_STATS, reset)
    per_layer = [{k: row[k] for k in ("layer", "steps", "tokens", "expert_union_before", "expert_union_after")}
                 for row in summary["per_layer"]]
    return {"top_k": settings.top_k if settings else None, "scope": settings.scope if settings else None,
            "routing": settings.routing if settings else None,
            "layers": summary["layers"], "steps": summary["steps"], "tokens_per_step": summary["tokens_per_step"],
            "expert_union_before": summary["expert_union_before"],
            "expert_union_after": summary["expert_union_after"], "experts_saved": summary["experts_saved"],
            "per_layer": per_layer, "pid": os.getpid()}

"""``moe.top_k`` in vLLM: plain top-K truncation as a per-layer ``custom_routing_function`` of the plugin.

Same mechanism as SERE in :mod:`harness.vllm_plugin` (read its module doc): the engine exports
``HARNESS_MOE_TOP_K`` (and ``HARNESS_MOE_SCOPE``, ``decode`` by default) before vLLM starts; in every vLLM
process :func:`harness.vllm_plugin.register` wraps ``qwen3_moe.FusedMoEFactory`` so each MoE layer gets
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

Refused in one process together with SERE (``register`` raises): the combination is not defined
(:mod:`harness.techniques.moe_topk`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

ENV_MOE_TOP_K = "HARNESS_MOE_TOP_K"
ENV_MOE_SCOPE = "HARNESS_MOE_SCOPE"
MOE_ENV = (ENV_MOE_TOP_K, ENV_MOE_SCOPE)
MOE_STATS_METHOD = "harness_moe_stats"


@dataclass(frozen=True)
class MoeSettings:
    """``moe.top_k`` settings of this process, read from the environment."""

    top_k: int
    scope: str = "decode"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "MoeSettings | None":
        from harness.techniques.moe_topk import SCOPES

        env = os.environ if env is None else env
        k = (env.get(ENV_MOE_TOP_K) or "").strip()
        if not k:
            return None
        scope = (env.get(ENV_MOE_SCOPE) or "decode").strip()
        if int(k) < 1 or scope not in SCOPES:
            raise RuntimeError(f"{ENV_MOE_TOP_K}={k} {ENV_MOE_SCOPE}={scope}: expected K >= 1 and a scope in {SCOPES}")
        return cls(top_k=int(k), scope=scope)

    def env(self) -> dict[str, str]:
        return {ENV_MOE_TOP_K: str(self.top_k), ENV_MOE_SCOPE: self.scope}


_MOE_STATS: dict[int, Any] = {}


def make_topk_routing_function(layer: int, top_k: int, scope: str = "decode", stats: Any = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (module doc)."""
    import torch

    from harness.techniques.moe_topk import pad_routing, truncate_routing
    from harness.vllm_plugin import _DECODE, stock_topk

    def routing(hidden_states, gating_output, topk, renormalize):
        weights, ids = stock_topk(gating_output, topk, renormalize)
        rows = gating_output.shape[0]
        if scope == "all":
            mask = None if _DECODE.dummy else torch.ones(rows, dtype=torch.bool, device=gating_output.device)
            n_rows = rows
        else:
            mask = _DECODE.rows(gating_output.device, rows)
            n_rows = _DECODE.n_decode
        if mask is None or top_k >= topk:
            new_w, new_ids = weights, ids
        else:
            w_k, ids_k = truncate_routing(gating_output, ids, top_k, renormalize)
            pad_w, pad_ids = pad_routing(w_k, ids_k, topk)
            new_w = torch.where(mask[:, None], pad_w, weights)
            new_ids = torch.where(mask[:, None], pad_ids, ids)
        if stats is not None and mask is not None and n_rows > 0 and not _DECODE.dummy:
            stats.add(ids, new_ids, mask, min(top_k, topk), n_rows)
        return new_w, new_ids.to(torch.int32)

    routing.harness_layer = layer  # type: ignore[attr-defined]
    return routing


class TopKRouting:
    """``routing_for(prefix, num_experts)`` for the plugin's factory wrapper (as ``_SereArtifacts``)."""

    def __init__(self, settings: MoeSettings) -> None:
        self.settings = settings

    def routing_for(self, prefix: str, num_experts: int | None) -> Callable:
        from harness.vllm_plugin import _LayerStats, layer_index

        layer = layer_index(prefix)
        if layer is None:
            raise RuntimeError(f"moe.top_k: cannot find the layer index in the MoE prefix {prefix!r}")
        if num_experts is None:
            raise RuntimeError(f"moe.top_k: the MoE layer {prefix!r} was built without num_experts")
        stats = _MOE_STATS[layer] = _LayerStats(layer, int(num_experts), None)
        return make_topk_routing_function(layer, self.settings.top_k, self.settings.scope, stats)


def moe_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's ``moe.top_k`` statistics (the HF engine's ``TopKHandle.stats()`` keys)."""
    from harness.vllm_plugin import _STATE, layer_stats_summary

    settings = _STATE.get("moe")
    summary = layer_stats_summary(_MOE_STATS, reset)
    per_layer = [{k: row[k] for k in ("layer", "steps", "tokens", "expert_union_before", "expert_union_after")}
                 for row in summary["per_layer"]]
    return {"top_k": settings.top_k if settings else None, "scope": settings.scope if settings else None,
            "layers": summary["layers"], "steps": summary["steps"], "tokens_per_step": summary["tokens_per_step"],
            "expert_union_before": summary["expert_union_before"],
            "expert_union_after": summary["expert_union_after"], "experts_saved": summary["experts_saved"],
            "per_layer": per_layer, "pid": os.getpid()}

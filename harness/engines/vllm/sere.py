"""SERE in vLLM: the per-layer ``custom_routing_function`` that re-routes decode rows, its artifacts and
statistics.

:func:`harness.engines.vllm.plugin.register` wraps the MoE constructor of vLLM's ``qwen3_moe`` so that each
MoE layer is built with :meth:`SereArtifacts.routing_for`'s function, closing over that layer's similarity
and protection. **The routing function** (``fn(hidden_states, gating_output, topk, renormalize) -> (weights
float32, ids int32)``, :func:`harness.engines.vllm.routing.make_fused_routing_function`) is one or two launches (by step length) of
``harness.kernels.fused_routing``: the stock Qwen3 softmax top-k, then SERE's re-route of the decode rows
only (``row_mask`` = the step's decode rows, :class:`harness.engines.vllm.routing.DecodeRows`): prefill rows
are neither re-routed nor part of the primary set P (``harness.techniques.sere.reroute``). Weights are not changed
(SERE's reference semantics). With ``moe.top_k`` too, the truncation comes first, in the same launch.

Statistics (``harness_sere_stats`` on the workers, ``summary.json`` ``sere``): :func:`sere_stats`, from
device counters (``harness.techniques.sere.graphs.RoutingCounters``) that the kernel advances in place, so
captured CUDA graphs count on replay; ``calls``/``rows`` per layer feed the engine's engagement canary.
``HARNESS_ROUTING_STATS=0`` builds the op without them (benchmarks only: a run without counters has no
canary and reports no SERE statistics).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from harness.engines.vllm.routing import counters_summary, layer_index, make_fused_routing_function, Trace
from harness.engines.vllm.settings import routing_stats_enabled, SereSettings
from harness.engines.vllm.state import STATE
from harness.engines.vllm.topk import layer_stats
from harness.techniques.sere.calibration import load_similarity
from harness.techniques.sere.graphs import RoutingCounters
from harness.techniques.sere.protection import load_protection

__all__ = ["SereArtifacts", "counters_summary", "make_routing_function", "sere_stats"]

_STATS: dict[int, RoutingCounters] = {}


def sere_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's SERE statistics (the HF engine's ``SereHandle.stats()`` fields; call it on the
    workers with ``LLM.collective_rpc(sere_stats)``). ``reset=True`` clears them after reading."""
    settings = STATE.get("sere")
    summary = counters_summary(_STATS, reset)
    return {
        "k_primary": settings.k_primary if settings else None, "rho": settings.rho if settings else None,
        "mode": "decode", **summary, "pid": os.getpid(),
        "stats": "on" if routing_stats_enabled() else "off",
    }


def make_routing_function(layer: int, similarity, k_primary: int, rho: float, protected=None,
                          trace: Trace | None = None, stats: RoutingCounters | None = None, truncate: Any = None,
                          truncate_stats: RoutingCounters | None = None, op: Callable | None = None,
                          rule: Any = None, bias: Any = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (see the module doc). ``truncate``: a
    ``harness.engines.vllm.settings.MoeSettings`` applied before re-routing (``moe.top_k`` with SERE).
    ``op``: the routing op (default: the fused kernel where Triton runs, its torch reference elsewhere)."""
    return make_fused_routing_function(
        layer, trunc_k=truncate.top_k if truncate is not None else None,
        trunc_all=truncate is not None and truncate.scope == "all", k_primary=k_primary, rho=rho,
        similarity=similarity, protected=protected, sere_counters=stats, topk_counters=truncate_stats,
        trace=trace, op=op, rule=rule, bias=bias)


class SereArtifacts:
    """Similarity / protection tensors per layer, loaded once per process."""

    def __init__(self, settings: SereSettings) -> None:
        self.settings = settings
        self.similarity, _ = load_similarity(settings.similarity_path)
        self.protected: dict[int, Any] = {}
        if settings.protection_path:
            self.protected, _ = load_protection(settings.protection_path, n=settings.protect)
        self.trace = Trace(settings.trace_path) if settings.trace_path else None

    def routing_for(self, prefix: str, num_experts: int | None, rule: Any = None, bias: Any = None
                    ) -> Callable | None:
        layer = layer_index(prefix)
        if layer is None:
            raise RuntimeError(f"SERE: cannot find the layer index in the MoE prefix {prefix!r}")
        if layer not in self.similarity:
            raise RuntimeError(f"SERE: {self.settings.similarity_path} has no similarity for layer {layer} "
                               f"(has {sorted(self.similarity)})")
        sim = self.similarity[layer]
        if num_experts is not None and tuple(sim.shape) != (num_experts, num_experts):
            raise RuntimeError(f"SERE: layer {layer} similarity is {tuple(sim.shape)}, the layer has "
                               f"{num_experts} experts")
        prot = self.protected.get(layer)
        stats = None
        if routing_stats_enabled():
            stats = _STATS[layer] = RoutingCounters(layer, sim.shape[0], int(prot.sum()) if prot is not None else 0)
        moe = STATE.get("moe")  # moe.top_k as well: SERE re-routes the truncated routing (vllm.topk)
        moe_stats = None
        if moe is not None and routing_stats_enabled():
            moe_stats = layer_stats(layer, num_experts if num_experts is not None else sim.shape[0], prefix)
        return make_routing_function(layer, sim, self.settings.k_primary, self.settings.rho, prot, self.trace,
                                     stats=stats, truncate=moe, truncate_stats=moe_stats, rule=rule, bias=bias)

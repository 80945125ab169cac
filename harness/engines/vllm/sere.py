"""SERE in vLLM: the per-layer ``custom_routing_function`` that re-routes decode rows, its artifacts and
statistics.

:func:`harness.engines.vllm.plugin.register` wraps ``qwen3_moe.FusedMoEFactory`` so that each MoE layer is
built with :meth:`SereArtifacts.routing_for`'s function, closing over that layer's similarity and
protection. **The routing function** (``fn(hidden_states, gating_output, topk, renormalize) -> (weights,
ids)``) computes the stock Qwen3 top-k (:func:`harness.engines.vllm.routing.stock_topk`), then re-routes
the ids of the decode rows only with ``reroute_op`` (the fused Triton op on CUDA tensors, the torch
reference on CPU tensors; same ids) and ``row_mask`` = the step's decode rows
(:class:`harness.engines.vllm.routing.DecodeRows`): prefill rows are neither re-routed nor part of the
primary set P (``harness.techniques.sere``). Weights are not changed (SERE's reference semantics). With
``moe.top_k`` too, the truncation (:func:`harness.engines.vllm.topk.apply_topk`) comes first.

Statistics (``harness_sere_stats`` on the workers, ``summary.json`` ``sere``): :func:`sere_stats`, from
device counters (``harness.techniques.sere_graphs.RoutingCounters``) that captured CUDA graphs advance on
replay; ``calls``/``rows`` per layer feed the engine's engagement canary.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from harness.engines.vllm import routing as _routing
from harness.engines.vllm.routing import Trace, layer_index, stock_topk
from harness.engines.vllm.settings import SereSettings
from harness.techniques.sere_graphs import RoutingCounters, capturing, route


def _reroute_fn() -> Callable:
    from harness.techniques.sere import reroute as reference

    try:
        from harness.kernels.reroute import reroute_triton
    except Exception:  # noqa: BLE001 - no (working) Triton here: the reference has the same semantics
        reroute_triton = None

    def op(ids, similarity, k_primary, rho, protected, row_mask):
        if ids.is_cuda and reroute_triton is not None:
            return reroute_triton(ids, similarity, k_primary, rho, protected, row_mask)
        return reference(ids, similarity, k_primary, rho, protected, row_mask)

    return op


_STATS: dict[int, RoutingCounters] = {}


def counters_summary(stats: dict[int, RoutingCounters], reset: bool = False) -> dict[str, Any]:
    """Per-layer and overall statistics from the device counters (one read per layer; ``reset`` zeroes them
    in place afterwards). ``steps`` = routing calls that saw a decode row, ``tokens`` = decode rows: both
    counted on the device, so steps replayed from a CUDA graph count like eager ones."""
    per_layer, sums = [], dict.fromkeys(("calls", "before", "after", "primary", "moved", "secondary"), 0)
    for layer in sorted(stats):
        c = stats[layer].read()
        calls = c["calls"]
        per_layer.append({
            "layer": layer, "steps": calls, "tokens": c["rows"], "calls": calls, "rows": c["rows"],
            "expert_union_before": c["before"] / calls if calls else None,
            "expert_union_after": c["after"] / calls if calls else None,
            "primary_union": c["primary"] / calls if calls else None,
            "moved_slots": c["moved"], "secondary_slots": c["secondary"],
            "moved_fraction": c["moved"] / c["secondary"] if c["secondary"] else None,
            "protected": stats[layer].protected,
        })
        for key in sums:
            sums[key] += c[key]
        if reset:
            stats[layer].reset()
    n_steps = max((p["steps"] for p in per_layer), default=0)
    n_tokens = max((p["tokens"] for p in per_layer), default=0)
    calls = sums["calls"]
    mean = (lambda v: v / calls) if calls else (lambda v: None)
    before, after = mean(sums["before"]), mean(sums["after"])
    return {
        "layers": len(per_layer), "steps": n_steps,
        "tokens_per_step": n_tokens / n_steps if n_steps else None,
        "expert_union_before": before, "expert_union_after": after,
        "experts_saved": before - after if calls else None,
        "primary_union": mean(sums["primary"]),
        "moved_fraction": sums["moved"] / sums["secondary"] if sums["secondary"] else None,
        "counters": "device",
        "per_layer": per_layer,
    }


def sere_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's SERE statistics (the HF engine's ``SereHandle.stats()`` fields; call it on the
    workers with ``LLM.collective_rpc(sere_stats)``). ``reset=True`` clears them after reading."""
    from harness.engines.vllm.plugin import _STATE

    settings = _STATE.get("sere")
    summary = counters_summary(_STATS, reset)
    return {
        "k_primary": settings.k_primary if settings else None, "rho": settings.rho if settings else None,
        "mode": "decode", **summary, "pid": os.getpid(),
    }


def make_routing_function(layer: int, similarity, k_primary: int, rho: float, protected=None,
                          trace: Trace | None = None, op: Callable | None = None,
                          stats: RoutingCounters | None = None, truncate: Any = None,
                          truncate_stats: Any = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (see the module doc). ``truncate``: a
    ``harness.engines.vllm.settings.MoeSettings`` applied before re-routing (``moe.top_k`` with SERE).

    Graph-safe by construction (``harness.techniques.sere_graphs``): it reads only the persistent
    decode-row buffer, the per-device similarity/protection copies and the device counters, takes no
    Python branch that depends on the step except the eager skip of a step without decode rows, and the
    trace (which synchronises) is written only outside a capture."""
    import torch

    op = op or _reroute_fn()
    per_device: dict[Any, tuple] = {}

    def on(device):
        got = per_device.get(device)
        if got is None:
            sim = similarity.to(device=device, dtype=torch.float32).contiguous()
            prot = protected.to(device=device, dtype=torch.bool).contiguous() if protected is not None else None
            got = per_device[device] = (sim, prot)
        return got

    def routing(hidden_states, gating_output, topk, renormalize):
        weights, ids = stock_topk(gating_output, topk, renormalize)
        width = topk
        if truncate is not None:  # moe.top_k first; SERE sees the truncated routing's first K' columns
            from harness.engines.vllm.topk import apply_topk

            weights, ids, width = apply_topk(gating_output, weights, ids, renormalize, truncate.top_k,
                                             truncate.scope, truncate_stats)
        if k_primary >= width:
            new = ids
        else:
            sim, prot = on(gating_output.device)
            head = ids[:, :width]
            new_head = route(head, sim, k_primary, rho, prot, _routing.DECODE.steps, stats, op)
            if new_head is head:  # an eager step without decode rows: nothing launched
                new = ids
            else:
                new = new_head if width == topk else torch.cat([new_head, ids[:, width:]], dim=1)
        if trace is not None and not capturing():
            mask = _routing.DECODE.rows(gating_output.device, gating_output.shape[0])
            rows = mask.nonzero().reshape(-1).tolist()
            changed = (new != ids)
            trace.write({"pid": os.getpid(), "layer": layer, "rows": int(gating_output.shape[0]),
                         "decode_rows": rows, "prefill_changed": bool(changed[~mask].any()),
                         "moved": int(changed.sum()), "mask": True})
        return weights, new.to(torch.int32)

    routing.harness_layer = layer  # type: ignore[attr-defined]
    return routing


class SereArtifacts:
    """Similarity / protection tensors per layer, loaded once per process."""

    def __init__(self, settings: SereSettings) -> None:
        from harness.techniques.sere_calibration import load_similarity

        self.settings = settings
        self.similarity, _ = load_similarity(settings.similarity_path)
        self.protected: dict[int, Any] = {}
        if settings.protection_path:
            from harness.techniques.sere_protection import load_protection

            self.protected, _ = load_protection(settings.protection_path, n=settings.protect)
        self.trace = Trace(settings.trace_path) if settings.trace_path else None

    def routing_for(self, prefix: str, num_experts: int | None) -> Callable | None:
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
        stats = _STATS[layer] = RoutingCounters(layer, sim.shape[0], int(prot.sum()) if prot is not None else 0)
        from harness.engines.vllm.plugin import _STATE

        moe = _STATE.get("moe")  # moe.top_k as well: SERE re-routes the truncated routing (vllm.topk)
        moe_stats = None
        if moe is not None:
            from harness.engines.vllm.topk import layer_stats

            moe_stats = layer_stats(layer, num_experts if num_experts is not None else sim.shape[0], prefix)
        return make_routing_function(layer, sim, self.settings.k_primary, self.settings.rho,
                                     self.protected.get(layer), self.trace, stats=stats, truncate=moe,
                                     truncate_stats=moe_stats)

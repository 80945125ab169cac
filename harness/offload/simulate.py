"""Replay a routing trace through the expert cache with no model and no tensors (bookkeeping only).

Why: policies and the accounting are checked on scripted traces (tests), and a trace recorded on one machine can
be replayed for many capacities and policies in milliseconds. Differences from a live run, by construction:
copies are instantaneous (no late arrivals, no stall or copy time: those are measured only with a mover), the
clock's ``ms`` is ``tokens × ms_per_token``, and there is no prefill pass unless ``prefill`` gives one per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harness.offload.cache import ExpertCache
from harness.offload.policy import Geometry, PolicyContext, make_policy, policy_class

__all__ = ["simulate", "replay"]


def _unique(ids: Any) -> list[int]:
    vals = ids.reshape(-1).tolist() if hasattr(ids, "reshape") else [e for row in ids for e in row]
    return sorted({int(e) for e in vals if int(e) >= 0})


def replay(cache: ExpertCache, steps: Sequence[Any], gate: Callable[[int, Any], Any] | None = None,
           hiddens: Sequence[Any] | None = None, embeds: Sequence[Any] | None = None,
           new_batch_at: Sequence[int] = ()) -> ExpertCache:
    """Feed ``steps`` (each ``[b, L, k]`` ids: a tensor or nested lists) as decode passes. ``new_batch_at``:
    step indices where a new batch starts (a prefill pass with no experts precedes them: the step counter
    restarts; warm/cold follow)."""
    starts = set(new_batch_at) | {0}
    for t, ids in enumerate(steps):
        if t in starts:
            cache.begin_pass("prefill", rows=0, row_tokens=0)
            cache.end_pass()
        rows = len(ids)
        cache.begin_pass("decode", rows=rows, row_tokens=rows,
                         embeddings=None if embeds is None else embeds[t])
        for layer in range(cache.g.num_layers):
            layer_ids = ids[:, layer] if hasattr(ids, "shape") else [r[layer] for r in ids]
            for chunk in cache.plan(layer, _unique(layer_ids)):
                cache.acquire(layer, chunk)
                cache.release(layer)
            hidden = None if hiddens is None else hiddens[t][layer]
            cache.prefetch(cache.policy.prefetch(layer, cache.clock, hidden))
        cache.end_pass()
    return cache


def simulate(steps: Sequence[Any], policy: str, capacity: int, num_experts: int, *, expert_bytes: int = 1,
             top_k: int | None = None, params: dict[str, Any] | None = None, trace: Any = None,
             gate: Callable[[int, Any], Any] | None = None, hiddens: Sequence[Any] | None = None,
             embeds: Sequence[Any] | None = None, warm_after: int = 8, ms_per_token: float = 1.0,
             new_batch_at: Sequence[int] = ()) -> dict[str, Any]:
    """Replay ``steps`` under ``policy`` with ``capacity`` slots per layer; returns the ``offload`` metrics
    (plus ``policy_stats``). ``trace`` is the oracle's future (defaults to ``steps`` themselves)."""
    first = steps[0]
    num_layers = first.shape[1] if hasattr(first, "shape") else len(first[0])
    k = top_k if top_k is not None else (first.shape[2] if hasattr(first, "shape") else len(first[0][0]))
    cap = num_experts if policy_class(policy).mode == "resident" else capacity
    geometry = Geometry(num_layers, num_experts, k, cap, expert_bytes)
    ctx = PolicyContext(geometry, dict(params or {}), trace if trace is not None else _ListTrace(steps), gate)
    cache = ExpertCache(geometry, make_policy(policy, ctx), None, warm_after, ms_per_token)
    replay(cache, steps, gate, hiddens, embeds, new_batch_at)
    out = cache.summary()
    out["policy_stats"] = cache.policy.stats()
    return out


class _ListTrace:
    """``steps`` as an oracle trace (already in replay order, whatever the batch size)."""

    def __init__(self, steps: Sequence[Any]):
        self.steps = steps

    def steps_by_batch(self, batch_size: int) -> list[Any]:
        import torch

        return [s if isinstance(s, torch.Tensor) else torch.tensor(s) for s in self.steps]

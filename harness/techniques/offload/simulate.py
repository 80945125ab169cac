"""Replay a routing trace through the expert cache with no model and no tensors (bookkeeping only).

Why: policies and the accounting are checked on scripted traces (tests), and a trace recorded on one machine can
be replayed for many capacities and policies in milliseconds. Differences from a live run, by construction:
copies are instantaneous (no late arrivals, no stall or copy time: those are measured only with a mover), the
clock's ``ms`` is ``tokens × ms_per_token``, and there is no prefill pass unless ``prefill`` gives one per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harness.techniques.offload.cache import ExpertCache
from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy, policy_class

__all__ = ["simulate", "replay", "simulate_trace", "embeds_by_batch"]


def _rows(ids: Any) -> dict[int, int]:
    """expert → how many (row, slot) entries name it (rows: a row names an expert at most once in top-k)."""
    vals = ids.reshape(-1).tolist() if hasattr(ids, "reshape") else [e for row in ids for e in row]
    out: dict[int, int] = {}
    for e in vals:
        if int(e) >= 0:
            out[int(e)] = out.get(int(e), 0) + 1
    return out


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
            rows_of = _rows(layer_ids)
            for chunk in cache.plan(layer, sorted(rows_of)):
                cache.acquire(layer, chunk, rows_of)
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


def embeds_by_batch(trace: Any, batch_size: int) -> list[Any]:
    """The trace's token embeddings regrouped exactly as ``trace.steps_by_batch(batch_size)`` regroups its ids:
    one ``[b, 1, H]`` tensor per decode step (what ``begin_pass`` receives in a live decode step)."""
    import torch

    request = trace.request.long()
    n_req = int(request.max()) + 1 if len(request) else 0
    counts = torch.bincount(request, minlength=n_req).tolist()
    starts = [sum(counts[:i]) for i in range(n_req)]
    out = []
    for g in range(0, n_req, batch_size):
        group = list(range(g, min(g + batch_size, n_req)))
        for t in range(max(counts[r] for r in group)):
            rows = [starts[r] + t for r in group if t < counts[r]]
            out.append(trace.embeds[rows].float()[:, None, :])
    return out


def simulate_trace(trace: Any, batch_size: int, policy: str, capacity: int, **kw: Any) -> dict[str, Any]:
    """:func:`simulate` on a recorded trace (``harness.techniques.offload.trace.RoutingTrace`` or one loaded by
    :func:`harness.techniques.offload.trace_io.load_trace`): ids regrouped by ``steps_by_batch(batch_size)``, the policy's
    ``begin_pass`` gets the matching ``[b, 1, H]`` embeddings when the trace has them, the oracle sees the same
    trace, a prefill marker starts each batch (so warm/cold follow batches)."""
    steps = trace.steps_by_batch(batch_size)
    embeds = None
    if getattr(trace, "embeds", None) is not None and trace.embeds.shape[-1] > 0:
        embeds = embeds_by_batch(trace, batch_size)
    starts, t = [], 0
    for g in _group_lengths(trace, batch_size):
        starts.append(t)
        t += g
    params = {"batch_size": batch_size, **(kw.pop("params", None) or {})}
    num_experts = kw.pop("num_experts", None) or int(getattr(trace, "num_experts", 0) or (int(trace.ids.max()) + 1))
    return simulate(steps, policy, capacity, num_experts, trace=trace, embeds=embeds, params=params,
                    new_batch_at=starts, **kw)


def _group_lengths(trace: Any, batch_size: int) -> list[int]:
    import torch

    request = trace.request.long()
    n_req = int(request.max()) + 1 if len(request) else 0
    counts = torch.bincount(request, minlength=n_req).tolist()
    return [max(counts[g:g + batch_size]) for g in range(0, n_req, batch_size)]


class _ListTrace:
    """``steps`` as an oracle trace (already in replay order, whatever the batch size)."""

    def __init__(self, steps: Sequence[Any]):
        self.steps = steps

    def steps_by_batch(self, batch_size: int) -> list[Any]:
        import torch

        return [s if isinstance(s, torch.Tensor) else torch.tensor(s) for s in self.steps]

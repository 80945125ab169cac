"""The built-in offload policies: ``none``, ``staging``, ``lru``, ``lru+gate``, ``oracle`` (``lease``: another module).

- ``none`` — every expert resident (the model's own weights stay on the device): the upper bound;
- ``staging`` — no cache: every needed expert copied on every access, forgotten after the layer: the lower bound;
- ``lru`` — per-layer least-recently-used eviction (the mixtral-offloading baseline);
- ``lru+gate`` — LRU plus, in decode, a speculative prefetch of layer ``l+1``'s experts chosen by layer ``l+1``'s
  router applied to layer ``l``'s MoE input (the hidden state one layer early: the residual stream changes
  little between adjacent layers, which is what makes this guess useful and cheap);
- ``oracle`` — Belady's eviction (evict the candidate used farthest in the future) on a recorded routing trace of
  the same requests: the ceiling any eviction rule on this cache can reach (no prefetch: it bounds eviction,
  not overlap).

Trivial baselines (issue 31), for a predictive policy to beat at the same capacity:

- ``lfu`` — per-layer least-frequently-used eviction: each expert's count of passes that computed it (kept across
  evictions: "perfect" LFU, the stronger variant), ties to the least recently used, then the lower id;
- ``static_hot`` — the most frequent experts of a recorded routing trace (``offload.trace``: counts per layer over
  every token row of the trace), pinned: a victim is always the coldest candidate by the trace's counts (ties:
  the higher id: the reverse of the hot ranking, so the hot set is exactly what stays), so once loaded the ``capacity`` hottest experts of a layer are never evicted for a colder one; no
  adaptation at run time. Record the trace on other requests than the measured ones for an honest baseline
  (the same requests make it an in-sample, optimistic one).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

from harness.techniques.offload.policy import Clock, OffloadPolicy, PolicyContext, register_policy

__all__ = ["NonePolicy", "StagingPolicy", "LRUPolicy", "LRUGatePolicy", "OraclePolicy", "LFUPolicy",
           "StaticHotPolicy"]


def smallest(n: int, candidates: Sequence[int], key: Any) -> list[int]:
    """The ``n`` candidates of smallest ``key``, smallest first (keys end with the id, so they are unique and
    the order is total). One pass for the common n = 1 (a single prefetch or miss), a sort otherwise."""
    if n == 1:
        return [min(candidates, key=key)] if len(candidates) else []
    return sorted(candidates, key=key)[:n]


@register_policy("none")
class NonePolicy(OffloadPolicy):
    """All experts resident; never asked anything."""

    mode = "resident"


@register_policy("staging")
class StagingPolicy(OffloadPolicy):
    """Copy every needed expert on every access (the cache forgets a layer's experts after its compute)."""

    mode = "staging"


@register_policy("lru")
class LRUPolicy(OffloadPolicy):
    """Per-layer LRU. Recency is a counter of accesses (pass, layer order), so it is exact and clock-free.

    Contract (tests/techniques/offload/test_policy_contracts.py):

    - victims: the ``n`` candidates with the oldest last use, oldest first;
    - an expert never used since it was loaded (or since its last eviction) is older than any used one;
    - one ``on_access`` call is one tick: the experts of one call tie, and every tie goes to the lowest id;
    - ``on_evict`` forgets the expert's recency; layers never share recency.
    """

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self._tick = 0
        self.last_use: list[dict[int, int]] = [dict() for _ in range(ctx.geometry.num_layers)]

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        self._tick += 1
        for e in experts:
            self.last_use[layer][e] = self._tick

    def on_access(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        self.touch(layer, experts)

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        lu = self.last_use[layer]
        return smallest(n, candidates, lambda e: (lu.get(e, -1), e))

    def on_evict(self, layer: int, expert: int, clock: Clock) -> None:
        self.last_use[layer].pop(expert, None)


@register_policy("lru+gate")
class LRUGatePolicy(LRUPolicy):
    """LRU + next layer's router on the current hidden state → prefetch (decode only; ``params.prefetch_prefill``
    turns it on for prefill too). A prefetched expert counts as just used, so LRU does not evict it at once.

    Contract, beyond LRU's: ``prefetch(l)`` returns ``(l + 1, e)`` for the gate's guesses in
    :func:`rank_gate_guess` order, nothing for the last layer, without a hidden state or a gate, or outside
    decode (unless ``prefetch_prefill``); every guess (resident or not) is touched as one access."""

    needs_gate = True

    def prefetch(self, layer: int, clock: Clock, hidden: Any = None) -> Iterable[tuple[int, int]]:
        nxt = layer + 1
        if (nxt >= self.geometry.num_layers or hidden is None or self.ctx.gate is None
                or (clock.phase != "decode" and not self.ctx.params.get("prefetch_prefill", False))):
            return ()
        ids = self.ctx.gate(nxt, hidden)
        experts = rank_gate_guess(ids, self.geometry.num_experts)
        self.touch(nxt, experts)
        return [(nxt, e) for e in experts]


def rank_gate_guess(ids: Any, num_experts: int) -> list[int]:
    """The gate's guessed experts ``[T, k]`` (each row's top-k, best first), best first: by the number of rows
    naming the expert, then by its best rank in a row, then id. The cache admits only the first few
    (``offload.prefetch.max_per_layer``), so the order is the prefetch priority. ``ids`` is a tensor or host
    rows (lists, as :class:`harness.techniques.offload.gate_read.GateReader` returns them); ids outside
    ``[0, num_experts)`` are dropped; a single row keeps its own order, duplicates dropped."""
    if hasattr(ids, "reshape"):
        rows = ids.reshape(-1, ids.shape[-1]).tolist()
    elif ids and isinstance(ids[0], (list, tuple)):
        rows = [list(r) for r in ids]  # host rows (a gate guess read with the layer's routing)
    else:
        rows = [list(ids)]
    if len(rows) == 1:  # one row: its own order (ties in count are all 1; best rank first), duplicates dropped
        seen: dict[int, None] = {}
        for e in rows[0]:
            e = int(e)
            if 0 <= e < num_experts and e not in seen:
                seen[e] = None
        return list(seen)
    score: dict[int, list[int]] = {}
    for row in rows:
        for rank, e in enumerate(row):
            e = int(e)
            if 0 <= e < num_experts:
                s = score.setdefault(e, [0, rank])
                s[0] += 1
                s[1] = min(s[1], rank)
    return sorted(score, key=lambda e: (-score[e][0], score[e][1], e))


@register_policy("oracle")
class OraclePolicy(OffloadPolicy):
    """Belady on ``ctx.trace`` (an object with ``steps_by_batch(B)`` → per decode step ``[b, L, k]`` ids, the
    order this run decodes in; ``params.batch_size`` = the engine's batch size). Decode step ``t`` of the
    measured run (``clock.tokens`` after the warm-up reset) is trace step ``t - 1``; a prefill looks ahead from
    the next decode step. Steps whose routing differs from the trace are counted (``trace_mismatch_steps``):
    the ceiling is exact only when that is 0.

    Contract: the next use of a candidate is its first trace step ``>= now`` (a use at the current step counts:
    an expert the current step still needs is the last to go); victims are the farthest next uses first, never
    used again (∞) before any, ties to the lowest id. Only decode accesses are checked against the trace;
    an access at ``now >= len(trace)`` is counted in ``accesses_beyond_trace``."""

    needs_trace = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        steps = ctx.trace.steps_by_batch(int(ctx.params.get("batch_size", 1)))
        num_layers = ctx.geometry.num_layers
        self.sets: list[list[frozenset[int]]] = []  # [step][layer] -> experts
        self.uses: list[dict[int, list[int]]] = [dict() for _ in range(num_layers)]
        for t, ids in enumerate(steps):
            if ids.shape[1] != num_layers:
                raise ValueError(f"trace has {ids.shape[1]} MoE layers, the model {num_layers}")
            row = []
            for layer in range(num_layers):
                s = frozenset(int(e) for e in ids[:, layer].reshape(-1).tolist() if e >= 0)
                row.append(s)
                for e in s:
                    self.uses[layer].setdefault(e, []).append(t)
            self.sets.append(row)
        self.mismatch_steps: set[int] = set()
        self.beyond_trace = 0

    def _now(self, clock: Clock) -> int:
        return clock.tokens - 1 if clock.phase == "decode" else clock.tokens

    def next_use(self, layer: int, expert: int, now: int) -> float:
        uses = self.uses[layer].get(expert, [])
        i = bisect.bisect_left(uses, now)
        return uses[i] if i < len(uses) else float("inf")

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        now = self._now(clock)
        return smallest(n, candidates, lambda e: (-self.next_use(layer, e, now), e))

    def on_access(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        if clock.phase != "decode":
            return
        now = self._now(clock)
        if now >= len(self.sets):
            self.beyond_trace += 1
        elif not set(experts) <= self.sets[now][layer]:
            self.mismatch_steps.add(now)

    def on_reset(self, clock: Clock) -> None:
        self.mismatch_steps.clear()
        self.beyond_trace = 0

    def stats(self) -> dict[str, Any]:
        return {"trace_steps": len(self.sets), "trace_mismatch_steps": len(self.mismatch_steps),
                "accesses_beyond_trace": self.beyond_trace}


@register_policy("lfu")
class LFUPolicy(LRUPolicy):
    """Per-layer LFU (module doc): evict the candidate computed in the fewest passes, then the least recent
    (LRU's ticks), then the lowest id. Counts survive eviction ("perfect" LFU); recency does not."""

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.count: list[dict[int, int]] = [dict() for _ in range(ctx.geometry.num_layers)]

    def on_access(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        super().on_access(layer, experts, clock)
        counts = self.count[layer]
        for e in experts:
            counts[e] = counts.get(e, 0) + 1

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        counts, lu = self.count[layer], self.last_use[layer]
        return smallest(n, candidates, lambda e: (counts.get(e, 0), lu.get(e, -1), e))

    def stats(self) -> dict[str, Any]:
        return {"distinct_experts_counted": sum(len(c) for c in self.count)}


def trace_counts(ids: Any, num_layers: int, num_experts: int) -> list[list[int]]:
    """Per MoE layer, how many token rows of a trace ``ids`` [N, L, k] name each expert (ids < 0 ignored)."""
    import torch

    if ids.dim() != 3 or ids.shape[1] != num_layers:
        raise ValueError(f"trace ids {tuple(ids.shape)}: expected [N, {num_layers}, k]")
    out = []
    for layer in range(num_layers):
        flat = ids[:, layer].reshape(-1).long()
        flat = flat[(flat >= 0) & (flat < num_experts)]
        out.append(torch.bincount(flat, minlength=num_experts).tolist())
    return out


def _trace_ids(trace: Any) -> Any:
    """``[N, L, k]`` ids of a ``RoutingTrace`` (``.ids``) or of any object with ``steps_by_batch`` (a replay)."""
    import torch

    ids = getattr(trace, "ids", None)
    if ids is None:
        ids = torch.cat([torch.as_tensor(s) for s in trace.steps_by_batch(1)], dim=0)
    return ids


@register_policy("static_hot")
class StaticHotPolicy(OffloadPolicy):
    """The trace's hottest experts pinned (module doc): victims are the coldest candidates by trace counts, ties
    to the higher id (the hot ranking keeps the lower id, so on a tie the expert outside the hot set goes);
    ``hot_evictions`` counts victims from the hot set (a layer needing more than its capacity at once)."""

    needs_trace = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        g = ctx.geometry
        self.counts = trace_counts(_trace_ids(ctx.trace), g.num_layers, g.num_experts)
        self.hot = [sorted(range(g.num_experts), key=lambda e, c=c: (-c[e], e))[:g.capacity] for c in self.counts]
        self.hot_sets = [frozenset(h) for h in self.hot]
        self.hot_evictions = 0

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        c = self.counts[layer]
        victims = sorted(candidates, key=lambda e: (c[e], -e))[:n]  # the reverse of the hot ranking
        self.hot_evictions += sum(1 for e in victims if e in self.hot_sets[layer])
        return victims

    def stats(self) -> dict[str, Any]:
        """``hot``: the pinned set per layer; ``hot_evictions``: hot experts evicted (only when every candidate
        was hot: a layer needing more than its capacity in one pass)."""
        return {"hot": self.hot, "hot_evictions": self.hot_evictions,
                "trace_rows": int(_trace_ids(self.ctx.trace).shape[0])}

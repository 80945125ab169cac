"""The expert cache: per-layer pools of slots, the expert→slot table, loads, events, policy calls, accounting.

Why per-layer pools (not one global pool): every decode token visits every MoE layer in order, so under any
recency rule a shared pool evicts the layers that ran longest ago — exactly the ones about to run next — and a
global pool lets one layer's burst (a prefill) flush every other layer. Per-layer pools of equal size are the
mixtral-offloading baseline, make LRU and Belady well defined per layer (the oracle's ceiling is then the
ceiling of the same cache), and give the fused kernel a plain ``[C, 2I, H]`` weight tensor per layer: the slots
of all layers live in ONE device slab per weight kind (``[L, C, ...]``), viewed per layer.

The bookkeeping (which expert is in which slot, what is in flight, what the policy is asked) is plain Python and
identical with or without tensors: :class:`ExpertCache` takes an optional :class:`harness.techniques.offload.store.Mover`
that performs copies; without one (``mover=None``) it is a simulator over a routing trace.

Mechanism, per access of layer ``l`` with needed experts ``N`` (sorted unique):

1. ``plan``: if ``|N| > C`` (a prefill or a large batch) the layer is computed in chunks of at most C experts,
   resident experts first (streamed per layer); else one chunk.
2. ``acquire(l, chunk)``: hits stay; in-flight prefetches are waited on (a late arrival if not finished); misses
   take a free slot or a victim the policy chooses among the layer's experts not in this chunk, and are copied
   (demand loads) — the copy waits on the layer's last-read event, so it never overwrites a slot compute may
   still read; the compute stream waits on each needed load's event; the table gets the new slot ids.
3. the caller computes, then ``release(l)`` records the layer's read event; ``prefetch(l, pairs)`` issues
   speculative loads for later layers under the admission rules of :mod:`harness.techniques.offload.prefetch`
   (``offload.prefetch.*``: a cap per layer, a cap on prefetch copies in flight, no eviction of an expert
   used in the last N tokens or predicted by the same request, their own low-priority copy stream; their
   victims also exclude experts loaded in the current pass).

Slot reuse across streams: when an entry whose load is still in flight is evicted (an unused prefetch), the
next load into its slot is told to wait on that load (``after=``), so two copies never race on one slot.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.techniques.offload.accounting import Accounting
from harness.techniques.offload.policy import Clock, Geometry, OffloadPolicy
from harness.techniques.offload.prefetch import PrefetchSettings

__all__ = ["ExpertCache", "Entry"]


@dataclass
class Entry:
    """One resident (or in-flight) expert of a layer."""

    slot: int
    prefetched: bool  # its load was a prefetch not yet used
    pass_loaded: int  # pass index of the load
    load: Any = None  # the mover's handle of an in-flight load (None = complete)
    last_step: int = -1  # the cache's pass-independent decode-step counter at the last access (-1 = never)


class ExpertCache:
    """See the module doc. ``mover`` performs copies (None = bookkeeping only)."""

    def __init__(self, geometry: Geometry, policy: OffloadPolicy, mover: Any = None, warm_after: int = 8,
                 ms_per_token: float | None = None, prefetch: PrefetchSettings | None = None):
        self.g = geometry
        self.pf = prefetch if prefetch is not None else PrefetchSettings()
        if mover is not None and hasattr(mover, "set_streams"):
            mover.set_streams(self.pf.stream)
        self._inflight: list[Any] = []  # handles of prefetch loads that may still be copying
        self._slot_after: list[dict[int, Any]] = [dict() for _ in range(geometry.num_layers)]
        self._steps = 0  # decode steps ever (never reset: the recency rule must survive reset_stats)
        self._pending: list[tuple[int, list[int], Clock]] = []  # on_access calls not yet delivered (see _flush)
        self.policy = policy
        self.mover = mover
        self.mode = policy.mode
        self.acct = Accounting(geometry.num_layers, geometry.expert_bytes, warm_after)
        self.entries: list[dict[int, Entry]] = [dict() for _ in range(geometry.num_layers)]
        self.free: list[list[int]] = [list(range(geometry.capacity)) for _ in range(geometry.num_layers)]
        self.ms_per_token = ms_per_token  # simulated wall clock (trace replay); None = host time
        self._t0 = time.perf_counter()
        self.pass_index = -1
        self.batch_index = -1
        self.step = 0
        self.tokens = 0
        self.phase = "prefill"
        self.clock = self._clock()

    # -- clock ------------------------------------------------------------------------------------
    def _clock(self) -> Clock:
        ms = (self.tokens * self.ms_per_token if self.ms_per_token is not None
              else (time.perf_counter() - self._t0) * 1e3)
        return Clock(self.pass_index, self.phase, self.step, self.tokens, ms, self.batch_index)

    def begin_pass(self, phase: str, rows: int, row_tokens: int, tokens: Any = None, embeddings: Any = None) -> None:
        """A forward pass starts: ``phase`` prefill (a new batch) or decode (its next step)."""
        self.pass_index += 1
        self.phase = phase
        if phase == "prefill":
            self.batch_index += 1
            self.step = 0
        else:
            self.step += 1
            self.tokens += 1
            self._steps += 1
        self._flush()
        self.clock = self._clock()
        self.acct.begin_pass(phase, row_tokens)
        self.policy.begin_pass(self.clock, tokens, embeddings if self.policy.needs_embeddings else None)

    def end_pass(self) -> None:
        self._flush()
        if self.mover is not None:
            self.mover.end_pass(self)
        self.policy.end_pass(self.clock)

    def reset_stats(self) -> None:
        """Measurement starts: counters zeroed, contents kept, token clock restarted."""
        self._flush()
        if self.mover is not None:
            self.mover.drain(self)
        self.acct.reset()
        for layer, entries in enumerate(self.entries):
            for e in entries:
                self.acct.ever_loaded.add((layer, e))
        self.tokens = 0
        self.clock = self._clock()
        self.policy.on_reset(self.clock)

    # -- planning ---------------------------------------------------------------------------------
    def resident(self, layer: int) -> list[int]:
        return sorted(self.entries[layer])

    def plan(self, layer: int, needed: Sequence[int]) -> list[list[int]]:
        """Chunks of at most ``capacity`` experts (resident ones first) covering ``needed``."""
        cap = self.g.capacity
        if self.mode == "resident" or len(needed) <= cap:
            return [list(needed)]
        self.acct.chunked_layer_passes += 1
        here = [e for e in needed if e in self.entries[layer]]
        rest = [e for e in needed if e not in self.entries[layer]]
        order = here + rest
        return [sorted(order[i:i + cap]) for i in range(0, len(order), cap)]

    # -- demand path ------------------------------------------------------------------------------
    def acquire(self, layer: int, chunk: Sequence[int], rows: dict[int, int] | None = None) -> dict[int, int]:
        """Make ``chunk`` resident in ``layer``; returns expert → slot. Accounts each access once (``rows``:
        expert → how many rows named it, for the per-token hit rate; default 1)."""
        self._flush()
        clock, phase, acct = self.clock, self.phase, self.acct
        rows = rows or {}
        if self.mode == "resident":
            for e in chunk:
                acct.access(phase, self.step, layer, e, "hit", False, rows.get(e, 1))
            self._pending.append((layer, list(chunk), clock))
            return {e: e for e in chunk}
        entries = self.entries[layer]
        waits: list[Any] = []
        missing: list[int] = []
        for e in chunk:
            ent = entries.get(e)
            if ent is None:
                missing.append(e)
                continue
            late = ent.load is not None and self.mover is not None and not self.mover.done(ent.load)
            acct.access(phase, self.step, layer, e, "late" if late else "hit", ent.prefetched, rows.get(e, 1))
            if ent.load is not None:
                waits.append(ent.load)
                ent.load = None
            ent.prefetched = False
            ent.last_step = self._steps
        if missing:
            self._make_room(layer, len(missing), exclude=set(chunk), for_prefetch=False)
            for e in missing:
                acct.access(phase, self.step, layer, e, "miss", False, rows.get(e, 1))
                ent = self._load(layer, e, prefetch=False)
                ent.last_step = self._steps
                if ent.load is not None:
                    waits.append(ent.load)
                    ent.load = None
        if waits and self.mover is not None:
            self.mover.wait(self, waits)
        self._pending.append((layer, list(chunk), clock))  # on_access: in release, after the kernel is issued
        return {e: entries[e].slot for e in chunk}

    def _flush(self) -> None:
        """Deliver the pending ``on_access`` calls. ``acquire`` only queues them; ``release`` (called right after
        the layer's kernel was issued) delivers them, so the policy's bookkeeping runs while the GPU computes
        instead of between the routing read and the kernel launch. Every other entry point flushes first, so a
        policy sees exactly the order of calls it saw when ``acquire`` called it directly."""
        if self._pending:
            pending, self._pending = self._pending, []
            for layer, chunk, clock in pending:
                self.policy.on_access(layer, chunk, clock)

    def release(self, layer: int) -> None:
        """The layer's compute was issued: record its read event, deliver ``on_access`` (off the critical path);
        staging forgets the layer's experts."""
        if self.mover is not None:
            self.mover.record_read(layer)
        self._flush()
        if self.mode == "staging":
            for e in list(self.entries[layer]):
                self._drop(layer, e, count=False)

    # -- prefetch path ----------------------------------------------------------------------------
    def prefetch(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Speculative loads (policy-chosen ``(layer, expert)`` pairs, best first); no-op outside the cache mode.
        Admission (``self.pf``): resident or repeated pairs are redundant; of the rest, per layer, the first
        ``max_per_layer`` (others ``prefetch_capped``), while fewer than ``max_inflight`` prefetch copies are in
        flight (others ``prefetch_throttled``), into free slots or victims that are not protected (others
        ``prefetch_dropped``)."""
        self._flush()
        if self.mode != "cache":
            return
        by_layer: dict[int, list[int]] = {}
        predicted: dict[int, set[int]] = {}
        for layer, e in pairs:
            if not (0 <= layer < self.g.num_layers and 0 <= e < self.g.num_experts):
                raise ValueError(f"policy {self.policy.name!r} asked to prefetch ({layer}, {e}): out of range")
            predicted.setdefault(layer, set()).add(e)
            if e in self.entries[layer] or e in by_layer.get(layer, ()):
                self.acct.prefetch_redundant += 1
                continue
            by_layer.setdefault(layer, []).append(e)
        pf, acct = self.pf, self.acct
        for layer, experts in by_layer.items():
            asked = experts
            if pf.max_per_layer and len(experts) > pf.max_per_layer:
                acct.prefetch_capped += len(experts) - pf.max_per_layer
                experts = experts[:pf.max_per_layer]
            if pf.max_inflight:
                self._prune_inflight()
                room_q = max(0, pf.max_inflight - len(self._inflight))
                if room_q < len(experts):
                    acct.prefetch_throttled += len(experts) - room_q
                    experts = experts[:room_q]
            if experts:
                room = self._make_room(layer, len(experts), exclude=predicted[layer], for_prefetch=True)
                if room < len(experts):
                    acct.prefetch_dropped += len(experts) - room
                    experts = experts[:room]
            if len(experts) < len(asked):
                self.policy.on_prefetch_skipped(layer, asked[len(experts):], self.clock)
            for e in experts:
                ent = self._load(layer, e, prefetch=True)
                if ent.load is not None:
                    self._inflight.append(ent.load)
            if experts:
                self.policy.on_prefetch_issued(layer, experts, self.clock)

    def _prune_inflight(self) -> None:
        if self.mover is None:
            self._inflight.clear()
        else:
            self._inflight = [h for h in self._inflight if not self.mover.done(h)]

    def protected(self, layer: int, e: int) -> bool:
        """``e`` of ``layer`` was accessed in the last ``protect_tokens`` decode steps (a prefetch may not evict it)."""
        n = self.pf.protect_tokens
        ent = self.entries[layer][e]
        return bool(n) and ent.last_step >= 0 and ent.last_step > self._steps - n

    # -- internals --------------------------------------------------------------------------------
    def _make_room(self, layer: int, n: int, exclude: set[int], for_prefetch: bool) -> int:
        """Free ``n`` slots of ``layer`` (evicting policy-chosen victims); returns how many are free (≤ n for a
        prefetch, which may not evict experts loaded in this pass; exactly n for demand)."""
        free = self.free[layer]
        if len(free) >= n:
            return n
        entries = self.entries[layer]
        if for_prefetch:  # not loaded in this pass, not protected (protected() inlined: this runs per prefetch)
            n_prot, now, pi = self.pf.protect_tokens, self._steps, self.pass_index
            cands = [e for e in sorted(entries) if e not in exclude and entries[e].pass_loaded != pi
                     and not (n_prot and entries[e].last_step >= 0 and entries[e].last_step > now - n_prot)]
        else:
            cands = [e for e in sorted(entries) if e not in exclude]
        want = min(n - len(free), len(cands))
        if want < n - len(free) and not for_prefetch:
            raise RuntimeError(f"layer {layer}: {n} slots needed, {len(free)} free and {len(cands)} evictable "
                               f"(capacity {self.g.capacity})")
        if want:
            victims = list(self.policy.choose_victims(layer, want, cands, self.clock))
            if len(victims) != want or len(set(victims)) != want or not set(victims) <= set(cands):
                raise RuntimeError(f"policy {self.policy.name!r} returned victims {victims} for {want} of {cands}")
            for e in victims:
                self._drop(layer, e, count=True)
                self.policy.on_evict(layer, e, self.clock)
        return len(free) if for_prefetch else n

    def _drop(self, layer: int, e: int, count: bool) -> None:
        ent = self.entries[layer].pop(e)
        self.free[layer].append(ent.slot)
        if ent.load is not None and self.mover is not None and not self.mover.done(ent.load):
            self._slot_after[layer][ent.slot] = ent.load  # the next write of this slot waits on this copy
        if count:
            self.acct.evict(unused_prefetch=ent.prefetched)
        if self.mover is not None:
            self.mover.unmap(layer, e)

    def _load(self, layer: int, e: int, prefetch: bool) -> Entry:
        slot = self.free[layer].pop(0)
        after = self._slot_after[layer].pop(slot, None)
        handle = (self.mover.load(self, layer, e, slot, prefetch, after=after) if self.mover is not None
                  else None)
        ent = Entry(slot=slot, prefetched=prefetch, pass_loaded=self.pass_index, load=handle)
        self.entries[layer][e] = ent
        self.acct.load(self.phase, layer, e, prefetch)
        return ent

    def summary(self) -> dict[str, Any]:
        self._flush()
        if self.mover is not None:
            self.mover.drain(self)
        out = self.acct.summary()
        out["prefetch_pending_unused"] = sum(ent.prefetched for entries in self.entries for ent in entries.values())
        return out

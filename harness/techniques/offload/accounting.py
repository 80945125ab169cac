"""Offload accounting: every number of ``summary.json`` ``offload`` that counts (hits, bytes, prefetches, stalls).

Why its own module: the definitions are the result, so they must be checkable by hand on a scripted trace with
no model and no tensors (tests/techniques/offload/test_accounting.py). The cache (:mod:`harness.techniques.offload.cache`) reports
*events* here; this module only counts and divides. Definitions (docs/offload.md repeats them):

- an *access* is one (pass, layer, expert) the layer computes: the expert is named by at least one row's
  top-k (so a decode step at B rows counts each distinct expert of a layer once);
- *hit*: resident with its load complete when the layer asked; *late*: resident but its (prefetch) load still
  in flight (the compute waits on it: a late arrival); *miss*: not resident (a demand load);
- hit rate = hits / accesses, decode only (``hit_rate_per_row_token`` weighs each access by the rows naming the
  expert: per (token, layer, expert); equal to ``hit_rate`` at B = 1), split *cold* (decode steps 1..``warm_after`` of a batch, right after
  its prefill rewrote the cache) and *warm* (later steps); ``compulsory`` = misses of a (layer, expert) never
  loaded before in the run;
- prefetch precision = prefetch loads later used (accessed before eviction) / prefetch loads issued;
  on-time recall = accesses served by a completed prefetch / (those + late + misses): of what had to come from
  the host, the share that was already there; wasted bytes = bytes of prefetch loads evicted unused;
- new experts per layer per token = (demand loads + prefetch loads that were used) / (decode steps × layers);
- H2D bytes per token = decode-phase bytes copied / decode steps (and per generated row-token: / row-steps);
  achieved GB/s = bytes / copy-stream busy time (CUDA events around each group of copies; CPU: host time);
- stall = time the compute stream waited for loads (CUDA: events before/after the waits; CPU: host time of the
  synchronous demand copies), per decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PhaseCounts", "Accounting"]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class PhaseCounts:
    """Counters of one phase (prefill or decode)."""

    passes: int = 0
    row_tokens: int = 0  # rows × passes (decode) or prompt tokens (prefill)
    accesses: int = 0
    hits: int = 0
    late: int = 0
    misses: int = 0
    prefetch_hits: int = 0  # hits served by a completed prefetch (subset of hits)
    demand_bytes: int = 0
    prefetch_bytes: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    stall_ms: float = 0.0
    copy_ms: float = 0.0  # copy-stream busy time
    cold_accesses: int = 0
    cold_hits: int = 0
    warm_accesses: int = 0
    warm_hits: int = 0
    row_accesses: int = 0  # (row, layer, expert) triples: an expert named by r rows counts r times
    row_hits: int = 0

    @property
    def bytes(self) -> int:
        return self.demand_bytes + self.prefetch_bytes


@dataclass
class Accounting:
    """Counters for one run (reset after the warm-up). ``expert_bytes`` = bytes of one expert."""

    num_layers: int
    expert_bytes: int
    warm_after: int = 8
    phases: dict[str, PhaseCounts] = field(default_factory=lambda: {"prefill": PhaseCounts(), "decode": PhaseCounts()})
    compulsory: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_redundant: int = 0  # asked for an expert already resident or in flight (no copy)
    prefetch_dropped: int = 0  # no evictable slot for it (free slots gone, the rest protected)
    prefetch_capped: int = 0  # over offload.prefetch.max_per_layer (not issued)
    prefetch_throttled: int = 0  # offload.prefetch.max_inflight prefetch copies already in flight (not issued)
    evictions: int = 0
    chunked_layer_passes: int = 0  # (pass, layer) computed in several chunks (more experts needed than slots)
    ever_loaded: set[tuple[int, int]] = field(default_factory=set)

    def reset(self) -> None:
        """Zero every counter; ``ever_loaded`` too (the warm-up's loads are not this run's compulsory misses,
        but the cache still holds them: a key the cache holds counts as loaded)."""
        fresh = Accounting(self.num_layers, self.expert_bytes, self.warm_after)
        self.__dict__.update(fresh.__dict__)

    # -- events from the cache --------------------------------------------------------------------
    def begin_pass(self, phase: str, row_tokens: int) -> None:
        p = self.phases[phase]
        p.passes += 1
        p.row_tokens += row_tokens

    def access(self, phase: str, step: int, layer: int, expert: int, outcome: str, prefetched: bool,
               rows: int = 1) -> None:
        """One access; ``outcome`` is ``hit`` | ``late`` | ``miss``; ``prefetched``: its load was a prefetch;
        ``rows``: how many rows (tokens) of the pass named the expert."""
        p = self.phases[phase]
        p.accesses += 1
        p.row_accesses += rows
        p.row_hits += rows if outcome == "hit" else 0
        if outcome == "hit":
            p.hits += 1
            p.prefetch_hits += int(prefetched)
        elif outcome == "late":
            p.late += 1
        elif outcome == "miss":
            p.misses += 1
        else:
            raise ValueError(f"unknown access outcome {outcome!r}")
        if prefetched and outcome in ("hit", "late"):
            self.prefetch_used += 1
        if phase == "decode":
            if step <= self.warm_after:
                p.cold_accesses += 1
                p.cold_hits += int(outcome == "hit")
            else:
                p.warm_accesses += 1
                p.warm_hits += int(outcome == "hit")

    def load(self, phase: str, layer: int, expert: int, prefetch: bool) -> None:
        p = self.phases[phase]
        if prefetch:
            p.prefetch_loads += 1
            p.prefetch_bytes += self.expert_bytes
            self.prefetch_issued += 1
        else:
            p.demand_loads += 1
            p.demand_bytes += self.expert_bytes
        if (layer, expert) not in self.ever_loaded:
            self.ever_loaded.add((layer, expert))
            self.compulsory += int(not prefetch)

    def evict(self, unused_prefetch: bool) -> None:
        self.evictions += 1
        self.prefetch_wasted += int(unused_prefetch)

    def stall(self, phase: str, ms: float) -> None:
        self.phases[phase].stall_ms += ms

    def copy_time(self, phase: str, ms: float) -> None:
        self.phases[phase].copy_ms += ms

    # -- the summary ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        d, pf = self.phases["decode"], self.phases["prefill"]
        steps = d.passes
        served = d.prefetch_hits + d.late + d.misses
        total_bytes = d.bytes + pf.bytes
        total_copy = d.copy_ms + pf.copy_ms
        return {
            "decode_steps": steps,
            "decode_row_tokens": d.row_tokens,
            "accesses": d.accesses,
            "hits": d.hits,
            "late_arrivals": d.late,
            "misses": d.misses,
            "hit_rate": _ratio(d.hits, d.accesses),
            "hit_rate_per_row_token": _ratio(d.row_hits, d.row_accesses),
            "row_accesses": d.row_accesses,
            "hit_rate_cold": _ratio(d.cold_hits, d.cold_accesses),
            "hit_rate_warm": _ratio(d.warm_hits, d.warm_accesses),
            "cold_accesses": d.cold_accesses,
            "warm_accesses": d.warm_accesses,
            "warm_after_tokens": self.warm_after,
            "compulsory_misses": self.compulsory,
            "new_experts_per_layer_token": _ratio(d.demand_loads + d.prefetch_hits + d.late,
                                                  steps * self.num_layers),
            "demand_loads_per_layer_token": _ratio(d.demand_loads, steps * self.num_layers),
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_wasted": self.prefetch_wasted,
            "prefetch_redundant": self.prefetch_redundant,
            "prefetch_dropped": self.prefetch_dropped,
            "prefetch_capped": self.prefetch_capped,
            "prefetch_throttled": self.prefetch_throttled,
            "prefetch_precision": _ratio(self.prefetch_used, self.prefetch_issued),
            "prefetch_recall_on_time": _ratio(d.prefetch_hits, served) if self.prefetch_issued else None,
            "wasted_bytes": self.prefetch_wasted * self.expert_bytes,
            "evictions": self.evictions,
            "chunked_layer_passes": self.chunked_layer_passes,
            "h2d_bytes_decode": d.bytes,
            "h2d_bytes_prefill": pf.bytes,
            "h2d_bytes_per_token": _ratio(d.bytes, steps),
            "h2d_bytes_per_row_token": _ratio(d.bytes, d.row_tokens),
            "achieved_gb_s": _ratio(total_bytes / 1e9, total_copy / 1e3),
            "copy_ms_total": total_copy,
            "stall_ms_per_token": _ratio(d.stall_ms, steps),
            "stall_ms_decode": d.stall_ms,
            "stall_ms_prefill": pf.stall_ms,
            "prefill_passes": pf.passes,
            "prefill_accesses": pf.accesses,
            "prefill_misses": pf.misses,
        }

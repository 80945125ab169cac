"""Prefetch admission: which speculative loads the expert cache actually issues, and what they may evict.

Why a separate rule set (not left to each policy): on one H200 at B = 1 and a ~32 % budget the gate prefetch of
``lru+gate``/``lease`` made decoding *slower* than plain LRU (results/benchmarks/offload.md: ~76 % of prefetched
experts never used; their copies share the one copy stream with demand loads, so a miss waited behind
speculative copies, and a prefetch could evict an expert that was about to be reused). A speculative copy only
pays when it (a) never delays a demand copy, (b) never displaces something likelier to be used than itself, and
(c) can finish before its layer runs. The cache enforces these for every policy (``offload.prefetch.*``):

- ``max_per_layer``: at most this many new (non-resident) experts per target layer per pass, highest-ranked
  first (the policy returns pairs best first). Default 1: a copy of one Qwen3-30B-A3B expert takes ~0.17 ms at
  ~55 GB/s while a layer (attention + MoE) takes ~0.2 ms, so about one copy fits in the window between
  issuing a prefetch for layer l+1 and layer l+1's router; more only arrive late or queue in front of misses,
  and at B = 1 the cache needs ~0.3 new experts per layer per token anyway.
- ``max_inflight``: a prefetch is not issued while this many earlier prefetch copies are still in flight (they
  are *dropped*, counted ``prefetch_throttled``): a backlog of speculative copies is exactly what a demand
  copy would otherwise queue behind, and an issued CUDA copy cannot be cancelled. Default 2 (one per layer of
  look-ahead, plus one of slack). 0 = no limit.
- ``protect_tokens``: a prefetch never evicts an expert accessed in the last N decode tokens, nor an expert
  the same prefetch request predicts for that layer; it is dropped instead (``prefetch_no_room``). Default 2:
  the median reuse distance of MoE routing is a few tokens (the issue's anchor; the synthetic trace's is 2),
  so an expert used within 2 tokens is more likely needed soon than a speculative guess. Demand loads are not
  restricted (they must succeed).
- ``stream``: ``separate`` (default) puts prefetches on their own low-priority copy stream and demand loads on
  a high-priority one, so a demand copy is never ordered behind a speculative one in a stream (copies on two
  streams can use both of the GPU's H2D copy engines concurrently; PCIe bandwidth is then shared, so the
  in-flight cap still matters); ``shared``: one copy stream for both (the previous behaviour).

``legacy()`` = no limits, one stream: the previous behaviour, kept for comparisons and old scripted tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PrefetchSettings", "STREAMS", "prefetch_settings"]

STREAMS = ("separate", "shared")


@dataclass(frozen=True)
class PrefetchSettings:
    """The cache's prefetch admission rules (see the module doc); 0 = no limit for the integer knobs."""

    max_per_layer: int = 1
    max_inflight: int = 2
    protect_tokens: int = 2
    stream: str = "separate"

    def __post_init__(self) -> None:
        for name in ("max_per_layer", "max_inflight", "protect_tokens"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"offload.prefetch.{name}={getattr(self, name)!r}: must be an integer >= 0")
        if self.stream not in STREAMS:
            raise ValueError(f"offload.prefetch.stream={self.stream!r}: one of {', '.join(STREAMS)}")

    @classmethod
    def legacy(cls) -> "PrefetchSettings":
        return cls(max_per_layer=0, max_inflight=0, protect_tokens=0, stream="shared")


def prefetch_settings(cfg: Any) -> PrefetchSettings:
    """``offload.prefetch`` (a mapping or config node; missing = defaults) → :class:`PrefetchSettings`."""
    node = cfg.get("prefetch") if cfg is not None else None
    if node is None:
        return PrefetchSettings()
    get = node.get if hasattr(node, "get") else (lambda k, d=None: getattr(node, k, d))
    d = PrefetchSettings()
    return PrefetchSettings(max_per_layer=int(get("max_per_layer", d.max_per_layer)),
                            max_inflight=int(get("max_inflight", d.max_inflight)),
                            protect_tokens=int(get("protect_tokens", d.protect_tokens)),
                            stream=str(get("stream", d.stream)))

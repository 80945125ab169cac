"""Shape keys: what a warm-up must have run for a timed batch to pay no first-time cost.

A key is ``(batch size, prompt-length bucket, technique state)``:

* batch size — the number of requests of the batch (the static decoder keeps one KV cache and CUDA graph per
  batch size; compiled steps specialise on it);
* prompt-length bucket — the batch's longest prompt in tokens (the padded prefill length, after VisionZip's
  pruning when the engine reports it), rounded up to a power of two (``latency.bucket=null``) or to a multiple
  of ``latency.bucket`` tokens. A bucket, not the length itself: warming every exact length would cost a
  second pass, and within a bucket the engines reuse what they built (the static decoder serves a batch whose
  cache need is up to 1.5x smaller from the same graph);
* technique state — VisionZip keep, SERE K/ρ, top-K: a job of a sweep that turns one on runs other kernels
  (importance scoring, re-routing) and other shapes than its baseline.

Two keys per batch: the *planned* key, from the engine's ``prompt_length(requests)`` (the processor's padded
length, before any pruning) chooses which batches to warm up; the *observed* key, from the generations
(``prompt_tokens`` as the engine reports them) is what the warm-up is checked against
(:mod:`harness.latency.watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

ShapeKey = tuple  # (batch_size: int, prompt_bucket: int, technique: str)


def bucket(n: int, size: int | None = None) -> int:
    """``n`` tokens rounded up to the next power of two (``size`` None) or to a multiple of ``size``."""
    n = max(0, int(n))
    if size:
        return -(-n // int(size)) * int(size)
    return 1 << max(0, n - 1).bit_length() if n > 1 else n


def technique_state(cfg: Any) -> str:
    """The techniques that change what a batch runs, as one stable string (``baseline`` when none is on)."""
    parts = []
    vz = cfg.visionzip
    if vz.keep is not None and vz.keep < 1.0:
        parts.append(f"visionzip keep={vz.keep:g} scope={vz.scope} ctx={vz.contextual:g}")
    top_k = getattr(getattr(cfg, "moe", None), "top_k", None)
    if top_k is not None:
        parts.append(f"top-k={top_k} scope={cfg.moe.scope}")
    if cfg.sere.k is not None:
        parts.append(f"sere K={cfg.sere.k} rho={cfg.sere.rho:g} protect={cfg.sere.protect}")
    return " + ".join(parts) or "baseline"


def observed_key(gens: Sequence[Any], technique: str, size: int | None = None) -> ShapeKey:
    """The key of a batch as it ran: its size and the bucket of the longest prompt the engine reported."""
    lengths = [int(g.prompt_tokens or 0) for g in gens if not getattr(g, "error", None)]
    return (len(gens), bucket(max(lengths, default=0), size), technique)


def planned_key(length_of: Callable[[list[Any]], int] | None, batch: list[Any], technique: str,
                size: int | None = None) -> ShapeKey | None:
    """The key of a batch before it runs (None when the engine cannot say its prompt length)."""
    if length_of is None:
        return None
    try:
        return (len(batch), bucket(int(length_of(batch)), size), technique)
    except Exception:  # noqa: BLE001 - a request the processor refuses fails when timed, not here
        return None


def warmup_plan(batches: Sequence[list[Any]], keys: Sequence[ShapeKey | None]) -> list[int]:
    """Indices of the batches to warm up: the first batch of each distinct planned key, and the first batch
    (always: lazy initialisation, allocator) when no key could be planned."""
    chosen, seen = [], set()
    for i, key in enumerate(keys):
        if key is not None and key not in seen:
            seen.add(key)
            chosen.append(i)
    if batches and 0 not in chosen and not seen:
        chosen.insert(0, 0)
    return chosen


def key_json(key: ShapeKey | None) -> dict[str, Any] | None:
    """A key as ``summary.json`` records it."""
    if key is None:
        return None
    return {"batch_size": key[0], "prompt_bucket": key[1], "technique": key[2]}

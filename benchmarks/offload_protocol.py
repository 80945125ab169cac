"""The offload benchmark's timing protocol: interleaved order, per-variant intervals, verdicts from intervals.

Why its own module: the verdict *is* the result ("lease beats lru"), so the rules that produce it must be
readable and tested without a GPU (tests/benchmarks/test_offload_protocol.py). What a reviewer asks for:

- **Interleaving.** Variants are timed in rounds; round ``r`` runs every variant once, in the order rotated by
  ``r`` (A B C, B C A, C A B, ...): each variant takes each position equally often, so drift during the
  process (clocks, allocator, thermal) spreads over all variants instead of reading as a difference. The
  resident model (``none``) is one of the variants, timed in the same rounds.
- **Warm-up.** One untimed run of every variant at every shape before round 0 (Triton compiles, the caching
  allocator fills); each run also decodes untimed steps before its timed ones.
- **Intervals.** Per variant, a bootstrap interval of the mean ms/token over the rounds
  (:func:`harness.latency.stats.bootstrap_ci`: scipy BCa), the median, and the spread = (max − min) / median.
  Per variant against a reference (lru): the *paired* ratio ms(variant) / ms(reference) of each round, with its
  bootstrap interval (pairing removes the drift common to a round).
- **Verdict.** ``faster`` only when the variant's interval lies wholly below the reference's
  (:func:`harness.latency.stats.intervals_overlap` is False and the variant's mean is lower); ``slower`` the
  other way round; otherwise ``n.s.`` (not significant). Fewer than 2 rounds: no interval, no verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["rounds", "summarize", "paired_ratio", "verdict", "compare"]


def rounds(variants: Sequence[str], repeats: int) -> list[list[str]]:
    """``repeats`` rounds, each every variant once, round ``r`` rotated left by ``r`` (A B C, B C A, ...)."""
    v = list(variants)
    if not v:
        return []
    return [v[r % len(v):] + v[:r % len(v)] for r in range(repeats)]


def summarize(ms: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """ms/token of one variant over the rounds → mean, median, bootstrap interval of the mean, spread, cv."""
    from harness.latency.stats import bootstrap_ci, coefficient_of_variation

    xs = [float(x) for x in ms]
    if not xs:
        return {"n": 0, "mean": None, "median": None, "ci": None, "spread": None, "cv": None, "values": []}
    med = statistics.median(xs)
    return {"n": len(xs), "mean": statistics.fmean(xs), "median": med,
            "ci": bootstrap_ci(xs, confidence), "confidence": confidence,
            "spread": (max(xs) - min(xs)) / med if med else None,
            "cv": coefficient_of_variation(xs), "values": xs}


def paired_ratio(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """Per-round ratio a[r] / b[r] (same round: same drift) → mean and bootstrap interval."""
    from harness.latency.stats import bootstrap_ci

    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in length: {len(a)} vs {len(b)}")
    ratios = [x / y for x, y in zip(a, b, strict=True) if y]
    return {"mean": statistics.fmean(ratios) if ratios else None, "ci": bootstrap_ci(ratios, confidence),
            "values": ratios}


def verdict(variant: Mapping[str, Any], reference: Mapping[str, Any]) -> str:
    """``faster`` | ``slower`` | ``n.s.`` from two :func:`summarize` blocks of ms/token (lower is faster)."""
    from harness.latency.stats import intervals_overlap

    overlap = intervals_overlap(variant.get("ci"), reference.get("ci"))
    if overlap is None or overlap:
        return "n.s."
    return "faster" if variant["ci"][1] < reference["ci"][0] else "slower"


def compare(ms_by_variant: Mapping[str, Sequence[float]], reference: str = "lru", resident: str = "none",
            confidence: float = 0.95) -> dict[str, dict[str, Any]]:
    """Every variant: its :func:`summarize` block, the paired ratio and verdict against ``reference``, and its
    share of the resident speed (ms(resident) / ms(variant), paired per round) when ``resident`` was timed."""
    out: dict[str, dict[str, Any]] = {}
    ref = ms_by_variant.get(reference)
    res = ms_by_variant.get(resident)
    ref_s = summarize(ref, confidence) if ref else None
    for name, ms in ms_by_variant.items():
        s = summarize(ms, confidence)
        if ref and name != reference:
            s["vs_" + reference] = paired_ratio(ms, ref, confidence)
            s["verdict_vs_" + reference] = verdict(s, ref_s)
        if res and name != resident:
            s["share_of_resident"] = paired_ratio(res, ms, confidence)
        out[name] = s
    return out

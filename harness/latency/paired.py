"""Paired A/B timing inside one run (``latency.paired=true``, issue 31 item 3): the run's technique and the baseline
(and, with ``latency.paired_with``, trivial baselines at the same budget) timed on the same batches, alternating
in one process, with a paired interval on the speed-up.

Why: the jobs of a sweep run minutes apart. Load on a shared machine changes in between, and a sweep's first job
pays cold-start costs that per-shape warm-up does not remove. A speed-up taken across two runs carries that drift,
and neither run's own interval can see it: on the 2-core machine a decode-only technique showed a 2.3× TTFT
"speed-up", and on the H200 SERE showed 10× (measuring.md). Timing both sides back to back on the same batch, in
the same process, puts the drift on both sides of every pair.

The protocol (after the run's scored pass; answers and scores are never taken from here):

* every variant is warmed up on its own shapes (each has its own :class:`~harness.latency.runner.TimedBatches`,
  so its shape keys, re-timing and exclusions are its own);
* ``latency.paired_rounds`` rounds; in each, every batch is timed once under every variant, back to back. The order
  rotates with the round and the batch (A B, B A, ...), so neither side always runs first;
* the unit of the statistics is one (batch, round): the variants' means over that batch's requests, taken within
  seconds of each other. A unit where either side was excluded (it compiled even after re-timing) is dropped and
  counted;
* per metric (TTFT, TPOT, E2E), the speed-up of the technique against a reference is ``mean(reference) /
  mean(technique)`` over the units (> 1: the technique is faster), with a paired bootstrap interval
  (``scipy.stats.bootstrap``, ``paired=True``: units resampled with both sides, percentile,
  ``latency.bootstrap_resamples`` draws at ``latency.confidence``). It is significant when the interval excludes 1.

E2E compares like with like only when both sides generate the same number of tokens (VisionZip may change the
answer): TTFT and TPOT are the figures to read. The result goes to ``summary.json`` ``latency.paired`` and, as
entries of ``comparisons`` (harness/results/schema.py ``Comparison``), to the report, which prefers them to
speed-ups taken across runs. No torch, numpy or scipy at module level.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from harness.latency.runner import TimedBatches
from harness.latency.stats import sample_values

METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
METHOD = "paired A/B timing in one process (alternating order), bootstrap over (batch, round) pairs"


def rotation(names: Sequence[str], round_index: int, batch_index: int) -> list[str]:
    """The order the variants run on one batch in one round: rotated by ``round + batch`` (two variants: A B, B A)."""
    k = (round_index + batch_index) % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def unit_means(samples: Sequence[Mapping[str, Any]], metric: str) -> dict[tuple[int, int], float]:
    """``{(batch, round): mean of metric over the batch's requests}``, excluded and failed timings left out."""
    by_unit: dict[tuple[int, int], list[float]] = {}
    dirty: set[tuple[int, int]] = set()
    for s in samples:
        unit = (int(s.get("batch", 0)), int(s.get("pass", 0)))
        if s.get("excluded"):
            dirty.add(unit)
            continue
        if s.get("error"):
            continue
        by_unit.setdefault(unit, []).extend(sample_values(s, metric))
    return {u: statistics.fmean(v) for u, v in by_unit.items() if v and u not in dirty}


def paired_ratio(reference: Sequence[float], technique: Sequence[float], *, confidence: float = 0.95,
                 n_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """``mean(reference) / mean(technique)`` over paired units with its paired bootstrap interval.

    Returns ``{"estimate", "ci", "n", "significant"}``; ``ci`` None for fewer than two pairs, ``[r, r]`` when neither
    side varies (nothing to resample); ``significant``: the interval excludes 1."""
    if len(reference) != len(technique):
        raise ValueError(f"paired timings differ in length: {len(reference)} vs {len(technique)}")
    n = len(reference)
    if n == 0 or sum(technique) <= 0:
        return {"estimate": None, "ci": None, "n": n, "significant": None}
    estimate = statistics.fmean(reference) / statistics.fmean(technique)
    if n < 2:
        return {"estimate": estimate, "ci": None, "n": n, "significant": None}
    if len(set(reference)) == 1 and len(set(technique)) == 1:
        ci = [estimate, estimate]
    else:
        import warnings

        import numpy as np
        from scipy.stats import bootstrap

        def ratio(r: Any, t: Any, axis: int = -1) -> Any:
            return np.mean(r, axis=axis) / np.mean(t, axis=axis)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = bootstrap((np.asarray(reference, float), np.asarray(technique, float)), ratio, paired=True,
                            vectorized=True, confidence_level=confidence, n_resamples=n_resamples,
                            method="percentile", random_state=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        ci = [lo, hi] if math.isfinite(lo) and math.isfinite(hi) else None
    return {"estimate": estimate, "ci": ci, "n": n, "significant": None if ci is None else not (ci[0] <= 1.0 <= ci[1])}


def compare(samples_by_variant: Mapping[str, Sequence[Mapping[str, Any]]], technique: str, reference: str, *,
            confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per metric, :func:`paired_ratio` of ``reference`` over ``technique`` on the units both timed cleanly, with
    ``dropped``: units one side lost (excluded or failed)."""
    out = {}
    for metric in METRICS:
        a = unit_means(samples_by_variant[technique], metric)
        b = unit_means(samples_by_variant[reference], metric)
        shared = sorted(set(a) & set(b))
        res = paired_ratio([b[u] for u in shared], [a[u] for u in shared], confidence=confidence,
                           n_resamples=n_resamples, seed=seed)
        out[metric] = {**res, "dropped": len(set(a) ^ set(b)),
                       "technique_mean": statistics.fmean(a[u] for u in shared) if shared else None,
                       "reference_mean": statistics.fmean(b[u] for u in shared) if shared else None}
    return out


class PairedTiming:
    """Warm up and time every variant of :mod:`harness.latency.variants` on the same batches (module doc)."""

    def __init__(self, engine: Any, latency_cfg: Any, variants: Sequence[Any], *, warmup_rounds: int = 1):
        self.variants = list(variants)
        self.rounds = int(getattr(latency_cfg, "paired_rounds", 5))
        self.confidence = float(getattr(latency_cfg, "confidence", 0.95))
        self.n_resamples = int(getattr(latency_cfg, "bootstrap_resamples", 2000))
        self.timers = {v.name: TimedBatches(engine, latency_cfg, f"paired:{v.name}", warmup_rounds=warmup_rounds)
                       for v in self.variants}
        self.order: list[list[str]] = []  # the order of the first batch's variants, per round (summary.json)

    def warm_up(self, batches: Sequence[list[Any]], bar: Any = None) -> None:
        """Each variant's own warm-up plan (its shapes differ: VisionZip prunes the prompt)."""
        try:
            for v in self.variants:
                v.apply()
                timer = self.timers[v.name]
                timer.warm_up(batches, timer.plan(batches), bar)
        finally:
            self.variants[0].restore()

    def run(self, batches: Sequence[list[Any]], bar: Any = None) -> None:
        """``rounds`` rounds, every batch timed under every variant back to back (rotated order)."""
        by_name = {v.name: v for v in self.variants}
        try:
            for r in range(self.rounds):
                for bi, batch in enumerate(batches):
                    order = rotation([v.name for v in self.variants], r, bi)
                    if bi == 0:
                        self.order.append(order)
                    for name in order:
                        by_name[name].apply()
                        self.timers[name].time_batch(batch, r, bi)
                        if bar is not None:
                            bar.update(len(batch))
        finally:
            self.variants[0].restore()

    def samples(self) -> list[dict[str, Any]]:
        """Every paired timing, one line per request, variant and round (``paired_timings.jsonl``)."""
        return [{"variant": name, **s} for name, t in self.timers.items() for s in t.samples]

    def summary(self, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(``summary.json`` ``latency.paired``, the ``comparisons`` entries: the technique against the baseline
        and against each trivial baseline)."""
        technique = self.variants[0].name
        samples = {name: t.samples for name, t in self.timers.items()}
        block: dict[str, Any] = {
            "rounds": self.rounds, "order": self.order, "method": METHOD, "confidence": self.confidence,
            "variants": [{"name": v.name, "role": v.role,
                          "mean": {m: _mean_of(unit_means(samples[v.name], m)) for m in METRICS},
                          "batches_excluded": self.timers[v.name].protocol_block()["batches_excluded"],
                          "batches_retimed": self.timers[v.name].protocol_block()["batches_retimed"]}
                         for v in self.variants],
            "speedup": {},
        }
        comparisons = []
        for ref in self.variants[1:]:
            res = compare(samples, technique, ref.name, confidence=self.confidence, n_resamples=self.n_resamples,
                          seed=seed)
            block["speedup"][ref.name] = res
            against = "baseline" if ref.role == "baseline" else ref.name
            for metric, r in res.items():
                if r["estimate"] is None or r["ci"] is None:
                    continue
                comparisons.append({"metric": metric, "against": against, "kind": "ratio", "estimate": r["estimate"],
                                    "ci": r["ci"], "confidence": self.confidence, "n": r["n"], "method": METHOD,
                                    "variant": technique})
        return block, comparisons


def _mean_of(units: Mapping[Any, float]) -> float | None:
    return statistics.fmean(units.values()) if units else None

"""``summary.json`` ``latency`` statistics over repeated timings: what a reader needs to trust a difference.

Per metric (TTFT, TPOT, ITL, E2E as :mod:`harness.metrics.latency` defines them), over every timed sample
(request x pass, excluded batches left out):

* ``mean``, ``p50``, ``p90``, ``p99``, ``n`` — :func:`harness.metrics.latency.summarize` (numpy's linear
  percentiles, as ``vllm bench serve``);
* ``ci`` = ``[lo, hi]`` — a bootstrap interval of the mean (``scipy.stats.bootstrap``, BCa, percentile when BCa
  is degenerate) at ``latency.confidence``. The resampled unit is the **request** (its mean over passes): the
  passes of one request are not independent draws, the requests are. None below two requests;
* ``cv`` — the coefficient of variation of the per-pass means (std with ddof=1 / mean): how far the same
  requests' figure moves when timed again. None with one pass. ``pass_means`` lists them;
* ``noisy`` — ``cv > latency.max_cv``.

ITL is pooled over a request's gaps for the percentiles (as vLLM) and averaged per request for the interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from harness.metrics.latency import _finite, summarize, tpot  # _finite: one rule for what counts as a timing

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")




def sample_values(sample: Mapping[str, Any], metric: str) -> list[float]:
    """The finite values one timed sample contributes to ``metric`` (ITL: every gap; TPOT: none for a
    one-token output)."""
    if metric == "itl_ms":
        return [v for v in (_finite(x) for x in sample.get("itl_ms") or []) if v is not None]
    if metric == "tpot_ms":
        n = _finite(sample.get("output_tokens"))
        if n is not None and n <= 1:
            return []
        value = _finite(sample.get("tpot_ms"))
        if value is None and n is not None and n > 1:
            value = tpot(sample.get("ttft_ms"), sample.get("e2e_ms"), n)
        return [] if value is None else [value]
    value = _finite(sample.get(metric))
    return [] if value is None else [value]


def bootstrap_ci(values: Sequence[float], confidence: float = 0.95, n_resamples: int = 2000,
                 seed: int = 0) -> list[float] | None:
    """Bootstrap interval of the mean of ``values`` (scipy BCa; percentile where BCa cannot be had, e.g. all
    values equal). None for fewer than two values."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        return None
    if max(xs) == min(xs):  # no spread: every resample has the same mean
        return [xs[0], xs[0]]
    import warnings

    import numpy as np
    from scipy.stats import bootstrap

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns (DegenerateDataWarning) before returning NaN
            res = bootstrap((np.asarray(xs),), np.mean, confidence_level=confidence, n_resamples=n_resamples,
                            method=method, random_state=np.random.default_rng(seed), vectorized=True)
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return [lo, hi]
    return None


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """std (ddof=1) / mean; None for fewer than two values or a zero mean."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        return None
    mean = statistics.fmean(xs)
    return statistics.stdev(xs) / mean if mean else None


def metric_summary(samples: Iterable[Mapping[str, Any]], metric: str, *, confidence: float = 0.95,
                   n_resamples: int = 2000, max_cv: float | None = None, seed: int = 0) -> dict[str, Any]:
    """One metric's block (see the module doc) over timed samples ``{"uid", "pass", <metric>...}``."""
    rows = [s for s in samples if not s.get("error") and not s.get("excluded")]
    pooled: list[float] = []
    by_request: dict[str, list[float]] = {}
    by_pass: dict[int, list[float]] = {}
    for s in rows:
        vals = sample_values(s, metric)
        if not vals:
            continue
        pooled.extend(vals)
        by_request.setdefault(str(s.get("uid")), []).append(statistics.fmean(vals))
        by_pass.setdefault(int(s.get("pass", 0)), []).extend(vals)
    out = summarize(pooled)
    request_means = [statistics.fmean(v) for v in by_request.values()]
    pass_means = [statistics.fmean(by_pass[p]) for p in sorted(by_pass)]
    cv = coefficient_of_variation(pass_means)
    out.update({
        "ci": bootstrap_ci(request_means, confidence, n_resamples, seed),
        "confidence": confidence,
        "n_requests": len(request_means),
        "passes": len(pass_means),
        "pass_means": pass_means,
        "cv": cv,
        "noisy": bool(cv is not None and max_cv is not None and cv > max_cv),
    })
    return out


def repeat_summary(samples: Sequence[Mapping[str, Any]], *, confidence: float = 0.95, n_resamples: int = 2000,
                   max_cv: float | None = None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{metric: metric_summary(...)}`` for TTFT, TPOT, ITL and E2E."""
    return {m: metric_summary(samples, m, confidence=confidence, n_resamples=n_resamples, max_cv=max_cv, seed=seed)
            for m in METRICS}


def intervals_overlap(a: Sequence[float] | None, b: Sequence[float] | None) -> bool | None:
    """Whether two intervals overlap (a speed-up between them is then not significant); None when either is
    missing (significance unknown)."""
    if not a or not b or len(a) != 2 or len(b) != 2:
        return None
    return not (a[1] < b[0] or b[1] < a[0])

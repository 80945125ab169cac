"""Paired intervals on quality (issue 31): a technique against its baseline on the same samples.

Two runs that share requests (same dataset, same limit) give, per sample, a score under A (the technique or a
trivial baseline) and under B (the baseline). A difference of means over 12 samples and one over 500 read the
same without an interval; with unpaired intervals the between-sample spread (some samples are hard for every
method) swamps the difference. Pairing removes it: the statistic is the mean of the per-sample differences
``d_i = a_i − b_i``.

* **Interval:** a percentile bootstrap of ``mean(d)`` over samples (``scipy.stats.bootstrap`` on ``d``, which
  resamples the *pairs*: the paired bootstrap), ``n_resamples`` draws from a generator seeded with ``seed``,
  95 % by default. All ``d_i`` equal (e.g. two runs that generated the same text) gives the degenerate
  interval ``[d, d]``.
* **Test:** the Wilcoxon signed-rank test on ``d`` (``scipy.stats.wilcoxon``, zero differences dropped — the
  ``wilcox`` rule; ``p = 1`` when every difference is 0), reported beside the interval.
* **Verdict:** ``"n.s."`` when the interval contains 0, else ``"+"`` / ``"−"`` (A higher / lower than B).
* **Invalid outputs** are counted apart, per side: a sample whose output could not be parsed (``format_invalid``
  or an MCQ without a parsed letter) keeps its score (0 where the scorer gives 0, as the run's aggregate does)
  and is counted in ``invalid_a`` / ``invalid_b``; a sample with an error (no score) on either side leaves
  the pairs and is counted in ``errors_a`` / ``errors_b``; samples present in one run only in ``unmatched``.

**Macro averages** (OpenCompass's ``average``: the unweighted mean over datasets of each dataset's accuracy) are
not a mean over samples: a dataset of 50 items weighs as much as one of 5,000. Their delta is the mean over
datasets of the per-dataset paired deltas, and its interval a **stratified** paired bootstrap
(:func:`stratified_paired_delta`): each resample draws the pairs of every dataset from that dataset alone
(``scipy.stats.bootstrap`` with one sample per dataset, resampled independently), so each dataset keeps its size
and its weight. A dataset whose differences are all equal (or that has one pair) is a constant in the statistic.
Pooling the items instead would weigh datasets by size and give another number. Records are grouped by their
``dataset`` field, else the ``uid`` before its last ``/`` (``<dataset>/<item>``): :func:`stratified_paired_metrics`.

Only the standard library, numpy and scipy are imported; records are ``samples.jsonl`` lines (dicts with
``uid``, ``scores``, ``error``), read by :func:`read_samples`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FLAG_KEYS", "paired_delta", "paired_metrics", "read_samples", "stratified_paired_delta",
           "stratified_paired_metrics", "stratum_of", "verdict"]

#: per-sample score keys that are flags or bookkeeping, never a quality metric
FLAG_KEYS = frozenset({"format_invalid", "hallucinated_image", "reference_fault", "reference_fault_reason", "error",
                       "reason", "pred_image_ids", "ref_image_ids", "n_candidates", "pred", "gold", "unparsed"})


def verdict(low: float, high: float) -> str:
    """``n.s.`` when ``[low, high]`` contains 0, else the sign of the difference."""
    if low <= 0.0 <= high:
        return "n.s."
    return "+" if low > 0 else "−"


def paired_delta(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000,
                 seed: int = 0) -> dict[str, Any]:
    """Mean of ``a − b`` over pairs with its paired bootstrap interval, the Wilcoxon p-value and the verdict.

    Returns ``{"n", "mean_a", "mean_b", "delta", "low", "high", "confidence", "p_wilcoxon", "verdict"}``
    (``None`` figures for 0 pairs; one pair gives ``low = high = delta``)."""
    import numpy as np
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = int(x.size)
    out: dict[str, Any] = {"n": n, "confidence": confidence}
    if n == 0:
        return {**out, "mean_a": None, "mean_b": None, "delta": None, "low": None, "high": None,
                "p_wilcoxon": None, "verdict": "n.s."}
    d = x - y
    delta = float(d.mean())
    if n < 2 or float(np.ptp(d)) == 0.0:
        low = high = delta
    else:
        res = stats.bootstrap((d,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                              method="percentile", vectorized=True, random_state=np.random.default_rng(seed))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if np.count_nonzero(d) == 0:
        p = 1.0
    else:
        p = float(stats.wilcoxon(d, zero_method="wilcox").pvalue)
    return {**out, "mean_a": float(x.mean()), "mean_b": float(y.mean()), "delta": delta, "low": low, "high": high,
            "p_wilcoxon": p, "verdict": verdict(low, high)}


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``samples.jsonl`` (``path``: the file or its run directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "samples.jsonl"
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _invalid(rec: Mapping[str, Any]) -> bool:
    s = rec.get("scores") or {}
    return bool(s.get("format_invalid")) or bool(s.get("unparsed")) or ("pred" in s and s.get("pred") is None)


def _value(rec: Mapping[str, Any], metric: str) -> float | None:
    if rec.get("error"):
        return None
    v = (rec.get("scores") or {}).get(metric)
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and not math.isnan(float(v)):
        return float(v)
    return None


def _metric_names(records: Iterable[Mapping[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for rec in records:
        for k, v in (rec.get("scores") or {}).items():
            if k in FLAG_KEYS or k.startswith("_"):
                continue
            if isinstance(v, (int, float)):  # bool too: "correct"
                names.setdefault(k, None)
    return list(names)


def _match(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]]
           ) -> tuple[dict[str, Mapping[str, Any]], dict[str, Mapping[str, Any]], list[str]]:
    by_a = {str(r["uid"]): r for r in records_a}
    by_b = {str(r["uid"]): r for r in records_b}
    return by_a, by_b, [u for u in by_a if u in by_b]


def _bookkeeping(by_a: Mapping[str, Mapping[str, Any]], by_b: Mapping[str, Mapping[str, Any]],
                 shared: Sequence[str]) -> dict[str, int]:
    return {
        "pairs": len(shared), "unmatched": len(set(by_a) ^ set(by_b)),
        "errors_a": sum(1 for u in shared if by_a[u].get("error")),
        "errors_b": sum(1 for u in shared if by_b[u].get("error")),
        "invalid_a": sum(1 for u in shared if not by_a[u].get("error") and _invalid(by_a[u])),
        "invalid_b": sum(1 for u in shared if not by_b[u].get("error") and _invalid(by_b[u])),
    }


def paired_metrics(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]],
                   metrics: Sequence[str] | None = None, **kw: Any) -> dict[str, Any]:
    """Per metric, :func:`paired_delta` of run A against run B over the samples both scored (matched by
    ``uid``), with the bookkeeping of the module doc: ``{"pairs", "unmatched", "errors_a", "errors_b",
    "invalid_a", "invalid_b", "metrics": {name: paired_delta(...)}}``."""
    by_a, by_b, shared = _match(records_a, records_b)
    names = list(metrics) if metrics else [m for m in _metric_names(by_a[u] for u in shared)
                                           if m in set(_metric_names(by_b[u] for u in shared))]
    out: dict[str, Any] = {**_bookkeeping(by_a, by_b, shared), "metrics": {}}
    for name in names:
        xs, ys = [], []
        for u in shared:
            va, vb = _value(by_a[u], name), _value(by_b[u], name)
            if va is not None and vb is not None:
                xs.append(va)
                ys.append(vb)
        out["metrics"][name] = paired_delta(xs, ys, **kw)
    return out


def stratified_paired_delta(strata: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, scale: float = 1.0,
                            confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The macro-average delta over strata (``{name: (a, b)}``, paired within each) with its stratified paired
    bootstrap interval (module doc), every figure times ``scale`` (100: accuracies in %).

    Returns ``{"n", "n_strata", "mean_a", "mean_b", "delta", "low", "high", "confidence", "verdict", "strata"}``:
    ``mean_a`` / ``mean_b`` / ``delta`` are means over strata of each stratum's mean (never over pooled pairs);
    ``strata`` holds each stratum's own :func:`paired_delta` (scaled, same seed). A stratum without pairs has
    no mean: it is left out of the average and listed in ``empty``. No stratum with pairs: ``None`` figures."""
    import numpy as np
    from scipy import stats

    kw = {"confidence": confidence, "n_resamples": n_resamples, "seed": seed}
    per: dict[str, dict[str, Any]] = {}
    diffs: dict[str, Any] = {}
    for name, (a, b) in strata.items():
        per[name] = _scaled(paired_delta(a, b, **kw), scale)
        if len(a):
            diffs[name] = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    empty = [name for name in strata if name not in diffs]
    out: dict[str, Any] = {"n": sum(d.size for d in diffs.values()), "n_strata": len(diffs), "confidence": confidence,
                           "strata": per, "empty": empty}
    if not diffs:
        return {**out, "mean_a": None, "mean_b": None, "delta": None, "low": None, "high": None, "verdict": "n.s."}
    k = len(diffs)
    delta = scale * sum(float(d.mean()) for d in diffs.values()) / k
    varying = [d for d in diffs.values() if d.size >= 2 and float(np.ptp(d)) != 0.0]
    if not varying:
        low = high = delta
    else:
        fixed = sum(float(d.mean()) for d in diffs.values() if d.size < 2 or float(np.ptp(d)) == 0.0)

        def macro(*samples: Any, axis: int = -1) -> Any:
            return scale * (sum(np.mean(x, axis=axis) for x in samples) + fixed) / k

        # each stratum resampled on its own (paired=False: independent samples); batches bound the memory
        res = stats.bootstrap(tuple(varying), macro, n_resamples=n_resamples, confidence_level=confidence,
                              method="percentile", vectorized=True, paired=False,
                              batch=max(1, 4_000_000 // max(d.size for d in varying)),
                              random_state=np.random.default_rng(seed))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    mean_a = sum(per[s]["mean_a"] for s in diffs) / k
    mean_b = sum(per[s]["mean_b"] for s in diffs) / k
    return {**out, "mean_a": mean_a, "mean_b": mean_b, "delta": delta, "low": low, "high": high,
            "verdict": verdict(low, high)}


def _scaled(d: dict[str, Any], scale: float) -> dict[str, Any]:
    return {**d, **{f: d[f] * scale for f in ("delta", "low", "high", "mean_a", "mean_b") if d.get(f) is not None}}


def stratum_of(rec: Mapping[str, Any]) -> str:
    """A record's dataset: its ``dataset`` field, else its ``uid`` before the last ``/`` (``<dataset>/<item>``)."""
    return str(rec.get("dataset") or str(rec.get("uid")).rpartition("/")[0])


def stratified_paired_metrics(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]],
                              metric: str = "correct", *, scale: float = 1.0, **kw: Any) -> dict[str, Any]:
    """:func:`stratified_paired_delta` of ``metric`` (run A − run B) over the samples both scored, matched by
    ``uid`` and grouped by :func:`stratum_of`, with :func:`paired_metrics`' bookkeeping (``pairs``,
    ``unmatched``, ``errors_*``, ``invalid_*``). A stratum every one of whose shared samples failed on either side
    is in ``empty``."""
    by_a, by_b, shared = _match(records_a, records_b)
    strata: dict[str, tuple[list[float], list[float]]] = {}
    for u in shared:
        xs, ys = strata.setdefault(stratum_of(by_a[u]), ([], []))
        va, vb = _value(by_a[u], metric), _value(by_b[u], metric)
        if va is not None and vb is not None:
            xs.append(va)
            ys.append(vb)
    return {**_bookkeeping(by_a, by_b, shared), **stratified_paired_delta(strata, scale=scale, **kw)}

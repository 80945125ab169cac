"""Each run against the baseline of its setup: the quality metrics a setup is judged on
(:func:`quality_metrics_for`), the paired comparisons a run recorded itself (``summary.json`` ``comparisons``:
:func:`within_run_comparisons`), speed-ups and quality changes with what each rests on (:func:`compare_latency`,
:func:`compare_quality`), paired quality intervals from two runs' ``samples.jsonl`` (:func:`paired_quality`,
:func:`paired_on`), all of it written into the rows by :func:`_add_baseline_deltas`.

Why a module of its own: comparing runs is a job apart from reading them (issue 31's paired A/B timing and paired
quality intervals plug in here), split from harness/report/rows.py. Why *below* rows, not above it: the rows'
loader needs it — :func:`harness.report.rows.load_row` turns a summary's ``comparisons`` block into the row's and
:func:`harness.report.rows.load_rows` hands back every row with its deltas — so rows imports this module, and this
module imports nothing of rows (it works on the rows' keys alone): no circle. The report's writers (``build``,
``markdown``, ``plots``, ``frontier``, ``wandb_report``) and harness/report/panels.py may import it; it imports
none of them, and ``harness.report.build`` re-exports its names.

Reads result files only: the standard library, the paired statistics (harness/metrics/paired.py), the OpenCompass
rows (harness/report/opencompass_rows.py) and :func:`harness.report.values.finite` are all it imports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.metrics.paired import paired_metrics, read_samples
from harness.report.opencompass_rows import paired_opencompass
from harness.report.values import finite as _num

log = logging.getLogger("harness.report")  # the report's logger


# RAG-IGBench's quality metrics (harness/report/rows.py ``QUALITY``), in the order the default one is chosen from
RAG_METRICS = ("comprehensive", "rouge1", "edit_score", "kendall", "clip_score", "alignment")


def quality_metrics_for(rows: Sequence[Mapping[str, Any]], requested: Sequence[str] | None = None) -> list[str]:
    """The quality metrics shown for a set of runs of one dataset.

    ``requested`` (``--metric``, repeatable): those of them the runs have, in the order given. Else the default:
    RAG-IGBench's first of ``RAG_METRICS`` whose scorers are meaningful for every run that has it (a metric a
    random-init scorer feeds — CLIP score, alignment, their ``comprehensive`` mean — is never the default), plus
    ``ocrbench_score``, ``mcq_accuracy`` and ``opencompass_average`` when present."""
    if requested:
        return [m for m in requested if any(r.get(m) is not None for r in rows)]
    out = []
    rag = next((m for m in RAG_METRICS if any(r.get(m) is not None for r in rows)
                and not any(m in r.get("random_scorer_metrics", ()) for r in rows)), None)
    if rag:
        out.append(rag)
    out += [m for m in ("ocrbench_score", "mcq_accuracy", "opencompass_average")
            if any(r.get(m) is not None for r in rows)]
    return out


def within_run_comparisons(block: Any) -> dict[str, dict[str, Any]]:
    """``summary.json`` ``comparisons`` (harness/results/schema.py :class:`Comparison`) against the baseline, by
    metric: the variant and the baseline measured in one process on the same requests (paired A/B timing,
    paired quality intervals: issue 31). Entries without an estimate or a two-sided interval are ignored."""
    out: dict[str, dict[str, Any]] = {}
    for c in block if isinstance(block, list) else []:
        if not isinstance(c, Mapping) or c.get("against", "baseline") != "baseline":
            continue
        ci = c.get("ci")
        est = _num(c.get("estimate"))
        if est is None or not (isinstance(ci, Sequence) and len(ci) == 2 and all(_num(x) is not None for x in ci)):
            continue
        out[str(c.get("metric"))] = {"estimate": est, "lo": _num(ci[0]), "hi": _num(ci[1]),
                                     "kind": c.get("kind") or "ratio", "confidence": _num(c.get("confidence")),
                                     "n": c.get("n"), "method": c.get("method")}
    return out


def compare_latency(row: Mapping[str, Any], base: Sequence[Mapping[str, Any]], short: str) -> dict[str, Any]:
    """The speed-up of ``row`` over its baseline on ``short`` (``ttft`` / ``tpot``) and how far it can be trusted.

    - ``paired``: the run measured itself against the baseline in one process (``comparisons``): the speed-up and
      its interval are the run's own; significant when the interval excludes 1.
    - ``across runs``: the run's p50 against the baseline runs' (measured at another time, in another process):
      drift between the runs (load, cold start of a sweep's first job) is in neither run's interval, so such a
      comparison is never called significant — ``significant`` is False (``n.s.``) when even the within-run
      intervals of the means overlap, else None (unknown).
    """
    paired = (row.get("comparisons") or {}).get(f"{short}_ms")
    if paired and paired["kind"] == "ratio":
        return {"speedup": paired["estimate"], "lo": paired["lo"], "hi": paired["hi"], "kind": "paired",
                "significant": not (paired["lo"] <= 1.0 <= paired["hi"])}
    b = _mean(x[f"{short}_p50"] for x in base)
    v = row[f"{short}_p50"]
    out = {"speedup": b / v if b and v else None, "lo": None, "hi": None, "kind": "across runs" if base else None,
           "significant": None}
    mine, theirs = _interval([row], short), _interval(base, short)
    if mine is not None and theirs is not None and not (mine[1] < theirs[0] or theirs[1] < mine[0]):
        out["significant"] = False
    return out


def compare_quality(row: Mapping[str, Any], base: Sequence[Mapping[str, Any]], metric: str) -> dict[str, Any]:
    """The quality change of ``row`` against its baseline on ``metric``: a paired interval when the run has one
    (``comparisons``, kind ``difference``; significant when it excludes 0), else the difference of the scores
    (no interval: ``significant`` None)."""
    paired = (row.get("comparisons") or {}).get(metric)
    if paired and paired["kind"] == "difference":
        return {"delta": paired["estimate"], "lo": paired["lo"], "hi": paired["hi"], "kind": "paired",
                "significant": not (paired["lo"] <= 0.0 <= paired["hi"])}
    b = _mean(x[metric] for x in base)
    return {"delta": row[metric] - b if b is not None and row[metric] is not None else None, "lo": None, "hi": None,
            "kind": "across runs" if base else None, "significant": None}


# a run-level metric whose per-sample score is kept under another name and scale in samples.jsonl: OCRBench's
# score is 1000 × the share of right answers, each sample's ``score`` 0 or 1 (harness/metrics/ocrbench.py)
PER_SAMPLE = {"ocrbench_score": ("score", 1000.0)}


def paired_on(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]],
              metrics: Sequence[str]) -> dict[str, Any]:
    """:func:`harness.metrics.paired.paired_metrics` on the report's metric names (:data:`PER_SAMPLE` mapped to the
    per-sample key, the delta and its interval scaled back)."""
    keys = {m: PER_SAMPLE.get(m, (m, 1.0)) for m in metrics}
    res = paired_metrics(records_a, records_b, metrics=[k for k, _ in keys.values()])
    out = {**res, "metrics": {}}
    for m, (key, scale) in keys.items():
        d = dict(res["metrics"].get(key) or {})
        for f in ("delta", "low", "high", "mean_a", "mean_b"):
            if d.get(f) is not None:
                d[f] = d[f] * scale
        out["metrics"][m] = d
    return out


def paired_quality(row: dict[str, Any], base: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> None:
    """Paired quality intervals (issue 31, harness/metrics/paired.py) of ``row`` against its one baseline run, from
    the two runs' ``samples.jsonl`` (matched by ``uid``; quality is per sample, so there is no drift between the
    runs to hide): each metric scored per sample under its own name gets a ``comparisons`` entry of kind
    ``difference`` (unless the run already carries one). Skipped without exactly one baseline, without both
    ``samples.jsonl`` files, without shared samples or without scipy."""
    if len(base) != 1 or row["family"] == "baseline":
        return
    todo = [m for m in metrics if m not in row["comparisons"]]
    a, b = Path(row.get("_samples") or ""), Path(base[0].get("_samples") or "")
    if not todo or not a.is_file() or not b.is_file():
        return
    try:
        records_a, records_b = read_samples(a), read_samples(b)
        shared = {str(r.get("uid")) for r in records_a} & {str(r.get("uid")) for r in records_b}
        names = [m for m in todo if any(PER_SAMPLE.get(m, (m,))[0] in (r.get("scores") or {}) for r in records_a)]
        if len(shared) < 2 or not names:
            return
        result = paired_on(records_a, records_b, names)
    except Exception as e:  # noqa: BLE001 - no interval is the honest fallback: the cell then has none
        log.warning("%s: no paired quality interval (%s: %s)", row["run_dir"], type(e).__name__, e)
        return
    for m, d in result["metrics"].items():
        if d.get("delta") is not None and d.get("low") is not None and d.get("high") is not None:
            row["comparisons"][m] = {"estimate": d["delta"], "lo": d["low"], "hi": d["high"], "kind": "difference",
                                     "confidence": d.get("confidence"), "n": d.get("n"),
                                     "method": "paired bootstrap over samples (harness/metrics/paired.py)"}


def _add_baseline_deltas(rows: list[dict[str, Any]], requested: Sequence[str] | None = None) -> None:
    """Speed-up (baseline p50 / run p50) and quality change against the baseline run of the same setup
    (platform, dataset and its selection, generation length); the mean when the baseline ran several times.
    Each comparison says what it rests on (:func:`compare_latency`, :func:`compare_quality`): ``*_kind``
    ``paired`` or ``across runs``, ``*_significant`` True / False (n.s.) / None (cannot tell)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    for group in groups.values():
        base = [r for r in group if r["family"] == "baseline"]
        metrics = quality_metrics_for(group, requested)
        base_partial = {bool(x["latency_partial"]) for x in base}
        for r in group:
            r["baseline_runs"] = len(base)
            is_base = r["family"] == "baseline"
            # a partial (resumed) latency compared with a full one, or baselines that mix both: said in the cell
            r["latency_mixed"] = bool(base) and not is_base and (
                len(base_partial) > 1 or base_partial != {bool(r["latency_partial"])})
            for short in ("ttft", "tpot"):
                if is_base:  # against the baselines' mean (several baseline runs: their spread), no claim
                    b, v = _mean(x[f"{short}_p50"] for x in base), r[f"{short}_p50"]
                    c = {"speedup": b / v if b and v else None, "lo": None, "hi": None, "kind": None,
                         "significant": None}
                else:
                    c = compare_latency(r, base, short)
                r[f"{short}_speedup"] = c["speedup"]
                r[f"{short}_speedup_ci"] = (c["lo"], c["hi"]) if c["lo"] is not None else None
                r[f"{short}_comparison"] = c["kind"]
                r[f"{short}_significant"] = c["significant"]
            paired_quality(r, base, metrics)
            paired_opencompass(r, base, metrics)  # stratified over datasets; per-dataset deltas
            for m in metrics:
                q = compare_quality(r, base, m)
                r[f"{m}_delta"] = q["delta"]
                r[f"{m}_delta_ci"] = (q["lo"], q["hi"]) if q["lo"] is not None else None
                r[f"{m}_delta_significant"] = q["significant"] if not is_base else None
            r["quality_metrics"] = metrics


def _mean(values: Iterable[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _interval(rows: Sequence[Mapping[str, Any]], short: str) -> tuple[float, float] | None:
    """The interval of one run's mean, or the hull of several baseline runs' intervals (conservative); None when
    any lacks one."""
    cis = [(r.get(f"{short}_ci_lo"), r.get(f"{short}_ci_hi")) for r in rows]
    if not cis or any(lo is None or hi is None for lo, hi in cis):
        return None
    return min(lo for lo, _ in cis), max(hi for _, hi in cis)

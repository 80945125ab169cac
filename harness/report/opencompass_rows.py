"""OpenCompass runs in the report (issue 31): the macro average's delta with a paired interval, and every
dataset's accuracy delta with its own.

An OpenCompass run (``python -m harness.opencompass``, docs/opencompass.md) reports ``metrics.opencompass``: per
dataset its metrics (the first is the one OpenCompass's summariser shows: accuracy in %), and ``average`` — the
unweighted mean over ``average_over`` of those, the report's ``opencompass_average``. Its ``samples.jsonl`` holds
one record per item, ``uid`` ``<dataset>/<item>``, ``scores.correct`` 0/1.

* **The average:** ``opencompass_average`` is a mean over datasets, not over items, so :func:`paired_opencompass`
  gives it a *stratified* paired bootstrap (:func:`harness.metrics.paired.stratified_paired_metrics`: items
  resampled within each dataset, delta = mean over datasets of the per-dataset accuracy deltas, × 100), stored
  as the row's ``comparisons`` entry — so the runs table's Δ quality shows it like any paired delta. Only when
  the datasets with paired items are exactly the run's ``average_over`` (a dataset without per-item outcomes,
  or a summary group, would make the interval describe another average): otherwise the difference of the two
  averages, unpaired.
* **Per dataset** (``row["opencompass_deltas"]``, the ``OpenCompass per dataset`` section of ``report.md``): the
  accuracy delta with the dataset's paired bootstrap interval and the verdict *better than the baseline*:
  ``yes`` / ``no`` / ``n.s.`` (as the frontier table's, harness/report/frontier.py); without both runs' items (no
  ``samples.jsonl``, several baseline runs) the difference of the summary accuracies, ``across runs``, verdict
  ``n/a``.

Reads result files only; imports the standard library, harness.report.values and (lazily) :mod:`harness.metrics.paired`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.metrics.paired import read_samples, stratified_paired_metrics
from harness.report.values import finite as _num

log = logging.getLogger("harness.report")

METRIC = "opencompass_average"
METHOD = "stratified paired bootstrap over items within each dataset (harness/metrics/paired.py)"


def opencompass_columns(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The row's OpenCompass fields from ``summary.json`` ``metrics``: ``opencompass_accuracy`` ({dataset: its
    first metric}, over ``average_over`` when the run lists it) and ``opencompass_average_over``."""
    oc = metrics.get("opencompass")
    if not isinstance(oc, Mapping):
        return {"opencompass_accuracy": {}, "opencompass_average_over": None}
    over = oc.get("average_over")
    names = [str(n) for n in over] if isinstance(over, list) else [k for k, v in oc.items() if isinstance(v, Mapping)]
    acc: dict[str, float | None] = {}
    for name in names:
        block = oc.get(name)
        acc[name] = next((_num(v) for v in block.values() if _num(v) is not None), None) \
            if isinstance(block, Mapping) else None
    return {"opencompass_accuracy": acc, "opencompass_average_over": names if isinstance(over, list) else None}


def verdict(lo: float | None, hi: float | None) -> str:
    """``yes`` (interval above 0) / ``no`` (below) / ``n.s.`` (holds 0) / ``n/a`` (no interval)."""
    if lo is None or hi is None:
        return "n/a"
    return "yes" if lo > 0 else "no" if hi < 0 else "n.s."


def _paired(row: Mapping[str, Any], base: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The stratified comparison of ``row``'s items with its one baseline run's (None when it cannot be had)."""
    if len(base) != 1:
        return None
    a, b = Path(row.get("_samples") or ""), Path(base[0].get("_samples") or "")
    if not a.is_file() or not b.is_file():
        return None
    try:
        res = stratified_paired_metrics(read_samples(a), read_samples(b), "correct", scale=100.0)
    except Exception as e:  # noqa: BLE001 - no interval is the honest fallback: the cells then have none
        log.warning("%s: no paired OpenCompass interval (%s: %s)", row["run_dir"], type(e).__name__, e)
        return None
    return res if res.get("n_strata") else None


def paired_opencompass(row: dict[str, Any], base: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> None:
    """``row["opencompass_deltas"]`` ({dataset: accuracy, baseline, delta, lo, hi, kind, verdict, n}) and, when
    ``opencompass_average`` is compared and the run has none yet, its paired ``comparisons`` entry (module doc).
    Nothing for a run that is not an OpenCompass run, for the baseline itself, or without a baseline."""
    row["opencompass_deltas"] = {}
    if row.get(METRIC) is None or row["family"] == "baseline" or not base:
        return
    averages = [b[METRIC] for b in base if b.get(METRIC) is not None]
    row["opencompass_average_baseline"] = sum(averages) / len(averages) if averages else None
    res = _paired(row, base)
    strata = (res or {}).get("strata") or {}
    mine = row.get("opencompass_accuracy") or {}
    names = list(dict.fromkeys([*mine, *(s for s in strata if strata[s].get("n"))]))
    for name in names:
        d = strata.get(name) or {}
        if d.get("n"):
            row["opencompass_deltas"][name] = {
                "accuracy": mine.get(name, d["mean_a"]), "baseline": (base[0].get("opencompass_accuracy") or {})
                .get(name, d["mean_b"]), "delta": d["delta"], "lo": d["low"], "hi": d["high"], "kind": "paired",
                "verdict": verdict(d["low"], d["high"]), "n": d["n"]}
            continue
        theirs = [x for x in ((b.get("opencompass_accuracy") or {}).get(name) for b in base) if x is not None]
        b_acc = sum(theirs) / len(theirs) if theirs else None
        a_acc = mine.get(name)
        row["opencompass_deltas"][name] = {
            "accuracy": a_acc, "baseline": b_acc, "delta": a_acc - b_acc if None not in (a_acc, b_acc) else None,
            "lo": None, "hi": None, "kind": "across runs", "verdict": "n/a", "n": None}
    over = row.get("opencompass_average_over")
    if METRIC not in metrics or METRIC in row["comparisons"] or res is None or res.get("delta") is None:
        return
    paired_names = {s for s, d in strata.items() if d.get("n")}
    if over is not None and set(over) != paired_names:
        log.warning("%s: no paired interval on %s: its average is over %s, the paired items cover %s",
                    row["run_dir"], METRIC, sorted(over), sorted(paired_names))
        return
    row["comparisons"][METRIC] = {"estimate": res["delta"], "lo": res["low"], "hi": res["high"], "kind": "difference",
                                  "confidence": res.get("confidence"), "n": res.get("n"), "method": METHOD}


def _cell(x: Any, spec: str) -> str:
    return "n/a" if x is None else spec.format(x)


def opencompass_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The ``## OpenCompass per dataset`` section of ``report.md`` ("" when no run has per-dataset deltas): per
    run the macro average, then each dataset, its accuracy, the baseline's, Δ [interval] and the verdict."""
    with_deltas = [r for r in rows if r.get("opencompass_deltas")]
    if not with_deltas:
        return ""
    lines = ["## OpenCompass per dataset", "",
             "| run | technique | dataset | accuracy (%) | baseline (%) | Δ accuracy [95 % CI] | better than baseline "
             "| pairs |", "|---|---|---|---|---|---|---|---|"]
    for r in with_deltas:
        avg_ci = r.get(f"{METRIC}_delta_ci")
        lo, hi = avg_ci if avg_ci else (None, None)
        avg = {"delta": r.get(f"{METRIC}_delta"), "lo": lo, "hi": hi, "accuracy": r.get(METRIC),
               "baseline": r.get("opencompass_average_baseline"), "verdict": verdict(lo, hi),
               "n": (r["comparisons"].get(METRIC) or {}).get("n") if avg_ci else None}
        entries = [("**average** (macro)", avg), *r["opencompass_deltas"].items()]
        for name, d in entries:
            delta = _cell(d["delta"], "{:+.2f}")
            if d["lo"] is not None:
                delta += f" [{d['lo']:+.2f}, {d['hi']:+.2f}]"
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in [
                f"`{r['run_dir']}`", r["label"], name, _cell(d["accuracy"], "{:.2f}"), _cell(d["baseline"], "{:.2f}"),
                delta, f"**{d['verdict']}**" if d["verdict"] in ("yes", "no") else d["verdict"],
                _cell(d["n"], "{}")]) + " |")
    lines += ["", "Δ accuracy: the run's accuracy minus its baseline run's (same suite and setup), in points. With an "
              "interval: paired over the items both runs scored (`samples.jsonl`; bootstrap 95 %); the macro "
              "average's interval resamples items within each dataset and averages the per-dataset deltas, as "
              "OpenCompass averages datasets (harness/metrics/paired.py). *Better than baseline*: **yes** when the "
              "interval is above 0, **no** when below, n.s. when it holds 0; n/a without the items of both runs "
              "(an unpaired difference of the summaries).", ""]
    return "\n".join(lines)

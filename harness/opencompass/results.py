"""Reading OpenCompass's own outputs back: the summariser's CSV and the per-dataset results JSON.

Why both: the CSV is what OpenCompass reports (one row per dataset and per summary group, its chosen
metric), the JSON carries every metric an evaluator returned and the per-item details the cross-check
reads. OpenCompass exits 0 even when a task failed (the CSV then shows ``-``): a missing number is turned
into :class:`OpenCompassFailed` here, naming the task logs, never into a silently shorter average.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any


class OpenCompassFailed(RuntimeError):
    """OpenCompass exited non-zero, or left a dataset without results; the message points at its logs."""


def latest_output(work_dir: Path) -> Path:
    """OpenCompass writes each run into ``<work_dir>/<YYYYmmdd_HHMMSS>/``: the newest one with a summary."""
    runs = sorted(p for p in work_dir.iterdir() if (p / "summary").is_dir()) if work_dir.is_dir() else []
    if not runs:
        raise OpenCompassFailed(f"OpenCompass left no summary under {work_dir}")
    return runs[-1]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_summary_csv(out_dir: Path, model_abbr: str) -> dict[str, dict[str, float | None]]:
    """``{dataset_abbr: {metric: value}}`` from ``summary/summary_*.csv`` (the model's column)."""
    files = sorted((out_dir / "summary").glob("summary_*.csv"))
    if not files:
        raise OpenCompassFailed(f"no summary CSV in {out_dir / 'summary'}")
    table: dict[str, dict[str, float | None]] = {}
    with files[-1].open(encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if model_abbr not in row:
                raise OpenCompassFailed(f"{files[-1]} has no column for model {model_abbr!r}")
            metric = row["metric"] if row["metric"] not in ("", "-") else "score"
            table.setdefault(row["dataset"], {})[metric] = _number(row[model_abbr])
    return table


def read_result_json(out_dir: Path, model_abbr: str, dataset_abbr: str) -> dict[str, Any] | None:
    path = out_dir / "results" / model_abbr / f"{dataset_abbr}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_results(work_dir: Path, model_abbr: str, top_level: list[str]) -> tuple[dict[str, Any], Path]:
    """``metrics.opencompass``: every dataset's (and summary group's) metrics, plus ``average`` — the
    unweighted mean over ``top_level`` (the suite's datasets, groups counted once) of each one's reported
    metric — and ``average_over``. Returns it with OpenCompass's output directory."""
    out_dir = latest_output(work_dir)
    table = read_summary_csv(out_dir, model_abbr)
    for abbr, metrics in table.items():  # every numeric metric the evaluator returned, not only the CSV's
        res = read_result_json(out_dir, model_abbr, abbr)
        for key, value in (res or {}).items():
            if key != "details" and isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics.setdefault(key, float(value))
    missing = [name for name in top_level if not table.get(name) or
               next(iter(table[name].values())) is None]
    if missing:
        logs = out_dir / "logs"
        raise OpenCompassFailed(
            f"OpenCompass produced no result for {', '.join(missing)}; see the task logs under {logs} "
            f"(infer/{model_abbr}/<dataset>.out, eval/{model_abbr}/<dataset>.out)")
    primary = [next(iter(table[name].values())) for name in top_level]
    metrics_out: dict[str, Any] = dict(table)
    metrics_out["average"] = sum(primary) / len(primary) if primary else None
    metrics_out["average_over"] = list(top_level)
    return metrics_out, out_dir


def read_trace(trace_path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The model class's per-generation records (timings) and the techniques' statistics.

    One inference process (the usual case: ``opencompass.max_num_workers=1``) → its statistics as they are
    (``sere`` / ``moe`` / ``engine``). Several → ``engine`` from the first, and each process's technique
    statistics in a list under ``technique_stats_by_process`` (they are not merged: each is over its own
    datasets)."""
    records = []
    if trace_path.exists():
        with trace_path.open(encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    files = sorted(trace_path.parent.glob(f"{trace_path.stem}.stats.*.json"))
    per_process = [json.loads(p.read_text(encoding="utf-8")) for p in files]
    if len(per_process) <= 1:
        return records, (per_process[0] if per_process else {})
    return records, {"engine": per_process[0].get("engine"),
                     "technique_stats_by_process": [{k: v for k, v in s.items() if k != "engine"}
                                                    for s in per_process]}


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value  # --dump-eval-details wraps items in lists


#: per-item outcome fields of OpenCompass's evaluators, in the order its BaseEvaluator reads them
CORRECT_FIELDS = ("correct", "is_correct", "cascade_correct")


def item_records(out_dir: Path, model_abbr: str, dataset_abbrs: list[str]) -> list[dict[str, Any]]:
    """OpenCompass's per-item outcomes as ``samples.jsonl`` records, so that two OpenCompass runs of the same
    suite compare item by item (``python -m harness.commands.paired_quality BASE RUN``: a paired interval per
    dataset, issue 31) exactly as two harness runs do.

    One record per evaluated item: ``uid`` = ``<dataset>/<item key>``, ``scores`` = ``correct`` (0/1; over all
    datasets, item-weighted) and ``correct/<dataset>`` (that dataset alone), from the first of
    :data:`CORRECT_FIELDS` the item carries. OpenCompass's own average is
    unweighted over datasets; the per-dataset keys are the ones to read. A dataset whose results carry no
    per-item details, or an item without a ``correct`` field (an evaluator that does not report one), becomes a
    record with ``error`` and its reason: counted by the comparison, never silently dropped."""
    records: list[dict[str, Any]] = []
    for abbr in dataset_abbrs:
        res = read_result_json(out_dir, model_abbr, abbr)
        details = (res or {}).get("details")
        if details is None:
            records.append({"uid": f"{abbr}/*", "dataset": abbr, "task": "opencompass", "scores": {},
                            "error": f"OpenCompass wrote no per-item details for {abbr}", "error_kind": "data"})
            continue
        pairs = list(details.items()) if isinstance(details, dict) else list(enumerate(details))
        # OpenCompass's format_details (evaluators without details of their own) adds {"type": "GEN"} beside
        # the items: only dict values are items
        pairs = [(key, item) for key, item in pairs if isinstance(item, dict)]
        for key, item in pairs:
            rec: dict[str, Any] = {"uid": f"{abbr}/{key}", "dataset": abbr, "task": "opencompass"}
            # the per-item fields OpenCompass itself reads (BaseEvaluator.evaluate): an evaluator that reports
            # none (AccEvaluator: its details are formatted afterwards, without one) leaves the item unscored
            fields = [_first(item.get(k)) for k in CORRECT_FIELDS] if isinstance(item, dict) else []
            correct = next((v for v in fields if v is not None), None)
            if correct is None:
                rec.update(scores={}, error=f"item {key} of {abbr}: the evaluator reported no per-item outcome "
                                            f"({' / '.join(CORRECT_FIELDS)})", error_kind="data")
            else:
                value = float(bool(correct))
                rec["scores"] = {"correct": value, f"correct/{abbr}": value}
            records.append(rec)
    return records

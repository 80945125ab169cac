"""OpenCompass's per-item outcomes as samples.jsonl records (harness.opencompass.results.item_records): every
item becomes one record, a dataset or item without the evidence becomes a counted error, and two runs compare
per dataset through the same paired machinery as harness runs (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.commands.paired_quality import compare
from harness.opencompass.results import item_records


def _results(out_dir: Path, model: str, abbr: str, data: dict) -> None:
    path = out_dir / "results" / model / f"{abbr}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def _run(tmp: Path, name: str, correct_a: list[bool]) -> Path:
    out = tmp / name / "oc"
    # --dump-eval-details wraps values in lists; details keyed by item index (AccEvaluator) or a plain list
    _results(out, "m", "a", {"accuracy": 50.0, "details": {str(i): {"pred": ["x"], "correct": [c]}
                                                          for i, c in enumerate(correct_a)}})
    _results(out, "m", "b", {"accuracy": 100.0, "details": {"0": {"pred": "y", "is_correct": True}, "1": {"pred": "z"},
                                                          "type": "GEN"}})   # as OpenCompass's format_details
    _results(out, "m", "c", {"score": 1.0})  # no details at all
    records = item_records(out, "m", ["a", "b", "c"])
    run = tmp / name
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return run


def test_items_become_records_and_missing_evidence_is_counted(tmp_path):
    recs = [json.loads(line) for line in (_run(tmp_path, "r", [True, False, True]) / "samples.jsonl").open()]
    by_uid = {r["uid"]: r for r in recs}
    assert by_uid["a/0"]["scores"] == {"correct": 1.0, "correct/a": 1.0}
    assert by_uid["a/1"]["scores"] == {"correct": 0.0, "correct/a": 0.0}
    assert by_uid["b/0"]["scores"] == {"correct": 1.0, "correct/b": 1.0}
    assert "no per-item outcome" in by_uid["b/1"]["error"] and by_uid["b/1"]["scores"] == {}
    assert "no per-item details" in by_uid["c/*"]["error"]
    assert len(recs) == 3 + 2 + 1


def test_two_runs_compare_per_dataset(tmp_path):
    base = _run(tmp_path, "base", [True] * 8)
    worse = _run(tmp_path, "worse", [True, False, False, False, False, False, False, True])
    (row,) = compare(base, [worse])
    m = row["metrics"]["correct/a"]
    assert m["n"] == 8 and m["delta"] == -0.75 and m["verdict"] == "−" and m["high"] < 0
    assert row["metrics"]["correct/b"]["n"] == 1 and row["metrics"]["correct/b"]["verdict"] == "n.s."
    assert row["errors_a"] == row["errors_b"] == 2   # b/1 and c/* in both runs, counted, not scored

"""harness/results/schema.py: one typed schema for summary.json, old summaries still load (issue 24, item 3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.results import schema

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/results/v1"

# The keys of schema version 1 (harness/results/schema.py). A key removed or renamed breaks old readers: bump
# SCHEMA_VERSION, add an upgrade step, and record the new version's keys here. Adding an optional key is no change.
V1_KEYS = {
    "Summary": {"run", "config", "metrics", "latency", "warnings", "visionzip", "sere", "moe", "offload", "cache",
                "load", "opencompass_crosscheck", "technique_stats_by_process", "comparisons"},
    "Run": {"schema_version", "harness_version", "git_commit", "engine", "engine_version", "engine_settings",
            "python", "torch_version", "transformers_version", "triton_version", "device_name", "dtype", "model",
            "weights", "seed", "hostname", "start_time", "end_time", "wall_time_s", "run_dir", "sweep", "attempt",
            "scoring", "phase_s", "wandb_dir", "opencompass_version", "opencompass"},
    "Latency": {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "output_tokens_per_s", "output_tokens_per_s_basis",
                "total_output_tokens", "n_requests", "completed", "failed", "tpot_undefined", "partial",
                "n_measured", "n_cached", "repeats", "max_cv", "noisy", "protocol"},
    "Distribution": {"mean", "p50", "p90", "p99", "n", "ci", "confidence", "cv", "noisy", "n_requests", "passes",
                     "pass_means", "n_excluded"},
    "Comparison": {"metric", "against", "kind", "estimate", "ci", "confidence", "n", "method"},
}


def test_no_key_of_version_1_changed_without_a_bump():
    if schema.SCHEMA_VERSION != 1:
        pytest.skip("a later version: its keys are guarded by its own set")
    for name, keys in V1_KEYS.items():
        missing = keys - schema.declared_keys(getattr(schema, name))
        assert not missing, f"{name} lost {missing}: bump SCHEMA_VERSION and add an upgrade step"


def test_the_committed_summary_of_today_s_version_loads():
    """tests/fixtures/results/v1/summary.json was written by `python -m harness` (embedded model, dataset.limit=3,
    visionzip.keep=0.6 sere.k=2 latency.repeats=2) at schema version 1."""
    s = schema.read_summary(FIXTURE / "summary.json")
    assert s["run"]["schema_version"] == 1 == schema.SCHEMA_VERSION
    assert not schema.undeclared_keys(s), "the run writes keys the schema does not declare"
    assert set(s["latency"]) <= schema.declared_keys(schema.Latency)
    for dist in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s["latency"][dist]) <= schema.declared_keys(schema.Distribution), dist
    assert set(schema.REQUIRED_BLOCKS) <= set(s)


def test_the_report_and_wandb_read_the_committed_summary(tmp_path):
    from harness.report.rows import load_rows
    from harness.results.tracking import summary_values

    shutil.copytree(FIXTURE, tmp_path / "v1")
    (row,) = load_rows([tmp_path / "v1"])
    assert row["family"] == "visionzip+sere" and row["sere_k"] == 2 and row["vz_keep"] == 0.6
    assert row["ttft_p50"] is not None and row["ttft_ci_lo"] is not None and row["latency_repeats"] == 2
    assert row["random_scorers"] == ["clip", "embed"]
    values = summary_values(schema.read_summary(tmp_path / "v1/summary.json"))
    assert values["run/schema_version"] == 1 and values["latency/ttft_ms/ci_lo"] is not None
    assert values["warnings"] and "random-init scorers" in values["warnings"]


def test_a_summary_without_a_version_loads_as_version_0(tmp_path):
    data = json.loads((FIXTURE / "summary.json").read_text())
    del data["run"]["schema_version"]
    p = tmp_path / "summary.json"
    p.write_text(json.dumps(data))
    assert schema.read_summary(p)["run"]["schema_version"] == 0
    p.write_text(json.dumps({"metrics": {"ocrbench_score": 1.0}}))  # the oldest: nothing but metrics
    assert schema.read_summary(p)["metrics"]["ocrbench_score"] == 1.0


def test_a_newer_version_is_refused_by_name(tmp_path):
    data = json.loads((FIXTURE / "summary.json").read_text())
    data["run"]["schema_version"] = schema.SCHEMA_VERSION + 1
    p = tmp_path / "summary.json"
    p.write_text(json.dumps(data))
    with pytest.raises(schema.UnsupportedSummary, match="newer harness"):
        schema.read_summary(p)


def test_write_summary_stamps_the_version_and_names_undeclared_keys(tmp_path, caplog):
    p = tmp_path / "summary.json"
    schema.write_summary(p, {"run": {"engine": "hf"}, "config": {}, "metrics": {}, "latency": {}, "mystery": 1})
    assert json.loads(p.read_text())["run"]["schema_version"] == schema.SCHEMA_VERSION
    assert "mystery" in caplog.text

"""harness/results/tracking.py without W&B: the run id of a rerun, the W&B summary of a summary.json (issue 25, 5–6)."""

from __future__ import annotations

from harness.results.tracking import SAMPLE_COLUMNS, config_run_id, summary_values


def test_a_changed_configuration_gets_another_wandb_run():
    """Old code: rerunning a hydra.run.dir with a changed config reused the W&B run id for another experiment."""
    cfg = {"visionzip": {"keep": 0.6}, "sere": {"k": None}, "wandb": {"tags": []}}
    same = config_run_id("abc123", cfg)
    assert same == config_run_id("abc123", {**cfg}) and same.startswith("abc123-")
    assert config_run_id("abc123", {**cfg, "visionzip": {"keep": 0.5}}) != same
    assert config_run_id("abc123", {**cfg, "wandb": {"tags": ["x"]}}) == same  # W&B settings are not the experiment


def test_wandb_summary_carries_intervals_metadata_warnings_and_comparisons():
    summary = {"run": {"schema_version": 1, "device_name": "H200", "weights": "real", "scoring": {"clip_weights": "pretrained"}},
               "metrics": {"rouge1": 0.4},
               "latency": {"ttft_ms": {"p50": 10.0, "ci": [9.0, 11.0]}},
               "warnings": ["a", "b"],
               "comparisons": [{"metric": "ttft_ms", "against": "baseline", "kind": "ratio", "estimate": 1.4,
                                "ci": [1.2, 1.6]}]}
    v = summary_values(summary)
    assert (v["latency/ttft_ms/ci_lo"], v["latency/ttft_ms/ci_hi"]) == (9.0, 11.0)
    assert v["run/device_name"] == "H200" and v["run/scoring/clip_weights"] == "pretrained"
    assert v["warnings"] == "a\nb" and v["warnings_count"] == 2
    assert v["comparisons/baseline/ttft_ms/estimate"] == 1.4 and v["comparisons/baseline/ttft_ms/ci_hi"] == 1.6


def test_samples_table_has_prompt_reference_and_one_error_column():
    assert {"prompt", "reference"} <= set(SAMPLE_COLUMNS) and SAMPLE_COLUMNS.count("error") == 1


def test_wandb_stages_artifacts_inside_the_run_directory(tmp_path, monkeypatch):
    """Old code: offline artifacts were staged under ~/.local/share/wandb, outside the run directory."""
    import harness.results.tracking as tr

    monkeypatch.setattr(tr, "_USER_DATA_DIR", None)
    monkeypatch.delenv("WANDB_DATA_DIR", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    tr._quiet_and_local(tmp_path / "run")
    import os

    assert os.environ["WANDB_DATA_DIR"] == str(tmp_path / "run" / "wandb" / "staging")
    assert os.environ["WANDB_SILENT"] == "true"


def test_samples_table_thumbnails(tmp_path):
    """Old code: the samples table had no images."""
    from PIL import Image

    from harness.results.tracking import THUMBNAIL_PX, thumbnail_strip

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    Image.new("RGB", (640, 320), "red").save(a)
    Image.new("RGB", (100, 200), "blue").save(b)
    strip = thumbnail_strip([str(a), str(b), str(tmp_path / "gone.png")])
    assert strip.height == THUMBNAIL_PX and strip.width == 128 + 4 + 64
    assert thumbnail_strip(["bytes-key"]) is None and thumbnail_strip(None) is None

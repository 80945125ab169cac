"""Does the harness *detect* a quality regression? Directions with margins, on the trained embedded model
(model=tiny, ``trained-synthetic``) and the bundled held-out samples, CPU, in CI.

Margins are about half of what was measured (2026-12-01, 2-core CPU, float32 greedy; docs/embedded_model.md has
the table): RAG-IGBench on the 12 bundled held-out requests — baseline edit 0.329 / Kendall 0.164; VisionZip
keep 0.5: edit 0.269; SERE K=1 ρ=0: edit 0.090 / Kendall 0.019; + protect=4: edit 0.286 / Kendall 0.155.
Never an exact score.

What the trained model cannot do (so no test claims it): read the OCR lines or answer the shape questions
above chance — OCR accuracy is 0 at keep 1.0, so "OCR falls at a small keep" cannot be shown with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
_RUNS: dict[tuple[str, ...], dict] = {}


def run(tmp_path_factory, *overrides: str) -> dict:
    """``summary.json`` of one in-process run (memoised per overrides within the session)."""
    from harness.run import run_experiment

    key = tuple(overrides)
    if key not in _RUNS:
        register_configs()
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["wandb.mode=disabled", "cache.enabled=false",
                                                           "engine.warmup=0", *overrides])
        GlobalHydra.instance().clear()
        _RUNS[key] = run_experiment(cfg, tmp_path_factory.mktemp("run"))
    return _RUNS[key]


def answers(summary: dict) -> list[str]:
    import json

    path = Path(summary["run"]["run_dir"]) / "samples.jsonl"
    return [json.loads(line)["answer"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
def test_keep_one_is_exactly_the_baseline_and_pruning_costs_edit_score(tmp_path_factory):
    base = run(tmp_path_factory)
    assert base["run"]["weights"] == "trained-synthetic"
    assert base["metrics"]["format_invalid"] <= 3 and base["metrics"]["edit_score"] > 0.2  # the model answers
    # keep = 1.0 with every other VisionZip knob moved: nothing is pruned, the answers are the baseline's
    same = run(tmp_path_factory, "visionzip.keep=1.0", "visionzip.scope=image", "visionzip.contextual=0.5")
    assert answers(same) == answers(base) and same["metrics"] == base["metrics"]
    half = run(tmp_path_factory, "visionzip.keep=0.5")
    assert half["visionzip"]["keep_rate"] == pytest.approx(0.5, abs=0.02)
    assert half["metrics"]["edit_score"] < base["metrics"]["edit_score"] - 0.03  # measured −0.060


@pytest.mark.slow
def test_sere_k1_rho0_is_below_top_k(tmp_path_factory):
    base = run(tmp_path_factory)
    sere = run(tmp_path_factory, "sere.k=1", "sere.rho=0.0")
    assert sere["sere"]["moved_fraction"] > 0.5  # ρ = 0 re-routes every secondary slot outside the union
    assert sere["metrics"]["edit_score"] < base["metrics"]["edit_score"] - 0.12  # measured −0.239
    assert sere["metrics"]["kendall"] < base["metrics"]["kendall"] - 0.07  # measured −0.145
    assert sere["metrics"]["format_invalid"] > base["metrics"]["format_invalid"]  # measured 4 vs 1
    # protecting the 4 experts per layer whose re-routing does the most damage recovers part of the loss
    prot = run(tmp_path_factory, "sere.k=1", "sere.rho=0.0", "sere.protect=4")
    assert prot["metrics"]["edit_score"] > sere["metrics"]["edit_score"] + 0.1  # measured +0.196
    assert prot["metrics"]["kendall"] > sere["metrics"]["kendall"] + 0.07  # measured +0.137


def test_request_budget_splits_sources_unequally_and_per_image_ratio_does_not(tmp_path_factory):
    """OCR+CC mix, keep 0.5: one request-wide budget gives the two sources clearly different keep rates,
    the per-image ratio gives both the same. Measured: request scope CCBench (shape images) 0.564 vs OCRBench
    (text images) 0.431; image scope 0.500 / 0.500. The sign is the *opposite* of the seed's OCRBench +13.6:
    the trained tower concentrates its attention on the few shape tokens of a sparse image, whose
    normalised scores (each image's scores average 1) then beat text tokens spread over more of an image."""
    common = ("dataset=ocr_cc_mix_sample", "generation.max_new_tokens=2", "visionzip.keep=0.5")
    req = run(tmp_path_factory, *common, "visionzip.scope=request")["visionzip"]["by_source"]
    img = run(tmp_path_factory, *common, "visionzip.scope=image")["visionzip"]["by_source"]
    gap_request = req["ccbench"]["keep_rate"] - req["ocrbench"]["keep_rate"]
    gap_image = img["ccbench"]["keep_rate"] - img["ocrbench"]["keep_rate"]
    assert gap_request > 0.06  # measured +0.134
    assert abs(gap_image) < 0.02  # measured 0.000


@pytest.mark.slow
def test_plain_top_k_truncation_costs_quality(tmp_path_factory):
    """Plain top-K truncation (``moe.top_k``, decode only like SERE) computes fewer experts and the harness sees
    what it costs. Measured (12 held-out requests): baseline edit 0.329 → top-1 0.175, top-2 0.042.

    What this model does *not* reproduce is the seed's ordering "plain top-K loses more than SERE at that K": at
    K=1, SERE ρ=0 gives edit 0.094, ρ=0.3 0.188, ρ=0.5 0.154 against top-1's 0.175; at K=2, SERE ρ=0.5 0.054
    against top-2's 0.042 — differences within the noise of 12 samples of a model whose experts barely
    specialise (docs/embedded_model.md), so no test claims an ordering."""
    base = run(tmp_path_factory)
    plain = run(tmp_path_factory, "moe.top_k=1")
    assert plain["moe"]["expert_union_after"] < plain["moe"]["expert_union_before"]
    assert plain["metrics"]["edit_score"] < base["metrics"]["edit_score"] - 0.07  # measured −0.154

"""The seed's OpenCompass table in miniature (issue 28 item 2), on the committed embedded model (recipe v7g), the CI
suite (``opencompass.ci_items`` = 4 held-out items per prompt-reading task, 24 facts of the recall table), CPU,
float32, greedy, through OpenCompass's own runner and evaluators.

Measured 2026-12-04 (the lane's own runs; docs/embedded_model_v7.md §13, README "Embedded model" has the larger run):

| setting | harness_text_qa | harness_text_recall | harness_text_choice | average |
|---|---|---|---|---|
| baseline (top-4) | 100.0 | 100.0 | 75.0 | 91.7 |
| SERE K=2 ρ 0.5 | 100.0 | 100.0 | 75.0 | 91.7 |
| SERE K=1 ρ 0.5 | 100.0 | 95.8 | 75.0 | 90.3 |
| plain top-2 | 100.0 | 79.2 | 75.0 | 84.7 |
| plain top-1 | 83.3 | 29.2 | 75.0 | 62.5 |

The seed's shape (top-8 82.24, SERE K=2 80.37, plain top-2 14.30): re-routing keeps the model, truncating breaks
it. Here plain top-1 keeps a quarter of the experts, as the seed's top-2 keeps a quarter of its top-8. Where it
shows: the closed-book recall file (answers held in the weights, none in the prompt); the prompt-reading files lose
little under any setting (their first two experts carry ~83 % of the mixture, docs/embedded_model_v7.md §11).
Margins: about half of what was measured. Not asserted here: "protection recovers part of K=1's loss" — SERE K=1
loses one fact of 24 here, nothing for protection to recover (it is asserted on RAG, tests/run/test_sensitivity.py).
"""

from __future__ import annotations

QA = "harness_text_qa"
RECALL = "harness_text_recall"
CHOICE = "harness_text_choice"


def acc(oc_runs, setting: str, dataset: str) -> float:
    return oc_runs[setting][1]["metrics"]["opencompass"][dataset]["accuracy"]


def average(oc_runs, setting: str) -> float:
    return oc_runs[setting][1]["metrics"]["opencompass"]["average"]


def test_baseline_answers_the_text_tasks(oc_runs):
    _, off = oc_runs["off"]
    assert off["config"]["model"]["weights"] == "trained-synthetic"
    assert acc(oc_runs, "off", QA) >= 50.0  # measured 100.0
    assert acc(oc_runs, "off", CHOICE) >= 50.0  # measured 75.0 (chance 25)
    assert acc(oc_runs, "off", RECALL) >= 80.0  # measured 100.0: the table is in the weights


def test_sere_keeps_most_of_the_baseline(oc_runs):
    """SERE K=2 and K=1 (ρ 0.5) keep ≥ 90 % of the baseline, per file and on average (measured 100 % and 98.5 %)."""
    for setting in ("sere_k2", "sere_k1"):
        sere = oc_runs[setting][1]
        assert sere["sere"]["steps"] > 0 and sere["sere"]["moved_fraction"] > 0.0  # SERE re-routed decode tokens
        for dataset in (QA, RECALL):
            assert acc(oc_runs, setting, dataset) >= 0.9 * acc(oc_runs, "off", dataset)
        assert average(oc_runs, setting) >= 0.9 * average(oc_runs, "off")


def test_plain_truncation_loses_more_than_sere_at_the_same_k(oc_runs):
    """The seed's row: at the same K, plain truncation loses the facts that SERE's re-routing keeps."""
    # top-2 vs SERE K=2: recall measured 79.2 vs 100.0 (5 facts of 24), average 84.7 vs 91.7
    assert acc(oc_runs, "top_k2", RECALL) < acc(oc_runs, "sere_k2", RECALL) - 10.0
    assert average(oc_runs, "top_k2") < average(oc_runs, "sere_k2") - 3.0
    # top-1 vs SERE K=1 (the seed's quarter of the experts): recall 29.2 vs 95.8, average 62.5 vs 90.3
    assert acc(oc_runs, "top_k1", RECALL) < acc(oc_runs, "sere_k1", RECALL) - 33.0
    assert average(oc_runs, "top_k1") < average(oc_runs, "sere_k1") - 14.0
    assert oc_runs["top_k1"][1]["moe"]["top_k"] == 1 and oc_runs["top_k2"][1]["moe"]["top_k"] == 2

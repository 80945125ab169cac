"""The seed's OpenCompass table in miniature (issue 28 item 2), on the committed embedded model (recipe v7c-lr2),
the CI suite's held-out items (``opencompass.ci_items`` per text task), CPU, float32, greedy.

Measured 2026-12-03 (4 items per task; docs/embedded_model_v7.md §9 has 16 per task): SERE off — harness_text_qa
100.0 (addition, list operations, key-value lookup: 12 of 12), harness_text_choice 25.0 (chance: choice over the
passage is not learnt); SERE K=2 ρ 0.5 — 100.0 / 25.0. Margins: about half of what was measured.

What holds and is asserted: the baseline answers the QA file (recipe v4, before, scored 0 there), and SERE K=2
keeps at least 90 % of it. What is not asserted, because it does not hold on these tasks: "plain top-2 loses
clearly more than SERE K=2" (top-2 answers the same 16 items alike) and "protection recovers part of K=1's loss"
(K=1 at ρ 0.5 loses at most one item in 64). A direction on the choice file, at chance, would mean nothing.
"""

from __future__ import annotations

QA = "harness_text_qa"


def test_baseline_answers_the_text_tasks(oc_runs):
    _, off = oc_runs["off"]
    assert off["config"]["model"]["weights"] == "trained-synthetic"
    assert off["metrics"]["opencompass"][QA]["accuracy"] >= 50.0  # measured 100.0


def test_sere_k2_keeps_most_of_the_baseline(oc_runs):
    _, off = oc_runs["off"]
    _, sere = oc_runs["sere_k2"]
    assert sere["sere"]["steps"] > 0 and sere["sere"]["moved_fraction"] > 0.0  # SERE re-routed decode tokens
    base = off["metrics"]["opencompass"][QA]["accuracy"]
    assert sere["metrics"]["opencompass"][QA]["accuracy"] >= 0.9 * base  # measured 100.0 of 100.0

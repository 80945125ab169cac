"""Cross-check: on the same predictions, OpenCompass's multiple-choice accuracy equals the harness's own MCQ
scoring (``harness.metrics.mcq``) where both define the chosen option (harness/opencompass/crosscheck.py)."""

from __future__ import annotations

import pytest

from conftest import CI_ITEMS

from harness.opencompass.crosscheck import mcq_crosscheck, read_rows
from harness.opencompass.suites import write_ci_sample


def _oc_score(rows, predictions):
    """OpenCompass's own evaluator of custom MCQ gen datasets, on ``predictions``."""
    from datasets import Dataset
    from opencompass.datasets.custom import OptionSimAccEvaluator

    ev = OptionSimAccEvaluator(options=["A", "B", "C", "D"])
    return ev.score(predictions, [r["answer"] for r in rows], Dataset.from_list(rows))


def test_crosscheck_in_every_run(oc_runs):
    for setting, (_, s) in oc_runs.items():
        cc = s["opencompass_crosscheck"]["harness_text_choice"]
        assert cc["n"] == CI_ITEMS and cc["n_both_decide"] + cc["n_oc_only"] <= cc["n"]
        if cc["n_both_decide"]:
            assert cc["oc_accuracy_on_both"] == pytest.approx(cc["harness_accuracy_on_both"]), setting


def test_same_predictions_same_accuracy(tmp_path):
    """Clear answers in the forms models give, plus unclear ones: where the harness decides, both agree on
    every item, and the accuracies are equal; OpenCompass alone scores the unclear ones."""
    rows = read_rows(write_ci_sample(tmp_path, n=8, seed=3)[-1])  # the multiple-choice dataset
    gold = [r["answer"] for r in rows]
    wrong = [{"A": "B", "B": "C", "C": "D", "D": "A"}[g] for g in gold]
    preds = [gold[0], f"The answer is {gold[1]}", f"{wrong[2]}. {rows[2][wrong[2]]}", f"({gold[3]})",
             f"答案是{wrong[4]}", rows[5][gold[5]], "I am not sure", "A or B"]
    res = _oc_score(rows, preds)
    cc = mcq_crosscheck(res["details"], rows)
    assert cc["n_both_decide"] == 6  # the last two name no option / two options: the harness declines
    assert cc["n_same_letter"] == 6
    assert cc["oc_accuracy_on_both"] == cc["harness_accuracy_on_both"] == pytest.approx(100 * 4 / 6)
    assert cc["n_oc_only"] == 2


def test_crosscheck_refuses_misaligned_details(tmp_path):
    rows = read_rows(write_ci_sample(tmp_path, n=4, seed=0)[-1])
    res = _oc_score(rows, ["A"] * 4)
    with pytest.raises(ValueError, match="reference"):
        mcq_crosscheck(res["details"], rows[::-1] if rows[0]["answer"] != rows[-1]["answer"] else rows[1:] + rows[:1])
    with pytest.raises(ValueError, match="details"):
        mcq_crosscheck(res["details"], rows[:3])

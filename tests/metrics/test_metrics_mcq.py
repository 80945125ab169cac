"""Rule-based choice extraction and circular accuracy."""

import csv
from pathlib import Path

import pytest

from harness.metrics import mcq

CCBENCH_TSV = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ccbench" / "CCBench_samples.tsv"
OPTS = {"A": "天坛", "B": "故宫", "C": "黄鹤楼", "D": "少林寺"}


@pytest.mark.parametrize(
    "prediction, expected",
    [
        ("B", "B"), ("b", "B"), (" (B) ", "B"), ("B.", "B"), ("[C]", "C"), ("D)", "D"),
        ("答案是B", "B"), ("答案：C", "C"), ("正确答案为 D。", "D"), ("选B", "B"), ("我选择A，因为……", "A"),
        ("The answer is B", "B"), ("Answer: (C)", "C"), ("the correct option is D.", "D"),
        ("B. 故宫", "B"), ("(A) 天坛是明清两代皇帝祭天的地方", "A"), ("C、黄鹤楼", "C"), ("B 故宫", "B"),
        ("我认为选项B正确", "B"), ("I think it is C", "C"), ("A is correct", "A"),
        ("图中是故宫。", "B"), ("This is the Temple of Heaven, 天坛.", "A"),
        ("Ｂ", "B"), ("（Ｃ）", "C"), ("答案：Ｄ", "D"),  # full width
        ("**B**", "B"),
        ("答案是B，A是错误的", "B"),  # an explicit statement wins over other letters
    ],
)
def test_extract_choice(prediction, expected):
    assert mcq.extract_choice(prediction, OPTS) == expected


@pytest.mark.parametrize(
    "prediction",
    [
        None, "", "   ", "A or B", "不是A就是B", "E", "答案是E", "我不知道", "故宫和天坛都有可能",
        "答案是A。不对，答案是B",  # two explicit answers
        "A cat is sitting there",  # English article, no choice
    ],
)
def test_extract_choice_ambiguous_or_absent_is_none(prediction):
    assert mcq.extract_choice(prediction, OPTS) is None


def test_extract_choice_option_text_containment_and_missing_options():
    opts = {"A": "北京", "B": "北京市", "C": "上海", "D": float("nan")}
    assert mcq.extract_choice("应该是北京市", opts) == "B"  # 北京 is part of 北京市: the longer one
    assert mcq.extract_choice("D", opts) is None  # D is not an option (NaN text)
    assert mcq.extract_choice("B", {}) is None


def test_extract_choice_on_ccbench_options():
    if not CCBENCH_TSV.is_file():
        pytest.skip(f"needs {CCBENCH_TSV}")
    with open(CCBENCH_TSV, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert rows
    for row in rows:
        options = {k: row[k] for k in "ABCD" if row.get(k)}
        gold = row["answer"]
        assert mcq.extract_choice(f"答案是{gold}", options) == gold
        assert mcq.extract_choice(f"{gold}. {options[gold]}", options) == gold
        unique_text = not any(options[gold] in v for k, v in options.items() if k != gold)
        if unique_text:
            assert mcq.extract_choice(f"这是{options[gold]}。", options) == gold


def test_circular_one_wrong_rotation_counts_wrong():
    records = [
        # question 0: 4 rotations, all right
        *({"group": 0, "category": "Scenery Building", "pred": g, "gold": g} for g in "ABCD"),
        # question 1: one rotation wrong
        {"group": 1, "category": "Scenery Building", "pred": "B", "gold": "B"},
        {"group": 1, "category": "Scenery Building", "pred": "C", "gold": "C"},
        {"group": 1, "category": "Scenery Building", "pred": "A", "gold": "D"},
        {"group": 1, "category": "Scenery Building", "pred": "A", "gold": "A"},
        # question 2 (another category) given by index, rows i + k·1e6; one unparsed
        {"index": 2, "category": "Food Clothes", "pred": "A", "gold": "A"},
        {"index": 1_000_002, "category": "Food Clothes", "pred": None, "gold": "B"},
    ]
    res = mcq.circular_accuracy(records)
    assert res["n_questions"] == 3 and res["n_rows"] == 10
    assert res["mcq_accuracy"] == pytest.approx(1 / 3)
    assert res["mcq_accuracy_per_category"] == {"Food Clothes": 0.0, "Scenery Building": 0.5}
    assert res["mcq_row_accuracy"] == pytest.approx(8 / 10)
    assert res["mcq_row_accuracy_per_category"]["Scenery Building"] == pytest.approx(7 / 8)
    assert res["unparsed"] == 1 and res["errors"] == 0


def test_circular_errors_and_empty():
    res = mcq.circular_accuracy([{"group": 5, "category": "x", "pred": "A", "gold": "A", "error": "timeout"}])
    assert res["mcq_accuracy"] == 0.0 and res["errors"] == 1
    empty = mcq.circular_accuracy([])
    assert empty["mcq_accuracy"] is None and empty["mcq_accuracy_per_category"] == {} and empty["n_rows"] == 0
    assert mcq.circular_group(3_000_017) == 17

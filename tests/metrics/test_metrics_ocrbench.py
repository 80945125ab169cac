"""OCRBench scoring rules and a conformance run over the real metadata file."""

import json
from pathlib import Path

import pytest

from harness.metrics import ocrbench as ob

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
OCRBENCH_JSON = SHARED_DATA / "ocrbench" / "OCRBench.json"


def test_case_insensitive_substring():
    assert ob.score_one("The text reads: HELLO World.", "hello world", "IIIT5K") == 1
    assert ob.score_one("hello", "hello world", "IIIT5K") == 0
    assert ob.score_one("  Stop  ", ["go", "STOP"], "svt") == 1  # any answer of a list


def test_newlines_become_spaces_on_both_sides():
    assert ob.score_one("NEWS\nAGENCY", "news agency", "WordArt") == 1
    assert ob.score_one("news agency", "NEWS\nAGENCY\n", "WordArt") == 1
    assert ob.score_one("NEWS\n\nAGENCY", "news agency", "WordArt") == 0  # two spaces, not one


def test_hme_removes_spaces_and_keeps_case():
    answer = "x _ { 1 } = \\frac { - 2 } { 2 }\n"
    assert ob.score_one("The result is x_{1}=\\frac{-2}{2}", answer, "HME100k") == 1
    assert ob.score_one("X_{1}=\\frac{-2}{2}", answer, "HME100k") == 0  # case kept
    assert ob.score_one("x_{1}\n=\\frac{-2}{2}", answer, "HME100k") == 1  # newline → space → removed
    assert ob.score_one("x_{1}=\\frac{-2}{2}", answer, ob.HME_TYPE) == 1  # VLMEvalKit keys on the category
    # outside HME the spaces matter
    assert ob.score_one("x_{1}=\\frac{-2}{2}", answer, "IIIT5K") == 0


def test_bad_inputs_have_defined_results():
    assert ob.score_one(None, "a", "svt") == 0
    assert ob.score_one("", "a", "svt") == 0
    assert ob.score_one("anything", "", "svt") == 0  # an empty answer matches nothing
    assert ob.score_one("anything", [], "svt") == 0
    assert ob.score_one("anything", None, None) == 0
    assert ob.score_one("ＡＢＣ", "abc", "svt") == 0  # full-width is not folded (as the benchmark)
    assert ob.score_one("答案是北京Beijing", "beijing", "ESTVQA") == 1  # mixed Chinese/English


def test_aggregate_categories_and_scale():
    rows = [
        {"type": "Regular Text Recognition", "dataset_name": "IIIT5K", "prediction": "CAT", "answers": "cat"},
        {"type": "Digit String Recognition", "dataset_name": "ORAND", "prediction": "12", "answers": "13"},
        {"type": "Doc-oriented VQA", "score": 1},
        {"type": ob.HME_TYPE, "prediction": "a+b", "answers": ["a + b"]},
        {"type": "Scene Text-centric VQA", "error": "image missing", "prediction": "x", "answers": "x"},
    ]
    agg = ob.aggregate(rows)
    assert (agg["n"], agg["correct"], agg["errors"]) == (5, 3, 1)
    assert agg["ocrbench_score"] == pytest.approx(600.0) and agg["ocrbench_accuracy"] == pytest.approx(0.6)
    assert agg["per_category"]["Text Recognition"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert list(agg["per_category"]) == ["Text Recognition", "Scene Text-centric VQA", "Doc-oriented VQA", ob.HME_TYPE]
    assert agg["per_type"]["Digit String Recognition"]["correct"] == 0
    empty = ob.aggregate([])
    assert empty["n"] == 0 and empty["ocrbench_score"] is None


@pytest.fixture(scope="module")
def ocrbench_rows():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-data conformance needs {SHARED_DATA} (../shared/data beside the checkout)")
    return json.loads(OCRBENCH_JSON.read_text(encoding="utf-8"))


def test_real_metadata_conformance(ocrbench_rows):
    rows = ocrbench_rows
    assert len(rows) == 1000
    first = lambda a: a if isinstance(a, str) else a[0]  # noqa: E731
    # every row's own first answer, padded with text and upper-cased (not for HME), scores 1
    perfect = []
    for r in rows:
        ans = first(r["answers"])
        pred = ans.replace(" ", "") if r["dataset_name"] == "HME100k" else f"It says: {ans.upper()} ."
        perfect.append({**r, "prediction": pred})
    agg = ob.aggregate(perfect)
    assert agg["correct"] == 1000 and agg["ocrbench_score"] == 1000
    assert {k: v["n"] for k, v in agg["per_category"].items()} == ob.CATEGORIES
    assert all(agg["per_type"][t]["n"] == 50 for t in ob.TEXT_RECOGNITION_TYPES)
    # nothing predicted scores nothing
    assert ob.aggregate([{**r, "prediction": ""} for r in rows])["correct"] == 0
    # ids are not unique: scoring is by row, so duplicates do not collide
    assert len({r["id"] for r in rows}) < 1000

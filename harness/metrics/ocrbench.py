"""OCRBench v1 scoring (Yuliang-Liu/MultimodalOCR; VLMEvalKit ``OCRBench``).

A prediction scores 1 when **any** reference answer is a substring of it after both are normalised:
``lower()``, ``strip()``, newline → space; for HME100k (handwritten mathematical expressions) case is kept
and every ASCII space is removed instead (after the same strip and newline → space, so newlines go too).
This is the rule of the benchmark's own scripts (``OCRBench/scripts/*.py``) and of VLMEvalKit, which keys
the HME rule on the category name where the scripts key it on ``dataset_name == "HME100k"``; both are
accepted here. No other normalisation (no Unicode width folding, tabs kept), as there.

The benchmark reports the number of correct answers out of 1000, in five categories: "Text Recognition"
(the six "… Recognition" types of 50 rows pooled, 300), "Scene Text-centric VQA" (200), "Doc-oriented VQA"
(200), "Key Information Extraction" (200), "Handwritten Mathematical Expression Recognition" (100).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

HME_DATASET = "HME100k"
HME_TYPE = "Handwritten Mathematical Expression Recognition"

#: The six fine types reported together as "Text Recognition" (50 rows each).
TEXT_RECOGNITION_TYPES = (
    "Regular Text Recognition", "Irregular Text Recognition", "Artistic Text Recognition",
    "Handwriting Recognition", "Digit String Recognition", "Non-Semantic Text Recognition",
)
#: The reported categories, in the benchmark's order, with their full-set sizes.
CATEGORIES = {
    "Text Recognition": 300, "Scene Text-centric VQA": 200, "Doc-oriented VQA": 200,
    "Key Information Extraction": 200, HME_TYPE: 100,
}
FULL_SIZE = 1000


def category_of(type_name: str) -> str:
    """The reported category of an OCRBench ``type`` (the six recognition types → "Text Recognition")."""
    return "Text Recognition" if type_name in TEXT_RECOGNITION_TYPES else type_name


def _is_hme(dataset_name: str | None) -> bool:
    names = (HME_DATASET.lower(), HME_TYPE.lower())
    return isinstance(dataset_name, str) and dataset_name.strip().lower() in names


def _normalise(text: str, hme: bool) -> str:
    text = text.strip().replace("\n", " ")
    return text.replace(" ", "") if hme else text.lower()


def score_one(prediction: str | None, answers: str | Sequence[str] | None, dataset_name: str | None = None) -> int:
    """1 if any answer is a substring of the prediction after normalisation (module docstring), else 0.

    ``answers`` is a string or a list of strings (the JSON has both); ``dataset_name`` is the row's
    ``dataset_name`` (or its type, for VLMEvalKit rows). A missing prediction scores 0. An answer that is
    empty after normalisation matches nothing here (the reference would count it as found in any
    prediction; the real metadata has no such answer).
    """
    if not isinstance(prediction, str):
        return 0
    if isinstance(answers, str):
        answers = [answers]
    hme = _is_hme(dataset_name)
    pred = _normalise(prediction, hme)
    for answer in answers or []:
        ans = _normalise(str(answer), hme)
        if ans and ans in pred:
            return 1
    return 0


def aggregate(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals of scored rows in the benchmark's reporting.

    A row has ``type`` and either ``score`` (0/1) or ``prediction`` + ``answers`` (+ ``dataset_name``),
    scored with :func:`score_one`; a row with ``error`` (engine failure, missing image) scores 0 and is
    counted in ``errors``. Returns ``n``, ``correct``, ``errors``, ``ocrbench_score`` (correct answers scaled
    to 1000 questions, ``correct · 1000 / n``: equal to the correct count, the benchmark's "Final Score", on
    the full set), ``ocrbench_accuracy`` (``correct / n``, VLMEvalKit's "Final Score Norm" / 100),
    ``per_type`` (each fine type: ``n``, ``correct``, ``accuracy``) and ``per_category`` (the five reported
    categories, same fields). Empty input → zeros and None.
    """
    n = correct = errors = 0
    per_type: dict[str, dict[str, Any]] = {}
    per_category: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("error"):
            errors, score = errors + 1, 0
        elif row.get("score") is not None:
            score = 1 if row["score"] else 0
        else:
            name = HME_DATASET if _is_hme(row.get("type")) else row.get("dataset_name")
            score = score_one(row.get("prediction"), row.get("answers"), name)
        n, correct = n + 1, correct + score
        type_name = str(row.get("type", "unknown"))
        for table, key in ((per_type, type_name), (per_category, category_of(type_name))):
            entry = table.setdefault(key, {"n": 0, "correct": 0})
            entry["n"] += 1
            entry["correct"] += score
    for table in (per_type, per_category):
        for entry in table.values():
            entry["accuracy"] = entry["correct"] / entry["n"]
    order = list(CATEGORIES) + sorted(set(per_category) - set(CATEGORIES))
    return {
        "n": n, "correct": correct, "errors": errors,
        "ocrbench_score": correct * FULL_SIZE / n if n else None,
        "ocrbench_accuracy": correct / n if n else None,
        "per_type": dict(sorted(per_type.items())),
        "per_category": {k: per_category[k] for k in order if k in per_category},
    }

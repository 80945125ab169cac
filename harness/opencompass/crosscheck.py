"""Cross-check: OpenCompass's multiple-choice accuracy against the harness's own MCQ scoring, on the same
predictions.

The two define "the chosen option" differently where an answer is not clear: the harness
(:func:`harness.metrics.mcq.extract_choice`) returns None for an answer that names no option or several,
OpenCompass's ``OptionSimAccEvaluator`` always picks one (exact letter, first option in the text, the one
option text contained, else the option nearest in Levenshtein distance). So they are compared where both
define a choice: on the items the harness's extractor decides, the accuracy from OpenCompass's per-item
``correct`` must equal the harness's (extracted letter == gold). Items only OpenCompass decides are counted
(``oc_only``), and on random weights they are most of them: that is where the two scorings differ by design.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.metrics.mcq import extract_choice

OPTION_KEYS = [chr(ord("A") + i) for i in range(26)]


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value  # --dump-eval-details wraps items in lists


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a custom MCQ dataset file (JSONL, read as OpenCompass reads it: utf-8-sig)."""
    with open(path, encoding="utf-8-sig") as f:
        return [json.loads(line) for line in f if line.strip()]


def mcq_crosscheck(details: list[dict[str, Any]] | dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare per item: ``details`` = OpenCompass's evaluator details (``pred``, ``parsed``, ``refr``,
    ``correct``, in dataset order), ``rows`` = the dataset rows (options, ``answer``)."""
    items = list(details.values()) if isinstance(details, dict) else list(details)
    if len(items) != len(rows):
        raise ValueError(f"{len(items)} evaluator details for {len(rows)} dataset rows")
    both, oc_correct, h_correct, same_letter, oc_only = 0, 0, 0, 0, 0
    for item, row in zip(items, rows):
        options = {k: row[k] for k in OPTION_KEYS if k in row}
        pred, parsed = str(_first(item["pred"])), _first(item.get("parsed"))
        refr, correct = _first(item["refr"]), bool(_first(item["correct"]))
        if str(refr) != str(row["answer"]):
            raise ValueError(f"OpenCompass's reference {refr!r} is not the row's answer {row['answer']!r}")
        letter = extract_choice(pred, options)
        if letter is None:
            oc_only += bool(parsed)
            continue
        both += 1
        oc_correct += correct
        h_correct += letter == str(row["answer"]).strip().upper()
        same_letter += letter == parsed
    return {
        "n": len(rows), "n_both_decide": both, "n_oc_only": oc_only, "n_same_letter": same_letter,
        "oc_accuracy_on_both": 100.0 * oc_correct / both if both else None,
        "harness_accuracy_on_both": 100.0 * h_correct / both if both else None,
    }

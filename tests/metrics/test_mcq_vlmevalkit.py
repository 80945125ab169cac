"""CCBench answer extraction by VLMEvalKit's exact-matching rule (the default) beside the lenient one.

Cases follow the rule's definition (``harness/metrics/mcq.py``): option letters as whole tokens after
``.()[],:;!*#{}`` become spaces (case-sensitive, exactly one), then option texts (case-insensitive
substring, exactly one), refusal phrases and ``Z`` mean no answer; no Unicode normalisation."""

from __future__ import annotations

import math

import pytest

from harness.metrics.mcq import EXTRACTION_RULES, extract, extract_choice, extract_choice_vlmevalkit

OPTS = {"A": "故宫", "B": "天坛", "C": "Paris", "D": "长城"}

# (answer, VLMEvalKit's letter, the lenient rule's letter); None = no answer
CASES = [
    ("B", "B", "B"),
    ("(B) 天坛", "B", "B"),
    ("The answer is B.", "B", "B"),
    ("B. 天坛", "B", "B"),
    ("**B**", "B", "B"),
    ("[C]", "C", "C"),
    ("答案是B", None, "B"),              # one token: VLMEvalKit's rule does not split Chinese from the letter
    ("答案是 B", "B", "B"),
    ("Ｂ", None, "B"),                   # full width: no normalisation in VLMEvalKit
    ("（Ｂ）天坛", "B", "B"),             # no letter token, but the option text 天坛 is in the answer
    ("b", None, "B"),                    # case-sensitive letters
    ("A cat sits on the mat", "A", None),  # VLMEvalKit's known quirk: the article "A" is a letter token
    ("A or B", None, None),              # two letters: nothing (then option texts: none)
    ("I think it is paris", "C", "C"),    # option text, case-insensitive
    ("故宫和天坛都很有名", None, None),      # two option texts
    ("E", None, None),                   # not an option
    ("Z", None, None),                   # VLMEvalKit's "no answer" token
    ("Cannot determine the answer, maybe A", None, "A"),   # refusal phrase first
    ("I'm sorry, but without the image provided I would say B", None, "B"),
    ("", None, None),
]


@pytest.mark.parametrize("answer,want_vlm,want_lenient", CASES)
def test_both_rules(answer, want_vlm, want_lenient):
    assert extract_choice_vlmevalkit(answer, OPTS) == want_vlm
    assert extract(answer, OPTS) == want_vlm                       # the default rule
    assert extract(answer, OPTS, "vlmevalkit") == want_vlm
    assert extract(answer, OPTS, "lenient") == want_lenient == extract_choice(answer, OPTS)


def test_missing_options_are_not_choices():
    opts = {"A": "一", "B": "二", "C": float("nan"), "D": None}
    assert extract_choice_vlmevalkit("C", opts) is None            # NaN / None option: not a choice
    assert extract_choice_vlmevalkit("二", opts) == "B"
    assert extract_choice_vlmevalkit(None, opts) is None
    assert extract_choice_vlmevalkit("A", {}) is None
    assert math.isnan(opts["C"])


def test_unknown_rule_and_the_list():
    assert EXTRACTION_RULES == ("vlmevalkit", "lenient")
    with pytest.raises(ValueError, match="mcq_extraction"):
        extract("A", OPTS, "judge")


def test_scorer_uses_the_configured_rule():
    from types import SimpleNamespace

    from harness.datasets.base import Sample
    from harness.scoring import Scorer

    sample = Sample(uid="q", dataset="ccbench", task="mcq", content=[], images=[],
                    reference={"options": OPTS, "answer": "B", "group": "0", "category": "x"})
    base = dict(rouge_variant="reference", clip_model=None, clip_pretrained=None, embed_model=None)
    default = Scorer(SimpleNamespace(**base))
    assert default.mcq_extraction == "vlmevalkit" and default.describe()["mcq_extraction"] == "vlmevalkit"
    assert default(sample, "答案是B")["pred"] is None
    lenient = Scorer(SimpleNamespace(**base, mcq_extraction="lenient"))
    assert lenient(sample, "答案是B")["pred"] == "B" and lenient(sample, "答案是B")["correct"]
    with pytest.raises(ValueError, match="mcq_extraction"):
        Scorer(SimpleNamespace(**base, mcq_extraction="bogus"))

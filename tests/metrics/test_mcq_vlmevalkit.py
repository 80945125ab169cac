"""CCBench answer extraction by VLMEvalKit's current exact-matching rule (the default), its pre-August-2025 rule
(``vlmevalkit_2025``) and the lenient one.

Every expected letter is written by hand from the rule's definition (``harness/metrics/mcq.py``): option
letters as whole tokens after ``.()[],:;!*#{}`` become spaces (case-sensitive, exactly one; the current rule
only among the last 4 tokens), then (current rule) the first case-insensitive ``answer is X`` (X in A-D),
then option texts (case-insensitive substring, exactly one; the current rule only when the answer is at most
twice the options' total text length); refusal phrases and ``Z`` mean no answer; "Failed to obtain answer
via API" skips the letter stage (current rule); no Unicode normalisation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.metrics.mcq import (EXTRACTION_RULES, RULE_SOURCES, extract, extract_choice, extract_choice_vlmevalkit,
                                 extract_choice_vlmevalkit_2025)

OPTS = {"A": "故宫", "B": "天坛", "C": "Paris", "D": "长城"}  # 11 characters of option text: the guard is 22

# (answer, VLMEvalKit's current letter, its pre-2025-08 letter, the lenient rule's letter); None = no answer
CASES = [
    ("B", "B", "B", "B"),
    ("(B) 天坛", "B", "B", "B"),
    ("The answer is B.", "B", "B", "B"),
    ("B. 天坛", "B", "B", "B"),
    ("**B**", "B", "B", "B"),
    ("[C]", "C", "C", "C"),
    ("答案是B", None, None, "B"),              # one token: the VLMEvalKit rules do not split Chinese from the letter
    ("答案是 B", "B", "B", "B"),
    ("答案：B", None, None, "B"),              # the full-width colon is no separator there
    ("答案: B", "B", "B", "B"),
    ("Ｂ", None, None, "B"),                   # full width: no normalisation in VLMEvalKit
    ("（Ｂ）天坛", "B", "B", "B"),             # no letter token, but the option text 天坛 (5 chars <= 22)
    ("b", None, None, "B"),                    # case-sensitive letters
    # lone letter: 6 tokens, A is token 0, not among the last 4 (current); any position counted before
    ("A cat sits on the mat", None, "A", None),
    ("A or B", None, None, None),              # two letters, no "answer is", no option text
    ("I think it is paris", "C", "C", "C"),    # option text, case-insensitive (19 chars <= 22)
    ("故宫和天坛都很有名", None, None, None),      # two option texts
    ("E", None, None, None),                   # not an option
    ("Z", None, None, None),                   # VLMEvalKit's "no answer" token
    ("Cannot determine the answer, maybe A", None, None, "A"),   # refusal phrase first
    ("I'm sorry, but without the image provided I would say B", None, None, "B"),
    ("", None, None, None),
]

# The four rules the current source added, each on its own (answer, options, current, 2025).
OPTS_2 = {"A": "竹简", "B": "宣纸"}  # CCBench-like, 2 options, 4 characters: the guard is 8
OPTS_3 = {"A": "毛笔", "B": "宣纸", "C": "砚台"}  # 6 characters: the guard is 12
FOUR_RULES = [
    # 1. length guard of the option-text stage: 11 characters > 2 x 4
    ("正确答案是：B. 宣纸", OPTS_2, None, "B"),
    ("宣纸", OPTS_2, "B", "B"),                      # 2 <= 8: still read
    ("我选宣纸", OPTS_2, "B", "B"),                  # 4 <= 8
    ("这幅画用的是宣纸", OPTS_2, "B", "B"),            # 8 <= 8: the guard is "longer than", not "as long as"
    ("这幅画用的应该是宣纸", OPTS_2, None, "B"),          # 10 > 8
    ("图中的文房用品是砚台。", OPTS_3, "C", "C"),          # 11 <= 12
    ("图中的文房用品应当是砚台。", OPTS_3, None, "C"),       # 13 > 12
    # 2. a lone letter counts only among the last 4 tokens (its first occurrence)
    ("B is right", OPTS_3, "B", "B"),                # 3 tokens
    ("B is the right one", OPTS_3, None, "B"),       # 5 tokens, B first: then no "answer is", 18 > 12
    ("I would pick B here", OPTS_3, "B", "B"),       # 5 tokens, B is token 3 of 0..4
    ("I would pick B over here", OPTS_3, "B", "B"),  # 6 tokens, B is token 3: tokens 2..5 count
    ("I would pick B over all the others", OPTS_3, None, "B"),  # 8 tokens, B is token 3: only 4..7 count
    ("选项 B 宣纸 是 对 的", OPTS_3, None, "B"),        # 6 tokens, B is token 1; then 13 characters > 12
    ("B 宣纸 是 对 的", OPTS_3, "B", "B"),             # 5 tokens, B is token 0 (not in 1..4); then the text 宣纸 (10 <= 12)
    ("B 是 对 的 吧", OPTS_3, None, "B"),              # the same without the option text
    # 3. "answer is X", case-insensitive, X in A-D (June 2026)
    ("The answer is B, not A.", OPTS_3, "B", None),  # two letters: the pattern decides
    ("the answer is b", OPTS_3, "B", None),          # "b" is no letter token; the pattern reads it in any case
    ("The correct ANSWER IS **C** because the ink stone grinds the ink", OPTS_3, "C", "C"),  # C token 4 of 12
    ("My answer is A or B", OPTS_3, "A", None),      # two letter tokens, the pattern takes the first after "is"
    ("The answer is Beijing", OPTS_3, "B", None),    # nothing is required after the letter
    ("The answer is D", OPTS_3, None, None),         # D is not an option here (and the only token D: not one)
    ("answer: B", OPTS_3, "B", "B"),                 # plain letter token; "answer:" is no "answer is"
    # 4. "Failed to obtain answer via API" skips the letter stage; the option-text stage still runs
    ("Failed to obtain answer via API. B", OPTS_3, None, "B"),
    ("Failed to obtain answer via API", {"A": "via API", "B": "some option text longer than this"}, "A", "A"),
]


@pytest.mark.parametrize("answer,want_vlm,want_2025,want_lenient", CASES)
def test_three_rules(answer, want_vlm, want_2025, want_lenient):
    assert extract_choice_vlmevalkit(answer, OPTS) == want_vlm
    assert extract(answer, OPTS) == want_vlm                       # the default rule
    assert extract(answer, OPTS, "vlmevalkit") == want_vlm
    assert extract(answer, OPTS, "vlmevalkit_2025") == want_2025 == extract_choice_vlmevalkit_2025(answer, OPTS)
    assert extract(answer, OPTS, "lenient") == want_lenient == extract_choice(answer, OPTS)


@pytest.mark.parametrize("answer,options,want_vlm,want_2025", FOUR_RULES)
def test_the_four_rules_of_the_current_source(answer, options, want_vlm, want_2025):
    assert extract(answer, options, "vlmevalkit") == want_vlm
    assert extract(answer, options, "vlmevalkit_2025") == want_2025


def test_the_issues_examples():
    assert extract("正确答案是：B. 宣纸", OPTS_2) is None and extract("正确答案是：B. 宣纸", OPTS_2, "vlmevalkit_2025") == "B"
    assert extract("The answer is B, not A.", OPTS_2) == "B"
    assert extract("The answer is B, not A.", OPTS_2, "vlmevalkit_2025") is None


def test_refusal_stops_before_the_text_stage_and_api_failure_does_not():
    opts = {"A": "Cannot determine the answer", "B": "x" * 40}
    assert extract("Cannot determine the answer", opts) is None  # refusal: Z, the matching option text is not read
    opts = {"A": "Failed to obtain answer via API", "B": "x" * 40}
    assert extract("Failed to obtain answer via API", opts) == "A"


def test_revisions_are_named():
    src = RULE_SOURCES["vlmevalkit"]
    assert (src["repo"], src["commit"][:12], src["date"]) == ("open-compass/VLMEvalKit", "2cf2a36c6e79", "2026-06-25")
    assert RULE_SOURCES["vlmevalkit_2025"]["commit"].startswith("aca64dbb3113") and RULE_SOURCES["lenient"] is None


def test_missing_options_are_not_choices():
    opts = {"A": "一", "B": "二", "C": float("nan"), "D": None}
    assert extract_choice_vlmevalkit("C", opts) is None            # NaN / None option: not a choice
    assert extract_choice_vlmevalkit("二", opts) == "B"
    assert extract_choice_vlmevalkit(None, opts) is None
    assert extract_choice_vlmevalkit("A", {}) is None
    for rule in ("vlmevalkit_2025", "vlmevalkit"):
        assert extract("C", opts, rule) is None and extract("二", opts, rule) == "B"
    assert math.isnan(opts["C"])


def test_unknown_rule_and_the_list():
    assert EXTRACTION_RULES == ("vlmevalkit", "vlmevalkit_2025", "lenient")
    with pytest.raises(ValueError, match="mcq_extraction"):
        extract("A", OPTS, "judge")


def test_scorer_uses_the_configured_rule():
    from types import SimpleNamespace

    from harness.datasets.base import Sample
    from harness.metrics.scoring import Scorer

    sample = Sample(uid="q", dataset="ccbench", task="mcq", content=[], images=[],
                    reference={"options": OPTS, "answer": "B", "group": "0", "category": "x"})
    base = dict(rouge_variant="reference", clip_model=None, clip_pretrained=None, embed_model=None)
    default = Scorer(SimpleNamespace(**base))
    assert default.mcq_extraction == "vlmevalkit" and default.describe()["mcq_extraction"] == "vlmevalkit"
    assert default(sample, "答案是B")["pred"] is None
    lenient = Scorer(SimpleNamespace(**base, mcq_extraction="lenient"))
    assert lenient(sample, "答案是B")["pred"] == "B" and lenient(sample, "答案是B")["correct"]
    old = Scorer(SimpleNamespace(**base, mcq_extraction="vlmevalkit_2025"))
    assert old(sample, "The answer is B, not A.")["pred"] is None and default(sample, "The answer is B, not A.")["pred"] == "B"
    assert old.describe()["mcq_extraction_source"]["commit"].startswith("aca64dbb3113")
    assert old.describe()["departures"] == ["scoring.mcq_extraction=vlmevalkit_2025"]
    assert default.describe()["mcq_extraction_source"]["commit"].startswith("2cf2a36c6e79")
    with pytest.raises(ValueError, match="mcq_extraction"):
        Scorer(SimpleNamespace(**base, mcq_extraction="bogus"))


# ------------------------------------------------------------------------ generated answers: how often the rules differ

_EN_TEXTS = ["a red lantern", "the Forbidden City", "Paris", "bamboo slips", "a calligraphy brush", "ink stone",
             "the Great Wall", "silk", "porcelain", "tea", "a dragon boat", "paper cutting"]
_CN_TEXTS = ["宣纸", "竹简", "毛笔", "砚台", "故宫", "天坛", "长城", "京剧脸谱", "青花瓷", "剪纸", "龙舟", "中秋节",
             "端午节", "春联", "太极拳", "兵马俑"]
_FILLERS = ["", "I think ", "Looking at the image, ", "根据图片，", "我认为", "Based on the picture the ",
            "Hmm. ", "这个问题中", "Clearly ", "从画面上看，"]
_TAILS = ["", ".", "。", " because it is typical of the period.", "，因为它是传统的。", " (see the left side)",
          " is the best match here, as the style shows.", "，其他选项都不对。", "!", " not the others"]
_TEMPLATES = [
    "{L}", "({L})", "{L}.", "**{L}**", "{L}. {T}", "{L} {T}", "{F}{L}{E}", "{F}the answer is {L}{E}",
    "The answer is {L}, not {M}.", "answer is {l}", "{F}{T}{E}", "{T}", "答案是{L}", "答案：{L}", "答案: {L}",
    "正确答案是：{L}. {T}", "选{L}", "{F}选项{L}{E}", "{L} or {M}", "{L} and {M} both look right", "Option {L}: {T}{E}",
    "{L} is correct{E}", "I choose {L} over {M}{E}", "The correct answer is **{L}**{E}",
    "Failed to obtain answer via API", "Failed to obtain answer via API {L}", "Cannot determine the answer",
    "{F}{T} and {U}{E}", "A{E}", "Z", "{l}", "Ｂ", "（{L}）{T}", "{F}{L}{E} {F}{T}",
]


def generated_answers(seed: int, n: int, chinese: bool) -> list[tuple[str, dict[str, str]]]:
    """``n`` (answer, options) pairs from the templates above: English options (4) or CCBench-like Chinese
    options (2-4), answers short and long, with letters, option texts, refusals and API failures."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(2, 4) if chinese else 4
        texts = rng.sample(_CN_TEXTS if chinese else _EN_TEXTS, k)
        opts = dict(zip("ABCD", texts))
        letters = list(opts)
        L, M = rng.choice(letters), rng.choice(letters)
        T, U = opts[L], opts[M]
        answer = rng.choice(_TEMPLATES).format(L=L, M=M, l=L.lower(), T=T, U=U, F=rng.choice(_FILLERS),
                                               E=rng.choice(_TAILS))
        out.append((answer, opts))
    return out


def _disagreements(pairs, a: str, b: str) -> int:
    return sum(extract(ans, opts, a) != extract(ans, opts, b) for ans, opts in pairs)


def test_generated_answers_where_the_current_rule_and_the_2025_rule_differ():
    """The before/after count of the rule change on 20,000 generated answers of each kind (the closing note of
    issue 30 quotes these): the current rule reads differently from the 2025 one on a fixed, pinned share."""
    english, chinese = generated_answers(0, 20_000, False), generated_answers(1, 20_000, True)
    counts = (_disagreements(english, "vlmevalkit", "vlmevalkit_2025"),
              _disagreements(chinese, "vlmevalkit", "vlmevalkit_2025"))
    assert counts == EXPECTED_DISAGREEMENTS, counts


EXPECTED_DISAGREEMENTS = (2555, 4006)  # of 20,000 each; the current rule = VLMEvalKit 2cf2a36c on all 40,000 (checked outside the suite)


@settings(max_examples=80, deadline=None)
@given(pred=st.one_of(st.none(), st.text(max_size=40), st.sampled_from([a for a, _, _, _ in CASES])),
       options=st.dictionaries(st.sampled_from(list("ABCDEab1")),
                               st.one_of(st.none(), st.text(max_size=6), st.floats(), st.integers()), max_size=5))
def test_vlmevalkit_rules_never_raise_and_answer_an_option(pred, options):
    for rule in ("vlmevalkit", "vlmevalkit_2025"):
        got = extract(pred, options, rule)
        assert got is None or (got in options and got.isupper())

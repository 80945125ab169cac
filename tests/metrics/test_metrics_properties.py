"""Property tests: no scoring function raises on arbitrary strings and lists, and scores stay in range."""

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.metrics import latency as lt
from harness.metrics import mcq
from harness.metrics import ocrbench as ob
from harness.metrics import rag_igbench as rb
from harness.metrics import rag_igbench_answer as ra

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FRAGMENTS = st.sampled_from([
    "![](IMG#1)", "![图](IMG#2)", "![x](IMG#0)", "![](IMG#37)", "<sup>[1](DOC#1)</sup>", "我爱北京天安门", "的",
    "Hello World", "3.5", "，", "。", "\n", " ", '"', "'", "{", "}", "```json", "```", '"answer": "', ",", "\\",
    "ＡＢＣ", "答案是B", "IMG#", "![", "](",
])
MARKDOWN = st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=14).map("".join)
IDS = st.lists(st.integers(min_value=-3, max_value=60), max_size=10)
BIG_IDS = st.lists(st.integers(), max_size=6)
N = st.one_of(st.none(), st.integers(min_value=-5, max_value=80))


@st.composite
def raw_answers(draw):
    """Model outputs: arbitrary text, markdown, or JSON-ish with an answer, possibly cut or fenced."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.text(max_size=40))
    if kind == 1:
        return draw(MARKDOWN)
    obj = json.dumps({"reason": draw(st.text(max_size=5)), "answer": draw(MARKDOWN)}, ensure_ascii=draw(st.booleans()))
    if kind == 2:
        return obj[: draw(st.integers(0, len(obj)))]
    return f"```json\n{obj}\n```"


@SETTINGS
@given(raw=raw_answers(), ref=MARKDOWN, n=N)
def test_rag_igbench_never_raises(raw, ref, n):
    answer = ra.parse_answer(raw)
    assert answer is None or isinstance(answer, str)
    for md in (raw, ref, answer):
        ra.image_ids(md)
        ra.clean_text(md)
        ra.image_contexts(md)
        ra.image_contexts(md, window=3, unique=False)
    for variant in ("reference", "rouge_score"):
        assert 0.0 <= rb.rouge1(raw, ref, variant) <= 1.0 + 1e-9
    s = rb.score_sample(raw, ref, n)
    for m in ("rouge1", "edit_score", "kendall"):
        assert 0.0 <= s[m] <= 1.0 + 1e-9
    agg = rb.aggregate([s, s, {"error": "x"}])
    assert agg["n_samples"] == 3


@SETTINGS
@given(pred=IDS, ref=IDS, n=N, big=BIG_IDS)
def test_image_list_scores_in_range(pred, ref, n, big):
    assert 0.0 <= rb.edit_score(pred, ref) <= 1.0
    assert 0.0 <= rb.edit_score(big, pred) <= 1.0
    for variant in ("reference", "paper", "scipy_tau_b"):
        assert 0.0 <= rb.kendall_score(pred, ref, n, variant=variant) <= 1.0 + 1e-9
        assert 0.0 <= rb.kendall_score(big, ref, n, variant=variant) <= 1.0 + 1e-9
    if pred:
        assert rb.edit_score(pred, pred) == 1.0


@SETTINGS
@given(pred=st.one_of(st.none(), st.text(max_size=30)),
       answers=st.one_of(st.none(), st.text(max_size=10), st.lists(st.text(max_size=10), max_size=3)),
       name=st.one_of(st.none(), st.sampled_from(["HME100k", "IIIT5K", ob.HME_TYPE]), st.text(max_size=5)))
def test_ocrbench_never_raises(pred, answers, name):
    assert ob.score_one(pred, answers, name) in (0, 1)
    ob.aggregate([{"type": str(name), "prediction": pred, "answers": answers, "dataset_name": name}])


@SETTINGS
@given(pred=st.one_of(st.none(), st.text(max_size=30), FRAGMENTS),
       options=st.dictionaries(st.sampled_from(list("ABCDEab1")),
                               st.one_of(st.none(), st.text(max_size=6), st.floats()), max_size=5))
def test_extract_choice_never_raises(pred, options):
    got = mcq.extract_choice(pred, options)
    assert got is None or (got in {str(k).upper() for k in options})
    mcq.circular_accuracy([{"group": 1, "category": "c", "pred": got, "gold": "A"}])


NUMBER = st.one_of(st.none(), st.floats(), st.integers(-5, 10**6), st.text(max_size=3))


@SETTINGS
@given(records=st.lists(st.fixed_dictionaries({}, optional={
    "ttft_ms": NUMBER, "e2e_ms": NUMBER, "tpot_ms": NUMBER, "output_tokens": NUMBER,
    "itl_ms": st.one_of(st.none(), st.lists(NUMBER, max_size=3)), "error": st.one_of(st.none(), st.text(max_size=3)),
}), max_size=6), duration=NUMBER)
# found by CI: two finite token counts whose sum overflows to inf
@example(records=[{"output_tokens": 8.98846567431158e+307}, {"output_tokens": 8.988465674311579e+307}], duration=None)
def test_latency_never_raises(records, duration):
    s = lt.latency_summary(records, duration)
    assert s["n_requests"] == len(records) and s["completed"] + s["failed"] == len(records)
    lt.summarize(v for r in records for v in r.values() if not isinstance(v, list))

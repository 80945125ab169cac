"""RAG-IGBench answer reading: the ``answer`` markdown out of a model's raw (often malformed) JSON, and the image
numbers, Rouge text and image contexts out of that markdown (harness/metrics/rag_igbench_answer.py)."""

import pytest

from harness.metrics import rag_igbench as rb
from harness.metrics import rag_igbench_answer as ra


# ------------------------------------------------------------------------------------------ answer parsing

@pytest.mark.parametrize(
    "raw, expected",
    [
        ('{"reason": "r", "category": "c", "answer": "文字 ![](IMG#1)"}', "文字 ![](IMG#1)"),
        ('```json\n{"reason": "r", "answer": "a ![](IMG#2)"}\n```', "a ![](IMG#2)"),
        ('{"answer": "x",}', "x"),  # trailing comma
        ('{"reason": "r", "answer": "y", "category": ["a", "b",],}', "y"),
        ("{'reason': 'r', 'answer': 'single quotes'}", "single quotes"),
        ('{"answer": "line one\nline two"}', "line one\nline two"),  # unescaped newline
        ('Here you go:\n{"answer": "around"}\nHope it helps.', "around"),  # text around the object
        ('{"answer": "他说"好"的", "category": "x"}', '他说"好"的'),  # unescaped inner quotes
        ('{"answer":"no space"}', "no space"),
        ('{"reason": "r", "answer": "cut by the token limit ![](IMG#3) and', "cut by the token limit ![](IMG#3) and"),
        ('{"answer": "a \\"quoted\\" word"}', 'a "quoted" word'),
        ('{"answer": "code ```py\\nx\\n``` kept"}', "code ```py\nx\n``` kept"),
        ('{"answer": ""}', ""),
    ],
)
def test_parse_answer_repairs(raw, expected):
    assert ra.parse_answer(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        None, "", "   ", "plain markdown ![](IMG#1) without JSON", '{"reason": "r", "category": "c"}',
        '{"answer": null}', '{"answer": 3}', '{"answer": ["a"]}', '{"result": {"answer": "nested"}}', "{", "}{",
    ],
)
def test_parse_answer_invalid_is_none(raw):
    assert ra.parse_answer(raw) is None


# ----------------------------------------------------------------------------------------------- markdown

MD = "开头<sup>[1](DOC#1)</sup>第一张图在这里![图一](IMG#3)后面是描述文字很多很多很多。然后![](IMG#5)结尾![](IMG#3)"


def test_image_ids_in_order_with_repeats():
    assert ra.image_ids(MD) == [3, 5, 3]
    assert ra.image_ids("![](IMG#12)![x](IMG#1) IMG#7 ![](img#2)") == [12, 1]
    assert ra.image_ids("") == [] and ra.image_ids(None) == []


def test_clean_text_removes_citations_and_images():
    assert ra.clean_text(MD) == "开头第一张图在这里后面是描述文字很多很多很多。然后结尾"
    assert ra.clean_text("  <sup>[2](DOC#2)</sup> ![](IMG#1)  ") == ""


def test_image_contexts_window_and_uniqueness():
    text = "0123456789abcdefghijKLMNOPQRST![](IMG#1)uvwxyzUVWXYZ9876543210tail"
    ((k, ctx),) = ra.image_contexts(text)
    assert k == 1 and ctx == "abcdefghijKLMNOPQRST" + "uvwxyzUVWXYZ98765432"
    assert ctx[: rb.CLIP_TEXT_CHARS] == "abcdefghijKLMNOPQRSTuvwxy"  # what CLIP reads
    assert ra.image_contexts(text, window=3) == [(1, "RSTuvw")]
    # citations are removed before the window is taken; whole image tags inside the window are removed
    assert ra.image_contexts("ab<sup>[1](DOC#1)</sup>![](IMG#2)![](IMG#4)cd", window=20) == [(2, "abcd"), (4, "abcd")]
    # unique: first-appearance order, context of the last occurrence (the reference's dict)
    both = ra.image_contexts("AAAA![](IMG#1)BBBB ... CCCC![](IMG#2)DDDD ... EEEE![](IMG#1)FFFF", window=4)
    assert both == [(1, "EEEEFFFF"), (2, "CCCCDDDD")]
    every = ra.image_contexts("AAAA![](IMG#1)BBBB ... CCCC![](IMG#2)DDDD ... EEEE![](IMG#1)FFFF", window=4,
                              unique=False)
    assert [k for k, _ in every] == [1, 2, 1]

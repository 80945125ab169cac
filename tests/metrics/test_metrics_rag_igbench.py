"""RAG-IGBench text and image-list metrics: known answers from the definitions, and bad inputs."""

import math

import pytest

from harness.metrics import rag_igbench as rb
from harness.metrics import rag_igbench_words as rw


# ------------------------------------------------------------------------------------------------ Rouge-1

def test_rouge1_known_answer_by_hand():
    # jieba: 我/喜欢/北京/的/天安门 and 我/爱/北京/天安门; stopwords 我, 的
    assert rw.words("我喜欢北京的天安门") == ["喜欢", "北京", "天安门"]
    assert rw.words("我爱北京天安门") == ["爱", "北京", "天安门"]
    # sets {喜欢, 北京, 天安门} vs {爱, 北京, 天安门}: overlap 2 → F1 = 2·2/(3+3)
    assert rb.rouge1("我喜欢北京的天安门", "我爱北京天安门") == pytest.approx(2 / 3)


def test_rouge1_reference_variant_uses_sets():
    base = rb.rouge1("我喜欢北京的天安门", "我爱北京天安门")
    assert rb.rouge1("我喜欢北京北京北京的天安门", "我爱北京天安门") == base
    # Google's rouge-score counts: pred 喜欢 北京×3 天安门 (5) vs 3 words, clipped overlap 2
    p, r = 2 / 5, 2 / 3
    assert rb.rouge1("我喜欢北京北京北京的天安门", "我爱北京天安门", variant="rouge_score") == pytest.approx(
        2 * p * r / (p + r))
    assert rb.rouge1("我喜欢北京的天安门", "我爱北京天安门", variant="rouge_score") == pytest.approx(base)


def test_rouge1_edge_cases():
    assert rb.rouge1("", "我爱北京天安门") == 0.0
    assert rb.rouge1("我爱北京天安门", "") == 0.0
    assert rb.rouge1("", "") == 0.0
    assert rb.rouge1("的了，。", "我爱北京") == 0.0  # only stopwords left nothing
    assert rb.rouge1(None, None) == 0.0
    assert rb.rouge1("我爱北京天安门", "我爱北京天安门") == pytest.approx(1.0)


def test_rouge1_mixed_and_full_width():
    # mixed Chinese/English: English words are words, case kept, "." splits like the rouge package
    assert rw.words("使用 Python 3.5 版本") == ["使用", "Python", "3", "5", "版本"]
    assert rw.words("我用Python写代码") == ["我用", "Python", "写", "代码"]
    # the public list (the default) removes 好 too; the project's list keeps it
    assert rw.words("Python 很好用") == ["Python"] and rw.words("python 很好用") == ["python"]
    assert rb.rouge1("Python 很好用", "python 很好用") == 0.0  # case kept: nothing shared
    project = rw.PROJECT_STOPWORDS
    assert rw.words("Python 很好用", project) == ["Python", "好"] and rw.words("python 很好用", project) == ["python", "好"]
    assert rb.rouge1("Python 很好用", "python 很好用", stopwords=project) == pytest.approx(2 * 1 / (2 + 2))  # only 好
    # full-width characters are not folded (as in the reference): Ａ ≠ A
    assert rb.rouge1("ＡＢＣ", "ABC") == 0.0


def test_rouge1_custom_stopwords_and_unknown_variant(tmp_path):
    path = tmp_path / "stop.txt"
    path.write_text("北京\n", encoding="utf-8")
    assert rw.words("我爱北京", stopwords=path) == ["我", "爱"]
    assert rw.words("我爱北京", stopwords={"我"}) == ["爱", "北京"]
    with pytest.raises(ValueError):
        rb.rouge1("a", "a", variant="nope")


def test_default_stopword_file_is_shipped():
    stop = rw.load_stopwords()
    assert {"的", "了", "，", "。", "我"} <= stop and len(stop) > 300
    assert not any(w.startswith("# ") for w in stop)


# ------------------------------------------------------------------------------------ edit and Kendall

def test_worked_example_from_the_definitions():
    assert rb.kendall_score([1, 2, 4], [1, 2, 3]) == pytest.approx(1 / 3)
    assert rb.edit_score([1, 2, 4], [1, 2, 3]) == pytest.approx(2 / 3)


def test_reversed_order_scores_zero():
    assert rb.kendall_score([3, 2, 1], [1, 2, 3]) == 0.0
    assert rb.edit_score([3, 2, 1], [1, 2, 3]) == pytest.approx(1 / 3)


def test_kendall_scaling_perfect_answer():
    # (1 + 0.5·(10 − 3)/10) / 1.5 = 1.35 / 1.5
    assert rb.kendall_score([1, 2, 3], [1, 2, 3], n_candidates=10) == pytest.approx(0.9)
    assert rb.kendall_score([1, 2, 3], [1, 2, 3]) == 1.0
    assert rb.kendall_scale(1.0, 3, 3) == pytest.approx(1 / 1.5)
    assert rb.kendall_scale(0.6, None, 3) == 0.6 and rb.kendall_scale(0.6, 0, 3) == 0.6


def test_kendall_single_item_rules():
    assert rb.kendall_score([1, 2, 3], [2]) == pytest.approx(1 / 3)  # reference has one: |shared|/|model|
    assert rb.kendall_score([2], [1, 2, 3, 4]) == pytest.approx(1 / 4)  # model has one: |shared|/|ref|
    assert rb.kendall_score([5], [1, 2]) == 0.0


def test_kendall_variants():
    # model [1, 5, 3, 2] vs [1, 2, 3]: shared [1, 3, 2], concordant 2 of 3 shared pairs, of 6 model pairs
    assert rb.kendall_score([1, 5, 3, 2], [1, 2, 3]) == pytest.approx(2 / 6)
    assert rb.kendall_score([1, 5, 3, 2], [1, 2, 3], variant="paper") == pytest.approx(2 / 3)
    # τ-b over shared positions (0,1,2) vs (0,2,1): (2 − 1)/3 = 1/3 → (1/3 + 1)/2
    assert rb.kendall_score([1, 5, 3, 2], [1, 2, 3], variant="scipy_tau_b") == pytest.approx(2 / 3)
    assert rb.kendall_score([3, 2, 1], [1, 2, 3], variant="scipy_tau_b") == 0.0
    assert rb.kendall_score([1, 9], [1, 2], variant="paper") == 0.0  # one shared image: no pair
    with pytest.raises(ValueError):
        rb.kendall_score([1], [1], variant="nope")


def test_image_list_edge_cases():
    # both empty: defined as 1.0 (identical lists; the reference divides by zero)
    assert rb.edit_score([], []) == 1.0 and rb.kendall_score([], []) == 1.0
    assert rb.kendall_score([], [], n_candidates=10) == 1.0
    # model placed nothing
    assert rb.edit_score([], [1, 2]) == 0.0 and rb.kendall_score([], [1, 2]) == 0.0
    # reference has no image, model placed some
    assert rb.edit_score([1], []) == 0.0 and rb.kendall_score([1], []) == 0.0
    assert rb.kendall_score([1, 2], []) == 0.0
    assert rb.edit_score(None, None) == 1.0
    # repeated ids are ordinary elements; equal positions are not concordant
    assert rb.edit_score([1, 1, 2], [1, 2]) == pytest.approx(2 / 3)
    assert rb.kendall_score([1, 1], [1, 2]) == 0.0
    assert rb.kendall_score([1, 1, 2], [1, 2]) == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------- maps and mean

def test_maps_are_exact_linear_clips():
    assert rb.clip_map(0.1) == 0.0 and rb.clip_map(0.4) == 1.0
    assert rb.clip_map(0.25) == pytest.approx(0.5) and rb.clip_map(0.0) == 0.0 and rb.clip_map(0.9) == 1.0
    assert rb.align_map(0.7) == 0.0 and rb.align_map(1.0) == 1.0
    assert rb.align_map(0.85) == pytest.approx(0.5) and rb.align_map(-1) == 0.0 and rb.align_map(1.2) == 1.0
    assert rb.clip_map(math.nan) == 0.0


def test_comprehensive_gpt4o_check():
    assert round(rb.comprehensive(57.42, 51.28, 46.50, 38.81, 36.04), 2) == 46.01


# ---------------------------------------------------------------------------------------- score_sample

GOOD = '{"reason": "r", "category": "c", "answer": "我喜欢北京![](IMG#1)的天安门![](IMG#2)"}'
REF = "我爱北京![](IMG#1)天安门![](IMG#2)"


def test_score_sample_valid():
    s = rb.score_sample(GOOD, REF, 10)
    assert s["rouge1"] == pytest.approx(2 / 3)
    assert s["edit_score"] == 1.0 and s["kendall"] == pytest.approx((1 + 0.5 * 8 / 10) / 1.5)
    assert s["alignment"] is None and s["clip_score"] is None
    assert not s["format_invalid"] and not s["hallucinated_image"] and s["error"] is None and s["reason"] is None
    assert s["pred_image_ids"] == [1, 2] and s["ref_image_ids"] == [1, 2]


@pytest.mark.parametrize(
    "raw, n, flag",
    [
        ("not json at all", 10, "format_invalid"),
        ('{"reason": "no answer field"}', 10, "format_invalid"),
        ('{"answer": "beyond ![](IMG#11)"}', 10, "hallucinated_image"),
        ('{"answer": "zero ![](IMG#0)"}', None, "hallucinated_image"),  # image_zero="hallucination" (the default
        # scores IMG#0 as the public scorer does: tests/metrics/test_scoring_conformance.py)
        (None, 10, "error"),
    ],
)
def test_score_sample_invalid_scores_zero(raw, n, flag):
    s = rb.score_sample(raw, REF, n, image_zero="hallucination")
    assert s["rouge1"] == s["edit_score"] == s["kendall"] == 0.0
    assert s["reason"]
    assert (s["format_invalid"], s["hallucinated_image"], s["error"] is not None) == (
        flag == "format_invalid", flag == "hallucinated_image", flag == "error")


def test_score_sample_edge_answers():
    # empty answer text with no image vs a reference with images
    s = rb.score_sample('{"answer": ""}', REF, 10)
    assert not s["format_invalid"] and s["rouge1"] == 0.0 and s["edit_score"] == 0.0 and s["kendall"] == 0.0
    # empty reference: both image lists empty → edit/Kendall 1.0, Rouge 0.0
    s = rb.score_sample('{"answer": ""}', "", 10)
    assert (s["rouge1"], s["edit_score"], s["kendall"]) == (0.0, 1.0, 1.0)
    s = rb.score_sample('{"answer": "x ![](IMG#1)![](IMG#1)"}', None, 3)
    assert s["ref_image_ids"] == [] and s["kendall"] == 0.0 and s["edit_score"] == 0.0
    s = rb.score_sample(GOOD, REF, 10, error="engine timeout")
    assert s["error"] == "engine timeout" and s["rouge1"] == 0.0


def test_score_sample_clip_needs_images():
    with pytest.raises(ValueError):
        rb.score_sample(GOOD, REF, 10, clip=lambda ims, texts: [0.3] * len(ims))


def test_score_sample_with_fake_encoders_and_missing_image(tmp_path):
    def fake_clip(images, texts):
        return [0.25] * len(images)  # → 0.5 each

    def fake_embed(texts):
        return [[1.0, 0.0]] * len(texts)  # identical → cosine 1 → 1.0

    images = [object(), object()] + [None] * 8  # not paths: handed to the scorer as they are
    s = rb.score_sample(GOOD, REF, 10, candidate_images=images, clip=fake_clip, embed=fake_embed)
    assert s["clip_score"] == pytest.approx(0.5) and s["alignment"] == pytest.approx(1.0) and s["error"] is None
    missing = rb.score_sample('{"answer": "x ![](IMG#3)"}', REF, 10, candidate_images=images, clip=fake_clip,
                              embed=fake_embed)
    assert missing["error"] and "IMG#3" in missing["error"] and missing["clip_score"] == 0.0
    path = rb.score_sample('{"answer": "x ![](IMG#1)"}', REF, 2, candidate_images=[str(tmp_path / "gone.jpg")] * 2,
                           clip=fake_clip)  # 2 candidates: REF places IMG#2, a valid reference
    assert path["error"].startswith("FileNotFoundError")
    invalid = rb.score_sample("bad", REF, 10, candidate_images=images, clip=fake_clip, embed=fake_embed)
    assert invalid["clip_score"] == 0.0 and invalid["alignment"] == 0.0


# --------------------------------------------------------------------------------------------- aggregate

def test_aggregate_counts_invalid_as_zero():
    good = rb.score_sample(GOOD, REF, 10)
    rows = [good, rb.score_sample("bad", REF, 10), rb.score_sample('{"answer": "![](IMG#99)"}', REF, 10),
            {"error": "engine failed"}]
    agg = rb.aggregate(rows)
    assert (agg["n_samples"], agg["n_scored"], agg["format_invalid"], agg["hallucinated_image"], agg["errors"]) == (
        4, 1, 1, 1, 1)
    assert agg["format_invalid_rate"] == 0.25
    assert agg["rouge1"] == pytest.approx(good["rouge1"] / 4)
    assert agg["rouge1_valid_only"] == pytest.approx(good["rouge1"])
    assert agg["edit_score_valid_only"] == 1.0 and agg["edit_score"] == 0.25
    assert "alignment" not in agg and "comprehensive" not in agg


def test_aggregate_comprehensive_and_public_integrated():
    rows = [
        {"rouge1": 0.5, "edit_score": 1.0, "kendall": 0.9, "alignment": 0.2, "clip_score": 0.4},
        {"rouge1": 0.3, "edit_score": 0.0, "kendall": 0.1, "alignment": 0.6, "clip_score": 0.0},
        {"format_invalid": True, "rouge1": 0.0, "edit_score": 0.0, "kendall": 0.0, "alignment": 0.0, "clip_score": 0.0},
    ]
    agg = rb.aggregate(rows)
    means_valid = {"rouge1": 0.4, "edit_score": 0.5, "kendall": 0.5, "alignment": 0.4, "clip_score": 0.2}
    for m, v in means_valid.items():
        assert agg[f"{m}_valid_only"] == pytest.approx(v)
        assert agg[m] == pytest.approx(v * 2 / 3)
    assert agg["comprehensive_valid_only"] == pytest.approx(sum(means_valid.values()) / 5)
    assert agg["comprehensive"] == pytest.approx(sum(means_valid.values()) / 5 * 2 / 3)
    assert agg["public_integrated_valid_only"] == pytest.approx((2 * 0.4 + 0.5 + 0.5 + 0.2) / 5)


def test_aggregate_empty_and_all_invalid():
    agg = rb.aggregate([])
    assert agg["n_samples"] == 0 and agg["format_invalid_rate"] is None and "rouge1" not in agg
    agg = rb.aggregate([rb.score_sample("bad", REF, 3)])
    assert agg["rouge1"] == 0.0 and agg["rouge1_valid_only"] is None and agg["n_scored"] == 0

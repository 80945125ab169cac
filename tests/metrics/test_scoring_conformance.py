"""Issue 30: the defaults reproduce the public scorers' figures, every departure is one named option, recorded in
``summary.json`` ``run.scoring`` (docs/scoring.md, "Conformance").

RAG-IGBench: the public stopword list is shipped byte for byte and is the default; a reference that places an
image outside the candidates is scored as the public scorer scores it (``scoring.reference_faults=score``) and
counted, or is an error (``error``). Expected values are written by hand from the definitions; the generated
samples at the end measure how often each option changes a score (the closing note's before/after counts).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.metrics import rag_igbench as rb
from harness.metrics import rag_igbench_answer as ra
from harness.metrics import rag_igbench_words as rw

CONF = Path(__file__).resolve().parents[2] / "harness/conf"


@pytest.fixture
def compose_cfg():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides=(): compose(config_name="config", overrides=list(overrides))
    GlobalHydra.instance().clear()

# --------------------------------------------------------------------------------------------- stopwords


def test_the_public_list_is_shipped_unmodified_and_read_verbatim():
    with open(rw.PUBLIC_STOPWORDS, "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == rb.PUBLIC_SCORER_REVISION["stopwords_sha256"]
    # the public scorer's reading: set(file.read().splitlines()), nothing dropped or stripped
    assert rw.load_stopwords() == rw.resolve_stopwords("public") == set(raw.decode("utf-8").splitlines())
    stop = rw.load_stopwords()
    assert len(stop) == 752 and " " in stop and "\\n" in stop and "$" in stop
    assert {"我们", "这个", "很", "好", "的", "，"} <= stop
    assert rw.DEFAULT_STOPWORDS == rw.PUBLIC_STOPWORDS != rw.PROJECT_STOPWORDS


def test_public_and_project_lists_give_the_words_written_by_hand():
    # jieba: 我们/觉得/这个/地方/真的/很/好. Public list: 我们, 这个, 很, 好. Project list: 我们, 这个, 很 (not 好).
    assert rw.words("我们觉得这个地方真的很好") == ["觉得", "地方", "真的"]
    assert rw.words("我们觉得这个地方真的很好", rw.PROJECT_STOPWORDS) == ["觉得", "地方", "真的", "好"]
    # jieba: 这家/店/的/咖啡/非常/好喝. Public: 的. Project: 的, 非常.
    assert rw.words("这家店的咖啡非常好喝") == ["这家", "店", "咖啡", "非常", "好喝"]
    assert rw.words("这家店的咖啡非常好喝", rw.PROJECT_STOPWORDS) == ["这家", "店", "咖啡", "好喝"]
    # sets {觉得, 地方, 真的} vs {这家, 店, 咖啡, 非常, 好喝}: nothing shared; with 好 vs 好喝 neither
    pred, ref = "我们觉得这个地方真的很好，咖啡非常好喝", "这家店的咖啡非常好喝"
    # public: {觉得, 地方, 真的, 咖啡, 非常, 好喝} vs {这家, 店, 咖啡, 非常, 好喝}: 3 shared → 2·3/(6+5)
    assert rb.rouge1(pred, ref) == pytest.approx(6 / 11)
    # project: {觉得, 地方, 真的, 好, 咖啡, 好喝} vs {这家, 店, 咖啡, 好喝}: 2 shared → 2·2/(6+4)
    assert rb.rouge1(pred, ref, stopwords=rw.PROJECT_STOPWORDS) == pytest.approx(4 / 10)


# -------------------------------------------------------------------------------------- reference faults

REF = "先看这张<sup>[1](DOC#1)</sup>。![图](IMG#1)再看那张。![图](IMG#5)"  # IMG#5 of 3 candidates: a fault
PRED = json.dumps({"answer": "先看这张。![a](IMG#1)再看那张。![b](IMG#2)"}, ensure_ascii=False)


def test_a_reference_fault_is_scored_as_the_public_scorer_scores_it():
    s = rb.score_sample(PRED, REF, n_candidates=3)  # default: reference_faults="score"
    assert s["reference_fault"] is True and s["error"] is None and s["reason"] is None
    assert s["reference_fault_reason"] == "reference_fault: the reference answer places IMG#5 outside 1..3"
    assert s["ref_image_ids"] == [1, 5] and s["pred_image_ids"] == [1, 2]
    # edit: [1, 2] vs [1, 5], one substitution → 1 − 1/2; Kendall: two images each, shared [1], no pair is
    # concordant → 0; scaled: 0 anyway
    assert s["edit_score"] == pytest.approx(0.5) and s["kendall"] == 0.0
    assert s["rouge1"] == pytest.approx(1.0)  # the same words once the tags are gone
    m = rb.aggregate([s, rb.score_sample(PRED, "![x](IMG#1)", n_candidates=3)])
    assert m["n_scored"] == 2 and m["reference_faults"] == 1 and m["reference_faults_scored"] == 1
    assert m["errors"] == 0 and m["edit_score_valid_only"] == pytest.approx((0.5 + 0.5) / 2)


def test_the_strict_treatment_is_an_option():
    s = rb.score_sample(PRED, REF, n_candidates=3, reference_faults="error")
    assert s["reference_fault"] is True and s["error"] == s["reason"] == s["reference_fault_reason"]
    assert s["edit_score"] == 0.0 and s["rouge1"] == 0.0
    m = rb.aggregate([s, rb.score_sample(PRED, "![x](IMG#1)", n_candidates=3, reference_faults="error")])
    assert m["n_scored"] == 1 and m["errors"] == 1 and m["reference_faults"] == 1 and m["reference_faults_scored"] == 0
    with pytest.raises(ValueError, match="reference_faults"):
        rb.score_sample(PRED, REF, n_candidates=3, reference_faults="drop")


def test_reference_faults_count_under_data_errors_in_both_treatments():
    from harness.metrics.scoring import data_errors

    for mode in ("score", "error"):
        recs = [{"task": "rag_igbench", "scores": rb.score_sample(PRED, REF, 3, reference_faults=mode)},
                {"task": "rag_igbench", "scores": rb.score_sample(PRED, "![x](IMG#1)", 3, reference_faults=mode)}]
        assert data_errors(recs) == {"total": 1, "by_reason": {"reference_image_out_of_range": 1}}


# ---------------------------------------------------------------------------------------------- IMG#0

class _RecordingClip:
    def __init__(self):
        self.images = []

    def cosines(self, images, texts):
        self.images += images
        return [0.4] * len(images)


def test_img0_is_scored_as_the_public_scorer_scores_it_or_a_hallucination():
    raw = json.dumps({"answer": "先看<sup>[1](DOC#1)</sup>这张![a](IMG#1)再看那张![b](IMG#0)"}, ensure_ascii=False)
    ref = "先看这张![x](IMG#1)再看那张![y](IMG#2)"
    clip, candidates = _RecordingClip(), [("first",), ("second",), ("last",)]  # image stand-ins, not paths
    s = rb.score_sample(raw, ref, 3, candidate_images=candidates, clip=clip)  # default: image_zero="score"
    assert s["hallucinated_image"] is False and s["reason"] is None and s["pred_image_ids"] == [1, 0]
    # edit: [1, 0] vs [1, 2], one substitution → 1/2; Kendall: shared [1], no concordant pair → 0
    assert s["edit_score"] == pytest.approx(0.5) and s["kendall"] == 0.0
    assert clip.images == [("first",), ("last",)] and s["clip_score"] == pytest.approx(1.0)  # IMG#0 → the last candidate
    strict = rb.score_sample(raw, ref, 3, image_zero="hallucination")
    assert strict["hallucinated_image"] is True and strict["reason"] == "hallucinated_image: IMG#0 outside 1..3"
    with pytest.raises(ValueError, match="image_zero"):
        rb.score_sample(raw, ref, 3, image_zero="drop")


# ---------------------------------------------------------------------------------------- run.scoring

def _cfg(**kw):
    return SimpleNamespace(**{"rouge_variant": "reference", "clip_model": None, "clip_pretrained": None,
                              "embed_model": None, **kw})


def test_run_scoring_names_rule_revision_population_and_departures():
    from harness.metrics.scoring import Scorer

    d = Scorer(_cfg()).describe()
    assert (d["stopwords"], d["mcq_extraction"], d["reference_faults"], d["image_zero"]) == (
        "public", "vlmevalkit", "score", "score")
    assert d["departures"] == []
    assert d["mcq_extraction_source"]["commit"] == "2cf2a36c6e79b51faf676a7011b3a0f5b579814d"
    assert d["rag_igbench_source"]["repo"] == "zry13/RAG-IGBench"
    assert d["rag_igbench_source"]["commit"] == "8a43b3d33c7d291f73590e2a0ed54b9e584e2980"
    assert d["rag_igbench_population"].startswith("public")
    assert d["rag_igbench_unoptioned"] == list(rb.DEPARTURES_WITHOUT_OPTION) and len(d["rag_igbench_unoptioned"]) == 4
    strict = Scorer(_cfg(stopwords="project", mcq_extraction="lenient", reference_faults="error",
                         image_zero="hallucination", rouge_variant="rouge_score")).describe()
    assert strict["departures"] == ["scoring.mcq_extraction=lenient", "scoring.reference_faults=error",
                                    "scoring.image_zero=hallucination", "scoring.stopwords=project",
                                    "scoring.rouge_variant=rouge_score"]
    assert strict["mcq_extraction_source"] is None and strict["rag_igbench_population"].startswith("strict")
    with pytest.raises(ValueError, match="reference_faults"):
        Scorer(_cfg(reference_faults="drop"))
    with pytest.raises(ValueError, match="image_zero"):
        Scorer(_cfg(image_zero="drop"))


def test_the_composed_defaults_are_the_public_ones_and_pass_validation(compose_cfg):
    import harness.run.validate as v
    from harness.metrics.scoring import Scorer

    cfg = compose_cfg()
    assert cfg.scoring.mcq_extraction == "vlmevalkit" and cfg.scoring.reference_faults == "score"
    assert cfg.scoring.image_zero == "score"
    assert cfg.scoring.stopwords is None  # null = the public list
    v.validate_config(cfg)
    assert Scorer(cfg.scoring).describe()["departures"] == []
    for name in ("project", "none"):
        v.validate_config(compose_cfg([f"scoring.stopwords={name}"]))
    assert Scorer(compose_cfg(["scoring.reference_faults=error"]).scoring).reference_faults == "error"


# ------------------------------------------------------------------- generated samples: before/after counts

_HEADS = ["我们觉得", "这个地方", "真的很好", "价格也不贵", "而且很方便", "先这样做", "然后那样做", "这家店的咖啡",
          "非常好喝", "记得提前预约", "周末人比较多", "建议早点去", "拍照效果很好", "适合新手", "需要注意安全",
          "其实没有那么难", "大家都说", "一定要带上", "可以试试看", "总的来说"]
_ENDS = ["。", "，", "！", "；", ""]


def _sentence(rng: random.Random) -> str:
    return "".join(rng.choice(_HEADS) for _ in range(rng.randint(1, 3))) + rng.choice(_ENDS)


def generated_samples(seed: int, n: int, fault_rate: float = 0.25) -> list[tuple[str, str, int]]:
    """``n`` (raw model answer, reference markdown, candidate count): answers share part of the reference's
    sentences and images; a share ``fault_rate`` of the references cite an image above the candidates."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_cand = rng.randint(2, 8)
        ref_sents = [_sentence(rng) for _ in range(rng.randint(2, 5))]
        ref_imgs = rng.sample(range(1, n_cand + 1), rng.randint(1, min(3, n_cand)))
        if rng.random() < fault_rate:
            ref_imgs[rng.randrange(len(ref_imgs))] = n_cand + rng.randint(1, 3)
        ref = "".join(s + (f"![图](IMG#{k})" if i < len(ref_imgs) else "")
                      for i, (s, k) in enumerate(zip(ref_sents, ref_imgs + [0] * len(ref_sents))))
        pred_sents = [s if rng.random() < 0.5 else _sentence(rng) for s in ref_sents]
        pred_imgs = [k if 1 <= k <= n_cand and rng.random() < 0.7 else rng.randint(1, n_cand) for k in ref_imgs]
        pred = "".join(s + (f"![x](IMG#{pred_imgs[i]})" if i < len(pred_imgs) else "") for i, s in enumerate(pred_sents))
        out.append((json.dumps({"answer": pred}, ensure_ascii=False), ref, n_cand))
    return out


def test_generated_samples_measure_each_options_effect():
    """Counts pinned for the closing note of issue 30 (2,000 generated samples, a quarter with a reference fault):
    how many samples the strict treatment removes from the public population, and on how many Rouge-1 differs
    between the public and the project stopword lists."""
    samples = generated_samples(0, 2000)
    public = [rb.score_sample(raw, ref, n) for raw, ref, n in samples]
    strict = [rb.score_sample(raw, ref, n, reference_faults="error") for raw, ref, n in samples]
    agg_public, agg_strict = rb.aggregate(public), rb.aggregate(strict)
    faults = sum(s["reference_fault"] for s in public)
    left = agg_public["n_scored"] - agg_strict["n_scored"]
    project = rw.load_stopwords(rw.PROJECT_STOPWORDS)
    rouge_differs = sum(rb.rouge1(ra.clean_text(ra.parse_answer(raw)), ra.clean_text(ref)) !=
                        rb.rouge1(ra.clean_text(ra.parse_answer(raw)), ra.clean_text(ref), stopwords=project)
                        for raw, ref, _ in samples)
    assert (faults, left, agg_public["n_scored"], rouge_differs) == EXPECTED_COUNTS, (
        faults, left, agg_public["n_scored"], rouge_differs)
    assert agg_public["reference_faults_scored"] == left  # every fault the strict treatment drops is scored here


EXPECTED_COUNTS = (487, 487, 2000, 1499)  # measured: (reference faults, left the population under error, scored, Rouge-1 differs)

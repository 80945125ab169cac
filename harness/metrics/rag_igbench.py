"""RAG-IGBench scoring: Rouge-1, image-list edit and Kendall scores, CLIP and alignment scores.

Definitions follow the paper (NeurIPS 2025 D&B, arXiv 2512.05119) and its public scorer
(zry13/RAG-IGBench ``score/eval.py``, "the reference" below); /work/shared/notes/benchmarks.md has the summary.
A model answer is JSON ``{"reason", "category", "answer"}`` whose ``answer`` is markdown: image ``k`` of the
candidates (1-based over all notes' images, flattened) is placed as ``![...](IMG#k)``, a citation is
``<sup>[n](DOC#n)</sup>``. Reading that answer — the markdown out of the model's raw, often malformed JSON
(``parse_answer``), and the image numbers, Rouge text and image contexts out of the markdown (``image_ids``,
``clean_text``, ``image_contexts``) — is :mod:`harness.metrics.rag_igbench_answer`; this module scores it. The
words Rouge-1 counts (jieba's segmentation minus a stopword list, ``scoring.stopwords``) are
:mod:`harness.metrics.rag_igbench_words`.

Per sample (:func:`score_sample`): Rouge-1 on the text without citations and image tags; edit and Kendall
scores on the lists of image numbers; CLIP score (each placed image against the text around it) and alignment
(the text around an image in the model's answer against the text around the same image in the reference),
each only when an encoder is given. :func:`aggregate` averages, :func:`comprehensive` is the paper's "Mean"
of the five (check: GPT-4o 57.42, 51.28, 46.50, 38.81, 36.04 → 46.01).

Where this module deliberately differs from the public scorer, and why:

* **Comprehensive score** = mean of rouge1, edit, kendall, alignment, clip (the paper). The public scorer
  prints ``(align + edit + kendall + align + clip) / 5`` — alignment twice, Rouge-1 missing. That number is
  still reported, as ``public_integrated_valid_only``, to compare with figures produced by it.
* **Failed samples count.** The public scorer drops a sample from every average when its JSON cannot be
  repaired, when it places an image number above the candidate count, or on any exception. Here such samples
  are flagged (``format_invalid``, ``hallucinated_image``, ``error``), score 0 on every metric and count in the
  main means; the ``*_valid_only`` means (over scored samples only) are the public scorer's convention.
  ``IMG#0`` placed by the model is a named option, ``image_zero`` (``scoring.image_zero``): ``score``
  (default) scores it as the public scorer does (its check is only k > N; CLIP reads the last candidate
  through index -1); ``hallucination`` makes it a ``hallucinated_image`` too.
* **Reference faults** (a reference that places an image k < 1 or k > N: the data's fault) are a named option,
  ``reference_faults`` (``scoring.reference_faults``). ``score`` (default) scores the sample as the public
  scorer does — the reference's image list as written, the model's answer judged by the usual rules (a model
  that copies an out-of-range image is a ``hallucinated_image`` there, as in the public scorer) — and flags
  it ``reference_fault`` (counted in ``reference_faults`` and ``summary.json`` ``metrics.data_errors``), so the
  ``*_valid_only`` means keep the public population. ``error`` (strict) makes it an error scored 0 before the
  model's answer is read: it leaves ``*_valid_only``, and a model that copies it is never charged with a
  hallucination.
* **Reference text** is whatever the caller passes: the current data has ``gt_clean_answer``; the public scorer
  reads ``gt_answer`` (the field of older releases).
* **Edge cases on which the public scorer raises** (and the sample vanishes) get a defined value: both image
  lists empty → edit 1.0 and Kendall 1.0 (identical, empty lists); reference without images but the model
  placed some → Kendall 0.0, edit 0.0; no words left after stopwords on either side → Rouge-1 0.0; a CLIP
  text over 77 tokens is truncated (see :mod:`harness.metrics.encoders`).
* **Answer extraction** is more lenient than the public ``fix_json`` and keeps the answer text as written
  (:mod:`harness.metrics.rag_igbench_answer` says how, and what ``fix_json``'s rewriting changes).
* **Stopwords**: the public list by default (:data:`~harness.metrics.rag_igbench_words.PUBLIC_STOPWORDS`); the
  project's list is an option (:data:`~harness.metrics.rag_igbench_words.PROJECT_STOPWORDS`;
  :mod:`harness.metrics.rag_igbench_words` says how each list is read). **Rouge F1** is exact
  ``2|A∩B|/(|A|+|B|)``; the ``rouge`` package used by the reference adds 1e-8 to the denominator of
  ``2PR/(P+R)`` (difference < 1e-8).

Only the standard library is imported at module level; rapidfuzz, rouge_score, scipy, numpy and the encoders are
imported on first use (jieba by :mod:`harness.metrics.rag_igbench_words`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from harness.metrics.encoders import (
    DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED, DEFAULT_EMBED_MODEL, get_clip_scorer, get_text_embedder)
from harness.metrics.rag_igbench_answer import CONTEXT_WINDOW, clean_text, image_contexts, image_ids, parse_answer
from harness.metrics.rag_igbench_words import WordTokenizer, words

METRICS = ("rouge1", "edit_score", "kendall", "alignment", "clip_score")

#: Characters of the context given to CLIP (reference: ``context[:25]``).
CLIP_TEXT_CHARS = 25
#: Kendall scaling weight (reference: ``beta = 0.5``).
BETA = 0.5

#: The revision of the public scorer (``score/eval.py``) reproduced here, and of its stopword list shipped with
#: :mod:`harness.metrics.rag_igbench_words` (:data:`~harness.metrics.rag_igbench_words.PUBLIC_STOPWORDS`).
PUBLIC_SCORER_REVISION = {
    "repo": "zry13/RAG-IGBench", "commit": "8a43b3d33c7d291f73590e2a0ed54b9e584e2980", "date": "2025-06-12",
    "eval_py_last_changed": "9da0b6b3758d889ed4a4edbe70fc5905ec630d4b (2025-02-24)",
    "stopwords_last_changed": "ede777ee3bf799b76c4999f4dd1aeced595b6a15 (2025-02-21)",
    "stopwords_sha256": "066b0dd235fa7b413bc89b3d06402fb6ead081b13e7644a156e450b464ce1eb9",
}
#: ``scoring.reference_faults``: ``score`` (the public scorer's treatment, default) | ``error`` (strict).
REFERENCE_FAULT_CHOICES = ("score", "error")
#: ``scoring.image_zero``: ``score`` (the public scorer: IMG#0 is no hallucination, default) | ``hallucination``.
IMAGE_ZERO_CHOICES = ("score", "hallucination")
#: Known differences from the public ``score/eval.py`` that are not (yet) options, recorded in ``summary.json``
#: ``run.scoring.rag_igbench_unoptioned`` so that a reader sees them beside the figure (docs/scoring.md).
DEPARTURES_WITHOUT_OPTION = (
    "answer extraction: more lenient JSON repair than fix_json; newlines and inner quotes kept",
    "inputs on which the public scorer raises (both image lists empty, no reference image and one model image, "
    "no candidate images, an empty Rouge text) get defined scores and stay in *_valid_only",
    "Kendall scaling (N - n)/N clipped to [0, 1] (matters only when n > N)",
    "reference read from gt_clean_answer (gt_answer in old releases; the public scorer reads gt_answer)",
)


# ------------------------------------------------------------------------------------------------- Rouge-1


def rouge1(pred_text: str | None, ref_text: str | None, variant: str = "reference",
           stopwords: str | os.PathLike | Collection[str] | None = None) -> float:
    """Rouge-1 F1 of the model's text against the reference text, in [0, 1].

    ``variant="reference"`` (default): F1 over the **sets** of :func:`~harness.metrics.rag_igbench_words.words`
    — what the reference computes with the ``rouge`` package (``Rouge().get_scores``, exclusive n-grams), so
    repeating a word changes nothing.
    ``variant="rouge_score"``: Google's rouge-score ``rouge1`` with the same words as tokenizer, i.e. clipped
    unigram **counts**. Either side without words → 0.0 (the ``rouge`` package raises there).
    """
    a, b = words(pred_text, stopwords), words(ref_text, stopwords)
    if not a or not b:
        return 0.0
    if variant == "reference":
        sa, sb = set(a), set(b)
        return 2.0 * len(sa & sb) / (len(sa) + len(sb))
    if variant == "rouge_score":
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rouge1"], tokenizer=WordTokenizer(stopwords))
        return float(scorer.score(ref_text, pred_text)["rouge1"].fmeasure)
    raise ValueError(f"unknown Rouge variant {variant!r} (reference, rouge_score)")


# ------------------------------------------------------------------------------------------- image lists


def edit_score(pred_ids: Sequence[int] | None, ref_ids: Sequence[int] | None) -> float:
    """1 − Levenshtein(model list, reference list) / max(len): reference ``edit_distance``, in [0, 1].

    Both lists empty → 1.0 (identical sequences; the reference divides by zero there). Repeated ids are
    ordinary elements.
    """
    from rapidfuzz.distance import Levenshtein

    a, b = list(pred_ids or []), list(ref_ids or [])
    if not a and not b:
        return 1.0
    return 1.0 - Levenshtein.distance(a, b) / max(len(a), len(b))


def kendall_scale(score: float, n_candidates: int | None, n_ref: int, beta: float = BETA) -> float:
    """``score · (1 + β(N − n)/N) / (1 + β)``, N candidates, n reference images (reference, β = 0.5).

    Harder selections (many candidates, few reference images) keep more of the score. ``n_candidates``
    None or ≤ 0 → unscaled; (N − n)/N is clipped to [0, 1] for impossible inputs (n > N).
    """
    if n_candidates is None or n_candidates <= 0:
        return score
    frac = min(1.0, max(0.0, (n_candidates - n_ref) / n_candidates))
    return score * (1.0 + beta * frac) / (1.0 + beta)


def kendall_score(pred_ids: Sequence[int] | None, ref_ids: Sequence[int] | None,
                  n_candidates: int | None = None, beta: float = BETA, variant: str = "reference") -> float:
    """Order agreement of the model's image list with the reference's, in [0, 1], scaled by :func:`kendall_scale`.

    ``shared`` = the model's images that the reference contains, in the model's order (repeats kept).
    Rules of the reference ``Kendall_Score``, checked in this order:
    * model list empty → 0 (both empty → 1.0, defined here; the reference divides by zero);
    * reference empty (model not) → 0.0 (defined here; the reference gives 0 or divides by zero);
    * reference has one image → |shared| / |model|; model has one image → |shared| / |reference|;
    * else concordant pairs of ``shared`` (ordered by reference position; equal positions — a repeated id —
      are not concordant) divided by m(m−1)/2 with m = |model list|, so wrong or extra images cost too.

    ``variant="paper"`` divides by the pairs among ``shared`` instead (pure order agreement), and
    ``variant="scipy_tau_b"`` takes scipy's τ-b between model and reference positions of ``shared`` mapped to
    [0, 1] by (τ + 1)/2 (reversed order 0, unrelated 0.5; τ undefined, all tied → 0). Both keep the rules
    above and give 0 with fewer than two shared images (no pair to order).
    Worked example: model [1, 2, 4] vs reference [1, 2, 3] → 1/3 before scaling.
    """
    if variant not in ("reference", "paper", "scipy_tau_b"):
        raise ValueError(f"unknown Kendall variant {variant!r} (reference, paper, scipy_tau_b)")
    pred, ref = list(pred_ids or []), list(ref_ids or [])
    position = {k: i for i, k in enumerate(ref)}  # a repeated reference id keeps its last position
    shared = [k for k in pred if k in position]
    if not pred:
        raw = 1.0 if not ref else 0.0
    elif not ref:
        raw = 0.0
    elif len(ref) == 1:
        raw = len(shared) / len(pred)
    elif len(pred) == 1:
        raw = len(shared) / len(ref)
    elif variant == "scipy_tau_b":
        raw = 0.0
        if len(shared) >= 2:
            from scipy.stats import kendalltau

            tau = kendalltau(range(len(shared)), [position[k] for k in shared]).statistic
            raw = 0.0 if tau is None or math.isnan(tau) else (float(tau) + 1.0) / 2.0
    else:
        concordant = sum(position[shared[i]] < position[shared[j]]
                         for i in range(len(shared)) for j in range(i + 1, len(shared)))
        m = len(pred) if variant == "reference" else len(shared)
        raw = concordant / (m * (m - 1) / 2) if m >= 2 else 0.0
    return kendall_scale(raw, n_candidates, len(ref), beta)


# ------------------------------------------------------------------------------------------ image-text


def linear_map(x: float, lo: float, hi: float) -> float:
    """(x − lo)/(hi − lo) clipped to [0, 1]; NaN → 0."""
    if x is None or math.isnan(x):
        return 0.0
    return min(1.0, max(0.0, (x - lo) / (hi - lo)))


def clip_map(cosine: float) -> float:
    """CLIP cosine → score: 0.1 → 0, 0.4 → 1, linear between, clipped (reference)."""
    return linear_map(cosine, 0.1, 0.4)


def align_map(cosine: float) -> float:
    """Embedding cosine → alignment score: 0.7 → 0, 1 → 1, linear between, clipped (reference)."""
    return linear_map(cosine, 0.7, 1.0)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def clip_score(images: Sequence[Any], contexts: Sequence[str], scorer: Any = None, *,
               model_name: str | None = None, pretrained: str | None = None, device: str | None = None,
               n_chars: int = CLIP_TEXT_CHARS) -> float:
    """Mean over placed images of :func:`clip_map` (cosine(image, first ``n_chars`` of its context)); 0 if none.

    ``images[i]`` (PIL image or path) goes with ``contexts[i]`` (from
    :func:`~harness.metrics.rag_igbench_answer.image_contexts`). ``scorer`` is a
    :class:`~harness.metrics.encoders.ClipScorer` (or anything with ``cosines(images, texts)``, or a callable
    of the same signature); without one, the shared scorer for ``model_name``/``pretrained`` (default OpenAI
    ViT-L/14, the reference's weights) is loaded on first use.
    """
    if len(images) != len(contexts):
        raise ValueError(f"{len(images)} images but {len(contexts)} contexts")
    if not images:
        return 0.0
    if scorer is None:
        scorer = get_clip_scorer(model_name or DEFAULT_CLIP_MODEL,
                                 pretrained if model_name else DEFAULT_CLIP_PRETRAINED, device)
    texts = [str(c)[:n_chars] for c in contexts]
    cos = scorer.cosines(list(images), texts) if hasattr(scorer, "cosines") else scorer(list(images), texts)
    return _mean([clip_map(float(c)) for c in cos])


def _cosines(a, b) -> list[float]:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    return [float(d / n) if n > 0 else 0.0 for d, n in zip(dots, norms)]


def alignment_score(pred_markdown: str | None, ref_markdown: str | None, embed: Any = None, *,
                    window: int = CONTEXT_WINDOW, model_name: str | None = None, device: str | None = None
                    ) -> float:
    """Mean over images placed in both answers of :func:`align_map` (cosine of their contexts' embeddings).

    For each image k in both answers (model order), the model's ±``window``-character context of k and the
    reference's (:func:`~harness.metrics.rag_igbench_answer.image_contexts`, full contexts, not cut to 25) are
    embedded and compared; 0 if no image is shared. ``embed`` maps a list of texts to a [n, d] array (a
    :class:`~harness.metrics.encoders.TextEmbedder` does); without one the shared embedder for
    ``model_name`` (default ``TencentBAC/Conan-embedding-v1``, the reference's) is loaded on first use.
    """
    pred_ctx, ref_ctx = dict(image_contexts(pred_markdown, window)), dict(image_contexts(ref_markdown, window))
    shared = [k for k in pred_ctx if k in ref_ctx]
    if not shared:
        return 0.0
    if embed is None:
        embed = get_text_embedder(model_name or DEFAULT_EMBED_MODEL, device)
    vectors = embed([pred_ctx[k] for k in shared] + [ref_ctx[k] for k in shared])
    return _mean([align_map(c) for c in _cosines(vectors[: len(shared)], vectors[len(shared) :])])


def comprehensive(rouge1: float, edit: float, kendall: float, alignment: float, clip: float) -> float:
    """The paper's comprehensive score ("Mean"): the plain mean of the five metrics (any common scale)."""
    return (rouge1 + edit + kendall + alignment + clip) / 5.0


# -------------------------------------------------------------------------------------------- per sample


def _candidate(candidate_images: Any, k: int) -> Any:
    image = candidate_images(k) if callable(candidate_images) else candidate_images[k - 1]
    if image is None or (isinstance(image, (str, os.PathLike)) and not os.path.isfile(image)):
        raise FileNotFoundError(f"image IMG#{k} is missing" + (f" ({image})" if image is not None else ""))
    return image


def score_sample(raw_answer: str | None, gt_clean_answer: str | None, n_candidates: int | None = None, *,
                 candidate_images: Sequence[Any] | Callable[[int], Any] | None = None, clip: Any = None,
                 embed: Any = None, error: str | None = None, beta: float = BETA,
                 kendall_variant: str = "reference", rouge_variant: str = "reference",
                 stopwords: str | os.PathLike | Collection[str] | None = None,
                 reference_faults: str = "score", image_zero: str = "score") -> dict[str, Any]:
    """Every per-sample score and flag of one RAG-IGBench answer, as a flat dict.

    ``raw_answer`` is the model's raw output, ``gt_clean_answer`` the reference markdown, ``n_candidates`` the
    number of candidate images (N, for the hallucination check and the Kendall scaling). CLIP is computed
    only with ``clip`` (a scorer, see :func:`clip_score`) and ``candidate_images`` (index k−1 → PIL image or
    path, or a callable k → image); alignment only with ``embed``. A metric not computed is None.

    Keys: ``rouge1, edit, kendall, alignment, clip`` (float or None); ``format_invalid``,
    ``hallucinated_image`` (bool); ``error`` and ``reason`` (str or None); ``pred_image_ids``,
    ``ref_image_ids``, ``n_candidates``, ``reference_fault`` (bool). A sample is scored 0 on every computed
    metric, with a ``reason``, when: ``error`` is given (e.g. the engine failed) or ``raw_answer`` is None →
    ``error``; with ``reference_faults="error"``, the *reference* places an image k < 1 or k > N →
    ``reference_fault`` and ``error`` (a fault of the data, checked before the model's answer, so it is never
    the model's ``hallucinated_image``); with ``reference_faults="score"`` (default, the public scorer's
    treatment) such a sample is flagged ``reference_fault`` (``reference_fault_reason`` says why) and scored
    by the rules below with the reference as written; the answer
    cannot be parsed (:func:`~harness.metrics.rag_igbench_answer.parse_answer`) → ``format_invalid``; it places an image k > N, or k < 1 with
    ``image_zero="hallucination"`` → ``hallucinated_image`` (with ``image_zero="score"``, the default and the
    public scorer's rule, ``IMG#0`` is scored and CLIP reads the last candidate); an image is missing or an encoder raises → ``error``. Never raises for bad data.
    """
    if clip is not None and candidate_images is None:
        raise ValueError("a CLIP scorer needs candidate_images")
    if reference_faults not in REFERENCE_FAULT_CHOICES:
        raise ValueError(f"scoring.reference_faults={reference_faults!r}: expected one of "
                         f"{', '.join(REFERENCE_FAULT_CHOICES)}")
    if image_zero not in IMAGE_ZERO_CHOICES:
        raise ValueError(f"scoring.image_zero={image_zero!r}: expected one of {', '.join(IMAGE_ZERO_CHOICES)}")
    ref = gt_clean_answer if isinstance(gt_clean_answer, str) else ""
    out: dict[str, Any] = {
        "rouge1": 0.0, "edit_score": 0.0, "kendall": 0.0,
        "alignment": 0.0 if embed is not None else None, "clip_score": 0.0 if clip is not None else None,
        "format_invalid": False, "hallucinated_image": False, "reference_fault": False,
        "reference_fault_reason": None, "error": None, "reason": None,
        "pred_image_ids": [], "ref_image_ids": image_ids(ref), "n_candidates": n_candidates,
    }
    if error is not None or raw_answer is None:
        out["error"] = out["reason"] = str(error) if error is not None else "no model answer"
        return out
    ref_bad = [k for k in out["ref_image_ids"] if k < 1 or (n_candidates is not None and k > n_candidates)]
    if ref_bad:  # the data's fault
        out["reference_fault"] = True
        upper = n_candidates if n_candidates is not None else "N"
        out["reference_fault_reason"] = (f"reference_fault: the reference answer places IMG#{ref_bad[0]} outside "
                                         f"1..{upper}")
        if reference_faults == "error":  # strict: never the model's hallucination, whatever the model answered
            out["error"] = out["reason"] = out["reference_fault_reason"]
            return out
    answer = parse_answer(raw_answer)
    if answer is None:
        out["format_invalid"] = True
        out["reason"] = "format_invalid: no JSON object with a string 'answer' field"
        return out
    pred_ids = out["pred_image_ids"] = image_ids(answer)
    bad = [k for k in pred_ids if (k < 1 and image_zero == "hallucination")
           or (n_candidates is not None and k > n_candidates)]
    if bad:
        out["hallucinated_image"] = True
        upper = n_candidates if n_candidates is not None else "N"
        out["reason"] = f"hallucinated_image: IMG#{bad[0]} outside 1..{upper}"
        return out
    try:
        scores = {
            "rouge1": rouge1(clean_text(answer), clean_text(ref), rouge_variant, stopwords),
            "edit_score": edit_score(pred_ids, out["ref_image_ids"]),
            "kendall": kendall_score(pred_ids, out["ref_image_ids"], n_candidates, beta, kendall_variant),
        }
        if embed is not None:
            scores["alignment"] = alignment_score(answer, ref, embed)
        if clip is not None:
            placed = image_contexts(answer)
            scores["clip_score"] = clip_score([_candidate(candidate_images, k) for k, _ in placed],
                                        [c for _, c in placed], clip)
    except Exception as exc:  # a missing image or a failing encoder: the sample counts as an error
        out["error"] = out["reason"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(scores)
    return out


# --------------------------------------------------------------------------------------------- aggregate


def _status(sample: Mapping[str, Any]) -> str:
    """'error' > 'format_invalid' > 'hallucinated_image' > 'scored' (each sample counts once)."""
    if sample.get("error"):
        return "error"
    if sample.get("format_invalid"):
        return "format_invalid"
    if sample.get("hallucinated_image"):
        return "hallucinated_image"
    return "scored"


def _number(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def aggregate(per_sample: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Benchmark means and counts over per-sample dicts (from :func:`score_sample`, or ``{"error": ...}``).

    For each metric that some sample carries: ``<metric>`` = mean over **all** samples, a sample that is not
    scored (error, format_invalid, hallucinated_image) counting 0; ``<metric>_valid_only`` = mean over the
    samples scored here (the public scorer's rule for which samples count, applied to this module's
    per-sample scores — *not* the figure ``score/eval.py`` prints: it also drops every sample on which any of
    its steps raises, which this module scores, and reads ``gt_answer``, so its sample set and values can
    differ); a scored sample without that metric counts 0 in both and is counted in ``incomplete``.
    ``comprehensive`` (and ``comprehensive_valid_only``) only when all five metrics are present;
    ``public_integrated_valid_only`` = (2·alignment + edit + kendall + clip)/5 of the ``*_valid_only`` means:
    the public scorer's defective printed formula on this module's sample set (its arithmetic, not its number). Counts: ``n_samples``,
    ``n_scored``, ``format_invalid``, ``hallucinated_image`` (model answers only), ``errors`` (each sample in
    one class, first of error > format_invalid > hallucinated_image) and their ``*_rate``s;
    ``reference_faults`` (samples whose reference is defective: in ``errors`` under
    ``scoring.reference_faults=error``, scored under ``score``) and ``reference_faults_scored`` (those of them in
    ``n_scored``). Empty input → counts 0, means None.
    """
    samples = list(per_sample)
    status = [_status(s) for s in samples]
    n, scored = len(samples), [s for s, st in zip(samples, status) if st == "scored"]
    out: dict[str, Any] = {"n_samples": n, "n_scored": len(scored)}
    for key, name in (("format_invalid", "format_invalid"), ("hallucinated_image", "hallucinated_image"),
                      ("errors", "error")):
        out[key] = status.count(name)
        out[f"{key}_rate"] = status.count(name) / n if n else None
    incomplete: dict[str, int] = {}
    for m in METRICS:
        if not any(_number(s.get(m)) is not None for s in samples):
            continue
        valid = [_number(s.get(m)) for s in scored]
        if None in valid:
            incomplete[m] = valid.count(None)
        total = sum(v or 0.0 for v in valid)
        out[m] = total / n if n else None
        out[f"{m}_valid_only"] = total / len(scored) if scored else None
    out["reference_faults"] = sum(1 for s in samples if s.get("reference_fault"))
    out["reference_faults_scored"] = sum(1 for s in scored if s.get("reference_fault"))
    if incomplete:
        out["incomplete"] = incomplete
    if all(m in out for m in METRICS):
        out["comprehensive"] = comprehensive(*(out[m] for m in METRICS)) if n else None
        out["comprehensive_valid_only"] = (
            comprehensive(*(out[f"{m}_valid_only"] for m in METRICS)) if scored else None)
        out["public_integrated_valid_only"] = (
            (2 * out["alignment_valid_only"] + out["edit_score_valid_only"] + out["kendall_valid_only"]
             + out["clip_score_valid_only"]) / 5.0 if scored else None)
    return out

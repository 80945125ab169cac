"""Which metrics apply to a sample, by its ``task``: the glue between datasets and ``harness.metrics``.

A :class:`Scorer` is built once per run (it owns the optional CLIP and text-embedding models, loaded on
first use) and turns (sample, answer) into a flat dict of per-sample scores with the benchmark's flags
(``format_invalid``, ``hallucinated_image``) and a ``reason`` where the answer is unusable;
:func:`aggregate` turns the per-sample records into ``summary.json`` ``metrics``. A sample that failed
before scoring (bad image, engine error) carries ``error`` and counts 0 everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.datasets.base import Sample
from harness.datasets.synthetic_load import REASON as SYNTHETIC_LOAD_REASON
from harness.metrics import mcq, ocrbench, rag_igbench, rag_igbench as rb, tiny_encoders as te
from harness.metrics.encoders import ClipScorer, TextEmbedder, TransformersClipScorer
from harness.metrics.mcq import circular_accuracy, extract, EXTRACTION_RULES
from harness.metrics.ocrbench import score_one
from harness.metrics.rag_igbench import IMAGE_ZERO_CHOICES, REFERENCE_FAULT_CHOICES
from harness.metrics.rag_igbench_words import resolve_stopwords
from harness.metrics.scorer_checkpoints import checkpoint_info
from harness.metrics.tiny_encoders import ensure_tiny_clip, ensure_tiny_text_embedder
from harness.registry import Registry

TINY = "tiny"  # the embedded random-weight encoders (harness.metrics.tiny_encoders); the trained ones are directories
TRANSFORMERS_PREFIX = "transformers:"  # scoring.clip_model=transformers:<hub id or directory>: a transformers CLIPModel


def clip_backend(clip_model: str) -> str:
    """Which library scores ``scoring.clip_model``: ``transformers`` for ``tiny`` and ``transformers:<repo or
    dir>`` (base install), ``open_clip`` for open_clip names (``ViT-L-14``, ``hf-hub:...``, ``local-dir:...``;
    the ``[clip]`` extra). Decided from the value alone, so the config check needs no import."""
    name = str(clip_model)
    return "transformers" if name == TINY or name.startswith(TRANSFORMERS_PREFIX) else "open_clip"


class Scorer:
    """Per-sample scoring under each benchmark's definition.

    ``scoring.clip_model`` / ``scoring.embed_model`` name the encoders of RAG-IGBench's ``clip_score`` and
    ``alignment`` (None: the metric is skipped). The default (``conf/scoring/default.yaml``) is the committed
    tiny CLIP and text embedder trained on the synthetic data (:mod:`harness.metrics.scorer_checkpoints`, loaded
    as directories): meaningful on the embedded model's data. The value ``tiny`` selects the embedded
    random-weight stand-ins of :mod:`harness.metrics.tiny_encoders` (built once into the cache, then re-used;
    base install only): their scores exercise the path and mean nothing. ``transformers:<repo or dir>`` scores with a transformers
    ``CLIPModel`` (``transformers:openai/clip-vit-large-patch14`` is the reference's own stack); any other
    ``clip_model`` is an open_clip name (the ``[clip]`` extra). Encoders are built and loaded only when a
    RAG-IGBench sample is scored.
    """

    def __init__(self, scoring_cfg: Any):
        self.cfg = scoring_cfg
        self._clip = self._embed = None
        self.stopwords_choice = str(getattr(scoring_cfg, "stopwords", None) or "public")
        self.stopwords = resolve_stopwords(self.stopwords_choice)  # a missing file fails here, not per sample
        self.mcq_extraction = str(getattr(scoring_cfg, "mcq_extraction", None) or "vlmevalkit")
        if self.mcq_extraction not in EXTRACTION_RULES:
            raise ValueError(f"scoring.mcq_extraction={self.mcq_extraction!r}: expected one of "
                             f"{', '.join(EXTRACTION_RULES)}")
        self.reference_faults = str(getattr(scoring_cfg, "reference_faults", None) or "score")
        if self.reference_faults not in REFERENCE_FAULT_CHOICES:
            raise ValueError(f"scoring.reference_faults={self.reference_faults!r}: expected one of "
                             f"{', '.join(REFERENCE_FAULT_CHOICES)}")
        self.image_zero = str(getattr(scoring_cfg, "image_zero", None) or "score")
        if self.image_zero not in IMAGE_ZERO_CHOICES:
            raise ValueError(f"scoring.image_zero={self.image_zero!r}: expected one of {', '.join(IMAGE_ZERO_CHOICES)}")

    @property
    def clip(self):
        if self._clip is None and self.cfg.clip_model:
            backend, name = clip_backend(self.cfg.clip_model), str(self.cfg.clip_model)
            if backend == "transformers":
                if name == TINY:
                    name = ensure_tiny_clip()
                self._clip = TransformersClipScorer(name.removeprefix(TRANSFORMERS_PREFIX))
            else:
                import importlib.util

                if importlib.util.find_spec("open_clip") is None:
                    raise RuntimeError(f"scoring.clip_model={name}: an open_clip model needs the [clip] extra "
                                       "(pip install 'moe-vlm-harness[clip]'; it needs torchvision). "
                                       "scoring.clip_model=tiny, transformers:<repo or dir> or null need no extra.")

                self._clip = ClipScorer(name, self.cfg.clip_pretrained)
        return self._clip

    @property
    def embed(self):
        if self._embed is None and self.cfg.embed_model:
            if self.cfg.embed_model == "tiny":
                self._embed = TextEmbedder(ensure_tiny_text_embedder())
            else:
                self._embed = TextEmbedder(self.cfg.embed_model)
        return self._embed

    def prepare(self) -> None:
        """Build and load the configured encoders now (optional: otherwise the first RAG-IGBench sample
        scored does it), e.g. before the timed generation so their start-up is not counted there."""
        for encoder in (self.clip, self.embed):
            if encoder is not None:
                encoder._load()

    def describe(self) -> dict[str, Any]:
        """Which encoders score (for ``summary.json`` ``run.scoring``), without building or loading them.

        ``clip_weights`` / ``embed_weights``: ``"random-init"`` for the embedded ``tiny`` models, for a local
        directory whose ``harness_model.json`` says so, and for an open_clip model name without pretrained
        weights; ``"trained-synthetic"`` for the committed scorers trained on the synthetic data (the default,
        :mod:`harness.metrics.scorer_checkpoints`: meaningful on the embedded data only); ``"pretrained"``
        otherwise (the reference's models); None where the metric is off. ``clip_sha256`` / ``embed_sha256``:
        the weights' SHA-256 a local checkpoint records (checked when it loads), else None.
        """
        clip_model, clip_pretrained, clip_weights = self.cfg.clip_model, self.cfg.clip_pretrained, None
        if clip_model == te.TINY:
            clip_model, clip_pretrained, clip_weights = te.clip_dir_name(), None, "random-init"
        elif clip_model and clip_backend(clip_model) == "transformers":
            clip_pretrained = None  # the weights are the checkpoint's
            clip_weights = te.weights_label(str(clip_model).removeprefix(TRANSFORMERS_PREFIX)) or "pretrained"
        elif clip_model:
            has_weights = bool(clip_pretrained) or str(clip_model).startswith(("hf-hub:", "local-dir:"))
            clip_weights = te.weights_label(clip_model) if str(clip_model).startswith("local-dir:") else None
            clip_weights = clip_weights or ("pretrained" if has_weights else "random-init")
        embed_model, embed_weights = self.cfg.embed_model, None
        if embed_model == te.TINY:
            embed_model, embed_weights = te.text_embedder_dir_name(), "random-init"
        elif embed_model:
            embed_weights = te.weights_label(embed_model) or "pretrained"

        def recorded_sha(local: str | None) -> str | None:
            return (checkpoint_info(local) or {}).get("sha256") if local else None

        cfg_clip, cfg_embed = self.cfg.clip_model, self.cfg.embed_model
        clip_local = (str(cfg_clip).removeprefix(TRANSFORMERS_PREFIX) if cfg_clip and cfg_clip != te.TINY and (
            clip_backend(cfg_clip) == "transformers" or str(cfg_clip).startswith("local-dir:")) else None)
        return {"clip_model": clip_model, "clip_pretrained": clip_pretrained, "clip_weights": clip_weights,
                "clip_sha256": recorded_sha(clip_local),
                "embed_sha256": recorded_sha(str(cfg_embed) if cfg_embed and cfg_embed != te.TINY else None),
                "clip_backend": clip_backend(self.cfg.clip_model) if self.cfg.clip_model else None,
                "embed_model": embed_model, "embed_weights": embed_weights,
                "allow_random_scorers": bool(getattr(self.cfg, "allow_random_scorers", False)),
                "stopwords": self.stopwords_choice, "stopword_count": len(self.stopwords),
                "mcq_extraction": self.mcq_extraction, **self.conformance()}

    def conformance(self) -> dict[str, Any]:
        """Which public rule, revision and population each score follows, and every departure from them by
        its option name (``summary.json`` ``run.scoring``; docs/scoring.md has the table)."""
        return {"mcq_extraction_source": mcq.RULE_SOURCES[self.mcq_extraction],
                "reference_faults": self.reference_faults, "image_zero": self.image_zero,
                "rag_igbench_source": rb.PUBLIC_SCORER_REVISION,
                "rag_igbench_population": ("public: samples the public scorer scores, reference faults included"
                                           if self.reference_faults == "score" else
                                           "strict: reference faults are errors (out of *_valid_only)"),
                "rag_igbench_unoptioned": list(rb.DEPARTURES_WITHOUT_OPTION),
                "departures": self.departures()}

    def departures(self) -> list[str]:
        """The options of this run that depart from the public definitions, as ``key=value`` (empty: none)."""
        out = []
        if self.mcq_extraction != "vlmevalkit":
            out.append(f"scoring.mcq_extraction={self.mcq_extraction}")
        if self.reference_faults != "score":
            out.append(f"scoring.reference_faults={self.reference_faults}")
        if self.image_zero != "score":
            out.append(f"scoring.image_zero={self.image_zero}")
        if self.stopwords_choice != "public":
            out.append(f"scoring.stopwords={self.stopwords_choice}")
        if str(getattr(self.cfg, "rouge_variant", "reference")) != "reference":
            out.append(f"scoring.rouge_variant={self.cfg.rouge_variant}")
        return out

    def __call__(self, sample: Sample, answer: str, error: str | None = None) -> dict[str, Any]:
        return TASKS.load(sample.task).score(self, sample, answer, error)


@dataclass(frozen=True)
class TaskScoring:
    """How one task is scored: ``score(scorer, sample, answer, error)`` → the per-sample scores (a failed sample
    scores too, with ``error``), ``aggregate(scores)`` → the task's block of ``summary.json`` ``metrics``."""

    score: Callable[[Scorer, Sample, str, str | None], dict[str, Any]]
    aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]]


def _score_rag_igbench(scorer: Scorer, sample: Sample, answer: str, error: str | None) -> dict[str, Any]:
    return rag_igbench.score_sample(
        answer if error is None else None,
        sample.reference.get("answer"),
        n_candidates=sample.reference.get("n_candidates"),
        candidate_images=[img.path or img.key for img in sample.images] if scorer.clip else None,
        clip=scorer.clip,
        embed=scorer.embed,
        error=error,
        rouge_variant=scorer.cfg.rouge_variant,
        stopwords=scorer.stopwords,
        reference_faults=scorer.reference_faults,
        image_zero=scorer.image_zero,
    )


def _aggregate_rag_igbench(scores: list[dict[str, Any]]) -> dict[str, Any]:
    return rag_igbench.aggregate(scores)


def _score_ocrbench(scorer: Scorer, sample: Sample, answer: str, error: str | None) -> dict[str, Any]:
    ref = sample.reference
    return {"score": 0 if error else score_one(answer, ref["answers"], ref.get("dataset_name")),
            "type": ref.get("type"), "error": error}


def _aggregate_ocrbench(scores: list[dict[str, Any]]) -> dict[str, Any]:
    return ocrbench.aggregate(scores)


def _score_mcq(scorer: Scorer, sample: Sample, answer: str, error: str | None) -> dict[str, Any]:
    ref = sample.reference
    pred = None if error else extract(answer, ref["options"], scorer.mcq_extraction)
    return {"pred": pred, "gold": ref.get("answer"), "correct": pred is not None and pred == ref.get("answer"),
            "group": ref.get("group"), "category": ref.get("category"), "error": error}


def _aggregate_mcq(scores: list[dict[str, Any]]) -> dict[str, Any]:
    return circular_accuracy(scores)


# dataset=synthetic_load: requests of exact shapes with nothing to compare with — null, never 0
NO_REFERENCE_REASON = SYNTHETIC_LOAD_REASON


def _score_no_reference(scorer: Scorer, sample: Sample, answer: str, error: str | None) -> dict[str, Any]:
    return {"score": None, "reason": NO_REFERENCE_REASON, "error": error}


def _aggregate_no_reference(scores: list[dict[str, Any]]) -> dict[str, Any]:
    return {"quality": None, "quality_reason": NO_REFERENCE_REASON,
            "errors": sum(1 for s in scores if s.get("error"))}


#: Sample.task → how it is scored and aggregated. A dataset with a new kind of answer registers its task from
#: its loader module (imported before any sample is scored): ``TASKS.register("mine", TaskScoring(...))``.
TASKS: Registry = Registry("task scorer", "Sample.task", {
    "rag_igbench": TaskScoring(_score_rag_igbench, _aggregate_rag_igbench),
    "ocrbench": TaskScoring(_score_ocrbench, _aggregate_ocrbench),
    "mcq": TaskScoring(_score_mcq, _aggregate_mcq),
    "no_reference": TaskScoring(_score_no_reference, _aggregate_no_reference),
})


def _aggregate_task(task: str, scores: list[dict[str, Any]]) -> dict[str, Any]:
    return TASKS.load(task).aggregate(scores)


def data_errors(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``metrics.data_errors``: samples that failed because of the data, not the model or the engine.

    A record counts when the run marked it ``error_kind: "data"`` (a defective row or image, with its
    ``error_reason``), or when its scores carry ``reference_fault`` (a reference answer the scorer found
    defective). ``by_reason`` maps each reason code (:data:`harness.datasets.faults.REASONS`) to its count."""
    reasons: dict[str, int] = {}
    for r in records:
        if r.get("error_kind") == "data":
            reason = r.get("error_reason") or "unknown"
        elif (r.get("scores") or {}).get("reference_fault"):
            reason = "reference_image_out_of_range"
        else:
            continue
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"total": sum(reasons.values()), "by_reason": dict(sorted(reasons.items()))}


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json`` ``metrics`` over every record (errors included, as zeros).

    One task: its metrics at the top level. Several tasks (the OCRBench + CCBench mix): each task's
    metrics at the top level too (their key names do not collide: ``ocrbench_*`` / ``mcq_*``), and the
    per-task blocks under ``per_task`` with ``n_samples`` for each. ``data_errors`` (always present) counts
    the samples lost to defective data, by reason (:func:`data_errors`).
    """
    tasks: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        tasks.setdefault(r["task"], []).append(r["scores"])
    blocks = {task: _aggregate_task(task, scores) for task, scores in tasks.items()}
    if len(blocks) == 1:
        return {"n_samples": len(records), **next(iter(blocks.values())), "data_errors": data_errors(records)}
    out: dict[str, Any] = {"n_samples": len(records)}
    for block in blocks.values():
        out.update({k: v for k, v in block.items() if k not in out})
    out["per_task"] = {task: {"n_samples": len(tasks[task]), **block} for task, block in blocks.items()}
    out["data_errors"] = data_errors(records)
    return out

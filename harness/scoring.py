"""Which metrics apply to a sample, by its ``task``: the glue between datasets and ``harness.metrics``.

Each scorer takes the sample, the engine's answer and the scoring config and returns a flat dict of
per-sample scores (with ``format_invalid`` / ``hallucinated_image`` flags and a ``reason`` where the
answer is unusable); ``aggregate`` turns the per-sample records into ``summary.json`` ``metrics``.
A sample that failed before scoring (bad image, engine error) has ``error`` set and counts 0 everywhere.
"""

from __future__ import annotations

from typing import Any

from harness.datasets.base import Sample


def score_sample(sample: Sample, answer: str, scoring_cfg: Any) -> dict[str, Any]:
    """Per-sample scores of ``answer`` under the sample's benchmark definition."""
    if sample.task == "rag_igbench":
        from harness.metrics import rag_igbench

        return rag_igbench.score_sample(
            answer,
            sample.reference["answer"],
            n_candidates=sample.reference["n_candidates"],
            rouge_variant=scoring_cfg.rouge_variant,
        )
    raise KeyError(f"no scorer for task {sample.task!r}")


def aggregate(task: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json`` ``metrics`` over every record (errors included, as zeros)."""
    if task == "rag_igbench":
        from harness.metrics import rag_igbench

        return rag_igbench.aggregate([{**r.get("scores", {}), "error": r.get("error")} for r in records])
    raise KeyError(f"no aggregation for task {task!r}")

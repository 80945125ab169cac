"""VisionZip's statistics: what it did to each request, and the keep rate per image source over a run.

:class:`RequestStats` is the per-request record :func:`harness.engines.hf.visionzip.prepare_visionzip_inputs`
fills (``ctx.requests[row]``; the engine writes its :meth:`RequestStats.as_dict` into the generation's
``extra["visionzip"]``). :func:`keep_rate_by_source` aggregates such per-image counts over many requests —
whichever engine recorded them — for ``summary.json`` (``visionzip.by_source``) and the held-out evaluation.

Why here, beside the algorithm, with nothing but the standard library: the run loop
(:func:`harness.run.summary_blocks.visionzip_summary`) and :mod:`harness.commands.eval_tiny` read these numbers
after generation, for HF and vLLM runs alike; they need neither torch nor an engine's pruning machinery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RequestStats", "keep_rate_by_source"]


@dataclass
class RequestStats:
    """What VisionZip did to one request (one batch row). Images in the order of the request's images."""

    visual_tokens_before: int
    visual_tokens_after: int
    tokens_per_image: list[int] = field(default_factory=list)
    kept_per_image: list[int] = field(default_factory=list)

    @property
    def keep_rate(self) -> float | None:
        return self.visual_tokens_after / self.visual_tokens_before if self.visual_tokens_before else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["keep_rate"] = self.keep_rate
        return d


def keep_rate_by_source(items: Iterable[tuple[Sequence[Any], Sequence[int], Sequence[int]]]
                        ) -> dict[str, dict[str, Any]]:
    """Keep rate per image source over many requests.

    ``items``: iterable of ``(image_sources, tokens_per_image, kept_per_image)``, one per request, images in
    the request's order (e.g. ``meta["image_sources"]`` and a :class:`RequestStats`). Returns, per source:
    ``images``, ``visual_tokens_before``/``after`` (sums), ``keep_rate`` = after / before (token-weighted)
    and ``mean_image_keep_rate`` (mean over images of kept / tokens).
    """
    acc: dict[str, dict[str, Any]] = {}
    for sources, tokens, kept in items:
        if not (len(sources) == len(tokens) == len(kept)):
            raise ValueError(f"per-image lists disagree: {len(sources)} sources, {len(tokens)} sizes, {len(kept)} kept")
        for src, n, k in zip(sources, tokens, kept):
            a = acc.setdefault(str(src), {"images": 0, "visual_tokens_before": 0, "visual_tokens_after": 0,
                                          "_rates": []})
            a["images"] += 1
            a["visual_tokens_before"] += int(n)
            a["visual_tokens_after"] += int(k)
            a["_rates"].append(k / n if n else 1.0)
    out = {}
    for src, a in sorted(acc.items()):
        rates = a.pop("_rates")
        a["keep_rate"] = a["visual_tokens_after"] / a["visual_tokens_before"] if a["visual_tokens_before"] else None
        a["mean_image_keep_rate"] = sum(rates) / len(rates)
        out[src] = a
    return out

"""The report's panels: one per (setup, quality metric) (:func:`panels`, :class:`Panel`), and the Pareto front of
quality against latency drawn on each (:func:`pareto_front`).

Why a module of its own: the Markdown report, the plots and the W&B report show the same panels and fronts, so
they live below those writers (split from harness/report/rows.py) and none of them imports another to get them;
``harness.report.build`` re-exports the names. It sits above harness/report/rows.py (the quality metrics' names:
``QUALITY``) and harness/report/deltas.py (which metrics a setup is judged on: ``quality_metrics_for``, so a panel
shows the metrics the baseline deltas were computed for); neither of them imports it. Reads nothing itself: it
works on rows already loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.report.deltas import quality_metrics_for
from harness.report.rows import QUALITY


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats (latency x lower-or-equal and quality y higher-or-equal, one
    strictly), sorted by latency."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))


@dataclass
class Panel:
    platform: str
    dataset: str
    variant: str
    metric: str
    rows: list[dict[str, Any]]

    @property
    def title(self) -> str:
        return f"{QUALITY[self.metric][0]} · {self.dataset}" + (f" ({self.variant})" if self.variant else "")


def panels(rows: Sequence[dict[str, Any]], metrics: Sequence[str] | None = None) -> list[Panel]:
    """One panel per (setup, quality metric): ``metrics`` (``--metric``) or each setup's default."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    return [Panel(g[0]["platform"], g[0]["dataset"], g[0]["dataset_variant"], m,
                  [r for r in g if r.get(m) is not None])
            for g in groups.values() for m in quality_metrics_for(g, metrics)]

"""Did a timed batch pay a first-time cost? Counters read before and after each batch.

Three detectors, each a monotonically increasing count, so "the batch compiled" is "a count moved":

* the engine's own counters, ``engine.compile_counters() -> {name: int}`` where the engine has them (the HF
  engine: ``cuda_graph_captures`` of its static decoder; a compiled decode path adds its own);
* torch.compile's counters (``torch._dynamo.utils.counters``: ``frames.total`` = frames dynamo converted,
  ``stats.unique_graphs`` = graphs it built), read only when dynamo is already imported (nothing here imports
  torch) and only for the compilations of this process — vLLM compiles in its engine-core process, at start-up;
* a first-seen shape key (:mod:`harness.latency.shapes`): an observed key no warm-up and no earlier timed batch
  ran. On CPU (nothing captured, nothing compiled in eager mode) this is the only detector; for an engine whose
  warm-up does not return its generations the first batch of each key is flagged and re-timed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


def dynamo_counters() -> dict[str, int]:
    """torch.compile's compilation counts in this process ({} when torch._dynamo was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None) if utils is not None else None
    if counters is None:
        return {}
    return {"dynamo_frames": int(sum(counters["frames"].values()) if "frames" in counters else 0),
            "dynamo_graphs": int(counters["stats"].get("unique_graphs", 0) if "stats" in counters else 0)}


def snapshot(engine: Any) -> dict[str, int]:
    """Every counter a batch could move: the engine's own and torch.compile's."""
    out: dict[str, int] = {}
    own = getattr(engine, "compile_counters", None)
    if callable(own):
        try:
            out.update({str(k): int(v) for k, v in (own() or {}).items()})
        except Exception:  # noqa: BLE001 - a counter that cannot be read detects nothing, breaks nothing
            pass
    out.update(dynamo_counters())
    return out


def moved(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """The counters that increased, with by how much."""
    return {k: int(after[k]) - int(before.get(k, 0)) for k in after if int(after[k]) > int(before.get(k, 0))}


def reasons(counter_moves: Mapping[str, int], first_seen: Any | None) -> list[str]:
    """Why a batch is not a clean timing, one phrase each (empty: clean)."""
    out = [f"{k} +{v}" for k, v in sorted(counter_moves.items())]
    if first_seen is not None:
        out.append(f"first-seen shape {list(first_seen)}")
    return out

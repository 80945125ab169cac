"""The variants a paired timing switches between inside one engine: the run's technique, the baseline (every
technique off) and, where asked, trivial baselines at the same budget (``latency.paired_with``).

Why switch inside one loaded engine rather than load a second one: the point of paired timing
(:mod:`harness.latency.paired`) is that both sides run in one process, on one set of weights, on the same
requests, minutes apart at most — a second engine would double the memory of a real model and bring its own
allocator and cold start. What can be switched without reloading is what the HF engine applies per call:

* VisionZip (and its trivial baselines) is applied to each batch's inputs from ``engine.vz_cfg``: ``None`` runs the
  full visual tokens, a copy with ``method=random|pool|first`` (``contextual=0``: the baselines keep tokens
  without merging, at the same kept count) runs a trivial baseline;
* the routing hooks (SERE ``engine.sere``, ``moe.top_k`` / ``moe.routing`` ``engine.moe``) have a ``mode``;
  ``off`` leaves the router's output untouched, exactly the stock model (the hooks' own tests check it bit for
  bit). On the CUDA-graph decode path the decoder's fingerprint includes that mode, so a switch recaptures the
  graph; the latency protocol sees the capture and re-times that batch (``latency.on_compile``).

Expert offload cannot be switched (its experts left the device) and vLLM fixes its techniques when the engine
starts: ``latency.paired`` is refused there (harness/run/rules_latency.py). Only the standard library is imported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.latency.shapes import technique_state

VZ_BASELINES = ("random", "pool", "first")


@dataclass
class Variant:
    """One side of a paired timing: ``name`` (its label in ``summary.json``), ``role`` (``technique``,
    ``baseline`` or ``trivial``), ``apply`` (puts the engine in this variant) and ``restore`` (puts back what the
    run configured)."""

    name: str
    role: str
    apply: Callable[[], None]
    restore: Callable[[], None]


def _handles(engine: Any) -> list[Any]:
    return [h for h in (getattr(engine, "sere", None), getattr(engine, "moe", None)) if h is not None]


def technique_label(cfg: Any) -> str:
    """The run's technique in a few words (``visionzip keep=0.5 + sere K=2``), from :mod:`harness.latency.shapes`."""
    return technique_state(cfg)


def paired_variants(engine: Any, cfg: Any, paired_with: Sequence[str] = ()) -> list[Variant]:
    """The variants to interleave: the run's technique first, then the baseline, then each trivial baseline of
    ``paired_with``. Raises ValueError when the engine has nothing to switch (validation refuses that earlier)."""
    vz_cfg = getattr(engine, "vz_cfg", None)
    handles = _handles(engine)
    if vz_cfg is None and not handles:
        raise ValueError("latency.paired: the engine runs no technique it can switch off (VisionZip, SERE, moe.*)")
    modes = [h.mode for h in handles]

    def restore() -> None:
        engine.vz_cfg = vz_cfg
        for h, m in zip(handles, modes):
            h.mode = m

    def baseline() -> None:
        engine.vz_cfg = None
        for h in handles:
            h.mode = "off"

    out = [Variant(technique_label(cfg), "technique", restore, restore), Variant("baseline", "baseline", baseline,
                                                                                 restore)]
    for method in paired_with:
        if vz_cfg is None:
            raise ValueError(f"latency.paired_with={method}: a VisionZip baseline needs visionzip.keep < 1")
        trivial = copy.deepcopy(vz_cfg)
        trivial.method, trivial.contextual = method, 0.0

        def apply(t: Any = trivial) -> None:
            engine.vz_cfg = t
            for h in handles:  # the budget is VisionZip's; the routing techniques stay as configured
                h.mode = modes[handles.index(h)]

        out.append(Variant(f"{method} keep={vz_cfg.keep:g}", "trivial", apply, restore))
    return out

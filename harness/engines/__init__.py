"""Inference engines, by name (``engine.name``), imported only when chosen.

Every engine implements :class:`~harness.engines.base.Engine`: the run hands it requests and gets
generations with timings back; scoring and result files are the run's job, identical for all engines.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

ENGINES: dict[str, str] = {
    "hf": "harness.engines.hf.engine:HFEngine",
    "vllm": "harness.engines.vllm.engine:VLLMEngine",
}


def make_engine(name: str, model_path: str, engine_cfg: Any, generation_cfg: Any, **kwargs: Any):
    """Build the engine registered under ``name``; an unknown name suggests the nearest ones."""
    if name not in ENGINES:
        near = difflib.get_close_matches(name, ENGINES, n=3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        raise KeyError(f"unknown engine {name!r} (engine.name).{hint} Known: {sorted(ENGINES)}")
    module, attr = ENGINES[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(model_path, engine_cfg, generation_cfg, **kwargs)

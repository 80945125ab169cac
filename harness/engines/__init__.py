"""Inference engines, by name (``engine.name``), imported only when chosen.

Every engine implements :class:`~harness.engines.base.Engine`: the run hands it requests and gets
generations with timings back; scoring and result files are the run's job, identical for all engines.
"""

from __future__ import annotations

from typing import Any

from harness.registry import Registry

#: engine.name → the engine class (``"module:Class"``, imported only when chosen). A plugin adds its own with
#: ``ENGINES.register("mine", "mypkg.engine:MyEngine")``.
ENGINES: Registry = Registry("engine", "engine.name", {
    "hf": "harness.engines.hf.engine:HFEngine",
    "vllm": "harness.engines.vllm.engine:VLLMEngine",
})


def make_engine(name: str, model_path: str, engine_cfg: Any, generation_cfg: Any, **kwargs: Any):
    """Build the engine registered under ``name``; an unknown name suggests the nearest ones."""
    cls = ENGINES.load(name)
    return cls(model_path, engine_cfg, generation_cfg, **kwargs)

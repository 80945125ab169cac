"""Inference engines, by name (``engine.name``), imported only when chosen.

Every engine implements :class:`~harness.engines.base.Engine`: the run hands it requests and gets
generations with timings back; scoring and result files are the run's job, identical for all engines.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from harness.engines.base import EngineUnavailable
from harness.registry import Registry

#: engine.name → the engine class (``"module:Class"``, imported only when chosen). A plugin adds its own with
#: ``ENGINES.register("mine", "mypkg.engine:MyEngine")``.
ENGINES: Registry = Registry("engine", "engine.name", {
    "hf": "harness.engines.hf.engine:HFEngine",
    "vllm": "harness.engines.vllm.engine:VLLMEngine",
})


def make_engine(name: str, model_path: str, engine_cfg: Any, generation_cfg: Any, **kwargs: Any):
    """Build the engine registered under ``name``; an unknown name suggests the nearest ones. An engine class may
    name the packages it needs (``requires``) and how to get them (``install_hint``): a missing one is an
    :class:`EngineUnavailable` before anything loads, not an import error deep inside the engine."""
    cls = ENGINES.load(name)
    missing = [pkg for pkg in getattr(cls, "requires", ()) if importlib.util.find_spec(pkg) is None]
    if missing:
        raise EngineUnavailable(f"engine={name} needs {', '.join(missing)}, which this Python "
                                f"({sys.executable}) does not have: {getattr(cls, 'install_hint', 'install it')}")
    return cls(model_path, engine_cfg, generation_cfg, **kwargs)

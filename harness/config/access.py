"""One accessor for a config value, whatever form its group arrives in.

Why: engines, techniques and the vLLM worker processes receive config groups as OmegaConf nodes, plain dicts
(settings shipped to another process), dataclasses or None (tests pass plain objects; the GPU machine runs
benchmarks without OmegaConf). Each used to carry its own ``getattr``/``.get`` dance; this is the one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["setting"]


def setting(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` of a config group given as a dict, a dataclass, an OmegaConf node or None (``default`` when
    absent)."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    try:
        return getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - OmegaConf raises on missing keys of structured configs
        return default

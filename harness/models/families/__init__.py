"""The model-family registry: one small module per MoE family, keyed by the config's ``model_type``.

``family_of(model_or_config)`` finds a model's family (a multimodal config is looked up by its own
``model_type``, then by its text config's); ``get(name)`` by family name; ``all_families()`` lists them.
Adding a family = one module here that calls :func:`register` with a :class:`MoeFamily`, plus one line in
``_MODULES`` below; no engine changes (README "Add a model family", docs/families.md).

Imports: the standard library and torch (lazily); never an engine (shared/notes/layout.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.models.families.base import MoeFamily, RoutingRule, text_config

__all__ = ["MoeFamily", "RoutingRule", "all_families", "family_of", "get", "register", "text_config"]

_BY_NAME: dict[str, MoeFamily] = {}
_BY_TYPE: dict[str, MoeFamily] = {}
_MODULES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek", "gpt_oss", "qwen3_5_moe")
_loaded = False


def register(family: MoeFamily) -> MoeFamily:
    """Add ``family`` (idempotent for the same object; a second family claiming a name or model type fails)."""
    for key, table in ((family.name, _BY_NAME), *((t, _BY_TYPE) for t in family.model_types)):
        other = table.get(key)
        if other is not None and other is not family:
            raise ValueError(f"model family {family.name!r}: {key!r} is already registered by {other.name!r}")
    _BY_NAME[family.name] = family
    for t in family.model_types:
        _BY_TYPE[t] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _MODULES:
            importlib.import_module(f"harness.models.families.{mod}")


def all_families() -> list[MoeFamily]:
    _load()
    return list(_BY_NAME.values())


def get(name: str) -> MoeFamily:
    """The family called ``name``; a KeyError that lists the known ones."""
    _load()
    if name not in _BY_NAME:
        raise KeyError(f"unknown model family {name!r}: known {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def family_of(obj: Any) -> MoeFamily | None:
    """The family of a model or a transformers config (None: a model type no family claims)."""
    _load()
    config = getattr(obj, "config", obj)
    for cfg in (config, text_config(config)):
        fam = _BY_TYPE.get(str(getattr(cfg, "model_type", "") or ""))
        if fam is not None:
            return fam
    return None

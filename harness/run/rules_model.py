"""The values the checkpoint decides: harness/run/validate.py's third pass
(:func:`~harness.run.validate.validate_model`) checks :data:`MODEL_RULES` against the numbers read here.

Why apart from the config tables: ``visionzip.layer``, ``sere.k``, ``sere.protect``, ``offload.capacity`` and
``moe.top_k`` are right or wrong only against what the checkpoint's ``config.json`` says (vision depth, experts per
layer, experts per token). Those numbers are known once that one small file is read, before the weights load, and
not when the config is composed. This module says which numbers count (:class:`ModelFacts`), how they are read
from the architectures' ``config.json`` layouts (:func:`model_facts`, :func:`read_model_config`) and which keys are
checked against them (:data:`MODEL_RULES`). harness/run/rules_files.py checks the SERE and offload artifacts
against the same :class:`ModelFacts`. Besides the rules' vocabulary and the offload predicate, only the standard
library is imported at module level (huggingface_hub inside :func:`read_model_config`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config.checks import _select, _sere_on, _vz_on
from harness.run.rules_offload import _offload_caches


@dataclass(frozen=True)
class ModelFacts:
    """What the checkpoint's ``config.json`` decides (None where the architecture has no such thing)."""

    num_experts: int | None = None
    experts_per_token: int | None = None
    vision_depth: int | None = None


@dataclass(frozen=True)
class ModelRule:
    """``key`` checked against a number of the model (:class:`ModelFacts` attribute ``fact``)."""

    key: str
    fact: str
    applies: Callable[[Any], bool]
    ok: Callable[[Any, int], bool]
    allowed: Callable[[int], str]


def _moe_top_k(cfg: Any) -> Any:
    """``moe.top_k``, or None where the config has no ``moe`` group yet (its rules stay inert until it exists).
    Shared with validate.py's cross-key rules (``sere.k`` below ``moe.top_k``, the engines that implement it)."""
    return _select(cfg, "moe.top_k", None)


#: Keys checked against the checkpoint's numbers (in this order: the first refusal is the one reported).
MODEL_RULES: tuple[ModelRule, ...] = (
    ModelRule("visionzip.layer", "vision_depth", _vz_on, lambda v, d: -d <= v < d,
              lambda d: f"an integer in [{-d}, {d - 1}] (the vision tower has {d} blocks)"),
    ModelRule("sere.k", "experts_per_token", _sere_on,
              lambda v, k: 1 <= v < k, lambda k: f"an integer in [1, {k - 1}] (the model routes each token to {k} "
                                                 "experts; sere.k >= that moves nothing; 0 or null = off)"),
    ModelRule("sere.protect", "num_experts", _sere_on, lambda v, e: 0 <= v < e,
              lambda e: f"an integer in [0, {e - 1}] (the model has {e} experts per layer)"),
    ModelRule("offload.capacity", "num_experts", lambda cfg: _offload_caches(cfg) and cfg.offload.capacity is not None,
              lambda v, e: 1 <= v <= e, lambda e: f"an integer in [1, {e}] (slots per MoE layer; the model has {e} "
                                                  "experts per layer)"),
    ModelRule("moe.top_k", "experts_per_token", lambda cfg: _moe_top_k(cfg) is not None,
              lambda v, k: 1 <= v < k, lambda k: f"an integer in [1, {k - 1}] (the model's top-k is {k}; null = "
                                                 "unchanged)"),
)


def model_facts(config: dict[str, Any]) -> ModelFacts:
    """:class:`ModelFacts` from a ``config.json`` (Qwen3-VL-MoE nests ``text_config``/``vision_config``; text-only
    MoE models keep the numbers at the top level)."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}

    def first(d: dict[str, Any], *names: str) -> int | None:
        return next((int(d[n]) for n in names if isinstance(d.get(n), int)), None)

    return ModelFacts(num_experts=first(text, "num_experts", "num_local_experts", "n_routed_experts"),
                      experts_per_token=first(text, "num_experts_per_tok", "moe_top_k"),
                      vision_depth=first(vision, "depth", "num_hidden_layers"))


def read_model_config(model_path: str) -> dict[str, Any] | None:
    """The checkpoint's ``config.json`` (a local directory, or the hub cache / hub), or None if unreadable:
    then the engine's own loading reports the problem."""
    local = Path(model_path).expanduser()
    try:
        if local.is_dir():
            return json.loads((local / "config.json").read_text(encoding="utf-8"))
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_path)):
            return None  # neither a directory nor a hub id: the engine decides what it is
        from huggingface_hub import hf_hub_download

        try:  # the hub cache first: no network for a checkpoint already there
            path = hf_hub_download(repo_id=model_path, filename="config.json", local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached: fetch the one small file the weights load would fetch first
            path = hf_hub_download(repo_id=model_path, filename="config.json")
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - not readable here: loading the model will say why
        return None

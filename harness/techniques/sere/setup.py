"""SERE's artifacts from the ``sere`` config group: the expert-similarity matrices and the protected-expert mask
a run needs, read from the files the config names or computed on the stock model and cached.

Why here and not in an engine: both engines need the same two artifacts from the same keys (the HF engine
installs them as hooks, the vLLM engine ships them to its workers), so the decision "read or compute, with which
calibration data" is written once, beside the algorithms it feeds (layout note, part 15).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.config.access import setting
from harness.techniques.sere.calibration import DEFAULT_MAX_TOKENS, load_similarity, similarity_for
from harness.techniques.sere.protection import load_protection, protection_for

__all__ = ["calibration_kwargs", "sere_artifacts_from_config"]


def calibration_kwargs(sere_cfg: Any) -> dict[str, Any]:
    """``text_path`` / ``text_field`` / ``max_tokens`` for the calibration builders from ``sere.calibration_*``
    (absent keys: the builders' defaults)."""
    return {"text_path": setting(sere_cfg, "calibration_text") or None,
            "text_field": setting(sere_cfg, "calibration_field") or None,
            "max_tokens": int(setting(sere_cfg, "calibration_tokens") or DEFAULT_MAX_TOKENS)}


def sere_artifacts_from_config(model: torch.nn.Module, tokenizer: Any, sere_cfg: Any, model_id: str,
                               cache_dir: str | None = None) -> tuple[dict, dict | None] | None:
    """``(similarity, protected)`` for the ``sere`` config group (read, or computed on the stock model and
    cached), None when ``sere.k`` is null. Separate from installing, so the engine can compute them before
    any routing hook is on the model and install ``moe.top_k`` before SERE."""
    if sere_cfg.k is None:
        return None
    data = calibration_kwargs(sere_cfg)
    if sere_cfg.similarity:
        similarity, _ = load_similarity(sere_cfg.similarity)
    else:
        similarity = similarity_for(model, tokenizer, model_id, cache_dir, **data)
    protected = None
    n = int(sere_cfg.protect or 0)
    if n > 0 or sere_cfg.protection:
        if sere_cfg.protection:
            protected, _ = load_protection(sere_cfg.protection, n=n or None)
        else:
            protected = protection_for(model, tokenizer, model_id, similarity, int(sere_cfg.k),
                                       float(sere_cfg.rho), n, cache_dir, **data)
    return similarity, protected

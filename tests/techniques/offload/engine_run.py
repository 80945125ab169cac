"""What the offload engine tests share: the HF engine on the embedded trained tiny model (CPU, float32) with an
``offload`` block, and one run of fixed prompts through it (warm-up, generation, the engine's offload stats)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from harness.engines.base import Request
from harness.models.trained import trained_checkpoint

PROMPTS = ["hello there", "旅游 美食 推荐", "describe the city at night", "1 2 3 4"]


def make_engine(offload: dict[str, Any] | None = None, batch_size: int = 2, max_new: int = 12):
    from harness.config.schema import EngineConfig, GenerationConfig
    from harness.engines.hf.engine import HFEngine

    path, _ = trained_checkpoint()
    cfg = EngineConfig(device="cpu", dtype="float32", batch_size=batch_size)
    return HFEngine(str(path), cfg, GenerationConfig(max_new_tokens=max_new), sere_cfg=SimpleNamespace(k=None),
                    offload_cfg=offload)


def run(engine) -> tuple[list[str], list[int], dict[str, Any] | None]:
    """(texts, output token counts, ``technique_stats()["offload"]``) of :data:`PROMPTS`; closes the engine."""
    reqs = [Request(uid=str(i), content=[{"type": "text", "text": t}]) for i, t in enumerate(PROMPTS)]
    try:
        engine.warmup(reqs[:2])
        gens = engine.generate(reqs)
        stats = engine.technique_stats().get("offload")
    finally:
        engine.close()
    assert all(g.error is None for g in gens), [g.error for g in gens]
    return [g.text for g in gens], [g.output_tokens for g in gens], stats

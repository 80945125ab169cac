"""``moe.top_k=3`` with ``sere.k=1`` in vLLM: SERE re-routes the truncated routing, the same greedy ids as HF
with the two hooks chained (``hf_topk`` first, then ``hf_sere``); both statistics blocks from the worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_lane_helpers import MAX_NEW, engine_cfg, gen_cfg

TOP_K, K, RHO, E, LAYERS = 3, 1, 0.2, 16, (0, 1, 2)


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    from harness.techniques.sere.calibration import save_similarity

    gen = torch.Generator().manual_seed(5)
    sims = {layer: torch.rand(E, E, generator=gen) for layer in LAYERS}
    path = save_similarity(tmp_path_factory.mktemp("sere") / "sim.safetensors", sims, {})
    return sims, str(path)


@pytest.fixture(scope="module")
def engine(tiny_model_path, sims):
    from harness.engines.vllm.engine import VLLMEngine

    sere = SimpleNamespace(k=K, rho=RHO, protect=0, similarity=sims[1], protection=None)
    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(), max_images_per_prompt=2, sere_cfg=sere,
                     moe_cfg=SimpleNamespace(top_k=TOP_K, scope="decode"))
    yield eng
    eng.close()


def hf_both(hf_ref, sims, request):
    from harness.engines.hf.sere import install_sere
    from harness.engines.hf.topk import install_topk
    from harness.techniques.sere.reroute import reroute

    with install_topk(hf_ref.model, TOP_K), install_sere(hf_ref.model, sims[0], K, RHO, op=reroute):
        return hf_ref.generate(request, MAX_NEW)


def test_token_for_token_and_statistics(engine, hf_ref, sims, requests_text_images):
    from harness.engines.hf.topk import install_topk

    text, images = requests_text_images
    info = engine.describe()
    assert info["moe"]["top_k"] == TOP_K and info["sere"]["k"] == K
    differs_from_plain = 0
    for r in text + images:
        gen = engine.generate_batch([r])[0]
        assert gen.error is None, gen.error
        assert gen.extra["token_ids"] == hf_both(hf_ref, sims, r)["ids"], r.uid
        with install_topk(hf_ref.model, TOP_K):
            differs_from_plain += gen.extra["token_ids"] != hf_ref.generate(r, MAX_NEW)["ids"]
    assert differs_from_plain > 0  # SERE did re-route the truncated routing
    engine.warmup(text[:1])
    gens = engine.generate_batch(text[:1])
    st = engine.technique_stats()
    assert st["moe"]["top_k"] == TOP_K and st["sere"]["k_primary"] == K
    assert st["sere"]["expert_union_before"] == pytest.approx(st["moe"]["expert_union_after"])
    for layer in st["sere"]["per_layer"]:                  # secondary slots of the top-3 routing only
        assert layer["secondary_slots"] == layer["tokens"] * (TOP_K - K)
    assert st["sere"]["steps"] == gens[0].output_tokens - 1

"""SERE in vLLM through the plugin: the same token ids as HF with the reference re-routing on decode steps,
decode rows only (also inside a mixed chunked-prefill batch), as the plugin's trace records it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_lane_helpers import MAX_NEW, engine_cfg, gen_cfg

K, RHO, E, LAYERS = 2, 0.3, 16, (0, 1, 2)
BUDGET = 48  # max_num_batched_tokens: long prompts are prefilled in chunks, beside decoding requests


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from harness.techniques.sere.calibration import save_similarity
    from harness.techniques.sere.protection import save_protection

    root = tmp_path_factory.mktemp("sere")
    gen = torch.Generator().manual_seed(1)
    sims = {layer: torch.rand(E, E, generator=gen) for layer in LAYERS}
    prot = {}
    for layer in LAYERS:
        prot[layer] = torch.zeros(E, dtype=torch.bool)
        prot[layer][torch.randperm(E, generator=gen)[:3]] = True
    return SimpleNamespace(sims=sims, prot=prot, sim_path=str(save_similarity(root / "sim.safetensors", sims, {})),
                           prot_path=str(save_protection(root / "prot.safetensors", prot, {"n": 3})),
                           trace=root / "trace.jsonl")


@pytest.fixture(scope="module")
def engine(tiny_model_path, artifacts):
    from harness.engines.vllm.engine import VLLMEngine

    sere = SimpleNamespace(k=K, rho=RHO, protect=0, similarity=artifacts.sim_path, protection=artifacts.prot_path)
    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(), max_images_per_prompt=2, sere_cfg=sere,
                     sere_trace=str(artifacts.trace), engine_kwargs={"max_num_batched_tokens": BUDGET})
    yield eng
    eng.close()


class _HFSere:
    """HF generation with the reference re-routing hooked on every router, decode steps only."""

    def __init__(self, hf_ref, artifacts):
        self.hf, self.a = hf_ref, artifacts

    def generate(self, request, max_new_tokens=MAX_NEW):
        from harness.engines.hf.sere import install_sere
        from harness.techniques.sere.reroute import reroute

        with install_sere(self.hf.model, self.a.sims, K, RHO, self.a.prot, mode="decode", op=reroute):
            return self.hf.generate(request, max_new_tokens)


@pytest.fixture(scope="module")
def hf_sere(hf_ref, artifacts):
    return _HFSere(hf_ref, artifacts)


def _trace(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_engine_exports_the_settings_and_describes_them(engine, artifacts):
    info = engine.describe()["sere"]
    assert info["k"] == K and info["rho"] == RHO and info["similarity"] == artifacts.sim_path
    assert info["protection"] == artifacts.prot_path


def test_routing_statistics_from_the_worker(engine, requests_text_images):
    text, _ = requests_text_images
    engine.warmup(text[:1])  # resets the statistics
    assert engine.technique_stats()["sere"]["steps"] == 0
    gens = engine.generate_batch(text[:2])
    st = engine.technique_stats()["sere"]
    assert st["k_primary"] == K and st["layers"] == len(LAYERS) and st["workers"] == 1
    # one decode step per generated token after the first; both requests decode side by side
    assert st["steps"] == max(g.output_tokens for g in gens) - 1
    assert st["expert_union_after"] <= st["expert_union_before"] and 0 < st["moved_fraction"] <= 1
    assert st["primary_union"] <= st["expert_union_after"]
    for layer in st["per_layer"]:
        assert layer["tokens"] == sum(g.output_tokens - 1 for g in gens)
        assert layer["secondary_slots"] == layer["tokens"] * (4 - K)
        assert layer["protected"] == 3
        assert layer["calls"] == st["steps"] and layer["rows"] == layer["tokens"]   # device counters
    # the engagement canary agrees: every fed decode token was a decode row of every layer
    verdict = st["engagement"]
    assert verdict["ok"], verdict["reason"]
    assert verdict["decode_tokens"] == sum(g.output_tokens - 1 for g in gens)
    assert set(verdict["layers"]) == {str(layer) for layer in LAYERS}


def test_sere_token_for_token_and_decode_rows_only(engine, hf_sere, hf_ref, requests_text_images, artifacts):
    text, images = requests_text_images
    requests = text + images
    artifacts.trace.unlink(missing_ok=True)
    gens = []
    for r in requests:  # one at a time: P is the decode batch's union, so batch composition matters
        gen = engine.generate_batch([r])[0]
        assert gen.error is None, gen.error
        ref = hf_sere.generate(r)
        assert gen.extra["token_ids"] == ref["ids"], r.uid
        assert gen.output_tokens == len(ref["ids"])
        gens.append((r, gen))
    # the technique did something: at least one request differs from the stock model
    assert any(g.extra["token_ids"] != hf_ref.generate(r)["ids"] for r, g in gens)

    calls = _trace(artifacts.trace)
    assert calls and all(c["mask"] for c in calls)
    assert not any(c["prefill_changed"] for c in calls)
    assert engine.technique_stats()["sere"]["engagement"]["ok"]
    for layer in LAYERS:
        mine = [c for c in calls if c["layer"] == layer]
        decode = [c for c in mine if c["decode_rows"]]
        prefill = [c for c in mine if not c["decode_rows"]]
        # one decode step per generated token after the first (the first comes from the prefill step)
        assert len(decode) == sum(g.output_tokens - 1 for _, g in gens)
        assert all(c["rows"] == 1 and c["decode_rows"] == [0] for c in decode)
        # prefill steps: every prompt token, none treated as decode
        assert sum(c["rows"] for c in prefill) == sum(g.prompt_tokens for _, g in gens)
        assert sum(c["moved"] for c in decode) > 0


def test_mixed_chunked_prefill_batch_reroutes_decode_rows_only(engine, hf_sere, artifacts):
    """A short request decodes while a long one is prefilled in chunks beside it (token budget 48): the
    decode rows are re-routed with P taken from decode rows only, the prefill rows are untouched — so both
    requests produce exactly what each produces alone with HF + reference SERE."""
    from harness.engines.base import Request

    short = Request("short", [{"type": "text", "text": "旅游 美食 穿搭"}])
    words = "旅游 美食 穿搭 护肤 健身 数码 家居 理财 教育 宠物 摄影 咖啡 面包 火锅 蛋糕 城市 公园 海边".split()
    long = Request("long", [{"type": "text", "text": " ".join(words * 4)}])
    n_short, n_long = 4, 6
    ref_short, ref_long = hf_sere.generate(short, n_short), hf_sere.generate(long, n_long)
    assert ref_long["prompt_tokens"] > 2 * BUDGET  # prefilled over several steps

    artifacts.trace.unlink(missing_ok=True)
    outs = engine._llm.generate([engine.prompt(short), engine.prompt(long)],
                                [engine.sampling_params(n_short), engine.sampling_params(n_long)], use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == ref_short["ids"]
    assert list(outs[1].outputs[0].token_ids) == ref_long["ids"]

    calls = _trace(artifacts.trace)
    assert not any(c["prefill_changed"] for c in calls)
    mixed = [c for c in calls if c["decode_rows"] and len(c["decode_rows"]) < c["rows"]]
    assert mixed, "no mixed prefill/decode step happened: the test did not test what it says"
    for c in mixed:
        assert len(c["decode_rows"]) == 1  # the short request's one token; the chunk's rows are prefill
    assert any(c["moved"] for c in mixed)

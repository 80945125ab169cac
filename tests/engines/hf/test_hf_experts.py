"""``harness_fused_moe`` in transformers' experts registry, on the embedded tiny Qwen3-VL-MoE (float32, CPU).

- registration is idempotent and makes the name valid for ``from_pretrained`` / ``set_experts_implementation``;
- greedy tokens with the registered implementation equal those of ``eager`` (on CPU the registered function
  runs the float32 reference);
- the real Triton kernels (interpreter on CPU) reproduce the eager experts on every MoE block, fed the
  hidden states and routing the blocks really see in a prefill and a decode pass, and drive one short
  greedy generation to the same tokens;
- passes above ``MAX_FUSED_TOKENS`` (prefill) go to transformers' grouped_mm; unsupported layouts raise;
- GPU only: the registry function at Qwen3-30B-A3B shapes in bf16 against grouped_mm and the reference.
"""

from __future__ import annotations

import pytest
import torch

from harness.engines.hf import experts as hf_experts
from harness.kernels.fused_moe import fused_moe_triton, triton_available
from harness.models.tiny import TinyModelSpec, ensure_tiny_model

MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    hf_experts.register()
    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("tiny"))
    proc = AutoProcessor.from_pretrained(path)
    proc.tokenizer.padding_side = "left"

    def chat(parts):
        return proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)

    texts = [
        chat([{"type": "text", "text": "What is the best food in the city park?"}]),
        chat([{"type": "image"}, {"type": "text", "text": "请描述这张图片"}]),
        chat([{"type": "text", "text": "旅游 美食 2024 answer"}]),
    ]
    batch = proc(text=texts, images=[Image.new("RGB", (64, 48), (200, 30, 30))], return_tensors="pt", padding=True)
    short = proc(text=[chat([{"type": "text", "text": "cat dog"}])], return_tensors="pt")
    load = lambda impl: AutoModelForImageTextToText.from_pretrained(  # noqa: E731
        path, dtype=torch.float32, experts_implementation=impl).eval()
    return {"load": load, "eager": load("eager"), "proc": proc, "batch": batch, "short": short}


def generate(model, proc, inputs, max_new=MAX_NEW):
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=proc.tokenizer.pad_token_id)
    return out[:, inputs["input_ids"].shape[1]:]


def moe_experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]


def test_register_is_idempotent_and_valid():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    assert hf_experts.register() == hf_experts.NAME == "harness_fused_moe"
    before = dict(ExpertsInterface._global_mapping)
    hf_experts.register()
    assert dict(ExpertsInterface._global_mapping) == before
    assert hf_experts.is_registered()
    assert ALL_EXPERTS_FUNCTIONS[hf_experts.NAME] is hf_experts.experts_forward
    assert hf_experts.NAME in ExpertsInterface()          # every instance of the interface sees it


def test_from_pretrained_and_switch(tiny):
    model = tiny["load"](hf_experts.NAME)
    assert model.config.text_config._experts_implementation == hf_experts.NAME
    experts = moe_experts(model)
    assert experts and all(e.config._experts_implementation == hf_experts.NAME for e in experts)
    assert all(hf_experts.unsupported_reason(e) is None for e in experts)
    model.set_experts_implementation("eager")
    assert all(e.config._experts_implementation == "eager" for e in experts)
    model.set_experts_implementation(hf_experts.NAME)
    assert all(e.config._experts_implementation == hf_experts.NAME for e in experts)


def test_greedy_tokens_equal_eager(tiny, monkeypatch):
    calls = []
    reference = hf_experts.fused_moe_reference
    monkeypatch.setattr(hf_experts, "fused_moe_reference", lambda *a: calls.append(a[0].shape[0]) or reference(*a))
    model = tiny["load"](hf_experts.NAME)
    want = generate(tiny["eager"], tiny["proc"], tiny["batch"])
    got = generate(model, tiny["proc"], tiny["batch"])
    assert torch.equal(got, want)
    layers = len(moe_experts(model))
    assert len(calls) == layers * MAX_NEW and calls[-1] == 3      # every pass of every layer went through ours


def test_large_passes_go_to_grouped_mm(tiny, monkeypatch):
    """Above MAX_FUSED_TOKENS (a prefill) the stock grouped_mm runs; decode steps still use ours."""
    import transformers.integrations.moe as moe

    calls = []
    stock = moe.grouped_mm_experts_forward
    monkeypatch.setattr(moe, "grouped_mm_experts_forward", lambda *a: calls.append(a[1].shape[0]) or stock(*a))
    monkeypatch.setattr(hf_experts, "MAX_FUSED_TOKENS", 8)
    model = tiny["load"](hf_experts.NAME)
    want = generate(tiny["eager"], tiny["proc"], tiny["batch"])
    assert torch.equal(generate(model, tiny["proc"], tiny["batch"]), want)
    layers = len(moe_experts(model))
    assert len(calls) == layers and min(calls) > 8          # the prefill pass only, every layer


def capture_experts_inputs(model, proc, inputs):
    """[(experts module, hidden, ids, weights, eager output)] for the prefill and first decode pass."""
    seen = []

    def hook(module, args, output):
        seen.append((module, *(a.detach().clone() for a in args[:3]), output.detach().clone()))

    hooks = [experts.register_forward_hook(hook) for experts in moe_experts(model)]
    try:
        generate(model, proc, inputs, max_new=2)
    finally:
        for h in hooks:
            h.remove()
    return seen


# Where the Triton path runs: the GPU when there is one, else CPU tensors through the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(TRITON_DEVICE),
                                  reason="needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")


@needs_triton
def test_triton_kernel_matches_eager_experts_on_every_block(tiny):
    model = tiny["eager"]
    passes = capture_experts_inputs(model, tiny["proc"], tiny["batch"])
    layers = len(moe_experts(model))
    assert len(passes) == 2 * layers                       # prefill + one decode step, every layer
    assert passes[0][1].shape[0] > passes[-1][1].shape[0] == 3
    for experts, hidden, ids, weights, eager_out in passes:
        w1, w2 = (w.detach().to(TRITON_DEVICE) for w in (experts.gate_up_proj, experts.down_proj))
        got = fused_moe_triton(hidden.to(TRITON_DEVICE), w1, w2, ids.to(TRITON_DEVICE), weights.to(TRITON_DEVICE))
        err = float((got.cpu() - eager_out).norm() / eager_out.norm())
        assert err < 1e-5, (tuple(hidden.shape), err)


@needs_triton
def test_registered_triton_backend_greedy(tiny, monkeypatch):
    """Greedy tokens through the registry with the real kernels (interpreter on CPU, the GPU if present)."""
    monkeypatch.setattr(hf_experts, "CPU_BACKEND", "triton")
    calls = []
    triton_path = hf_experts.fused_moe
    monkeypatch.setattr(hf_experts, "fused_moe", lambda *a: calls.append(a[0].device.type) or triton_path(*a))
    eager = tiny["load"]("eager").to(TRITON_DEVICE)
    model = tiny["load"](hf_experts.NAME).to(TRITON_DEVICE)
    inputs = tiny["short"].to(TRITON_DEVICE)
    want = generate(eager, tiny["proc"], inputs, max_new=2)
    assert torch.equal(generate(model, tiny["proc"], inputs, max_new=2), want)
    assert calls and set(calls) == {TRITON_DEVICE}


def test_unsupported_layout_raises(tiny, monkeypatch):
    experts = moe_experts(tiny["eager"])[0]
    hidden = torch.randn(2, experts.gate_up_proj.shape[-1])
    ids, weights = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    monkeypatch.setattr(experts, "has_bias", True)
    with pytest.raises(NotImplementedError, match="has_bias"):
        hf_experts.experts_forward(experts, hidden, ids, weights)
    monkeypatch.setattr(experts, "has_bias", False)
    monkeypatch.setattr(experts, "act_fn", torch.nn.GELU())
    with pytest.raises(NotImplementedError, match="SiLU"):
        hf_experts.experts_forward(experts, hidden, ids, weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: bf16 experts at Qwen3-30B-A3B shapes")
def test_gpu_registry_matches_grouped_mm_at_real_shapes():
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from harness.kernels.fused_moe_reference import fused_moe_reference

    hf_experts.register()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            num_hidden_layers=1)
    config._experts_implementation = hf_experts.NAME
    with torch.device("cuda"):
        experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 2048 ** -0.5)
        experts.down_proj.normal_(0, 768 ** -0.5)
    for tokens in (1, 16, 128):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        top, ids = torch.randn(tokens, 128, device="cuda").softmax(-1).topk(8)
        weights = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)
        with torch.inference_mode():
            got = experts(x, ids, weights)                               # dispatched through the registry
            stock = ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, ids, weights)
        want = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, ids, weights, out_dtype=torch.float32)
        err = float((got.float() - want).norm() / want.norm())
        stock_err = float((stock.float() - want).norm() / want.norm())
        assert err < 1e-2 and err <= 2 * stock_err + 1e-3, (tokens, err, stock_err)

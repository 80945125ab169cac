"""The packed-QKV decode forward (``harness.engines.hf.decode_forward``) computes what transformers' forward does.

CPU, tiny Qwen3-VL-MoE in float32: the norm is bit-identical to the module's; q/k/v of one decode token equal the
original projections + norms + RoPE; greedy tokens through ``generate`` and the static decoder equal the original
forward's, with SDPA and with the Triton decode kernel (interpreter); prefill passes never take it; weights are
views of the packed tensor (no second copy); other attention classes are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_graphs import decoder, image_batch, load, stock, text_batch

from harness.engines.hf import attention_decode as hf_attention_decode
from harness.engines.hf import decode_forward as hf_decode_forward
from harness.kernels.decode_attention import triton_available

NEW = 8
# With the Triton decode kernel, which runs in the interpreter on CPU (seconds per launch: one per layer, decode
# step and generation), 3 decode steps per generation instead of 7: ~14 % of the main suite's time became ~7 %.
NEW_INTERPRETED = 4




def attention_layers(model):
    return [m for n, m in model.named_modules() if n.endswith("self_attn") and "visual" not in n]


def test_norm_is_bit_identical(tiny_path):
    model, _ = load(tiny_path)
    attn = attention_layers(model)[0]
    x = torch.randn(3, 1, model.config.text_config.num_attention_heads, attn.head_dim)
    assert torch.equal(hf_decode_forward._rms(x, attn.q_norm.weight, attn.q_norm.variance_epsilon), attn.q_norm(x))


def test_heads_equal_the_original_path(tiny_path):
    import sys

    model, _ = load(tiny_path)
    attn = attention_layers(model)[1]
    h = torch.randn(2, 1, model.config.text_config.hidden_size)
    cos, sin = torch.randn(2, 1, attn.head_dim), torch.randn(2, 1, attn.head_dim)
    shape = (2, 1, -1, attn.head_dim)
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    want_q, want_k = rope(attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2),
                          attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2), cos, sin)
    want_v = attn.v_proj(h).view(shape).transpose(1, 2)
    packed = hf_decode_forward.pack_qkv(attn)
    cfg = attn.config
    got = hf_decode_forward.qkv_heads(torch.nn.functional.linear(h, packed), attn.q_norm.weight, attn.k_norm.weight,
                                      attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon, cos, sin,
                                      cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim)
    for g, w in zip(got, (want_q, want_k, want_v), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_packing_keeps_one_copy_and_the_values(tiny_path):
    model, _ = load(tiny_path)
    attn = attention_layers(model)[0]
    before = [p.weight.detach().clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    packed = hf_decode_forward.pack_qkv(attn)
    for p, w in zip((attn.q_proj, attn.k_proj, attn.v_proj), before, strict=True):
        assert torch.equal(p.weight, w)
        assert p.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert hf_decode_forward.pack_qkv(attn) is packed


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("kind", ["text", "images"])
def test_generate_tokens_equal_the_original_forward(tiny_path, images, attention, kind, monkeypatch):
    if attention == "triton" and not triton_available("cpu"):
        pytest.skip("the kernel runs on CPU only in Triton's interpreter")
    new = NEW if attention == "sdpa" else NEW_INTERPRETED
    model, proc = load(tiny_path)
    inputs = text_batch(proc) if kind == "text" else image_batch(proc, images)
    want = stock(model, proc, inputs, n=new)
    calls = []
    real = hf_decode_forward.decode_forward
    monkeypatch.setattr(hf_decode_forward, "decode_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    if attention == "triton":
        assert hf_attention_decode.install(model) is None
    n = hf_decode_forward.install(model)
    assert n == model.config.text_config.num_hidden_layers
    got = stock(model, proc, inputs, n=new)
    assert got == want
    assert len(calls) == n * (new - 1)               # every decode step of every layer, never the prefill
    static = decoder(model, proc, use_graphs=False).generate(inputs, new).tokens
    hf_decode_forward.uninstall(model)
    assert static == decoder(model, proc, use_graphs=False).generate(inputs, new).tokens


def test_other_attention_classes_are_refused():
    class LlamaAttention(torch.nn.Module):
        pass

    assert "not a Qwen3-family" in hf_decode_forward.unsupported_reason(LlamaAttention())

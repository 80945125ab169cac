"""HF engine, LSE reuse: the scoring block's attention returns its LSE and the importance uses it.

Checked on the tiny Qwen3-VL-MoE: the block's output is unchanged by the registered attention function
(same op as SDPA), the captured LSE is the true row log-sum-exp of that block's (rotary) q·k, scores with and
without reuse agree, the LSE really is what the scores are computed from (a shifted LSE halves them), and
only the scoring block is switched (other blocks keep the model's implementation).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from harness.engines.hf.attention_lse import ATTN_NAME, capture_block_lse
from harness.engines.hf.visionzip_scoring import _base, encode_and_score


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image
    from harness.models.tiny import TinyModelSpec, ensure_tiny_model

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("lse-model"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    rng = random.Random(0)
    imgs = [text_dense_image(rng, 128, 96), plain_scene_image(rng, 64, 64)]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(text=[text], images=imgs, return_tensors="pt")
    return model, inputs


def _captured_qk(model, inputs, layer=-1):
    """q, k after the rotary embedding at the scoring block, recomputed from its input (independent path)."""
    import sys

    base = _base(model)
    attn = base.visual.blocks[layer].attn
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    seen = {}

    def pre(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["cu"] = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        seen["pe"] = kwargs.get("position_embeddings", args[2] if len(args) > 2 else None)

    h = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            base.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    finally:
        h.remove()
    n = seen["x"].shape[0]
    q, k, _ = attn.qkv(seen["x"]).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotary(q, k, *seen["pe"])
    return q, k, seen["cu"], attn


@torch.no_grad()
def test_captured_lse_is_the_blocks_true_lse_and_output_unchanged(tiny_inputs):
    model, inputs = tiny_inputs
    base = _base(model)
    q, k, cu, attn = _captured_qk(model, inputs)
    stock = base.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    other = base.visual.blocks[0].attn
    with capture_block_lse(attn) as got:
        assert attn.config._attn_implementation == ATTN_NAME
        assert other.config._attn_implementation != ATTN_NAME  # only the scoring block switches
        mine = base.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    assert attn.config._attn_implementation != ATTN_NAME  # restored
    for a, b in zip(stock.pooler_output, mine.pooler_output):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lse = got["lse"]
    assert lse is not None and lse.shape == (q.shape[1], q.shape[0])
    scale = attn.scaling
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        logits = torch.einsum("ihd,jhd->hij", q[s:e].double(), k[s:e].double()) * scale
        torch.testing.assert_close(lse[:, s:e].double(), torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_scores_with_and_without_reuse_agree_and_use_the_lse(tiny_inputs, monkeypatch):
    model, inputs = tiny_inputs
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    t_on, t_off = {}, {}
    _, on, _, _ = encode_and_score(model, pv, grid, timings=t_on)
    _, off, _, _ = encode_and_score(model, pv, grid, timings=t_off, reuse_lse=False)
    assert t_on["lse_reused"] is True and t_off["lse_reused"] is False
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)

    import harness.engines.hf.attention_lse as hf_lse  # the name as the scoring hook imported it

    real = hf_lse.sdpa_with_lse
    monkeypatch.setattr(hf_lse, "sdpa_with_lse",
                        lambda *a, **kw: (lambda o, l: (o, l + math.log(2.0)))(*real(*a, **kw)))
    _, halved, _, _ = encode_and_score(model, pv, grid)
    torch.testing.assert_close(halved, on / 2, rtol=1e-5, atol=1e-5)

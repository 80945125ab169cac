"""The embedded model: deterministic from its seed, a normal checkpoint both engines can load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness.models.tiny import TinyModelSpec, build_tiny_model, ensure_tiny_model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": build_tiny_model(root / "a", TinyModelSpec(seed=0)),
        "b": build_tiny_model(root / "b", TinyModelSpec(seed=0)),
        "c": build_tiny_model(root / "c", TinyModelSpec(seed=1)),
    }


def test_same_seed_same_weights(built):
    a, b = load_file(built["a"] / "model.safetensors"), load_file(built["b"] / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (built["a"] / "tokenizer.json").read_bytes() == (built["b"] / "tokenizer.json").read_bytes()


def test_other_seed_other_weights(built):
    a, c = load_file(built["a"] / "model.safetensors"), load_file(built["c"] / "model.safetensors")
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_architecture_has_what_the_techniques_need(built):
    cfg = json.loads((built["a"] / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert cfg["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert text["num_experts"] >= 16 and text["num_experts_per_tok"] >= 4  # secondary experts for SERE
    assert text["norm_topk_prob"] is True
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert vision["spatial_merge_size"] == 2 and len(vision["deepstack_visual_indexes"]) >= 1
    assert text["hidden_size"] != 2 * text["moe_intermediate_size"]  # a transposed load cannot pass silently
    assert json.loads((built["a"] / "harness_model.json").read_text())["weights"] == "random-init"


def test_experts_saved_in_checkpoint_layout(built):
    spec = TinyModelSpec()
    state = load_file(built["a"] / "model.safetensors")
    gate_up = state["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    down = state["model.language_model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (spec.num_experts, spec.hidden_size, 2 * spec.moe_intermediate_size)
    assert down.shape == (spec.num_experts, spec.moe_intermediate_size, spec.hidden_size)


def test_transformers_loads_it_back_exactly(built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(built["a"], dtype=torch.float32)
    state = load_file(built["a"] / "model.safetensors")
    experts = model.model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, state["model.language_model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2))
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    processor = AutoProcessor.from_pretrained(built["a"])
    ids = processor.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|im_end|>"])
    assert ids == [model.config.image_token_id, model.config.vision_start_token_id,
                   model.config.text_config.eos_token_id]
    assert processor.tokenizer.decode(processor.tokenizer("图片 IMG#3 answer")["input_ids"]) == "图片 IMG#3 answer"


def test_ensure_builds_once_and_reuses(tmp_path):
    first = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary leftovers

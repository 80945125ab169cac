"""The checkpoint's numbers (harness/run/rules_model.py): what ``config.json`` says, read before the weights load
and without the hub for a path that is no hub id. The rules checked against these numbers run on composed configs
in tests/config/test_config.py (``CASES``, ``test_moe_and_scoring_choices``)."""

from __future__ import annotations

import json

import pytest

from harness.run.rules_model import model_facts, read_model_config
from tests.config.test_config import _tiny_model_config


def test_model_facts_are_read_from_the_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_model_config()))
    facts = model_facts(read_model_config(str(tmp_path)))
    assert (facts.num_experts, facts.experts_per_token, facts.vision_depth) == (16, 4, 4)
    text_only = model_facts({"num_local_experts": 8, "num_experts_per_tok": 2})  # Mixtral-style, no vision
    assert (text_only.num_experts, text_only.experts_per_token, text_only.vision_depth) == (8, 2, None)


def test_model_config_is_not_fetched_for_a_path_that_is_no_hub_id(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("asked the hub"))
    assert read_model_config("unused") is None and read_model_config("/no/such/dir") is None

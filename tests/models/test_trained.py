"""The committed trained checkpoint and the pipeline that made it: hash, format, data, split, loading."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from harness.datasets.synthetic import tasks as st
from harness.models.tiny import build_processor
from harness.models.train_data import encode, make_example, patchify
from harness.models.trained import (
    CHECKPOINT,
    TRAINED_SPEC,
    WEIGHTS_LABEL,
    CheckpointError,
    checkpoint_info,
    sha256_file,
    trained_checkpoint,
)


def test_committed_checkpoint_hash_size_and_provenance():
    path, info = trained_checkpoint()  # raises on a SHA-256 mismatch
    assert sha256_file(path / "model.safetensors") == info["sha256"]
    assert (path / "model.safetensors").stat().st_size <= 20_000_000
    assert info["weights"] == WEIGHTS_LABEL and "not a real model" in info["meaning"]
    assert info["generator_version"] == st.GENERATOR_VERSION
    assert info["spec"]["hidden_size"] == TRAINED_SPEC.hidden_size and info["fingerprint"] == TRAINED_SPEC.fingerprint()
    train = info["training"]
    assert train["seed"] == 0 and train["steps_done"] > 0 and set(train["task_weights"]) == set(train["pool"])
    assert info["device"] and info["time_s"]["train"] > 0 and info["final_ema"]


def test_a_corrupt_checkpoint_is_refused(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        trained_checkpoint(copy)
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint_info(tmp_path / "absent")


def test_architecture_and_file_conventions_both_engines_need():
    cfg = json.loads((CHECKPOINT / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert cfg["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert text["num_experts"] == text["num_local_experts"] >= 16 and text["num_experts_per_tok"] >= 4
    assert text["norm_topk_prob"] is True and text["head_dim"] == 32
    assert text["hidden_size"] != 2 * text["moe_intermediate_size"]
    assert sum(text["rope_scaling"]["mrope_section"]) == text["head_dim"] // 2  # spelt for transformers 5.17
    assert vision["spatial_merge_size"] == 2 and len(vision["deepstack_visual_indexes"]) >= 1
    state = load_file(CHECKPOINT / "model.safetensors")
    gate_up = state["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (text["num_experts"], text["hidden_size"], 2 * text["moe_intermediate_size"])


def test_model_tiny_resolves_to_the_checkpoint_and_tiny_random_to_the_builder(tmp_path, monkeypatch):
    from harness.run.experiment import resolve_model

    path, info = resolve_model(SimpleNamespace(embedded=True, weights="trained-synthetic", name="t", seed=0))
    assert path == str(CHECKPOINT) and info["weights"] == "trained-synthetic" and "machinery" in info["weights_meaning"]
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    path, info = resolve_model(SimpleNamespace(embedded=True, weights="random-init", name="r", seed=0))
    assert info["weights"] == "random-init" and str(tmp_path) in path


def test_split_is_disjoint_and_deterministic():
    for task in ("ocr", "mcq", "rag"):
        train = st.items(task, "train", 150)
        held = st.items(task, "heldout", 40)
        assert all(st.is_heldout(i.key) for i in held) and not any(st.is_heldout(i.key) for i in train)
        assert [i.key for i in held] == [i.key for i in st.items(task, "heldout", 40)]


def test_training_examples_match_what_the_processor_builds():
    """Token ids (prompt with expanded image pads) and patch order equal the harness processor's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHECKPOINT)
    proc = build_processor(TRAINED_SPEC, tok)
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    rng = random.Random(3)
    for task in ("ocr", "mcq", "rag", "ocr_mix"):
        ex = make_example(task, rng, "heldout")
        enc = encode(ex, tok, image_token)
        parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                 for p in ex.content]
        prompt = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                          tokenize=False)
        ref = proc(text=[prompt], images=ex.images, return_tensors="np")
        assert list(ref["input_ids"][0]) == list(enc["ids"][: enc["n_prompt"]]), task
        pix = np.concatenate([patchify(a) for a in enc["images"]]).astype(np.float32) / 255 * 2 - 1
        np.testing.assert_allclose(pix, ref["pixel_values"], atol=1e-6)
        assert tok.decode(enc["ids"][enc["n_prompt"]:], skip_special_tokens=True) == ex.target


def test_trained_model_loads_and_answers_the_rag_format():
    """The trained model, greedy, on one held-out RAG request: a JSON answer with the benchmark's keys."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from harness.metrics.rag_igbench_answer import parse_answer

    model = AutoModelForImageTextToText.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(CHECKPOINT)
    ex = make_example("rag", random.Random(0), "heldout")
    parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"} for p in ex.content]
    prompt = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[prompt], images=ex.images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=192, do_sample=False)
    text = proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.startswith('{"reason": "用户询问') and "IMG#" in text
    assert parse_answer(text) is not None


def test_bundled_samples_are_the_held_out_split_regenerated(tmp_path):
    import filecmp

    from harness.datasets.synthetic.bundle import bundle

    bundle(str(tmp_path))
    bundled = CHECKPOINT.parents[2] / "datasets" / "bundled"
    for name in ("rag_igbench_sample", "ocrbench_sample", "ccbench_sample"):
        cmp = filecmp.dircmp(tmp_path / name, bundled / name)
        assert not (cmp.diff_files or cmp.left_only or cmp.right_only), name
    rows = [json.loads(line) for line in (bundled / "rag_igbench_sample/data.jsonl").read_text(encoding="utf-8").splitlines()]
    assert all(st.is_heldout("rag:" + r["query"] + "|" + "|".join(r["documents"])) for r in rows)

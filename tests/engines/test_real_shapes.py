"""Real-shape models, the tokenizer-free prompt path, synthetic load, the decode paths and device_map (CPU).

- ``shapes_config``: the real checkpoints' values (what the GPU runs build), special ids, mRoPE sections;
- ``hf_direct.patchify``: the Qwen2-VL processor's patch layout (compared with transformers' PIL processor);
- ``synthetic_load``: exact prompt / output lengths, nonsense refused, quality null with its reason;
- the run path end to end on the tiny shapes presets (``python -m harness`` with wandb absent);
- ``engine.decode_path=compiled`` (inductor on CPU: the compiled regions, no graphs) gives the same greedy
  tokens as ``eager`` (``model.generate``) on the embedded model and on a shapes model with SERE;
- ``engine.device_map=cpu|auto`` loads the embedded model and gives the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.datasets.base import DatasetError
from harness.engines.base import Request
from harness.engines.hf.direct import image_tokens, patchify
from harness.models.real_shapes import QWEN_SPECIAL_IDS, shapes_config

ROOT = Path(__file__).resolve().parents[2]
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, vocab_size=2048)


def engine_cfg(**kw):
    base = dict(device="cpu", dtype="float32", batch_size=3, attn_implementation="sdpa",
                experts_implementation="auto", cuda_graphs=True, decode_path="auto", compile_mode="default",
                compile_backend="inductor", device_map=None, max_memory={})
    return SimpleNamespace(**{**base, **kw})


def test_shapes_config_has_the_checkpoints_values():
    text = shapes_config("qwen3_30b_a3b")
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_experts"], text["num_experts_per_tok"],
            text["moe_intermediate_size"], text["vocab_size"], text["head_dim"]) == (2048, 48, 128, 8, 768, 151936, 128)
    assert text["rope_parameters"]["rope_theta"] == 1e6 and text["eos_token_id"] == 151645
    vl = shapes_config("qwen3_vl_30b_a3b", num_layers=4)
    assert vl["text_config"]["num_hidden_layers"] == 4
    assert vl["text_config"]["rope_parameters"]["mrope_section"] == [24, 20, 20]
    assert vl["vision_config"]["depth"] == 27 and vl["vision_config"]["out_hidden_size"] == 2048
    assert vl["image_token_id"] == QWEN_SPECIAL_IDS["image"] == 151655
    tiny = shapes_config("qwen3_vl_30b_a3b", 2, TINY_TEXT)
    assert sum(tiny["text_config"]["rope_parameters"]["mrope_section"]) == 8  # head_dim 16 / 2
    assert max(tiny["image_token_id"], tiny["text_config"]["eos_token_id"]) < 2048
    with pytest.raises(ValueError, match="arch"):
        shapes_config("qwen2")
    with pytest.raises(ValueError, match="num_layers"):
        shapes_config("qwen3_30b_a3b", 0)


def test_patchify_matches_the_qwen2vl_processor():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image
    import numpy as np

    vision = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8), "RGB")
    proc = pil.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                                        max_pixels=4096 * 4096, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ref = proc(images=[img], return_tensors="pt")
    got, grid = patchify(img, vision)
    assert list(ref["image_grid_thw"][0]) == list(grid)
    assert torch.allclose(got, ref["pixel_values"].float(), atol=1e-5)
    assert image_tokens(96, 64, vision) == grid[1] * grid[2] // 4


def test_synthetic_load_refuses_nonsense_and_has_exact_shapes():
    from harness.datasets.synthetic_load import load

    cfg = SimpleNamespace(n_images=2, image_width=40, image_height=70, prompt_tokens=11, output_tokens=3,
                          num_requests=4, limit=None, seed=0)
    samples = list(load(cfg, ROOT))
    assert len(samples) == 4 and len({s.uid for s in samples}) == 4
    assert [p["type"] for p in samples[0].content] == ["image", "image", "synthetic_tokens"]
    assert samples[0].load_images()[1].size == (40, 70)
    assert samples[0].load_images()[0].tobytes() != samples[1].load_images()[0].tobytes()
    for key, bad in (("n_images", -1), ("prompt_tokens", 0), ("num_requests", 0), ("image_width", "big")):
        with pytest.raises(DatasetError, match=key):
            list(load(SimpleNamespace(**{**vars(cfg), key: bad}), ROOT))


def run_harness(tmp_path, *overrides, block_wandb=True, block=()) -> dict:
    """``python -m harness`` in a subprocess (wandb made unimportable: the GPU box has none; ``block`` names more
    modules to make unimportable)."""
    env = {**os.environ, "HARNESS_CACHE": str(tmp_path / "cache")}
    blocked = (("wandb",) if block_wandb else ()) + tuple(block)
    if blocked:
        site = tmp_path / "blocked"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text("import sys\n" + "".join(
            f"sys.modules[{name!r}] = None  # import {name} fails\n" for name in blocked))
        env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "harness", *overrides, "wandb.mode=disabled", "cache.enabled=false",
                           f"hydra.run.dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), [json.loads(x) for x in (out / "samples.jsonl").open()]


def test_embedded_run_with_sere_needs_no_triton_on_cpu(tmp_path):
    """A CPU venv without triton (the OpenCompass lane's) runs the default model with SERE: no decode kernel, router
    kernel or statistics kernel is imported where none is used."""
    summary, records = run_harness(tmp_path, "sere.k=1", "sere.rho=0.0", "generation.max_new_tokens=6",
                                   "engine.warmup=0", "engine.device=cpu", block=("triton", "triton.language"))
    eng = summary["run"]["engine_settings"]
    assert eng["decode_attention"] == "sdpa" and eng["decode_router"] == "torch"
    assert summary["sere"]["moved_fraction"] > 0 and len(records) == 12


def test_run_path_on_the_tiny_vl_shapes_without_wandb(tmp_path):
    summary, records = run_harness(tmp_path, "model=qwen3_vl_30b_a3b_shapes_tiny", "dataset=synthetic_load",
                                   "dataset.n_images=2", "dataset.image_width=64", "dataset.image_height=64",
                                   "dataset.prompt_tokens=9", "dataset.output_tokens=4", "dataset.num_requests=3",
                                   "engine.batch_size=2", "sere.k=2", "sere.calibration_tokens=256")
    assert summary["run"]["weights"] == "random-init"
    eng = summary["run"]["engine_settings"]
    # engine.decode_path=auto: model.generate on a CPU machine, the compiled graph decoder where a GPU is visible
    assert eng["decode_path"] == ("compiled" if torch.cuda.is_available() else "eager")
    assert eng["ignore_eos"] and eng["tokenizer_free"]
    assert eng["shapes"]["arch"] == "qwen3_vl_30b_a3b" and eng["shapes"]["weights"] == "random-init"
    assert summary["metrics"]["quality"] is None and "no reference" in summary["metrics"]["quality_reason"]
    assert summary["latency"]["n_measured"] == 3
    per_image = 64 // 16 * (64 // 16) // 4
    for r in records:
        assert r["error"] is None and r["output_tokens"] == 4 and r["tpot_ms"] is not None
        assert r["prompt_tokens"] == 9 + 2 * (per_image + 2) and r["visual_tokens"] == 2 * per_image
        assert r["scores"]["score"] is None
    assert summary["sere"]["expert_union_after"] <= summary["sere"]["expert_union_before"]


def _tokens(engine, reqs):
    return [(g.error, g.output_tokens, g.text) for g in engine.generate(reqs)]


@pytest.fixture(scope="module")
def embedded_path(tmp_path_factory):
    from harness.models.tiny import TinyModelSpec, ensure_tiny_model

    return ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("shapes-model"))


def _requests():
    from PIL import Image

    img = Image.new("RGB", (64, 48), (200, 30, 90))
    return [Request("a", [{"type": "image"}, {"type": "text", "text": "describe the picture"}], [img]),
            Request("b", [{"type": "text", "text": "What is the best food in the city park?"}])]


@pytest.mark.parametrize("decode_attention", ["sdpa", "triton"])
def test_compiled_path_equals_eager_on_the_embedded_model(embedded_path, tmp_path, monkeypatch, decode_attention):
    """The compiled regions (inductor, CPU) in the static decoder = model.generate, token for token; with the
    Triton decode kernel (interpreter) and the packed-QKV forward, whose norm/RoPE function is one more region."""
    from harness.engines.hf.engine import HFEngine
    from harness.kernels.decode_attention import triton_available

    if decode_attention == "triton" and not triton_available("cpu"):
        pytest.skip("the kernel runs on CPU only in Triton's interpreter")

    monkeypatch.setenv("HARNESS_INDUCTOR_CACHE", str(tmp_path / "inductor"))
    gen = SimpleNamespace(max_new_tokens=8, do_sample=False)
    eager = HFEngine(str(embedded_path), engine_cfg(decode_path="eager"), gen)
    want = _tokens(eager, _requests())
    eager.close()
    compiled = HFEngine(str(embedded_path), engine_cfg(decode_path="compiled", decode_attention=decode_attention), gen)
    try:
        got = _tokens(compiled, _requests())
        info = compiled.describe()
    finally:
        compiled.close()
    assert got == want and all(e is None for e, _, _ in got)
    assert info["decode_path"] == "compiled" and info["compile"]["regions"]["norm"] >= 1 and info["compile"]["regions"]["rope_function"] >= 1
    assert info["compile"]["unique_graphs"] >= 1 and info["compile"]["inductor_cache_dir"] == str(tmp_path / "inductor")
    assert info["decode_attention"] == decode_attention
    assert (info["packed_qkv_layers"] > 0) == (decode_attention == "triton")


@pytest.mark.parametrize("device_map", ["cpu", "auto"])
def test_device_map_loads_the_embedded_model_with_the_same_tokens(embedded_path, device_map):
    """A CPU test on any machine: ``auto`` is given the CPU alone (``engine.max_memory``), else accelerate puts the
    layers on a visible GPU."""
    pytest.importorskip("accelerate")
    from harness.engines.hf.engine import HFEngine

    gen = SimpleNamespace(max_new_tokens=6, do_sample=False)
    plain = HFEngine(str(embedded_path), engine_cfg(), gen)
    want = _tokens(plain, _requests())
    plain.close()
    max_memory = {"cpu": "8GiB"} if device_map == "auto" else {}
    placed = HFEngine(str(embedded_path), engine_cfg(device_map=device_map, max_memory=max_memory), gen)
    try:
        info = placed.describe()
        assert info["device_map"] == device_map and info["placement"] == ["cpu"] and info["decode_path"] == "eager"
        assert _tokens(placed, _requests()) == want
    finally:
        placed.close()

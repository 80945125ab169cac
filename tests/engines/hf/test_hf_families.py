"""The HF engine's MoE hooks on every family's tiny random checkpoint (issue 29): ``moe.top_k`` and SERE engage
on decode steps and come off bit for bit, the hooks sit on the family's router (GPT-OSS ``.router``), DeepSeek's
unsorted slots are sorted by the rank key before a technique reads them; and ``python -m harness
model=<family>_tiny_random`` runs SERE + ``moe.top_k`` end to end, with the family refusals as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.models.families import all_families

FAMILIES = [f.name for f in all_families() if f.tiny is not None]


def _load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.models.families import get
    from harness.models.families.build import ensure_tiny_family

    path = ensure_tiny_family(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=get(name).attention or "sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    model, tok = _load(request.param)
    tok.padding_side = "left"
    batch = tok(["旅游 美食 请根据以下笔记回答问题", "Output JSON with the keys reason"], return_tensors="pt",
                padding=True)
    return request.param, model, batch


def _generate(model, batch, n=5):
    with torch.inference_mode():
        return model.generate(**batch, max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=model.generation_config.pad_token_id,
                              eos_token_id=[])


def test_topk_and_sere_engage_on_decode_steps_and_come_off_bit_for_bit(loaded):
    from harness.engines.hf.sere import install_sere
    from harness.engines.hf.topk import install_topk
    from harness.models.moe_blocks import find_moe_blocks

    name, model, batch = loaded
    base = _generate(model, batch)
    refs = find_moe_blocks(model)
    with install_topk(model, 2) as topk:
        _generate(model, batch)
        st = topk.stats()
    assert st["steps"] > 0 and st["expert_union_after"] < st["expert_union_before"], (name, st)
    gen = torch.Generator().manual_seed(0)
    sims = {r.layer: torch.rand(r.num_experts, r.num_experts, generator=gen) for r in refs}
    with install_sere(model, sims, 2, 0.0) as sere:
        _generate(model, batch)
        st = sere.stats()
    assert st["steps"] > 0 and st["moved_fraction"] > 0, (name, st)
    assert st["expert_union_after"] <= st["expert_union_before"]
    again = _generate(model, batch)
    assert torch.equal(again.sequences, base.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, base.logits, strict=True))
    if name == "gpt_oss":
        assert all(r.gate is r.block.router for r in refs)


def test_decode_routing_under_topk_is_the_family_rule_at_k(loaded):
    """What the experts receive on a decode step with ``moe.top_k=2``: the rule's own top-2 of the logits
    (DeepSeek: its unsorted slots sorted, the grouped / biased / scaled weights of a top-2 router)."""
    from harness.engines.hf.topk import install_topk
    from harness.models.moe_blocks import find_moe_blocks

    name, model, batch = loaded
    ref = find_moe_blocks(model)[0]
    seen = []
    with install_topk(model, 2):
        hook = ref.gate.register_forward_hook(lambda m, a, out: seen.append(out))  # after the top-K hook
        try:
            _generate(model, batch, n=3)
        finally:
            hook.remove()
    decode = [out for out in seen if out[2].shape[0] == 2]
    assert decode, name
    for logits, w, ids in (out[:3] for out in decode):
        w_ref, ids_ref = ref.rule.stock(logits, 2, ref.bias())
        assert torch.equal(ids, ids_ref), name
        torch.testing.assert_close(w, w_ref)


def _harness(*overrides: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "harness", "wandb.mode=disabled", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


SMALL = ("dataset.num_requests=2", "dataset.prompt_tokens=16", "dataset.output_tokens=6",
         "sere.calibration_tokens=512", "engine.warmup=0", "latency.sequential=false")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_cli_runs_sere_and_topk_on_the_family(name, tmp_path):
    """``python -m harness model=<family>_tiny_random sere.k=2 moe.top_k=3``: SERE (calibrated on the model)
    re-routes the truncated routing; both engage (the SERE canary included)."""
    run = tmp_path / "run"
    proc = _harness(f"model={name}_tiny_random", "sere.k=2", "sere.rho=0", "moe.top_k=3", f"hydra.run.dir={run}",
                    *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run"]["model"]["family"] == name
    sere, moe = summary["sere"], summary["moe"]
    assert sere["engagement"]["ok"] and sere["moved_fraction"] > 0, sere
    assert moe["expert_union_after"] < moe["expert_union_before"], moe


@pytest.mark.slow
def test_cli_runs_the_multimodal_qwen3_5_moe(tmp_path):
    """``model=qwen3_5_moe_vl_tiny_random``: the multimodal checkpoint's layout (image-text-to-text class, the Qwen-VL
    processor and chat template) answers the bundled RAG-IGBench rows with their images through SERE and
    ``moe.top_k``, and through VisionZip (its tower has no deepstack levels: only the merged tokens are pruned)."""
    run = tmp_path / "run"
    proc = _harness("model=qwen3_5_moe_vl_tiny_random", "sere.k=2", "sere.rho=0", "moe.top_k=3", "dataset.limit=2",
                    "generation.max_new_tokens=4", "engine.warmup=0", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    model = summary["run"]["model"]
    assert model["family"] == "qwen3_5_moe" and model["multimodal"] and model["weights"] == "random-init"
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["error"] is None and r["n_images"] > 0 and r["visual_tokens"] > 0 for r in rows)
    sere, moe = summary["sere"], summary["moe"]
    assert sere["engagement"]["ok"] and sere["moved_fraction"] > 0, sere
    assert moe["expert_union_after"] < moe["expert_union_before"], moe
    vz = tmp_path / "vz"
    proc = _harness("model=qwen3_5_moe_vl_tiny_random", "visionzip.keep=0.5", "dataset.limit=2",
                    "generation.max_new_tokens=2", "engine.warmup=0", f"hydra.run.dir={vz}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((vz / "summary.json").read_text())["visionzip"]
    assert summary["keep_rate"] == pytest.approx(0.5, abs=0.05) and summary["visual_tokens_kept"] < summary[
        "visual_tokens_in"]


def test_tiny_multimodal_build_is_its_own_checkpoint(tmp_path):
    """The multimodal tiny model has its own cache directory and fingerprint (the text-only one is unchanged), and a
    family without a multimodal builder says so instead of building a text model."""
    from harness.models.families.build import ensure_tiny_family, tiny_family_fingerprint

    assert tiny_family_fingerprint("qwen3_5_moe", 0, True) != tiny_family_fingerprint("qwen3_5_moe", 0)
    with pytest.raises(ValueError, match="no tiny multimodal builder"):
        ensure_tiny_family("olmoe", 0, cache_dir=tmp_path, multimodal=True)


@pytest.mark.slow
def test_cli_refusals_are_one_line(tmp_path):
    proc = _harness("model=olmoe_tiny_random", "visionzip.keep=0.5", f"hydra.run.dir={tmp_path / 'vz'}", *SMALL,
                    cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: visionzip.keep=0.5: olmoe is a text-only model (no vision tower): VisionZip does not apply")
    proc = _harness("model=gpt_oss_tiny_random", "engine.experts_implementation=harness_fused_moe",
                    f"hydra.run.dir={tmp_path / 'fm'}", *SMALL, cwd=tmp_path)
    assert proc.returncode == 2 and "GPT-OSS experts are interleaved" in proc.stderr.strip().splitlines()[-1]
    proc = _harness("model=gpt_oss_tiny_random", "offload.policy=lru", "offload.capacity=4",
                    f"hydra.run.dir={tmp_path / 'off'}", *SMALL, cwd=tmp_path)
    assert proc.returncode == 2 and "expert offload reads only" in proc.stderr.strip().splitlines()[-1]
    # the real-shapes path asks the family too, before it builds anything
    proc = _harness("model=gpt_oss_20b_shapes", "model.shapes.num_layers=2", "offload.policy=lru",
                    "offload.capacity=4", f"hydra.run.dir={tmp_path / 'shapes'}", "dataset.limit=1", cwd=tmp_path)
    assert proc.returncode == 2 and "expert offload reads only" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_cli_offload_on_deepseek_v3_keeps_the_answers(tmp_path):
    """Expert offload (LRU, half the experts resident) on a family with dense first layers, shared experts and
    unsorted router slots: the same greedy answers as the resident model. On the CPU in float32 (where a GPU is
    visible the resident model would decode in bfloat16 with the fused expert kernel and the offloaded one with
    the eager experts: a random-init model's near-ties then flip; the GPU path is benchmarks/check_offload_gpu.py's)."""
    answers = []
    for extra in ((), ("offload.policy=lru", "offload.capacity=4")):
        run = tmp_path / f"run{len(answers)}"
        proc = _harness("model=deepseek_v3_tiny_random", f"hydra.run.dir={run}", "engine.device=cpu", *extra, *SMALL,
                        cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        answers.append([r["answer"] for r in rows])
    summary = json.loads((tmp_path / "run1" / "summary.json").read_text())
    assert summary["offload"]["policy"] == "lru" and summary["offload"]["resident_fraction"] == 0.5
    assert answers[0] == answers[1]


def test_triton_router_takes_the_families_whose_rule_it_computes(loaded, monkeypatch):
    """``engine.decode_router=triton``: Qwen2-MoE, OLMoE, Qwen3.5-MoE (and Qwen3) routers go through the kernel on
    decode passes with the same greedy tokens (Triton's interpreter on CPU); Mixtral, DeepSeek and GPT-OSS keep
    transformers' router (0 layers, no error)."""
    from harness.engines.hf import router as hf_router
    from harness.kernels import router as router_kernel
    from harness.models.families import family_of
    from harness.models.moe_blocks import find_moe_blocks

    if not router_kernel.triton_available("cpu"):
        pytest.skip("the CPU tests run the kernel in Triton's interpreter")
    name, model, batch = loaded
    monkeypatch.setattr(hf_router, "MAX_TOKENS", 4)  # below the prompts: prefill keeps transformers' router
    want = _generate(model, batch, n=3).sequences
    try:
        n = hf_router.install(model)
        got = _generate(model, batch, n=3).sequences
    finally:
        hf_router.uninstall(model)
    assert n == (len(find_moe_blocks(model)) if family_of(model).router_kernel else 0), name
    assert torch.equal(got, want), name


def test_a_family_with_eager_attention_decodes_eagerly_on_cuda(loaded):
    """GPT-OSS runs eager attention (its sinks), whose mask transformers builds from a host scalar every step: a
    CUDA graph cannot capture that (the compiled and the graph path both failed on the H200), so the engine picks
    ``model.generate`` for it with the reason; every other family keeps the graph path."""
    from harness.engines.hf.decode_path import capture_reason, resolve_decode_path

    name, model, _ = loaded
    why = capture_reason(model)
    assert (why is not None) == (model.config._attn_implementation == "eager")
    assert (why is not None) == (name == "gpt_oss")  # the one family whose adapter asks for eager attention
    path, reason = resolve_decode_path("auto", "cuda", True, why)
    assert (path, reason) == (("eager", why) if why else ("compiled", None))

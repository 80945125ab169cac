"""``moe.top_k=2`` in vLLM through the plugin: the same greedy token ids as HF with ``hf_topk`` (decode
steps only), text and images, one request at a time and in a mixed chunked-prefill batch; statistics from
the worker. (With SERE: ``test_vllm_topk_sere.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_lane_helpers import MAX_NEW, engine_cfg, gen_cfg

TOP_K = 2
BUDGET = 48  # max_num_batched_tokens: long prompts are prefilled in chunks, beside decoding requests


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from harness.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(), max_images_per_prompt=2,
                     sere_cfg=SimpleNamespace(k=None), moe_cfg=SimpleNamespace(top_k=TOP_K, scope="decode"),
                     engine_kwargs={"max_num_batched_tokens": BUDGET})
    yield eng
    eng.close()


def hf_topk(hf_ref, request, max_new_tokens=MAX_NEW):
    from harness.engines.hf.topk import install_topk

    with install_topk(hf_ref.model, TOP_K, "decode"):
        return hf_ref.generate(request, max_new_tokens)


def test_top_k_token_for_token_with_hf(engine, hf_ref, requests_text_images):
    text, images = requests_text_images
    assert engine.describe()["moe"]["top_k"] == TOP_K
    changed = 0
    for r in text + images:
        gen = engine.generate_batch([r])[0]
        assert gen.error is None, gen.error
        ref = hf_topk(hf_ref, r)
        assert gen.extra["token_ids"] == ref["ids"], r.uid
        changed += gen.extra["token_ids"] != hf_ref.generate(r)["ids"]
    assert changed > 0  # the truncation changes answers on this model: the comparison is not vacuous


def test_statistics_from_the_worker(engine, requests_text_images):
    text, _ = requests_text_images
    engine.warmup(text[:1])
    assert engine.technique_stats()["moe"]["steps"] == 0
    gens = engine.generate_batch(text[:2])
    st = engine.technique_stats()["moe"]
    assert st["top_k"] == TOP_K and st["scope"] == "decode" and st["layers"] == 3 and st["workers"] == 1
    # decode steps: at least the longest request's; more when chunked prefill (budget 48) staggers the two
    assert max(g.output_tokens for g in gens) - 1 <= st["steps"] <= sum(g.output_tokens - 1 for g in gens)
    assert st["expert_union_after"] <= TOP_K * 2 < st["expert_union_before"]
    for layer in st["per_layer"]:
        assert layer["tokens"] == sum(g.output_tokens - 1 for g in gens)


def test_mixed_chunked_prefill_batch_truncates_decode_rows_only(engine, hf_ref):
    """A short request decodes while a long one is prefilled in chunks beside it: each gives exactly its
    solo HF + top-K ids, so the prefill rows kept the full top-k and the decode rows were truncated."""
    from harness.engines.base import Request

    short = Request("short", [{"type": "text", "text": "旅游 美食 穿搭"}])
    words = "旅游 美食 穿搭 护肤 健身 数码 家居 理财 教育 宠物 摄影 咖啡 面包 火锅 蛋糕 城市 公园 海边".split()
    long = Request("long", [{"type": "text", "text": " ".join(words * 4)}])
    ref_short, ref_long = hf_topk(hf_ref, short, 4), hf_topk(hf_ref, long, 6)
    assert ref_long["prompt_tokens"] > 2 * BUDGET
    outs = engine._llm.generate([engine.prompt(short), engine.prompt(long)],
                                [engine.sampling_params(4), engine.sampling_params(6)], use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == ref_short["ids"]
    assert list(outs[1].outputs[0].token_ids) == ref_long["ids"]


def test_settings_round_trip_and_register_with_sere(tmp_path):
    import os
    import subprocess
    import sys

    from harness.engines.vllm.settings import MoeSettings

    assert MoeSettings.from_env({}) is None
    st = MoeSettings(2, "all")
    assert MoeSettings.from_env(st.env()) == st
    with pytest.raises(RuntimeError):
        MoeSettings.from_env({"HARNESS_MOE_TOP_K": "2", "HARNESS_MOE_SCOPE": "prefill"})
    import torch

    from harness.techniques.sere.calibration import save_similarity

    sim = save_similarity(tmp_path / "sim.safetensors", {i: torch.eye(16) for i in range(3)}, {})
    code = ("from harness.engines.vllm import plugin as p\np.register()\ns = p.state()\n"
            "assert s['moe'].top_k == 2 and s['sere'].k_primary == 1, s\n"
            "assert type(s['routing']).__name__ == 'SereArtifacts'\nprint('ok')\n")
    env = {**os.environ, "HARNESS_MOE_TOP_K": "2", "HARNESS_SERE_K": "1", "HARNESS_SERE_SIMILARITY": str(sim)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]

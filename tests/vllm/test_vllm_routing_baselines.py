"""Issue 31's routing baselines in the vLLM plugin's routing path: the fused routing kernel does not implement
``random_p`` / ``top_p``, so :func:`harness.engines.vllm.topk.make_baseline_routing_function` is the torch path —
tested against the plain-torch reference (stock top-k, then harness.techniques.moe_routing) on a step that mixes
decode and prefill rows. No engine: the routing function is called as vLLM's MoE layer calls it."""

from __future__ import annotations

import pytest
import torch

from harness.engines.vllm.routing import DECODE, stock_topk
from harness.engines.vllm.topk import make_baseline_routing_function
from harness.kernels.fused_routing_reference import RoutingSpec
from harness.techniques.moe_routing import random_p, top_p

E, K, T = 16, 4, 7


@pytest.fixture
def step():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(T, E, generator=g)
    decode = torch.tensor([True, True, False, True, False, True, True])  # rows 2 and 4: a prefill chunk
    DECODE.steps.write(torch.device("cpu"), decode, T)
    yield logits, decode
    DECODE.clear()


def test_the_kernel_spec_has_no_such_baseline():
    fields = set(RoutingSpec.__slots__)
    assert not {"routing", "top_p", "random_p"} & fields  # the torch path below is the only one


def test_random_p_torch_path_equals_the_reference(step):
    logits, decode = step
    fn = make_baseline_routing_function(3, "random_p", k_primary=2, seed=9)
    w, ids = fn(None, logits, K, True)
    ref_w, ref_ids = stock_topk(logits, K, True)
    want = random_p(ref_ids, 2, E, torch.Generator().manual_seed(9), decode)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), want.long()) and torch.equal(w, ref_w.float())
    assert torch.equal(ids[~decode].long(), ref_ids[~decode])  # prefill rows keep the stock routing
    p = set(ref_ids[decode, :2].reshape(-1).tolist())
    assert set(ids[decode].reshape(-1).tolist()) == p and not torch.equal(ids.long(), ref_ids)


def test_top_p_torch_path_equals_the_reference(step):
    logits, decode = step
    w, ids = make_baseline_routing_function(0, "top_p", p=0.5)(None, logits, K, True)
    stock_w, stock_ids = stock_topk(logits, K, True)
    ref_w, ref_ids = top_p(logits, stock_ids, 0.5)
    assert torch.equal(ids[decode].long(), ref_ids[decode].long())
    assert torch.allclose(w[decode], ref_w[decode].float())
    assert torch.equal(ids[~decode].long(), stock_ids[~decode]) and torch.equal(w[~decode], stock_w[~decode].float())
    assert bool((w[decode] == 0).any())  # some slot was dropped: the baseline did something
    with pytest.raises(ValueError):
        make_baseline_routing_function(0, "nope")


def test_the_plugin_builds_the_baseline_from_its_environment():
    from harness.engines.vllm.settings import MoeSettings
    from harness.engines.vllm.topk import TopKRouting

    s = MoeSettings(None, "decode", "random_p", 1, 0.5, 4)
    env = s.env()
    assert MoeSettings.from_env(env) == s and MoeSettings.from_env({}) is None
    assert MoeSettings.from_env({"HARNESS_MOE_TOP_K": "2"}) == MoeSettings(2, "decode")
    fn = TopKRouting(MoeSettings.from_env(env)).routing_for("model.layers.3.mlp.experts", E)
    assert fn.harness_layer == 3 and fn.__qualname__.startswith("make_baseline_routing_function")


NEW = 8


@pytest.fixture(scope="module")
def top_p_run(tiny_model_path, requests_text_images):
    from types import SimpleNamespace

    from vllm_lane_helpers import engine_cfg, gen_cfg

    from harness.engines.vllm.engine import VLLMEngine

    text, _ = requests_text_images
    eng = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(NEW), sere_cfg=SimpleNamespace(k=None),
                     moe_cfg=SimpleNamespace(top_k=None, scope="decode", routing="top_p", k_primary=2, p=0.4, seed=0))
    try:
        yield text, eng.generate_batch(text), eng.describe()
    finally:
        eng.close()


def test_top_p_in_vllm_equals_hf_top_p(top_p_run, hf_ref):
    """End to end through the plugin: vLLM's batched top_p tokens = the HF engine's (top_p is per token, so the
    batch does not matter), and differ from the stock model's somewhere (the baseline ran)."""
    from harness.engines.hf.routing_baselines import install_routing_baseline
    from harness.techniques.moe_routing import RoutingSettings

    requests, gens, info = top_p_run
    assert info["moe"]["routing"] == "top_p"
    by_uid = {g.uid: g for g in gens}
    stock = {r.uid: hf_ref.generate(r, max_new_tokens=NEW)["ids"] for r in requests}
    handle = install_routing_baseline(hf_ref.model, RoutingSettings("top_p", 2, 0.4, 0))
    try:
        ref = {r.uid: hf_ref.generate(r, max_new_tokens=NEW)["ids"] for r in requests}
    finally:
        handle.remove()
    for r in requests:
        assert by_uid[r.uid].error is None and by_uid[r.uid].extra["token_ids"] == ref[r.uid], r.uid
    assert any(ref[u] != stock[u] for u in ref)

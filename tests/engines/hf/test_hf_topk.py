"""``moe.top_k`` in the HF engine: K = top-k is the baseline bit for bit; K < top-k routes exactly as the
plain-torch reference (``harness.techniques.moe_topk.truncate_routing``), decode steps only by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from routing_capture import capture

from harness.engines.hf.sere import install_sere
from harness.engines.hf.topk import install_topk
from harness.models.tiny import TinyModelSpec
from harness.techniques.moe_topk import truncate_routing
from harness.techniques.sere.reroute import expert_union
from harness.techniques.sere.calibration import find_moe_blocks

MAX_NEW = 5
TOP_K = TinyModelSpec().num_experts_per_tok


@pytest.fixture(scope="module")
def tiny(tiny_parts):
    from PIL import Image

    model, proc, path, chat = tiny_parts.model, tiny_parts.proc, tiny_parts.path, tiny_parts.chat

    texts = [chat([{"type": "text", "text": "What is the best food in the city park?"}]),
             chat([{"type": "image"}, {"type": "text", "text": "请描述这张图片"}]),
             chat([{"type": "text", "text": "旅游 美食 2024 answer"}])]
    batch = proc(text=texts, images=[Image.new("RGB", (64, 48), (200, 30, 30))], return_tensors="pt",
                 padding=True)
    return {"model": model, "proc": proc, "batch": batch, "path": path}


def generate(tiny):
    with torch.inference_mode():
        out = tiny["model"].generate(**tiny["batch"], max_new_tokens=MAX_NEW, do_sample=False,
                                     pad_token_id=tiny["proc"].tokenizer.pad_token_id)
    return out[:, tiny["batch"]["input_ids"].shape[1]:]


@pytest.fixture(scope="module")
def baseline(tiny):
    return generate(tiny)


@pytest.mark.parametrize("top_k", [TOP_K, TOP_K + 3])
def test_top_k_at_least_router_top_k_is_the_baseline(tiny, baseline, top_k):
    with capture(tiny["model"]) as log:
        handle = install_topk(tiny["model"], top_k)
        try:
            assert torch.equal(generate(tiny), baseline)
            st = handle.stats()
        finally:
            handle.remove()
    for entries in log.values():
        for e in entries:
            assert torch.equal(e["used"], e["orig"]) and torch.equal(e["used_w"], e["orig_w"])
    assert st["steps"] == MAX_NEW - 1 and st["expert_union_after"] == st["expert_union_before"]


@pytest.mark.parametrize("top_k,scope", [(2, "decode"), (1, "decode"), (2, "all")])
def test_truncated_routing_equals_reference(tiny, baseline, top_k, scope):
    with capture(tiny["model"]) as log:
        handle = install_topk(tiny["model"], top_k, scope)
        try:
            tokens = generate(tiny)
            st = handle.stats()
        finally:
            handle.remove()
    before, after, n = 0, 0, 0
    for entries in log.values():
        assert len(entries) == MAX_NEW  # one prefill + MAX_NEW - 1 decode steps
        for e in entries:
            if e["seq"] > 1 and scope == "decode":           # prefill keeps the full top-k
                assert torch.equal(e["used"], e["orig"]) and torch.equal(e["used_w"], e["orig_w"])
                continue
            want_w, want_ids = truncate_routing(e["logits"], e["orig"], top_k, True)
            assert e["used"].shape == (e["orig"].shape[0], top_k)      # the experts compute K per token
            assert torch.equal(e["used"], e["orig"][:, :top_k]) and torch.equal(e["used"], want_ids)
            assert torch.equal(e["used_w"], want_w)
            assert torch.allclose(e["used_w"].sum(-1), torch.ones(e["used_w"].shape[0]))
            if e["seq"] == 1 or scope == "all":               # the passes the statistics count
                before += expert_union(e["orig"])
                after += expert_union(e["orig"][:, :top_k])
                n += 1
    assert not torch.equal(tokens, baseline)            # it does change the answers on this model
    assert st["top_k"] == top_k and st["scope"] == scope and st["renormalize"] is True
    assert st["expert_union_before"] == pytest.approx(before / n)
    assert st["expert_union_after"] == pytest.approx(after / n) and after < before
    assert st["steps"] == n // len(log)
    if scope == "decode":
        assert st["tokens_per_step"] == tiny["batch"]["input_ids"].shape[0]
    json.dumps(st)


def test_one_handle_of_each_kind_and_the_order(tiny):
    eye = {r.layer: torch.eye(16) for r in find_moe_blocks(tiny["model"])}
    handle = install_topk(tiny["model"], 2)
    try:
        with pytest.raises(RuntimeError, match="moe.top_k is already installed"):
            install_topk(tiny["model"], 1)
    finally:
        handle.remove()
    sere = install_sere(tiny["model"], eye, 1, 0.0)
    try:
        with pytest.raises(RuntimeError, match="before SERE"):          # SERE must see the truncated routing
            install_topk(tiny["model"], 2)
    finally:
        sere.remove()
    blocks = find_moe_blocks(tiny["model"])
    assert all(not hasattr(r.block, "_harness_sere") and not hasattr(r.block, "_harness_topk") for r in blocks)
    with pytest.raises(ValueError):
        install_topk(tiny["model"], 0)


def test_top_k_then_sere_reroutes_the_truncated_routing(tiny):
    """moe.top_k=3 with sere.k=1: the experts receive reroute(router's top-3, K=1) with the top-3 weights."""
    from harness.techniques.sere.reroute import reroute
    from harness.techniques.sere.calibration import compute_similarity

    model = tiny["model"]
    sims, _ = compute_similarity(model, tiny["proc"].tokenizer, max_tokens=256)
    with capture(model) as log:
        topk = install_topk(model, 3)
        sere = install_sere(model, sims, 1, 0.0, op=reroute)
        try:
            generate(tiny)
            moe_st, sere_st = topk.stats(), sere.stats()
        finally:
            sere.remove()
            topk.remove()
    moved = 0
    for layer, entries in log.items():
        for e in entries:
            if e["seq"] > 1:                                   # prefill: neither (scope decode, SERE decode)
                assert torch.equal(e["used"], e["orig"]) and torch.equal(e["used_w"], e["orig_w"])
                continue
            want_w, want_ids = truncate_routing(e["logits"], e["orig"], 3, True)
            assert torch.equal(e["used_w"], want_w)
            want = reroute(want_ids, sims[layer], 1, 0.0)
            assert torch.equal(e["used"], want)
            moved += int((want != want_ids).sum())
    assert moved > 0
    assert sere_st["expert_union_before"] == pytest.approx(moe_st["expert_union_after"])  # SERE starts at top-3
    assert sere_st["expert_union_after"] < sere_st["expert_union_before"]


def test_engine_wiring_and_refusal(tiny):
    from harness.engines.base import Request
    from harness.engines.hf.engine import HFEngine

    eng_cfg = SimpleNamespace(device="cpu", dtype="float32", batch_size=2, attn_implementation="sdpa",
                              experts_implementation=None, cuda_graphs=False, warmup=0)
    gen_cfg = SimpleNamespace(max_new_tokens=4)
    sere_off, moe = SimpleNamespace(k=None), SimpleNamespace(top_k=2, scope="decode")
    with pytest.raises(ValueError, match="moe.top_k"):       # a bad value fails before the model loads
        HFEngine("/nonexistent/never/loaded", eng_cfg, gen_cfg, sere_cfg=sere_off,
                 moe_cfg=SimpleNamespace(top_k=0, scope="decode"))
    engine = HFEngine(tiny["path"], eng_cfg, gen_cfg, sere_cfg=sere_off, moe_cfg=moe)
    try:
        reqs = [Request(uid=str(i), content=[{"type": "text", "text": t}])
                for i, t in enumerate(["hello there", "旅游 美食"])]
        engine.warmup(reqs)
        assert engine.technique_stats()["moe"]["steps"] == 0       # warm-up steps are not counted
        gens = engine.generate(reqs)
        assert all(g.error is None for g in gens)
        st = engine.technique_stats()["moe"]
        assert st["top_k"] == 2 and st["steps"] >= 1 and st["expert_union_after"] <= 2 * 2
    finally:
        engine.close()
    assert all(not hasattr(r.block, "_harness_sere") for r in find_moe_blocks(tiny["model"]))


def test_run_records_moe(tmp_path):
    """End to end: summary.json has the ``moe`` block and the config; with sere.k both blocks."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    common = [sys.executable, "-m", "harness", "wandb.mode=disabled", "dataset.limit=2", "engine.batch_size=2",
              "generation.max_new_tokens=4", "scoring.clip_model=null", "scoring.embed_model=null",
              f"cache.path={tmp_path / 'cache'}"]
    run = subprocess.run(common + ["moe.top_k=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: summary["config"]["moe"][k] for k in ("top_k", "scope", "routing")} == {"top_k": 2, "scope": "decode", "routing": None}
    assert summary["moe"]["top_k"] == 2 and summary["moe"]["steps"] > 0
    assert summary["moe"]["expert_union_after"] < summary["moe"]["expert_union_before"]
    both = subprocess.run(common + ["moe.top_k=3", "sere.k=1", f"hydra.run.dir={tmp_path / 'both'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    summary = json.loads((tmp_path / "both" / "summary.json").read_text())
    assert summary["moe"]["top_k"] == 3 and summary["sere"]["k_primary"] == 1
    assert summary["sere"]["expert_union_before"] == pytest.approx(summary["moe"]["expert_union_after"])




def test_random_p_draws_depend_on_the_seed_and_the_batch_only(tiny):
    """``moe.routing=random_p`` re-seeds its draws at every prefill from ``moe.seed`` and the prompt ids, so a batch
    is routed the same whatever ran before it (the latency protocol's warm-ups and re-timings run extra batches):
    the same batch twice, with another batch between, gives the same ids; another seed gives other ids."""
    from harness.engines.hf.routing_baselines import install_routing_baseline
    from harness.techniques.moe_routing import RoutingSettings

    def decode_ids(log):  # the ids the experts received on every decode step, layer by layer
        return [e["used"].tolist() for layer in sorted(log) for e in log[layer] if e["seq"] == 1]

    other = {k: v[:2] for k, v in tiny["batch"].items() if k in ("input_ids", "attention_mask")}

    def routed(seed):
        passes = []
        with capture(tiny["model"]) as log:
            handle = install_routing_baseline(tiny["model"], RoutingSettings("random_p", 1, 0.5, seed))
            try:
                for batch in (tiny["batch"], other, tiny["batch"]):
                    for entries in log.values():
                        entries.clear()
                    with torch.inference_mode():
                        tiny["model"].generate(**batch, max_new_tokens=MAX_NEW, do_sample=False,
                                               pad_token_id=tiny["proc"].tokenizer.pad_token_id)
                    passes.append(decode_ids(log))
            finally:
                handle.remove()
        return passes

    first, _, again = routed(3)
    assert first and again == first
    assert routed(4)[0] != first

"""``moe.top_k`` in the HF engine: K = top-k is the baseline bit for bit; K < top-k routes exactly as the
plain-torch reference (``harness.techniques.moe_topk.truncate_routing``), decode steps only by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.engines.hf_sere import install_sere
from harness.engines.hf_topk import install_topk
from harness.models.tiny import TinyModelSpec, ensure_tiny_model
from harness.techniques.moe_topk import truncate_routing
from harness.techniques.sere import expert_union
from harness.techniques.sere_calibration import find_moe_blocks

MAX_NEW = 5
TOP_K = TinyModelSpec().num_experts_per_tok
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("tiny"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    proc.tokenizer.padding_side = "left"

    def chat(parts):
        return proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)

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


@contextmanager
def capture(model):
    """Per layer and MoE pass: seq length, router logits/ids/weights, what the experts received.
    Entered before the top-K hooks, so "orig" is the stock router output."""
    log: dict[int, list[dict]] = {}
    hooks = []
    for ref in find_moe_blocks(model):
        entries = log.setdefault(ref.layer, [])

        def pre(module, args, entries=entries):
            entries.append({"seq": args[0].shape[1]})

        def gate(module, args, out, entries=entries):
            entries[-1].update(logits=out[0].clone(), orig_w=out[1].clone(), orig=out[2].clone())

        def experts(module, args, entries=entries):
            entries[-1].update(used=args[1].clone(), used_w=args[2].clone())

        hooks += [ref.block.register_forward_pre_hook(pre), ref.block.gate.register_forward_hook(gate),
                  ref.block.experts.register_forward_pre_hook(experts)]
    try:
        yield log
    finally:
        for h in hooks:
            h.remove()


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


def test_one_rewrite_per_model(tiny):
    handle = install_topk(tiny["model"], 2)
    try:
        with pytest.raises(RuntimeError, match="moe.top_k is already installed"):
            install_sere(tiny["model"], {r.layer: torch.eye(16) for r in find_moe_blocks(tiny["model"])}, 1, 0.0)
        with pytest.raises(RuntimeError, match="already installed"):
            install_topk(tiny["model"], 1)
    finally:
        handle.remove()
    assert all(not hasattr(r.block, "_harness_sere") for r in find_moe_blocks(tiny["model"]))
    with pytest.raises(ValueError):
        install_topk(tiny["model"], 0)


def test_engine_wiring_and_refusal(tiny):
    from harness.engines.base import Request
    from harness.engines.hf import HFEngine

    eng_cfg = SimpleNamespace(device="cpu", dtype="float32", batch_size=2, attn_implementation="sdpa",
                              experts_implementation=None, cuda_graphs=False, warmup=0)
    gen_cfg = SimpleNamespace(max_new_tokens=4)
    sere_off, moe = SimpleNamespace(k=None), SimpleNamespace(top_k=2, scope="decode")
    with pytest.raises(NotImplementedError, match="sere.k"):
        HFEngine("/nonexistent/never/loaded", eng_cfg, gen_cfg, sere_cfg=SimpleNamespace(k=2), moe_cfg=moe)
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
    """End to end: summary.json has the ``moe`` block and the config; moe.top_k + sere.k exits 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    common = [sys.executable, "-m", "harness", "wandb.mode=disabled", "dataset.limit=2", "engine.batch_size=2",
              "generation.max_new_tokens=4", "scoring.clip_model=null", "scoring.embed_model=null",
              f"cache.path={tmp_path / 'cache'}"]
    run = subprocess.run(common + ["moe.top_k=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["moe"] == {"top_k": 2, "scope": "decode"}
    assert summary["moe"]["top_k"] == 2 and summary["moe"]["steps"] > 0
    assert summary["moe"]["expert_union_after"] < summary["moe"]["expert_union_before"]
    bad = subprocess.run(common + ["moe.top_k=2", "sere.k=2", f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "sere.k" in bad.stderr + bad.stdout

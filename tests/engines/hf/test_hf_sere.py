"""SERE in the HF engine: decode-only re-routing on the tiny Qwen3-VL-MoE, checked against the reference.

Routing is captured with our own hooks: a forward hook on each router registered *before* SERE's (it sees
the original top-k) and a forward pre-hook on each experts module (it sees the ids and weights the experts
really receive). A pass is labelled by the block input's sequence length (1 = decode step).
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.kernels._triton import interpreting
from routing_capture import capture

from harness.engines.hf.sere import install_sere
from harness.models.tiny import TinyModelSpec
from harness.techniques.sere.reroute import expert_union, reroute
from harness.techniques.sere.calibration import compute_similarity, find_moe_blocks

MAX_NEW = 6
TOP_K = TinyModelSpec().num_experts_per_tok


@pytest.fixture(scope="module")
def tiny(tiny_parts):
    from PIL import Image

    model, proc, path, chat = tiny_parts.model, tiny_parts.proc, tiny_parts.path, tiny_parts.chat
    sims, _ = compute_similarity(model, proc.tokenizer, max_tokens=512)

    img_a = Image.new("RGB", (64, 48), (200, 30, 30))
    img_b = Image.linear_gradient("L").convert("RGB").resize((48, 64))
    texts = [
        chat([{"type": "text", "text": "What is the best food in the city park?"}]),
        chat([{"type": "image"}, {"type": "text", "text": "请描述这张图片"}]),
        chat([{"type": "text", "text": "旅游 美食 2024 answer"}]),
        chat([{"type": "image"}, {"type": "text", "text": "What is in the image?"}]),
    ]
    batch = proc(text=texts, images=[img_a, img_b], return_tensors="pt", padding=True)
    text_only = proc(text=[texts[0], texts[2]], return_tensors="pt", padding=True)
    return {"model": model, "proc": proc, "sims": sims, "batch": batch, "text_only": text_only}


def generate(tiny, inputs):
    with torch.inference_mode():
        out = tiny["model"].generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False,
                                     pad_token_id=tiny["proc"].tokenizer.pad_token_id)
    return out[:, inputs["input_ids"].shape[1]:]


def decode_entries(log):
    return {layer: [e for e in entries if e["seq"] == 1] for layer, entries in log.items()}


@pytest.fixture(scope="module")
def baseline(tiny):
    with capture(tiny["model"]) as log:
        tokens = generate(tiny, tiny["batch"])
    return {"tokens": tokens, "log": log, "text_only": generate(tiny, tiny["text_only"])}


def protected_mask(seed=0, frac=0.3):
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.rand(TinyModelSpec().num_experts, generator=g) < frac for layer in range(3)}


# ---- (a) K >= top_k changes nothing --------------------------------------------------------------------
@pytest.mark.parametrize("k_primary", [TOP_K, TOP_K + 2])
def test_k_at_least_top_k_is_identity(tiny, baseline, k_primary):
    handle = install_sere(tiny["model"], tiny["sims"], k_primary, 0.0)
    try:
        assert torch.equal(generate(tiny, tiny["batch"]), baseline["tokens"])
        assert torch.equal(generate(tiny, tiny["text_only"]), baseline["text_only"])
        st = handle.stats()
        assert st["steps"] == 2 * (MAX_NEW - 1) and st["moved_fraction"] is None  # no secondary slots
        assert st["expert_union_after"] == st["expert_union_before"]
    finally:
        handle.remove()


# ---- (b) prefill keeps the original top-k --------------------------------------------------------------
def test_prefill_routing_unchanged(tiny, baseline):
    with capture(tiny["model"]) as log:
        handle = install_sere(tiny["model"], tiny["sims"], 1, 0.0, op=reroute)
        try:
            generate(tiny, tiny["batch"])
        finally:
            handle.remove()
    for layer, entries in log.items():
        prefill = [e for e in entries if e["seq"] > 1]
        base = [e for e in baseline["log"][layer] if e["seq"] > 1]
        assert len(prefill) == len(base) == 1
        assert torch.equal(prefill[0]["used"], base[0]["used"])          # what the experts computed
        assert torch.equal(prefill[0]["used"], prefill[0]["orig"])
        assert torch.equal(prefill[0]["used_w"], base[0]["used_w"])


# ---- (c) decode routing is exactly the reference re-routing -------------------------------------------
@pytest.mark.parametrize("k_primary,rho,protect,op", [(1, 0.0, False, reroute), (2, 0.05, True, None)])
def test_decode_routing_equals_reference(tiny, k_primary, rho, protect, op, monkeypatch):
    """op None = the engine's default: the Triton kernel (its interpreter on CPU in tests, asked for with
    ``INTERPRETER_AUTO``; without it a CPU run takes the torch reference)."""
    from harness.engines.hf import routing as hf_routing
    from harness.kernels import reroute as kernel_reroute

    if op is None:
        monkeypatch.setattr(hf_routing, "INTERPRETER_AUTO", True)
        launches = []
        real = kernel_reroute.reroute_triton
        monkeypatch.setattr(kernel_reroute, "reroute_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    prot = protected_mask() if protect else None
    with capture(tiny["model"]) as log:
        handle = install_sere(tiny["model"], tiny["sims"], k_primary, rho, prot, op=op)
        try:
            generate(tiny, tiny["batch"])
        finally:
            handle.remove()
    moved = kept = 0
    for layer, entries in decode_entries(log).items():
        assert len(entries) == MAX_NEW - 1
        for e in entries:
            want = reroute(e["orig"], tiny["sims"][layer], k_primary, rho, prot[layer] if prot else None)
            assert torch.equal(e["used"], want)
            assert torch.equal(e["used_w"], e["orig_w"])                 # weights untouched
            diff = (e["used"] != e["orig"])[:, k_primary:]
            moved, kept = moved + int(diff.sum()), kept + int((~diff).sum())
    assert moved > 0 and (rho == 0.0 or kept > 0)                         # the case is not trivial
    if op is None and interpreting():
        assert launches                                                   # the kernel itself ran, not the reference


def test_cpu_default_reroute_is_the_reference_without_the_interpreter_flag(monkeypatch):
    """On CPU the engine's default re-route is the torch reference unless ``INTERPRETER_AUTO`` asks for the
    interpreter (which made CI's SERE runs 5-6x slower); on the same ids both give the same result."""
    from harness.engines.hf import routing as hf_routing
    from harness.engines.hf.sere import _default_op
    from harness.kernels import reroute as kernel_reroute

    launches = []
    monkeypatch.setattr(kernel_reroute, "reroute_triton", lambda *a, **k: launches.append(1))
    monkeypatch.setattr(hf_routing, "INTERPRETER_AUTO", False)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(5)])
    sim = torch.rand(8, 8, generator=g)
    got = _default_op()(ids, sim, 1, 0.0)
    assert torch.equal(got, reroute(ids, sim, 1, 0.0)) and not launches


# ---- (d) K=1, rho=0: the union per step collapses ------------------------------------------------------
def test_union_bounded_by_k_times_batch(tiny, baseline):
    k_primary, batch = 1, tiny["batch"]["input_ids"].shape[0]
    assert batch >= 4
    with capture(tiny["model"]) as log:
        handle = install_sere(tiny["model"], tiny["sims"], k_primary, 0.0, op=reroute)
        try:
            generate(tiny, tiny["batch"])
        finally:
            handle.remove()
    with_sere = [expert_union(e["used"]) for es in decode_entries(log).values() for e in es]
    without = [expert_union(e["used"]) for es in decode_entries(baseline["log"]).values() for e in es]
    assert max(with_sere) <= k_primary * batch
    assert sum(with_sere) / len(with_sere) < sum(without) / len(without)
    assert max(with_sere) < min(without)


# ---- (e) statistics ------------------------------------------------------------------------------------
def test_stats_match_captured_routing(tiny):
    k_primary, rho, prot = 2, 0.05, protected_mask(1)
    with capture(tiny["model"]) as log:
        handle = install_sere(tiny["model"], tiny["sims"], k_primary, rho, prot, op=reroute)
        try:
            generate(tiny, tiny["batch"])
            st = handle.stats()
        finally:
            handle.remove()
    json.dumps(st)  # goes into summary.json as it is
    dec = decode_entries(log)
    batch = tiny["batch"]["input_ids"].shape[0]
    assert st["steps"] == MAX_NEW - 1 and st["tokens_per_step"] == batch and st["layers"] == 3
    tot = {"before": 0, "after": 0, "moved": 0, "slots": 0, "n": 0}
    for row in st["per_layer"]:
        es = dec[row["layer"]]
        before = [expert_union(e["orig"]) for e in es]
        after = [expert_union(e["used"]) for e in es]
        moved = sum(int((e["used"] != e["orig"]).sum()) for e in es)
        slots = len(es) * batch * (TOP_K - k_primary)
        assert row["steps"] == len(es) and row["tokens"] == len(es) * batch
        assert row["expert_union_before"] == pytest.approx(sum(before) / len(es))
        assert row["expert_union_after"] == pytest.approx(sum(after) / len(es))
        assert row["primary_union"] == pytest.approx(sum(expert_union(e["orig"][:, :k_primary]) for e in es) / len(es))
        assert row["moved_slots"] == moved and row["secondary_slots"] == slots
        assert row["moved_fraction"] == pytest.approx(moved / slots)
        assert row["protected"] == int(prot[row["layer"]].sum())
        tot["before"] += sum(before)
        tot["after"] += sum(after)
        tot["moved"] += moved
        tot["slots"] += slots
        tot["n"] += len(es)
    assert st["expert_union_before"] == pytest.approx(tot["before"] / tot["n"])
    assert st["expert_union_after"] == pytest.approx(tot["after"] / tot["n"])
    assert st["experts_saved"] == pytest.approx(st["expert_union_before"] - st["expert_union_after"])
    assert st["moved_fraction"] == pytest.approx(tot["moved"] / tot["slots"])
    assert st["expert_union_after"] <= st["expert_union_before"]


def test_reset_stats_and_prefill_not_counted(tiny):
    handle = install_sere(tiny["model"], tiny["sims"], 1, 0.0, op=reroute)
    try:
        generate(tiny, tiny["text_only"])
        assert handle.stats()["steps"] == MAX_NEW - 1          # the prefill pass is not a step
        handle.reset_stats()
        st = handle.stats()
        assert st["steps"] == 0 and st["expert_union_before"] is None and st["moved_fraction"] is None
        generate(tiny, tiny["text_only"])
        assert handle.stats()["steps"] == MAX_NEW - 1
    finally:
        handle.remove()


# ---- (f) remove() restores stock behaviour --------------------------------------------------------------
def test_remove_restores_stock_behaviour(tiny, baseline):
    model = tiny["model"]
    blocks = find_moe_blocks(model)
    counts = [(len(r.block._forward_pre_hooks), len(r.block._forward_hooks), len(r.block.gate._forward_hooks))
              for r in blocks]
    handle = install_sere(model, tiny["sims"], 1, 0.0, op=reroute)
    assert not torch.equal(generate(tiny, tiny["batch"]), baseline["tokens"])  # it does change decoding
    with pytest.raises(RuntimeError, match="already installed"):
        install_sere(model, tiny["sims"], 1, 0.0)
    handle.remove()
    handle.remove()  # idempotent
    assert [(len(r.block._forward_pre_hooks), len(r.block._forward_hooks), len(r.block.gate._forward_hooks))
            for r in blocks] == counts
    assert all(not hasattr(r.block, "_harness_sere") for r in blocks)
    assert torch.equal(generate(tiny, tiny["batch"]), baseline["tokens"])
    assert torch.equal(generate(tiny, tiny["text_only"]), baseline["text_only"])


# ---- modes and guards ----------------------------------------------------------------------------------
def test_modes(tiny, baseline):
    with capture(tiny["model"]) as log:                      # registered first: "orig" = stock top-k
        handle = install_sere(tiny["model"], tiny["sims"], 1, 0.0, op=reroute, mode="off")
        try:
            assert torch.equal(generate(tiny, tiny["batch"]), baseline["tokens"])
            assert handle.stats()["steps"] == 0
            assert all(torch.equal(e["used"], e["orig"]) for es in log.values() for e in es)
            for es in log.values():
                es.clear()
            handle.mode = "all"                               # the reference plugin: prefill too
            generate(tiny, tiny["text_only"])
            assert handle.stats()["steps"] == MAX_NEW        # prefill pass + (MAX_NEW - 1) decode steps
            for layer, es in log.items():
                prefill = [e for e in es if e["seq"] > 1][0]
                assert torch.equal(prefill["used"], reroute(prefill["orig"], tiny["sims"][layer], 1, 0.0))
                assert not torch.equal(prefill["used"], prefill["orig"])
            with pytest.raises(ValueError):
                handle.mode = "prefill"
            # a router called outside its block's forward is never rewritten, whatever the mode
            gate = find_moe_blocks(tiny["model"])[0].block.gate
            x = torch.randn(8, TinyModelSpec().hidden_size, generator=torch.Generator().manual_seed(0))
            with_hook = gate(x)[2]
        finally:
            handle.remove()
    assert torch.equal(with_hook, gate(x)[2])


def test_install_validates_inputs(tiny):
    model, sims = tiny["model"], tiny["sims"]
    with pytest.raises(ValueError, match="layers"):
        install_sere(model, {0: sims[0], 1: sims[1]}, 1, 0.0)
    with pytest.raises(ValueError):
        install_sere(model, {k: v[:8, :8] for k, v in sims.items()}, 1, 0.0)
    with pytest.raises(ValueError):
        install_sere(model, sims, 0, 0.0)
    with pytest.raises(ValueError):
        install_sere(model, sims, 1, 0.0, {0: torch.zeros(3, dtype=torch.bool)})
    stacked = torch.stack([sims[i] for i in range(3)])
    handle = install_sere(model, stacked, 2, 0.1)            # an [L, E, E] tensor in block order
    with pytest.raises(RuntimeError, match="SERE hooks"):   # calibration must see the stock routing
        compute_similarity(model, tiny["proc"].tokenizer, max_tokens=16)
    handle.remove()
    assert all(not hasattr(r.block, "_harness_sere") for r in find_moe_blocks(model))


def test_sere_from_config(tiny, tmp_path):
    from types import SimpleNamespace

    from harness.engines.hf.sere import sere_from_config
    from harness.techniques.sere.calibration import save_similarity
    from harness.techniques.sere.protection import save_protection, top_n_mask

    model, tok = tiny["model"], tiny["proc"].tokenizer
    off = SimpleNamespace(k=None, rho=0.1, protect=0, similarity=None, protection=None)
    assert sere_from_config(model, tok, off, "tiny", tmp_path) is None
    sim_path = save_similarity(tmp_path / "sim.safetensors", tiny["sims"])
    scores = {layer: {"total": torch.arange(16.0), "mean": torch.arange(16.0)} for layer in range(3)}
    prot_path = save_protection(tmp_path / "prot.safetensors",
                                {layer: top_n_mask(scores[layer]["total"], 4) for layer in range(3)},
                                {"rank_by": "total", "n": 4}, scores)
    cfg = SimpleNamespace(k=2, rho=0.05, protect=2, similarity=str(sim_path), protection=str(prot_path))
    handle = sere_from_config(model, tok, cfg, "tiny", tmp_path)
    try:
        assert handle.k_primary == 2 and handle.rho == 0.05
        assert [st.protected.nonzero().flatten().tolist() for st in handle.layers] == [[14, 15]] * 3
        assert all(torch.equal(st.similarity, tiny["sims"][st.layer]) for st in handle.layers)
    finally:
        handle.remove()


# ---- finished rows (fed their EOS, then pad) leave P and the statistics ---------------------------------
def test_finished_rows_leave_primary_union_and_statistics(tiny):
    """A row that produced its EOS keeps being fed tokens by ``generate`` (its EOS, then pad) until the whole
    batch ends. Its routing must neither join P nor be counted, and it is not re-routed. The EOS is chosen
    from the run's own tokens so that one row ends after its second token while the others go on."""
    model, tok = tiny["model"], tiny["proc"].tokenizer
    k_primary, rho, batch = 1, 0.0, tiny["batch"]
    with install_sere(model, tiny["sims"], k_primary, rho, op=reroute):
        free = generate(tiny, batch)                          # no early EOS: the routing up to it is the same
    nontrivial = 0
    for row in range(free.shape[0]):
        eos = int(free[row, 1])
        if any(eos in free[r, :2].tolist() for r in range(free.shape[0]) if r != row) or eos in free[row, :1]:
            continue
        with capture(model) as log:
            handle = install_sere(model, tiny["sims"], k_primary, rho, op=reroute, eos_token_ids=[eos])
            try:
                with torch.inference_mode():
                    out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                         pad_token_id=tok.pad_token_id)[:, batch["input_ids"].shape[1]:]
                st = handle.stats()
            finally:
                handle.remove()
        assert out[row, 1] == eos and (out[row, 2:] == tok.pad_token_id).all()
        live_total = 0
        for layer, entries in decode_entries(log).items():
            for step, e in enumerate(entries):                # decode step s feeds generated token s
                live = torch.tensor([eos not in out[r, :step + 1].tolist() for r in range(out.shape[0])])
                want = reroute(e["orig"], tiny["sims"][layer], k_primary, rho, row_mask=live)
                assert torch.equal(e["used"], want)
                assert torch.equal(e["used"][~live], e["orig"][~live])      # finished rows not re-routed
                if not torch.equal(want, reroute(e["orig"], tiny["sims"][layer], k_primary, rho)):
                    nontrivial += 1                           # the old rule (every row in P) differs here
                if layer == 0:
                    live_total += int(live.sum())
        assert st["per_layer"][0]["tokens"] == live_total < len(decode_entries(log)[0]) * out.shape[0]
        assert st["tokens_per_step"] == pytest.approx(live_total / (MAX_NEW - 1))
        assert set(st["by_batch_size"]) >= {str(out.shape[0]), str(out.shape[0] - 1)}
        for row_stats in st["per_layer"]:
            es = decode_entries(log)[row_stats["layer"]]
            before = after = 0
            for step, e in enumerate(es):
                live = torch.tensor([eos not in out[r, :step + 1].tolist() for r in range(out.shape[0])])
                before += expert_union(e["orig"][live])
                after += expert_union(e["used"][live])
            assert row_stats["expert_union_before"] == pytest.approx(before / len(es))
            assert row_stats["expert_union_after"] == pytest.approx(after / len(es))
        break
    assert nontrivial > 0


def test_invalid_primary_id_is_not_expert_zero(tiny):
    """-1 ("no expert") in a primary slot must not put expert 0 into P for the statistics: a secondary slot
    holding expert 0 is then outside P (and, with no similar primary, critical)."""
    handle = install_sere(tiny["model"], tiny["sims"], 1, 2.0, op=reroute)   # rho > 1: nothing ever moves
    try:
        st = handle.layers[0]
        old = torch.tensor([[-1, 0, 3, 4], [5, 6, 7, 8]])
        handle._record(st, old, reroute(old, st.similarity, 1, 2.0))
        stats = handle.stats()["per_layer"][0]
        # P = {5}; secondary experts outside P: 0, 3, 4, 6, 7, 8 -> all 6 slots critical
        assert stats["primary_union"] == 1
        assert stats["critical_fraction"] == 1.0
        assert stats["expert_union_before"] == 7                   # 0, 3, 4, 5, 6, 7, 8 (-1 is no expert)
    finally:
        handle.remove()

"""SERE calibration (similarity matrices) and protection builder, on the tiny Qwen3-VL-MoE and on
hand-built MoE blocks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from harness.models.tiny import TinyModelSpec, ensure_tiny_model
from harness.techniques.sere import calibration as cal
from harness.techniques.sere import protection as prot
from harness.commands import sere_calibrate, sere_protect
from harness.techniques.sere.reroute import reroute

SPEC = TinyModelSpec()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = ensure_tiny_model(SPEC, cache_dir=tmp_path_factory.mktemp("tiny"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return {"path": path, "model": model, "tok": AutoTokenizer.from_pretrained(path)}


@pytest.fixture(scope="module")
def tiny64(tiny):
    """The same model in float64, and the MoE inputs of 300 calibration tokens."""
    model = copy.deepcopy(tiny["model"]).to(torch.float64)
    model.set_experts_implementation("eager")          # grouped_mm has no float64 kernel
    text, _ = cal.load_calibration_text()
    seqs = cal.calibration_sequences(tiny["tok"], text, max_tokens=300)
    return {"model": model, "tok": tiny["tok"], "seqs": seqs, "hidden": cal.collect_moe_inputs(model, seqs)}


def brute_force_outputs(experts, x):
    """Every expert's output, one at a time, straight from the weights (eager formula): [E, T, H]."""
    outs = []
    for e in range(experts.gate_up_proj.shape[0]):
        gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, experts.down_proj[e]))
    return torch.stack(outs)


def brute_force_similarity(outs):
    """d_ij = ||O_i - O_j||_F with every output materialised; sim = 1 - d / max off-diagonal d."""
    e = outs.shape[0]
    d = torch.zeros(e, e, dtype=torch.float64)
    for i in range(e):
        for j in range(e):
            d[i, j] = (outs[i] - outs[j]).double().norm()
    off = d[~torch.eye(e, dtype=torch.bool)]
    sim = 1 - d / off.max()
    sim.fill_diagonal_(1.0)
    return sim


# ---- finding blocks, data ------------------------------------------------------------------------------
def test_find_moe_blocks(tiny):
    refs = cal.find_moe_blocks(tiny["model"])
    assert [r.layer for r in refs] == list(range(SPEC.num_hidden_layers))
    assert all(r.num_experts == SPEC.num_experts and r.name.endswith(f"layers.{r.layer}.mlp") for r in refs)


def test_calibration_sequences_budget(tiny):
    text, sha = cal.load_calibration_text()
    assert 3000 <= len(text.encode()) <= 6500 and len(sha) == 64
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)          # English and Chinese
    seqs = cal.calibration_sequences(tiny["tok"], text, max_tokens=700, max_seq_len=64)
    assert sum(s.numel() for s in seqs) == 700 and max(s.numel() for s in seqs) <= 64
    full = cal.calibration_sequences(tiny["tok"], text, max_tokens=10**6)
    assert max(s.numel() for s in full) <= 512


def test_collected_inputs_are_the_blocks_inputs(tiny64):
    hidden = tiny64["hidden"]
    n = sum(s.numel() for s in tiny64["seqs"])
    assert sorted(hidden) == [0, 1, 2] and all(h.shape == (n, SPEC.hidden_size) for h in hidden.values())
    # rows are the block's real inputs, in token order: compare with a hook of our own on one sequence
    model, seq = tiny64["model"], tiny64["seqs"][0]
    block = cal.find_moe_blocks(model)[1].block
    seen = []
    h = block.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).clone()))
    with torch.inference_mode():
        model(input_ids=seq[None], use_cache=False)
    h.remove()
    assert torch.equal(seen[0], hidden[1][: seq.numel()])


# ---- similarity: Gram accumulation == brute force --------------------------------------------------------
def test_gram_similarity_matches_brute_force(tiny64):
    for ref in cal.find_moe_blocks(tiny64["model"]):
        x = tiny64["hidden"][ref.layer]
        with torch.inference_mode():
            outs = brute_force_outputs(ref.block.experts, x)
            want = brute_force_similarity(outs)
            gram = cal.expert_gram(ref.block.experts, x, chunk_tokens=37)   # uneven chunks
        got, dmax = cal.similarity_from_gram(gram)
        assert torch.allclose(got, want, rtol=0, atol=1e-9)
        flat = outs.reshape(outs.shape[0], -1)
        assert torch.allclose(gram, flat @ flat.T, rtol=1e-10, atol=0)
        off = ~torch.eye(flat.shape[0], dtype=torch.bool)
        assert dmax == pytest.approx(float(torch.cdist(flat, flat)[off].max()), rel=1e-9)


def test_compute_similarity_end_to_end(tiny64):
    sims, meta = cal.compute_similarity(tiny64["model"], tiny64["tok"], max_tokens=300, model_id="tiny")
    assert meta["tokens"] == 300 and meta["layers"] == [0, 1, 2] and meta["num_experts"] == SPEC.num_experts
    for layer, sim in sims.items():
        x = tiny64["hidden"][layer]
        with torch.inference_mode():
            experts = cal.find_moe_blocks(tiny64["model"])[layer].block.experts
            want = brute_force_similarity(brute_force_outputs(experts, x))
        assert sim.dtype == torch.float32 and torch.allclose(sim.double(), want, atol=1e-6)
        assert torch.equal(sim, sim.T) and torch.all(sim.diagonal() == 1)
        assert float(sim.min()) == 0.0 and float(sim.max()) == 1.0


def test_identical_experts_have_similarity_one(tiny64):
    experts = copy.deepcopy(cal.find_moe_blocks(tiny64["model"])[0].block.experts)
    with torch.no_grad():
        experts.gate_up_proj[5] = experts.gate_up_proj[3]
        experts.down_proj[5] = experts.down_proj[3]
    sim, _ = cal.similarity_from_gram(cal.expert_gram(experts, tiny64["hidden"][0], chunk_tokens=64))
    assert sim[3, 5] == pytest.approx(1.0, abs=1e-6) and sim[5, 3] == pytest.approx(1.0, abs=1e-6)
    assert float(sim[3, 4]) < 0.99


def test_similarity_from_gram_edge_cases():
    same = torch.ones(3, 3, dtype=torch.float64)                 # three identical outputs
    sim, dmax = cal.similarity_from_gram(same)
    assert dmax == 0.0 and torch.equal(sim, torch.ones(3, 3, dtype=torch.float64))
    one, _ = cal.similarity_from_gram(torch.tensor([[4.0]]))
    assert one.tolist() == [[1.0]]
    # vectors (1,0), (0,1), (0,0): d = [[0, √2, 1], [√2, 0, 1], [1, 1, 0]]
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    sim, dmax = cal.similarity_from_gram(v @ v.T)
    assert dmax == pytest.approx(2 ** 0.5)
    assert torch.allclose(sim, torch.tensor([[1, 0, 1 - 2 ** -0.5], [0, 1, 1 - 2 ** -0.5],
                                             [1 - 2 ** -0.5, 1 - 2 ** -0.5, 1]], dtype=torch.float64))


def test_fast_dense_pass_equals_the_modules_own_forward(tiny):
    experts = cal.find_moe_blocks(tiny["model"])[2].block.experts
    x = torch.randn(10, SPEC.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = cal.expert_outputs(experts, x)
        ones = torch.ones(10, 1)
        own = torch.stack([experts(x, torch.full((10, 1), e), ones) for e in range(SPEC.num_experts)])
    assert torch.allclose(fast, own, rtol=1e-5, atol=1e-5)


# ---- artifacts and cache ---------------------------------------------------------------------------------
def test_save_load_roundtrip(tmp_path):
    sims = {3: torch.rand(4, 4), 7: torch.rand(4, 4)}
    path = cal.save_similarity(tmp_path / "s.safetensors", sims, {"model_id": "m", "tokens": 5})
    got, meta = cal.load_similarity(path)
    assert list(got) == [3, 7] and all(torch.equal(got[k], sims[k]) for k in sims)
    assert meta["model_id"] == "m" and meta["layers"] == [3, 7] and meta["kind"] == "sere_similarity"
    assert json.loads((tmp_path / "s.safetensors.json").read_text())["tokens"] == 5
    from safetensors.torch import save_file  # the single-tensor form

    save_file({"similarity": torch.stack([sims[3], sims[7]])}, str(tmp_path / "one.safetensors"),
              metadata={"harness_sere": json.dumps({"layers": [3, 7]})})
    got, _ = cal.load_similarity(tmp_path / "one.safetensors")
    assert torch.equal(got[7], sims[7])


def test_similarity_for_computes_once_then_reuses(tiny, tmp_path, monkeypatch):
    calls = []
    real = cal.compute_similarity

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cal, "compute_similarity", counting)
    first = cal.similarity_for(tiny["model"], tiny["tok"], "tiny", tmp_path, max_tokens=128)
    again = cal.similarity_for(tiny["model"], tiny["tok"], "tiny", tmp_path, max_tokens=128)
    assert len(calls) == 1 and all(torch.equal(first[k], again[k]) for k in first)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    assert cal.load_similarity(files[0])[1]["model_fingerprint"] == cal.model_fingerprint(tiny["model"])
    other = tmp_path / "other.txt"
    other.write_text("A different calibration text.\n\nAnother paragraph about rivers and hills.", encoding="utf-8")
    cal.similarity_for(tiny["model"], tiny["tok"], "tiny", tmp_path, text_path=other, max_tokens=128)
    assert len(calls) == 2                                         # new data hash, new entry
    files[0].write_bytes(b"garbage")                               # a damaged entry is recomputed
    cal.similarity_for(tiny["model"], tiny["tok"], "tiny", tmp_path, max_tokens=128)
    assert len(calls) == 3


def test_fingerprint_tracks_router_weights_not_dtype(tiny, tiny64):
    fp = cal.model_fingerprint(tiny["model"])
    assert fp == cal.model_fingerprint(tiny64["model"])
    changed = copy.deepcopy(tiny["model"])
    with torch.no_grad():
        cal.find_moe_blocks(changed)[0].block.gate.weight[0, 0] += 1
    assert cal.model_fingerprint(changed) != fp


def test_calibration_cli(tiny, tmp_path):
    out = tmp_path / "sim.safetensors"
    assert sere_calibrate.main(["--model", str(tiny["path"]), "--out", str(out), "--max-tokens", "96",
                     "--device", "cpu"]) == 0
    sims, meta = cal.load_similarity(out)
    assert sorted(sims) == [0, 1, 2] and meta["tokens"] == 96 and meta["model_id"] == str(tiny["path"])
    assert meta["harness_version"] and meta["date"] and len(meta["calibration_sha256"]) == 64


# ---- protection -------------------------------------------------------------------------------------------
def test_damage_equals_rerouting_one_expert_through_the_block(tiny64):
    """The per-slot formula equals re-running the experts with only e's slots re-routed."""
    block = cal.find_moe_blocks(tiny64["model"])[0].block
    x = tiny64["hidden"][0][:16]
    sim = torch.rand(16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    k_primary, rho = 1, 0.3
    got = prot.expert_damage(block, x, sim, k_primary, rho, batch_size=16)
    with torch.inference_mode():
        _, w, ids = block.gate(x)
        new = reroute(ids, sim, k_primary, rho)
        orig = block.experts(x, ids, w)
        want = torch.zeros(16, dtype=torch.float64)
        routed = torch.zeros(16, dtype=torch.long)
        for e in range(16):
            only_e = torch.where(ids == e, new, ids)
            out = block.experts(x, only_e, w)
            r = (out - orig).norm(dim=-1) / orig.norm(dim=-1)
            has = (ids[:, k_primary:] == e).any(dim=1)
            want[e] = r[has].sum()
            routed[e] = int(has.sum())
    assert torch.equal(got["routed"], routed)
    assert torch.allclose(got["damage_sum"], want, rtol=1e-9, atol=1e-12)
    assert torch.allclose(got["total"], want / 16) and torch.allclose(got["mean"], want / routed.clamp_min(1))
    assert int(got["moved"].sum()) == int((new != ids).sum()) > 0


def synthetic_block(num_experts=6, hidden=16, copies=(1, 2)):
    """A Qwen3-MoE block whose expert 0 is every token's top-1 (so P = {0} in every batch, K = 1) and
    whose experts in ``copies`` are exact copies of expert 0: re-routing them to 0 changes nothing."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=8, num_experts=num_experts,
                         num_experts_per_tok=2, norm_topk_prob=True, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(num_experts, hidden, generator=g))
        block.gate.weight[:, 0] = 0.0
        block.gate.weight[0, 0] = 5.0                 # feature 0 is 10 for every token: expert 0 wins
        block.gate.weight[0, 1:] = 0.0
        block.experts.gate_up_proj.copy_(torch.randn(block.experts.gate_up_proj.shape, generator=g) / 4)
        block.experts.down_proj.copy_(torch.randn(block.experts.down_proj.shape, generator=g) / 3)
        for c in copies:
            block.experts.gate_up_proj[c] = block.experts.gate_up_proj[0]
            block.experts.down_proj[c] = block.experts.down_proj[0]
    x = torch.randn(96, hidden, generator=g)
    x[:, 0] = 10.0
    return block, x


@pytest.mark.parametrize("rank_by", ["total", "mean"])
def test_harmless_expert_ranks_below_harmful_ones(rank_by):
    block, x = synthetic_block()
    sim = torch.full((6, 6), 0.5)
    sim.fill_diagonal_(1.0)
    st = prot.expert_damage(block, x, sim, k_primary=1, rho=0.0, batch_size=16)
    with torch.inference_mode():
        assert torch.all(block.gate(x)[2][:, 0] == 0)                # P = {0} indeed
    assert st["routed"][0] == 0 and torch.all(st["routed"][1:] > 0)
    assert st[rank_by][1] == 0 and st[rank_by][2] == 0               # copies of expert 0: no damage
    assert torch.all(st[rank_by][3:] > 0)
    mask = prot.top_n_mask(st[rank_by], 3)
    assert mask.tolist() == [False, False, False, True, True, True]
    order = torch.argsort(-st[rank_by], stable=True).tolist()
    assert max(order.index(3), order.index(4), order.index(5)) < min(order.index(1), order.index(2))


def test_top_n_mask_ties_and_bounds():
    s = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9])
    assert prot.top_n_mask(s, 3).tolist() == [True, True, False, False, True]   # tie 0.5: lower id
    assert prot.top_n_mask(s, 0).sum() == 0 and prot.top_n_mask(s, 5).all()
    with pytest.raises(ValueError):
        prot.top_n_mask(s, 6)


def test_protection_builder_deterministic_exactly_n(tiny, tmp_path):
    sims, _ = cal.compute_similarity(tiny["model"], tiny["tok"], max_tokens=256)
    kw = dict(max_tokens=256, model_id="tiny")
    p1, s1, meta = prot.compute_protection(tiny["model"], tiny["tok"], sims, 1, 0.0, 4, **kw)
    p2, s2, _ = prot.compute_protection(tiny["model"], tiny["tok"], sims, 1, 0.0, 4, **kw)
    assert sorted(p1) == [0, 1, 2]
    for layer in p1:
        assert p1[layer].dtype == torch.bool and p1[layer].shape == (SPEC.num_experts,)
        assert int(p1[layer].sum()) == 4 and torch.equal(p1[layer], p2[layer])
        assert torch.equal(s1[layer]["total"], s2[layer]["total"])
        assert torch.equal(p1[layer], prot.top_n_mask(s1[layer]["total"], 4))
        assert int(s1[layer]["routed"].sum()) == 256 * (SPEC.num_experts_per_tok - 1)
    assert meta["batch_size"] == 16 and meta["k_primary"] == 1 and meta["n"] == 4
    # artifact: round trip, and another n re-derived from the stored scores
    path = prot.save_protection(tmp_path / "p.safetensors", p1, meta, s1)
    got, gmeta = prot.load_protection(path)
    assert all(torch.equal(got[k], p1[k]) for k in p1) and gmeta["rank_by"] == "total"
    got8, meta8 = prot.load_protection(path, n=8)
    assert all(int(v.sum()) == 8 and bool((v & p1[k]).sum() == 4) for k, v in got8.items())
    assert meta8["n"] == 8


def test_protection_for_caches_scores_for_any_n(tiny, tmp_path, monkeypatch):
    sims, _ = cal.compute_similarity(tiny["model"], tiny["tok"], max_tokens=128)
    calls = []
    real = prot.compute_protection
    monkeypatch.setattr(prot, "compute_protection", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = prot.protection_for(tiny["model"], tiny["tok"], "tiny", sims, 2, 0.1, 2, tmp_path, max_tokens=128)
    b = prot.protection_for(tiny["model"], tiny["tok"], "tiny", sims, 2, 0.1, 5, tmp_path, max_tokens=128)
    assert len(calls) == 1
    assert all(int(a[k].sum()) == 2 and int(b[k].sum()) == 5 and bool((a[k] & ~b[k]).sum() == 0) for k in a)


def test_protection_cli(tiny, tmp_path):
    sim_path = tmp_path / "sim.safetensors"
    sere_calibrate.main(["--model", str(tiny["path"]), "--out", str(sim_path), "--max-tokens", "64", "--device", "cpu"])
    out = tmp_path / "prot.safetensors"
    assert sere_protect.main(["--model", str(tiny["path"]), "--similarity", str(sim_path), "--k", "2", "--rho", "0.0",
                      "--n", "3", "--out", str(out), "--max-tokens", "64", "--device", "cpu"]) == 0
    got, meta = prot.load_protection(out)
    assert sorted(got) == [0, 1, 2] and all(int(v.sum()) == 3 for v in got.values())
    assert meta["similarity_hash"] == prot.similarity_hash(cal.load_similarity(sim_path)[0])


# ---- the user's calibration data and token budget -------------------------------------------------------
def _write_dataset(root):
    """A directory with a .jsonl (objects with a ``body`` field), a .json list of strings and a .txt file."""
    root.mkdir()
    rows = [{"body": f"Document {i} about rivers, hills and the history of number {i}. " * 8, "id": i}
            for i in range(6)]
    (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    (root / "b.json").write_text(json.dumps(["第二个文件的第一篇文档，讲城市和公园。" * 5]), encoding="utf-8")
    (root / "c.txt").write_text("Plain text document one.\n\nPlain text document two.", encoding="utf-8")
    return root


def test_documents_from_jsonl_json_txt_and_directories(tmp_path):
    root = _write_dataset(tmp_path / "data")
    docs = list(cal.iter_calibration_documents(root, "body"))
    assert len(docs) == 6 + 1 + 2 and docs[0].startswith("Document 0") and docs[6].startswith("第二个")
    assert docs[-1] == "Plain text document two."
    assert list(cal.iter_calibration_documents(root / "b.json")) == docs[6:7]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "t1"}) + "\n" + json.dumps("t2") + "\n", encoding="utf-8")
    assert list(cal.iter_calibration_documents(plain)) == ["t1", "t2"]     # default field, bare strings
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no text field"):
        list(cal.iter_calibration_documents(root))                          # "body" is not a default field
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        list(cal.iter_calibration_documents(bad))
    with pytest.raises(FileNotFoundError, match="calibration_text"):
        cal.calibration_source_sha256(tmp_path / "missing.txt")
    # the cache key follows the bytes and the field
    sha = cal.calibration_source_sha256(root, "body")
    assert sha != cal.calibration_source_sha256(root, "text")
    (root / "c.txt").write_text("changed", encoding="utf-8")
    assert sha != cal.calibration_source_sha256(root, "body")
    assert cal.calibration_source_sha256() == cal.load_calibration_text()[1]   # shipped text: file bytes


def test_budget_default_is_the_references_and_shortfall_is_recorded(tiny, tmp_path, caplog):
    assert cal.DEFAULT_MAX_TOKENS == 32 * 512
    seqs, meta = cal.calibration_data(tiny["tok"])                          # the shipped text: ~3k tokens
    assert meta["max_tokens"] == 16384 and meta["tokens"] == sum(s.numel() for s in seqs) < 16384
    assert meta["budget_met"] is False and meta["calibration_source"].startswith("shipped:")
    assert "fewer than the budget" in caplog.text
    root = _write_dataset(tmp_path / "data")
    seqs, meta = cal.calibration_data(tiny["tok"], root, "body", max_tokens=300, max_seq_len=64)
    assert meta["tokens"] == 300 and meta["budget_met"] and meta["calibration_source"] == str(root)
    assert max(s.numel() for s in seqs) <= 64 and meta["calibration_field"] == "body"


def test_calibration_cli_with_user_data(tiny, tmp_path):
    root = _write_dataset(tmp_path / "data")
    out = tmp_path / "sim.safetensors"
    assert sere_calibrate.main(["--model", str(tiny["path"]), "--out", str(out), "--data", str(root), "--text-field", "body",
                     "--max-tokens", "200", "--device", "cpu"]) == 0
    _, meta = cal.load_similarity(out)
    assert meta["tokens"] == 200 and meta["budget_met"] and meta["calibration_source"] == str(root)
    assert meta["calibration_sha256"] == cal.calibration_source_sha256(root, "body")
    assert json.loads(out.with_name(out.name + ".json").read_text())["max_tokens"] == 200


def test_run_config_keys_reach_the_artifacts(tiny, tmp_path):
    """``sere.calibration_text`` / ``_field`` / ``_tokens`` decide the data of the similarity and protection
    built on first use, and their cache keys."""
    from types import SimpleNamespace

    from harness.engines.hf.sere import sere_from_config

    root = _write_dataset(tmp_path / "data")
    cfg = SimpleNamespace(k=2, rho=0.1, protect=2, similarity=None, protection=None, calibration_text=str(root),
                          calibration_field="body", calibration_tokens=160)
    handle = sere_from_config(tiny["model"], tiny["tok"], cfg, "tiny", tmp_path / "cache")
    handle.remove()
    metas = {p.name.split("-")[0]: json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*.json")}
    for kind in ("sim", "prot"):
        assert metas[kind]["tokens"] == 160 and metas[kind]["calibration_source"] == str(root)
        assert metas[kind]["calibration_sha256"] == cal.calibration_source_sha256(root, "body")

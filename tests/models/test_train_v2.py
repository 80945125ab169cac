"""Recipe v2 of the embedded model: generator 2's layout, the variant flags, grouped experts, adoption."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from harness.datasets.synthetic import tasks as st


def content_cells(img, threshold: int = 60) -> np.ndarray:
    """[rows, cols] bool: which 32 × 32 cells (LLM visual tokens) hold ink or a shape."""
    a = np.asarray(img.convert("RGB")).astype(int)
    h, w = a.shape[0] // 32, a.shape[1] // 32
    cells = a[: h * 32, : w * 32].reshape(h, 32, w, 32, 3).transpose(0, 2, 1, 3, 4).reshape(h, w, -1, 3)
    return (cells.max(axis=2) - cells.min(axis=2)).max(axis=-1) > threshold


def test_generator2_puts_each_glyph_in_its_own_token_cell(generator2):
    rng = random.Random(0)
    for _ in range(60):
        it = st.ocr_item(rng, "train")
        lines = it.answers[0].split(" ")
        cells = content_cells(it.image)
        assert cells.shape == (len(lines), 4)
        assert [int(r.sum()) for r in cells] == [len(line) for line in lines]  # one cell per character
        assert cells.mean() >= 0.75  # text-dense
        assert set(it.answers[0].replace(" ", "")) <= set(st.V2_ALPHABET)


def test_generator2_shapes_one_per_cell_and_sparse(generator2):
    rng = random.Random(1)
    for _ in range(60):
        it = st.mcq_item(rng, "train")
        cells = content_cells(it.image)
        n = int(cells.sum())
        assert 1 <= n <= 4 and cells.mean() <= 0.34  # sparse
        if it.category == "Count":
            assert it.options[it.answer] == st.COUNTS[n - 1]


def test_generator_choice_changes_items_and_split_keys_stay_disjoint(generator2):
    held = st.items("ocr", "heldout", 30)
    assert all(st.is_heldout(i.key) for i in held)
    assert not any(st.is_heldout(i.key) for i in st.items("ocr", "train", 60))
    st.use_generator("1")
    assert [i.key for i in st.items("ocr", "heldout", 30)] != [i.key for i in held]
    with pytest.raises(ValueError):
        st.use_generator("3")


def test_bundle_records_its_generator_version(tmp_path, generator2):
    from harness.datasets.synthetic.bundle import bundle

    bundle(str(tmp_path))
    assert (tmp_path / "GENERATOR").read_text().strip() == "2"
    assert st.generator_version() == "2"


def test_variant_defaults_and_explicit_flags():
    from harness.models.train_recipes import V1_TASK_WEIGHTS
    from harness.models.train_tiny import parse_args

    assert parse_args(["--out", "x"]).variant == "v4"  # the default: the committed checkpoint's recipe
    v1 = parse_args(["--variant", "v1", "--out", "x"])  # the first committed recipe, unchanged
    assert (v1.variant, v1.generator, v1.aux, v1.focus, v1.curriculum, v1.expert_groups) == ("v1", "1", 0.005, 0.1, 0.0, 0)
    assert v1.task_weights == V1_TASK_WEIGHTS
    v2 = parse_args(["--out", "x", "--variant", "v2-all", "--aux", "0.01"])
    assert v2.generator == "2" and v2.aux == 0.01 and v2.expert_groups == 4 and v2.curriculum == 0.3


def test_curriculum_weights():
    from harness.models.train_recipes import CURRICULUM_WEIGHTS, VARIANTS, task_weights_at

    r = VARIANTS["v2-curriculum"]
    assert task_weights_at(r, 10, 100) == CURRICULUM_WEIGHTS and CURRICULUM_WEIGHTS["rag"] == 0
    assert task_weights_at(r, 31, 100) == r["task_weights"]
    assert task_weights_at(VARIANTS["v1"], 1, 100) == VARIANTS["v1"]["task_weights"]


def test_grouped_expert_init_makes_near_duplicates():
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    from harness.models.tiny import TinyModelSpec, build_config, build_tokenizer
    from harness.models.train_recipes import group_experts

    spec = TinyModelSpec(num_experts=8, num_experts_per_tok=2)
    tok = build_tokenizer(spec)
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(build_config(spec, tok))
    name = next(n for n, _ in model.named_parameters() if n.endswith("layers.0.mlp.experts.down_proj"))
    before = dict(model.named_parameters())[name].detach().clone()
    router = next(p for n, p in model.named_parameters() if n.endswith("layers.0.mlp.gate.weight")).detach().clone()
    assert group_experts(model, 2) > 0
    after = dict(model.named_parameters())[name].detach()
    cos = torch.nn.functional.cosine_similarity
    flat = after.reshape(8, -1)
    assert torch.equal(after[0], before[0]) and torch.equal(after[4], before[4])  # group seeds stay as drawn
    assert cos(flat[1], flat[0], dim=0) > 0.9 and cos(flat[5], flat[4], dim=0) > 0.9
    assert abs(float(cos(flat[1], flat[4], dim=0))) < 0.3  # across groups: unrelated
    assert torch.equal(router, next(p for n, p in model.named_parameters() if n.endswith("layers.0.mlp.gate.weight")))
    with pytest.raises(ValueError):
        group_experts(model, 3)


def test_adopt_refuses_other_formats_and_adopts_a_good_one(tmp_path):
    from harness.commands.adopt_checkpoint import adopt
    from harness.models.trained import CHECKPOINT

    dst = tmp_path / "dst"
    shutil.copytree(CHECKPOINT, dst)
    bad = tmp_path / "bad"
    shutil.copytree(CHECKPOINT, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["text_config"]["norm_topk_prob"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="config keys missing"):
        adopt(bad, dst, tmp_path / "docs.md")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(CHECKPOINT, corrupt)
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="SHA-256"):
        adopt(corrupt, dst, tmp_path / "docs.md")

    # a "new" checkpoint: the same weights recorded under another hash history (docs quote the old hash)
    good = tmp_path / "good"
    shutil.copytree(CHECKPOINT, good)
    info = json.loads((dst / "harness_model.json").read_text())
    info["sha256"] = "0" * 64
    (dst / "harness_model.json").write_text(json.dumps(info))
    docs = tmp_path / "docs.md"
    docs.write_text(f"hash `{'0' * 64}` here\n")
    got = adopt(good, dst, docs, bundle_root=tmp_path / "bundled")
    assert json.loads((dst / "harness_model.json").read_text())["sha256"] == got["sha256"]
    assert got["sha256"] in docs.read_text() and "0" * 64 not in docs.read_text()
    assert (tmp_path / "bundled" / "GENERATOR").read_text().strip() == str(got["generator_version"])
    assert (tmp_path / "bundled" / "rag_igbench_sample" / "data.jsonl").exists()


def test_headline_and_table_read_the_evaluator_results():
    from harness.commands.eval_tiny import format_table, headline

    res = {"ocr": {"keep1.0": {"metrics": {"ocrbench_accuracy": 0.9}}, "keep0.25": {"metrics": {"ocrbench_accuracy": 0.1}}},
           "mix": {"request": {"visionzip": {"by_source": {"ocrbench": {"keep_rate": 0.8}, "ccbench": {"keep_rate": 0.3}}}}},
           "rag": {"base": {"metrics": {"rouge1": 0.5, "edit_score": 0.4, "kendall": 0.3, "format_invalid": 1,
                                        "n_samples": 12}}, "topk_1": {"error": "boom"}}}
    h = headline(res)
    assert h["ocr_acc_keep1.0"] == 0.9 and h["ocr_acc_keep0.5"] is None
    assert h["mix_request_gap_text_minus_sparse"] == pytest.approx(0.5) and h["mix_image_gap_text_minus_sparse"] is None
    assert h["rag_base"]["edit_score"] == 0.4 and h["rag_topk_1"] is None
    table = format_table(h)
    assert "| base | 0.500 | 0.400 | 0.300 | 1 | 12 |" in table


def test_generator2_lets_a_request_budget_favour_text_under_focused_attention(generator2):
    """The data design behind (d): if the vision tower's attention sits on content patches (what the focus loss
    trains; v1 reached 98.9 % of the mass), VisionZip's request-wide top-k keeps most of a text image and little
    more than the shapes of a shape image, while the per-image ratio keeps the same share of both."""
    import torch

    from harness.models.train_data import patchify
    from harness.techniques.visionzip.pruning import select_tokens

    def scores(img, mass=0.95):
        p = patchify(np.asarray(img.convert("RGB"))).reshape(-1, 3, 512).astype(int)
        c = ((p.max(-1) - p.min(-1)).max(-1) > 60).astype(float)
        r = mass * c / max(c.sum(), 1) + (1 - mass) / len(c)
        return torch.tensor(r * len(c)).reshape(-1, 4).mean(1)  # per LLM token, averaging 1 like VisionZip's

    rng = random.Random(0)
    pairs = [(scores(st.ocr_item(rng, "heldout").image), scores(st.mcq_item(rng, "heldout").image)) for _ in range(40)]
    share = {}
    for scope in ("request", "image"):
        kept = [select_tokens([t, s], 0.5, scope) for t, s in pairs]
        share[scope] = [sum(len(k[i]) for k in kept) / sum(len(p[i]) for p in pairs) for i in (0, 1)]
    assert share["request"][0] - share["request"][1] > 0.4  # measured 0.97 vs 0.32
    assert abs(share["image"][0] - share["image"][1]) < 0.05

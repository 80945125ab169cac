"""Recipe v4 of the embedded model: the training-only cell loss (harness/models/train_cells.py).

The cell targets must name exactly what each visual token shows — a wrong target teaches the model to misread —
so they are checked against the pixels (which 32 × 32 cells hold ink) and against the answer text; the probe must
see the merged tokens the language model receives, in the order the targets are built.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from harness.datasets.synthetic import tasks as st
from harness.models.train_cells import IGNORE, CellProbe, cell_targets


@pytest.fixture(scope="module")
def tok():
    from harness.models.tiny import build_tokenizer
    from harness.models.trained import TRAINED_SPEC

    return build_tokenizer(TRAINED_SPEC)


def ink(img) -> np.ndarray:
    a = np.asarray(img.convert("RGB")).astype(int)
    h, w = a.shape[0] // 32, a.shape[1] // 32
    cells = a[: h * 32, : w * 32].reshape(h, 32, w, 32, 3).transpose(0, 2, 1, 3, 4).reshape(h, w, -1, 3)
    return ((cells.max(axis=2) - cells.min(axis=2)).max(axis=-1) > 60).reshape(-1)


def test_ocr_cell_targets_are_the_answer_characters_in_reading_order(generator2, tok):
    rng = random.Random(0)
    for _ in range(40):
        item = st.ocr_item(rng, "train")
        t = cell_targets([item.image], tok)
        assert ((t != IGNORE) == ink(item.image)).all()  # a target exactly where the pixels have ink
        read = "".join(tok.convert_ids_to_tokens(int(i)) for i in t[t != IGNORE])
        assert read == item.answers[0].replace(" ", "")


def test_shape_cells_carry_their_colour_and_background_cells_nothing(generator2, tok):
    rng = random.Random(1)
    for _ in range(40):
        item = st.mcq_item(rng, "train")
        t = cell_targets([item.image], tok)
        assert ((t != IGNORE) == ink(item.image)).all()
        first = {tok(c, add_special_tokens=False)["input_ids"][0] for c in st.COLOURS}
        assert set(t[t != IGNORE].tolist()) <= first and len(first) == len(st.COLOURS)  # colours tell apart


def test_generator1_images_add_no_cell_targets(tok):
    before = st.generator_version()
    st.use_generator("1")
    try:
        item = st.ocr_item(random.Random(0), "train")
    finally:
        st.use_generator(before)
    assert (cell_targets([item.image], tok) == IGNORE).all()


def test_variant_v4_sets_the_cell_loss_and_older_recipes_do_not():
    from harness.models.train_tiny import parse_args

    assert parse_args(["--variant", "v4", "--out", "x"]).cells == 0.5
    assert parse_args(["--variant", "v4-plain", "--out", "x"]).cells == 0.5
    for v in ("v1", "v2-group", "v3"):
        assert parse_args(["--variant", v, "--out", "x"]).cells == 0.0
    assert parse_args(["--variant", "v4", "--out", "x", "--cells", "0.2"]).cells == 0.2


def test_probe_sees_the_merged_tokens_and_its_loss_trains_the_vision_tower(generator2, tiny_batch):
    import torch

    t = tiny_batch(("ocr", "mcq", "ocr_mix"))
    model, cfg, b = t.model, t.cfg, t.batch
    assert b["cells"].shape[0] == int((b["input_ids"] == cfg.image_token_id).sum())  # one target per token
    probe = CellProbe(model)
    feats = model.model.get_image_features(b["pixel_values"], b["image_grid_thw"], return_dict=True)
    captured = probe.captured["tokens"]
    assert torch.equal(captured, torch.cat(list(feats.pooler_output)))
    loss, acc = probe.loss(b["cells"])
    assert float(loss.detach()) > 1.0 and 0.0 <= acc <= 1.0  # fresh init: far from the targets
    loss.backward()
    assert float(model.model.visual.merger.linear_fc2.weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="cell targets"):
        model.model.get_image_features(b["pixel_values"], b["image_grid_thw"], return_dict=True)
        probe.loss(b["cells"][:-1])
    probe.remove()
    model.model.get_image_features(b["pixel_values"], b["image_grid_thw"], return_dict=True)
    assert "tokens" not in probe.captured  # removed: nothing captured any more


def test_option_targets_sit_on_each_option_word_with_its_letter(generator2, tok):
    """Recipe v5's option loss: the position of each option's word (its first token) and that option's letter."""
    from harness.models.train_cells import option_targets
    from harness.models.train_data import encode, make_example

    rng = random.Random(2)
    seen_three = False
    for _ in range(40):
        ex = make_example("mcq", rng)
        opts = dict(line.split(". ", 1) for line in ex.content[1]["text"].splitlines() if line[:3] in
                    ("A. ", "B. ", "C. ", "D. "))
        e = encode(ex, tok, 1)
        got = e["options"]
        assert (option_targets(e["ids"][: e["n_prompt"]], tok) == got).all()  # = the prompt's own scan
        assert [tok.convert_ids_to_tokens(int(x)) for x in got[:, 1]] == list(opts)  # A, B, C(, D) in order
        for (pos, _), word in zip(got, opts.values()):
            assert int(e["ids"][pos]) == tok(word, add_special_tokens=False)["input_ids"][0]
            assert pos < e["n_prompt"]  # in the prompt, where no answer loss is
        seen_three |= len(opts) == 3
    assert seen_three
    for task in ("ocr", "rag", "attr"):
        assert encode(make_example(task, rng), tok, 1)["options"].shape == (0, 2)


def test_option_and_pointer_targets_cover_the_text_choice_tasks(tok):
    """Recipe v7d: the text choice's option values start with a space-merged token (``Ġ7`` ``8``); the option target
    sits on that token, and the pointer target joins the answer position to the correct option's value."""
    from harness.models.train_data import encode, make_example
    from harness.models.train_pointer import pointer_targets

    rng = random.Random(5)
    for task in ("text_choice", "text_choice2"):
        for _ in range(10):
            ex = make_example(task, rng)
            opts = dict(line.split(". ", 1) for line in ex.content[0]["text"].splitlines() if line[:3] in
                        ("A. ", "B. ", "C. ", "D. "))
            e = encode(ex, tok, 1)
            got = e["options"]
            assert [tok.convert_ids_to_tokens(int(x)) for x in got[:, 1]] == list("ABCD")
            for (pos, _), value in zip(got, opts.values()):
                first = tok.convert_ids_to_tokens(int(e["ids"][pos]))  # the value's first token, space merged
                assert first.startswith("Ġ") and len(first) > 1 and value.startswith(first[1:])
            query, key = pointer_targets(e)
            assert query == e["n_prompt"] - 1
            assert key == got[list(opts).index(ex.target), 0]  # the correct option's value
    for task in ("text_lookup", "text_arith"):
        assert encode(make_example(task, rng), tok, 1)["options"].shape == (0, 2)


def test_option_loss_reads_the_logits_at_the_option_positions(generator2, tok):
    import torch

    from harness.models import train_tiny as tt
    from harness.models.train_cells import option_loss
    from harness.models.train_data import encode, make_example

    rng = random.Random(3)
    exs = [encode(make_example(t, rng), tok, 1) for t in ("mcq", "ocr", "mcq_hint")]
    b = tt.collate(exs, tok.pad_token_id, "cpu")
    n = sum(len(e["options"]) for e in exs)
    assert b["opt_index"].shape == (n,) and n >= 6
    logits = torch.full((*b["input_ids"].shape, len(tok)), -10.0)
    flat = logits.view(-1, len(tok))
    flat[b["opt_index"], b["opt_target"]] = 10.0  # a model that gets every letter right
    loss, acc = option_loss(logits, b["opt_index"], b["opt_target"])
    assert acc == 1.0 and float(loss) < 1e-4
    ids = b["input_ids"].reshape(-1)[b["opt_index"]]
    assert all(tok.convert_ids_to_tokens(int(i)) not in "ABCD" for i in ids)  # the word, not the letter


def test_pointer_attention_is_sdpa_and_its_rows_are_the_eager_attention(generator2, tiny_batch):
    """Recipe v6's pointer loss reads head 0 of the last text layer at the answer position: installing it must not
    change the model's output, and the row it captures must be the attention eager mode reports there."""
    import torch

    from harness.models import train_pointer

    t = tiny_batch(("mcq", "ocr", "mcq_hint", "mcq"), seed=4, train=False)
    model, tok, cfg, exs, b = t.model, t.tok, t.cfg, t.exs, t.batch
    assert b["ptr"].shape == (3, 3) and b["ptr"][:, 0].tolist() == [0, 2, 3]  # the three MCQ rows, not the OCR one
    for row, q, k in b["ptr"].tolist():
        assert q == exs[row]["n_prompt"] - 1 and k < q
        assert tok.convert_ids_to_tokens(int(exs[row]["ids"][k - 3])) == tok.convert_ids_to_tokens(
            int(exs[row]["ids"][exs[row]["n_prompt"]]))  # the pointed word's letter is the answer

    def forward(**kw):
        with torch.no_grad():
            return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
                         image_grid_thw=b["image_grid_thw"], position_ids=b["position_ids"], **kw)

    plain = forward().logits
    before = train_pointer.install(model)
    assert train_pointer.arm(b)
    probed = forward().logits
    weights = train_pointer._STATE["weights"]
    _, mass = train_pointer.loss(b)
    train_pointer.uninstall(model, before)
    assert torch.allclose(plain, probed, atol=1e-5)
    cfg.text_config._attn_implementation = "eager"
    eager = forward(output_attentions=True).attentions[-1]  # [B, H, L, L]
    want = eager[b["ptr"][:, 0], 0, b["ptr"][:, 1]]
    assert torch.allclose(weights, want, atol=1e-5)
    assert 0 < mass < 1
    with pytest.raises(ValueError, match="outside"):
        train_pointer.install(model, layer=cfg.text_config.num_hidden_layers)


def test_option_vocabulary_is_scanned_once_per_tokenizer(tok, monkeypatch):
    """option_targets runs on every training example; the vocabulary scan behind it runs once per tokenizer."""
    import numpy as np

    from harness.models import train_cells

    train_cells._OPTION_VOCAB.clear()
    calls = []
    real = type(tok).get_vocab
    monkeypatch.setattr(type(tok), "get_vocab", lambda self: calls.append(1) or real(self))
    ids = np.asarray(tok.encode("Q\nA. 78\nB. 5"), dtype=np.int64)
    first = train_cells.option_targets(ids, tok)
    again = train_cells.option_targets(ids, tok)
    assert len(calls) == 1 and (first == again).all() and len(first) == 2

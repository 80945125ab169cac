"""Recipe v3 of the embedded model: the ``attr`` grounding task, and the image pathway of a training batch.

Why the pathway checks: issue 13's visual tasks stayed at chance, and the first suspect was the training
pipeline (does the LM get usable image information?). These pin what was verified by hand
(docs/embedded_model_v3.md): one placeholder per merged vision token, the loss depends on the pixels, and the
gradient reaches the patch embedding, the merger and the deepstack mergers.
"""

from __future__ import annotations

import random


from harness.datasets.synthetic import tasks as st


def test_attr_example_is_the_mcq_question_without_options_answered_by_the_word(generator2):
    from harness.models.train_data import make_example

    for seed in range(30):
        mcq = make_example("mcq", random.Random(seed))
        attr = make_example("attr", random.Random(seed))  # same draw: the same item
        question = attr.content[1]["text"]
        assert attr.content[0] == {"type": "image", "index": 0} and "Options" not in question
        assert question in mcq.content[1]["text"]
        assert attr.target in mcq.content[1]["text"]  # the word is one of the options ...
        assert f"{mcq.target}. {attr.target}" in mcq.content[1]["text"]  # ... the one the letter names
        assert attr.target in st.COLOURS or attr.target in st.KINDS or attr.target in st.COUNTS
        assert list(attr.images[0].getdata()) == list(mcq.images[0].getdata())


def test_mcq_hint_is_the_mcq_request_with_its_answer_word_written_first(generator2):
    from harness.models.train_data import make_example

    for seed in range(20):
        mcq = make_example("mcq", random.Random(seed))
        hint = make_example("mcq_hint", random.Random(seed))
        word = make_example("attr", random.Random(seed)).target
        assert hint.target == mcq.target and hint.content[0] == mcq.content[0]
        assert hint.content[1]["text"] == f"提示：{word}。\n" + mcq.content[1]["text"]


def test_v1_pool_is_unchanged_and_v3_adds_attr():
    from harness.models.train_tiny import parse_args, pool_counts

    v1 = pool_counts(parse_args(["--out", "x", "--variant", "v1"]))
    assert set(v1) == {"ocr", "ocr_mix", "mcq", "mcq_mix", "rag"}  # v1 / v2 draws and checkpoints as before
    v3 = parse_args(["--out", "x", "--variant", "v3"])
    assert {"attr", "mcq_hint"} <= set(pool_counts(v3)) and v3.generator == "2" and v3.focus == 0.1
    assert abs(sum(v3.task_weights.values()) - 1) < 1e-9
    assert parse_args(["--out", "x", "--variant", "v3-nofocus"]).focus == 0.0


def test_curriculum_with_a_task_outside_the_curriculum_mix():
    from harness.models.train_recipes import CURRICULUM_WEIGHTS, VARIANTS, task_weights_at

    r = {**VARIANTS["v3"], "curriculum": 0.5}
    early = task_weights_at(r, 1, 100)
    assert set(early) == set(r["task_weights"]) and early["attr"] == 0.0
    assert all(early[t] == w for t, w in CURRICULUM_WEIGHTS.items())
    assert task_weights_at(r, 60, 100) == r["task_weights"]


def test_training_batch_feeds_the_images_to_the_language_model(generator2, tiny_batch):
    import torch

    t = tiny_batch(("mcq", "ocr", "attr", "ocr_mix"))
    model, tok, cfg, exs, b = t.model, t.tok, t.cfg, t.exs, t.batch
    feats = model.model.get_image_features(b["pixel_values"], b["image_grid_thw"], return_dict=True)
    assert int((b["input_ids"] == cfg.image_token_id).sum()) == sum(f.shape[0] for f in feats.pooler_output)
    for i, e in enumerate(exs):  # labels: the answer tokens only, unshifted (the model shifts)
        got = b["labels"][i][b["labels"][i] != -100].tolist()
        assert got == e["ids"][e["n_prompt"]:].tolist() and got[-1] == tok.eos_token_id

    def loss(pixel_values):
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                     pixel_values=pixel_values, image_grid_thw=b["image_grid_thw"],
                     position_ids=b["position_ids"]).loss

    real = loss(b["pixel_values"])
    with torch.no_grad():
        assert abs(float(real) - float(loss(torch.zeros_like(b["pixel_values"])))) > 1e-3
    real.backward()
    visual = model.model.visual
    for module in (visual.patch_embed, visual.merger, *visual.deepstack_merger_list):
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in module.parameters())

"""Recipe v7 (issue 28): the text tasks, their OpenCompass rows, text-only training batches, the routing prior."""

from __future__ import annotations

import json
import random

import pytest

from harness.datasets.synthetic import text_tasks as tt
from harness.datasets.synthetic.tasks import is_heldout


@pytest.mark.parametrize("task", tt.TEXT_TASKS)
def test_items_are_right_by_construction_and_split(task):
    held = tt.items(task, "heldout", 40)
    train = tt.items(task, "train", 40)
    assert held == tt.items(task, "heldout", 40)  # a pure function of the seed
    assert all(is_heldout(it.key) for it in held) and not any(is_heldout(it.key) for it in train)
    assert not {it.key for it in held} & {it.key for it in train}
    for it in held:
        q = it.question
        if task == "text_arith":
            a, b = q.rstrip("=").split("+")
            assert it.answer == str(int(a) + int(b)) and len(a) == len(b) == 2
        elif task == "text_list":
            op, xs = q.split(": ")
            xs = xs.split()
            want = sorted(xs) if op == "sort" else xs[::-1] if op == "reverse" else xs
            assert it.answer == " ".join(want)
        else:
            pairs = dict(p.split("=") for p in q.split(". ")[0].split())
            key = q.split(". ")[1].rstrip("?")
            value = pairs[key]
            if task == "text_lookup":
                assert it.answer == value
            else:
                assert it.options[it.answer] == value and sorted(it.options.values()) == sorted(pairs.values())


def test_choice_prompt_is_opencompass_custom_mcq_format():
    it = tt.items("text_choice", "heldout", 1)[0]
    lines = it.prompt.split("\n")
    assert lines[0] == "Question: " + it.question and lines[-1] == "Answer: "
    assert lines[1:5] == [f"{k}. {v}" for k, v in it.options.items()]
    assert tt.items("text_arith", "heldout", 1)[0].prompt == tt.items("text_arith", "heldout", 1)[0].question


def test_correct_follows_opencompass_rules():
    it = tt.TextItem("k", "text_choice", "X=12 K=34 E=56 L=78. K?", "B", {"A": "12", "B": "34", "C": "56", "D": "78"})
    assert tt.correct(it, "B") and tt.correct(it, " B.") and tt.correct(it, "34")
    assert not tt.correct(it, "A") and not tt.correct(it, "") and not tt.correct(it, "12 or 34")
    qa = tt.TextItem("k", "text_arith", "47+85=", "132")
    assert tt.correct(qa, "132") and not tt.correct(qa, "1320") and not tt.correct(qa, "13")


def test_ci_sample_is_held_out_text_rows(tmp_path):
    from harness.opencompass.suites import CI_SAMPLE_TASKS, CLOSED_BOOK_SCALE, write_ci_sample

    paths = write_ci_sample(tmp_path, n=5, seed=0)
    assert [p.name for p in paths] == list(CI_SAMPLE_TASKS)
    every = []
    for p in paths:
        rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines()]
        if p.name == "harness_text_recall.jsonl":  # closed book: distinct facts of the trained table, no split
            assert len(rows) == CLOSED_BOOK_SCALE * 5 == len({r["question"] for r in rows})
            assert all(tt.RECALL_FACTS[r["question"].split()[-1]] == r["answer"] for r in rows)
            assert all(r["question"] == f"recall {r['question'].split()[-1]}" for r in rows)
            continue
        want = [it.row() for task in CI_SAMPLE_TASKS[p.name] for it in tt.items(task, "heldout", 5, 0)]
        assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, want))
        assert all(is_heldout("text:" + ("choice:" if "A" in r else "") + r["question"]) for r in rows)
        assert all(("A" in r) == (p.name == "harness_text_choice.jsonl") for r in rows)
        every += rows
    assert len(every) == 5 * len(tt.TEXT_TASKS)


def test_the_recall_file_asks_distinct_facts_and_at_most_the_whole_table(tmp_path):
    """``opencompass.ci_items=16`` (the README's table) would ask 96 facts of a 90-fact table: the file holds all 90,
    each once, instead of refusing the run."""
    from harness.opencompass.suites import closed_book_count, closed_book_items, write_ci_sample

    assert closed_book_count(4) == 24 and closed_book_count(15) == 90 and closed_book_count(16) == 90
    path = next(p for p in write_ci_sample(tmp_path, n=16, seed=0) if p.name == "harness_text_recall.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["question"] for r in rows) == sorted(f"recall {c}" for c in tt.RECALL_FACTS)
    assert closed_book_items("text_recall", 24, 0) == closed_book_items("text_recall", 24, 0)  # seeded
    assert closed_book_items("text_recall", 24, 0) != closed_book_items("text_recall", 24, 1)
    with pytest.raises(ValueError, match="table of 90"):
        closed_book_items("text_recall", 91)


def test_text_examples_encode_and_collate_without_pixels():
    from harness.models.tiny import build_tokenizer
    from harness.models.train_data import collate, encode, make_example
    from harness.models.trained import TRAINED_SPEC

    tok = build_tokenizer(TRAINED_SPEC)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    exs = [encode(make_example(t, random.Random(i)), tok, image_id) for i, t in enumerate(tt.TEXT_TASKS)]
    for e, t in zip(exs, tt.TEXT_TASKS):
        assert e["task"] == t and e["images"] == [] and image_id not in e["ids"].tolist()
        target = tok.decode(e["ids"][e["n_prompt"]:], skip_special_tokens=True)
        assert target == make_example(t, random.Random(tt.TEXT_TASKS.index(t))).target
    batch = collate(exs, tok.pad_token_id, "cpu")
    assert batch["pixel_values"] is None and batch["image_grid_thw"] is None
    for i, e in enumerate(exs):  # loss only on the answer tokens
        labelled = (batch["labels"][i] != -100).nonzero().flatten().tolist()
        assert labelled == list(range(e["n_prompt"], len(e["ids"])))


def test_route_prior_pulls_towards_the_task_group():
    import torch

    from harness.models.train_recipes import route_group, route_prior_loss

    assert route_group("text_arith") == 3 and route_group("rag") == 2 and route_group("ocr_mix") == 0
    mask = torch.ones(2, 3, dtype=torch.long)
    on_group = torch.full((6, 16), -10.0)
    on_group[:, 12:] = 5.0  # all mass on experts 12-15 = group 3
    loss_on, mass_on = route_prior_loss((on_group,), mask, "text_list", 16)
    loss_off, mass_off = route_prior_loss((on_group,), mask, "rag", 16)
    assert mass_on > 0.99 and mass_off < 0.01 and float(loss_on) < 0.01 < float(loss_off)
    logits = torch.zeros(6, 16, requires_grad=True)
    route_prior_loss((logits,), mask, "text_list", 16)[0].backward()
    assert bool((logits.grad[:, 12:] < 0).all()) and bool((logits.grad[:, :12] > 0).all())  # descent raises group 3


def test_v7_recipe_flags():
    from harness.models.train_recipes import V4_SHA256, VARIANTS
    from harness.models.train_tiny import parse_args

    v7 = VARIANTS["v7"]
    assert abs(sum(v7["task_weights"].values()) - 1.0) < 1e-9
    assert set(tt.TEXT_TASKS) <= set(v7["task_weights"]) and v7["init"] == "v4" and len(V4_SHA256) == 64
    args = parse_args(["--variant", "v7-noprior", "--out", "x", "--init", "some/dir"])
    assert args.route_prior == 0.0 and args.init == "some/dir" and args.lr == 1e-3 and args.cells == 0.5


def test_v7b_recipe_flags_and_text_pool():
    from harness.models.train_tiny import parse_args, pool_counts

    v7b = parse_args(["--variant", "v7b", "--out", "x", "--pool", "0.5"])
    assert v7b.text_mix is True and v7b.text_pool == 4.0 and v7b.route_prior == 0.02 and v7b.init
    assert parse_args(["--variant", "v7b-p01", "--out", "x"]).route_prior == 0.01
    assert abs(sum(v7b.task_weights.values()) - 1.0) < 1e-3
    text = sum(w for t, w in v7b.task_weights.items() if t.startswith("text_"))
    assert abs(text - 0.7) < 1e-9
    assert parse_args(["--variant", "v7b", "--out", "x", "--no-text-mix"]).text_mix is False
    v7 = parse_args(["--variant", "v7", "--out", "x", "--pool", "0.5"])
    assert v7.text_mix is False and v7.text_pool == 1.0
    c7, c7b = pool_counts(v7), pool_counts(v7b)
    assert c7["text_arith"] == 3500 and c7["ocr"] == 24000  # v7's pool as it ran
    assert c7b["text_arith"] == 4 * c7["text_arith"] and c7b["text_lookup"] == 4 * c7["text_lookup"]
    assert all(c7b[t] == c7[t] for t in c7 if not t.startswith("text_"))


def _fake_pool(tasks, n=600):
    return {t: [{"task": t, "i": i} for i in range(n)] for t in tasks}


def test_text_mix_draws_every_text_task_and_leaves_other_steps_alone():
    import numpy as np

    from harness.models.train_tiny import BATCH, draw_batch, parse_args

    args = parse_args(["--variant", "v7b", "--out", "x", "--batch-scale", "0.5"])
    pool = _fake_pool(args.task_weights)
    label, rows = draw_batch(pool, "text_lookup", args, np.random.default_rng(0))
    counts = {t: sum(r["task"] == t for r in rows) for t in tt.TEXT_TASKS}
    assert label == "text_mix" and counts == {t: int(BATCH[t] * 0.5) // 2 for t in tt.TEXT_TASKS}
    assert all(len({r["i"] for r in rows if r["task"] == t}) == counts[t] for t in tt.TEXT_TASKS)  # no repeats
    # an image task's step, and a text step without text_mix, draw as before (same rows from the same rng)
    for task, mix in (("ocr", True), ("text_arith", False)):
        args.text_mix = mix
        label, rows = draw_batch(pool, task, args, np.random.default_rng(1))
        want = np.random.default_rng(1).choice(len(pool[task]), size=int(BATCH[task] * 0.5), replace=False)
        assert label == task and [r["i"] for r in rows] == want.tolist() and {r["task"] for r in rows} == {task}


def test_per_task_ce_separates_the_tasks_of_a_mixed_batch():
    import math

    import torch

    from harness.models.train_tiny import per_task_ce

    vocab = 7
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 5, 1, -100]])
    logits = torch.zeros(2, 4, vocab)  # row 1: uniform
    logits[0, 1, 3] = logits[0, 2, 4] = 50.0  # row 0: the next label predicted with certainty
    got = per_task_ce(logits, labels, [{"task": "text_arith"}, {"task": "text_list"}])
    assert got["text_arith"] < 1e-6 and abs(got["text_list"] - math.log(vocab)) < 1e-5


@pytest.mark.parametrize("task", tt.TRAIN_ONLY_TEXT_TASKS)
def test_two_pair_training_tasks(task):
    """Recipe v7c's two-pair lookup and choice: right by construction, split like the rest, the choice's other two
    options from no pair; and the four-pair tasks draw exactly the items they drew before (the held-out rows and the
    OpenCompass suite do not move: the first held-out choice item, written out)."""
    held, train = tt.items(task, "heldout", 40), tt.items(task, "train", 40)
    assert all(is_heldout(it.key) for it in held) and not any(is_heldout(it.key) for it in train)
    for it in held + train:
        passage, key = it.question.split(". ")
        pairs = dict(p.split("=") for p in passage.split())
        assert len(pairs) == 2
        value = pairs[key.rstrip("?")]
        if task == "text_lookup2":
            assert it.answer == value and not it.options
        else:
            assert it.options[it.answer] == value and len(set(it.options.values())) == 4
            assert len(set(it.options.values()) - set(pairs.values())) == 2
    first = tt.items("text_choice", "heldout", 1)[0]
    assert (first.question, first.answer, first.options) == (
        "X=67 P=24 Y=48 L=26. P?", "C", {"A": "48", "B": "67", "C": "24", "D": "26"})


def test_v7c_recipe_trains_the_two_pair_tasks_in_every_text_step():
    import numpy as np

    from harness.models.train_tiny import BATCH, POOL, draw_batch, parse_args

    args = parse_args(["--variant", "v7c", "--out", "x", "--batch-scale", "0.5"])
    assert args.text_mix is True and args.route_prior == 0.01 and abs(sum(args.task_weights.values()) - 1.0) < 1e-3
    texts = [t for t in args.task_weights if t.startswith("text_")]
    assert set(texts) == set(tt.TEXT_TASKS + tt.TRAIN_ONLY_TEXT_TASKS) and all(t in BATCH and t in POOL for t in texts)
    label, rows = draw_batch(_fake_pool(args.task_weights), "text_choice2", args, np.random.default_rng(0))
    assert label == "text_mix" and {r["task"] for r in rows} == set(texts)


def test_redraw_group_forgets_only_that_group_and_keeps_each_experts_scale(tiny_batch):
    """v7e: group 3's near-copies become unrelated experts of the same scale; every other parameter is untouched."""
    import torch

    from harness.models.train_recipes import group_experts, redraw_group_experts

    model = tiny_batch(("text_arith",)).model
    group_experts(model, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = redraw_group_experts(model, 3, seed=1)
    assert changed > 0
    seen = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and p.dim() >= 2 and p.shape[0] == 16:
            seen += 1
            old, new = before[name], p.detach()
            assert torch.equal(old[:12], new[:12])  # groups 0-2 untouched
            flat_old, flat_new = old[12:].reshape(4, -1), new[12:].reshape(4, -1)
            assert torch.allclose(flat_new.std(-1), flat_old.std(-1), rtol=0.05)  # each expert's scale kept
            cos = torch.nn.functional.cosine_similarity(flat_new[:, None], flat_new[None], dim=-1)
            off = cos[~torch.eye(4, dtype=torch.bool)]
            assert float(off.abs().max()) < 0.1  # the members no longer resemble each other
            cos_old = torch.nn.functional.cosine_similarity(flat_old[:, None], flat_old[None], dim=-1)
            assert float(cos_old[~torch.eye(4, dtype=torch.bool)].min()) > 0.8  # ...as they did (near-copies)
        else:
            assert torch.equal(before[name], p.detach()), name
    assert seen == changed
    with pytest.raises(ValueError):
        redraw_group_experts(model, 4)


def test_v7e_recipe_flags():
    from harness.models.train_recipes import V7D_MID_SHA256
    from harness.models.train_tiny import parse_args
    from harness.models.prior_init import PRIORS

    v7e = parse_args(["--variant", "v7e", "--out", "x"])
    assert v7e.init == "v7d-mid" and v7e.redraw_group == 3 and v7e.pointer_layer == 2 and v7e.options == 0.5
    assert PRIORS["v7d-mid"][1] == V7D_MID_SHA256
    text = parse_args(["--variant", "v7e-text", "--out", "x"])
    assert abs(sum(text.task_weights.values()) - 1.0) < 1e-3
    assert sum(w for t, w in text.task_weights.items() if t.startswith("text_")) > 0.55
    assert parse_args(["--variant", "v7d-mid", "--out", "x"]).redraw_group == -1
    assert parse_args(["--variant", "v7e", "--out", "x", "--redraw-group", "-1"]).redraw_group == -1


def test_routing_concentration_measures_weight_shares_and_the_cost_of_truncation(tiny_batch):
    from harness.models.train_eval import routing_concentration

    made = tiny_batch(("text_arith", "text_list"))
    model = made.model
    got = routing_concentration(model, made.exs)
    share = got["weight_share"]
    assert list(share) == [1, 2, 3, 4] and abs(share[4] - 1.0) < 1e-6
    assert 0.25 - 1e-6 <= share[1] <= share[2] <= share[3] <= share[4]  # cumulative, the largest first
    assert abs(sum(got["group_share"]) - 1.0) < 1e-3 and len(got["group_share"]) == 4
    lp = got["answer_logprob"]
    assert list(lp) == [4, 2, 1] and lp[1] != lp[4]  # truncation changes what the model computes
    assert all(lo <= lp[k] <= hi for k, (lo, hi) in got["answer_logprob_ci95"].items())
    assert all(layer.mlp.gate.top_k == 4 for layer in model.model.language_model.layers)  # restored
    assert model.training  # the fixture's mode restored too


def test_topk_flatness_loss_is_zero_for_an_even_mixture_and_its_gradient_flattens():
    import math

    import torch

    from harness.models.train_recipes import topk_flatness_loss

    mask = torch.ones(1, 2, dtype=torch.long)
    even = torch.full((2, 16), -10.0)
    even[:, :4] = 3.0  # four experts equally: the renormalised top-4 weights are 1/4 each
    loss, top2 = topk_flatness_loss((even,), mask, 4)
    assert abs(float(loss)) < 1e-5 and abs(top2 - 0.5) < 1e-5
    peaked = torch.full((2, 16), -10.0)
    peaked[:, 0], peaked[:, 1:4] = 4.0, 0.0
    logits = peaked.clone().requires_grad_(True)
    loss, top2 = topk_flatness_loss((logits,), mask, 4)
    assert 0 < float(loss) <= math.log(4) and top2 > 0.9
    loss.backward()
    assert bool((logits.grad[:, 0] > 0).all()) and bool((logits.grad[:, 1:4] < 0).all())  # descent evens them out


def test_v7f_recipe_adds_the_flatness_loss_to_v7e_text():
    from harness.models.train_tiny import parse_args

    v7f = parse_args(["--variant", "v7f", "--out", "x"])
    assert v7f.topk_flat == 0.1 and v7f.redraw_group == 3 and v7f.lr == 2e-3 and v7f.init == "v7d-mid"
    assert parse_args(["--variant", "v7e-text", "--out", "x"]).topk_flat == 0.0


def test_recall_facts_are_a_fixed_table_no_prompt_contains():
    facts = tt.recall_facts()
    assert facts == tt.recall_facts() == tt.RECALL_FACTS and len(facts) == 90
    assert tt.recall_facts(seed=1) != facts  # the seed picks the table
    assert all(len(c) == 2 and c[0] != c[1] and set(c) <= set(tt.KEYS) for c in facts)
    assert all(len(v) == 4 and v.isdigit() for v in facts.values())
    held, train = tt.items("text_recall", "heldout", 1000), tt.items("text_recall", "train", 1000)
    # closed book: a fact never trained cannot be recalled, so both splits ask the same table
    assert {it.question for it in held} == {it.question for it in train} == {f"recall {c}" for c in facts}
    for it in held:
        assert it.answer == facts[it.question.split()[1]] and it.answer not in it.prompt and not it.options
    assert "text_recall" in tt.CLOSED_BOOK_TASKS and "text_recall" not in tt.TEXT_TASKS  # not in the CI suite yet


def test_v7g_recipes_add_recall_to_the_committed_models_mix():
    from harness.models.train_recipes import VARIANTS, V7D_TASK_WEIGHTS

    v = VARIANTS["v7g"]
    assert v["init"] == "v7d-mid" and v["pointer_layer"] == 2
    assert v["task_weights"]["text_recall"] == 0.15 and abs(sum(v["task_weights"].values()) - 1) < 1e-3
    assert set(v["task_weights"]) == set(V7D_TASK_WEIGHTS) | {"text_recall"}
    assert VARIANTS["v7g-recall"]["task_weights"] == {"text_recall": 1.0}


def test_eval_tiny_asks_the_fact_table_only_of_a_checkpoint_taught_it():
    from harness.commands.eval_tiny import text_items_for

    plain = text_items_for({"training": {"task_weights": {"text_arith": 1.0}}}, 3)
    assert set(plain) == set(tt.TEXT_TASKS) and all(len(v) == 3 for v in plain.values())
    taught = text_items_for({"training": {"task_weights": {"text_recall": 0.15}}}, 3)
    assert [it.question for it in taught["text_recall"]] == [f"recall {c}" for c in tt.RECALL_FACTS]
    assert text_items_for({}, 2).keys() == plain.keys()


def test_headline_reports_recall_apart_from_the_text_average():
    from harness.commands.eval_tiny import headline, TEXT_CONDITIONS

    assert TEXT_CONDITIONS["topk_1"] == {"moe": {"top_k": 1}}
    h = headline({"text": {"base": {"metrics": {"text_arith": 1.0, "text_recall": 0.5, "average": 1.0}},
                           "topk_1": {"metrics": {"text_arith": 0.5, "average": 0.5}}}})
    assert h["text_base"] == 1.0 and h["text_recall_base"] == 0.5 and h["text_topk_1"] == 0.5
    assert "text_recall_topk_1" not in h


def test_text_vs_base_pairs_each_condition_with_the_baseline_per_task():
    from harness.commands.eval_tiny import text_vs_base

    text = {"base": {"correct": {"text_recall": [1] * 20, "text_arith": [1, 0] * 5}},
            "topk_1": {"correct": {"text_recall": [0] * 10 + [1] * 10, "text_arith": [1, 0] * 5}},
            "broken": {"error": "boom"}}
    d = text_vs_base(text)
    assert set(d) == {"topk_1"}
    assert d["topk_1"]["text_recall"]["delta"] == -0.5 and d["topk_1"]["text_recall"]["high"] < 0
    assert d["topk_1"]["text_recall"]["verdict"] == "−"
    assert d["topk_1"]["text_arith"]["delta"] == 0 and d["topk_1"]["text_arith"]["verdict"] == "n.s."
    assert text_vs_base({"topk_1": text["topk_1"]}) == {}

"""Training recipes of the embedded model: ``python -m harness.models.train_tiny --variant NAME``.

Why named variants: the committed checkpoint (``v1``) must stay reproducible while new recipes are tried, and
the GPU run trains several recipes side by side (``benchmarks/train_tiny_v2.py``) so one call can compare them.
A variant is a set of defaults for train_tiny's flags; any flag given explicitly still wins.

What v1 could not show (docs/embedded_model.md) and what each v2 ingredient is for:

- **generator 2** (:mod:`harness.datasets.synthetic.tasks`): every glyph and every shape alone in its own
  32 × 32 cell (one LLM visual token), 12 capitals + 10 digits, 3-4 characters per line: reading becomes a
  per-token classification in order (v1: OCR accuracy 0), a shape question needs one token (v1: MCQ at
  chance), and text images are 75-100 % content tokens against 6-33 % for shape images, so a request-wide
  VisionZip budget has a reason to favour the text image (v1: the sign was reversed);
- **lower load-balancing weight** (0.001, v1 0.005): v1's per-task expert usage stayed within 0.05-0.07 of the
  slots — the balancing term won over specialisation;
- **curriculum** (first ``curriculum`` fraction of the steps on the visual tasks only, more OCR overall): the
  vision tower learns to read before the long RAG sequences dominate the gradient;
- **grouped expert initialisation** (``expert_groups``): experts start as noisy copies inside groups, so the
  trained model has *near-duplicate* experts — the redundancy SERE exploits in real MoEs (it re-routes a
  secondary expert to a similar primary one; plain top-K truncation just drops it), which v1's independent
  random experts lacked (SERE and plain top-K were indistinguishable).
"""

from __future__ import annotations

import math
from typing import Any

V1_TASK_WEIGHTS = {"ocr": 0.34, "ocr_mix": 0.14, "mcq": 0.22, "mcq_mix": 0.10, "rag": 0.20}
OCR_HEAVY_WEIGHTS = {"ocr": 0.40, "ocr_mix": 0.14, "mcq": 0.24, "mcq_mix": 0.08, "rag": 0.14}
# v3: v2-group's data plus the two halves of the MCQ composition as their own training tasks — ``attr`` (read the
# attribute, answer the word) and ``mcq_hint`` (the word given in text, find its option's letter) — RAG kept near
# v1's share so the JSON format (the only thing v1/v2 learnt) is not starved
V3_TASK_WEIGHTS = {"ocr": 0.32, "ocr_mix": 0.08, "mcq": 0.14, "mcq_hint": 0.10, "mcq_mix": 0.06, "rag": 0.18,
                   "attr": 0.12}
# v5-mcq: v5 with more of the steps on the multiple-choice tasks (OCR needs few once the cell loss is on)
V5_MCQ_TASK_WEIGHTS = {"ocr": 0.22, "ocr_mix": 0.08, "mcq": 0.22, "mcq_hint": 0.12, "mcq_mix": 0.08, "rag": 0.18,
                       "attr": 0.10}
CURRICULUM_WEIGHTS = {"ocr": 0.45, "ocr_mix": 0.10, "mcq": 0.35, "mcq_mix": 0.10, "rag": 0.0}

# defaults of train_tiny's flags per variant; v4 = the committed checkpoint's recipe (v1 = the first one)
VARIANTS: dict[str, dict[str, Any]] = {
    "v1": {"generator": "1", "aux": 0.005, "focus": 0.1, "task_weights": V1_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 0},
    "v2": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V1_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 0},
    "v2-curriculum": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": OCR_HEAVY_WEIGHTS,
                      "curriculum": 0.3, "expert_groups": 0},
    "v2-group": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V1_TASK_WEIGHTS, "curriculum": 0.0,
                 "expert_groups": 4},
    "v2-all": {"generator": "2", "aux": 0.0005, "focus": 0.1, "task_weights": OCR_HEAVY_WEIGHTS,
               "curriculum": 0.3, "expert_groups": 4},
    # v3 (docs/embedded_model_v3.md): the image pathway works (fixed-order colour MCQ: 1.0 held-out in 150 CPU
    # steps) but shuffled-option MCQ stays at chance, and even the text-only lookup is slow: scaffold both steps
    "v3": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V3_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 4},
    "v3-nofocus": {"generator": "2", "aux": 0.001, "focus": 0.0, "task_weights": V3_TASK_WEIGHTS,
                   "curriculum": 0.0, "expert_groups": 4},
    # v4 (docs/embedded_model_v4.md): v3 + the cell loss (train_cells.py) — each glyph / shape cell's visual token
    # predicts its character / colour through the LM head; OCR-only CPU run: exact match 0 → 0.93 in 300 steps
    "v4": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V3_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 4, "cells": 0.5},
    # the same without v3's two MCQ scaffolding tasks: more of the steps on OCR and RAG (v1's task mix)
    "v4-plain": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V1_TASK_WEIGHTS, "curriculum": 0.0,
                 "expert_groups": 4, "cells": 0.5},
    # v5: v4 + the option loss (train_cells.option_targets): each option word's position outputs its letter, so
    # the MCQ answer's "emit the matching option's letter" becomes a copy (v4: MCQ and mcq_hint at chance)
    "v5": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V3_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 4, "cells": 0.5, "options": 0.5},
    "v5-mcq": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V5_MCQ_TASK_WEIGHTS, "curriculum": 0.0,
               "expert_groups": 4, "cells": 0.5, "options": 0.5},
    # v6: v5 + the pointer loss (train_pointer.py): the answer position's attention (head 0, last layer) is trained
    # onto the correct option's word — v5 showed the letter is readable there but the answer never looks
    "v6": {"generator": "2", "aux": 0.001, "focus": 0.1, "task_weights": V3_TASK_WEIGHTS, "curriculum": 0.0,
           "expert_groups": 4, "cells": 0.5, "options": 0.5, "pointer": 0.5},
}
# v7 (docs/embedded_model_v7.md, issue 28): v4's model fine-tuned with the text tasks OpenCompass's custom format
# carries (synthetic/text_tasks.py) beside v4's mix (scaled to 0.62), so the OpenCompass suite measures a model that
# learnt it (text 0.46 of the steps); ``route_prior`` pulls each task family onto its own group of v4's expert copies (ROUTE_GROUPS)
V7_TASK_WEIGHTS = {"ocr": 0.10, "ocr_mix": 0.04, "mcq": 0.07, "mcq_hint": 0.04, "mcq_mix": 0.04, "attr": 0.05,
                   "rag": 0.20,  # RAG replayed most: its image placement is what a fine-tune loses first (v6)
                   "text_arith": 0.13, "text_list": 0.11, "text_lookup": 0.08, "text_choice": 0.14}
VARIANTS["v7"] = {**VARIANTS["v4"], "task_weights": V7_TASK_WEIGHTS, "init": "v4", "lr": 1e-3, "route_prior": 0.05}
VARIANTS["v7-noprior"] = {**VARIANTS["v7"], "route_prior": 0.0}
# the text tasks alone (learning-speed experiments: how many steps each text task needs; not a checkpoint recipe —
# run with --no-pack, the pool has no image)
VARIANTS["v7-text"] = {**VARIANTS["v7"], "task_weights": {"text_arith": 0.3, "text_list": 0.3, "text_lookup": 0.2,
                                                          "text_choice": 0.2}, "lr": 2.5e-3}
# v7b (session 9, docs/embedded_model_v7.md §7): v7 gave each text task ~150 steps and none was learnt. v7b gives the
# text tasks 0.7 of the steps, and a text step trains all four at once (``text_mix``: the batch draws BATCH/2 rows
# from each text task's pool, 1024 rows in all), so each task sees every text step; a text pool 4 × the others'
# scale (``text_pool``; at train_tiny_v2's --pool 0.5 the 2-digit sums cover ~86 % of the train pairs instead of
# ~40 %, and a list / lookup item recurs about a dozen times in ~2,500 text steps); a weaker routing prior (v7's
# 0.05 cost the K=1 margins)
V7B_TASK_WEIGHTS = {**{t: round(w * 0.30 / 0.54, 4) for t, w in V7_TASK_WEIGHTS.items() if not t.startswith("text_")},
                    "text_arith": 0.175, "text_list": 0.175, "text_lookup": 0.175, "text_choice": 0.175}
VARIANTS["v7b"] = {**VARIANTS["v7"], "task_weights": V7B_TASK_WEIGHTS, "route_prior": 0.02, "text_mix": True,
                   "text_pool": 4.0}
VARIANTS["v7b-p01"] = {**VARIANTS["v7b"], "route_prior": 0.01}
# v7c (session 11, prepared, not trained yet): v7b-p01 learnt arithmetic and lists (1.00 held-out) but left lookup and
# choice at chance: both need the induction step (find the queried key, read the value after it). v7c trains them
# beside their two-pair versions (text_tasks.TRAIN_ONLY_TEXT_TASKS: a one-bit binding the gradient can find first) in
# every text step, and gives arithmetic and lists, already learnt, a smaller share
V7C_TASK_WEIGHTS = {**{t: w for t, w in V7B_TASK_WEIGHTS.items() if not t.startswith("text_")},
                    "text_arith": 0.07, "text_list": 0.07, "text_lookup": 0.14, "text_choice": 0.14,
                    "text_lookup2": 0.14, "text_choice2": 0.14}
VARIANTS["v7c"] = {**VARIANTS["v7b-p01"], "task_weights": V7C_TASK_WEIGHTS}
# v7c at twice the learning rate (session 13): a 6-minute budget gives ~2,800 steps; if the induction step is
# found late, a larger step size finds it sooner, at a risk to the replayed RAG placement that the held-out check shows
VARIANTS["v7c-lr2"] = {**VARIANTS["v7c"], "lr": 2e-3}
# the v4 checkpoint v7 starts from (``--init v4``: the committed checkpoint while it is v4; after v7's adoption, the
# v4 files from git: ``git show 8fa1f54:harness/models/checkpoints/tiny-trained-synthetic/model.safetensors``)
V4_SHA256 = "eb57d509e9defebdb1d08a86a9a8329167ec0bcba3e19fe156e6ee81ecca8441"
# the v7c-lr2 checkpoint v7d starts from (``--init v7c-lr2``: the committed model of session 13, from git history)
V7C_LR2_SHA256 = "0366bfaed8f995022d05f1e0c467fb0b7d66319fa99894ad0258de10468ebc81"
# task family -> expert group (v4's 4 groups of 4 noisy copies, train_recipes.group_experts): reading, shape
# questions, RAG answers, text tasks
ROUTE_GROUPS = {"ocr": 0, "ocr_mix": 0, "attr": 0, "mcq": 1, "mcq_mix": 1, "mcq_hint": 1, "rag": 2}
GROUP_NOISE = 0.35  # share of an expert's initial weights that is its own (the rest: its group's seed expert)


def task_weights_at(recipe: dict[str, Any], step: int, total: int) -> dict[str, float]:
    """Task sampling weights at ``step`` of ``total``: the curriculum's visual-only mix first, then the recipe's."""
    if recipe.get("curriculum", 0.0) > 0 and step <= recipe["curriculum"] * total:
        return {t: CURRICULUM_WEIGHTS.get(t, 0.0) for t in recipe["task_weights"]}
    return recipe["task_weights"]


def group_experts(model, groups: int, noise: float = GROUP_NOISE, seed: int = 0) -> int:
    """Make each MoE layer's experts noisy copies of ``groups`` seed experts (expert e joins group
    ``e // (E / groups)``): ``W_e = sqrt(1 − a²) · W_seed + a · W_e`` keeps the initial scale. Returns the number
    of expert tensors changed. Only the experts' weights move; the router stays random, so tokens still pick
    experts freely and the copies drift apart only as far as training pushes them."""
    import torch

    if groups <= 0:
        return 0
    changed = 0
    n_experts = model.config.text_config.num_experts
    if n_experts % groups:
        raise ValueError(f"expert_groups={groups} must divide num_experts={n_experts}")
    size = n_experts // groups
    keep = (1 - noise ** 2) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." not in name or p.dim() < 2 or p.shape[0] != n_experts:
                continue
            seeds = p[::size].repeat_interleave(size, dim=0)  # [E, ...]: each expert's group seed
            member = torch.arange(n_experts, device=p.device) % size != 0  # the seed experts stay as drawn
            p[member] = keep * seeds[member] + noise * p[member]
            changed += 1
    return changed


def route_group(task: str) -> int:
    """The expert group ``task``'s tokens are pulled onto by the routing prior (text tasks: group 3)."""
    return 3 if task.startswith("text_") else ROUTE_GROUPS[task]


def route_prior_loss(router_logits, attention_mask, task: str, num_experts: int, groups: int = 4):
    """(loss, mean mass): −log of the router's softmax mass on ``task``'s expert group, averaged over the real
    tokens of every MoE layer. Why: v4's experts barely specialise by task (total variation 0.058 between tasks'
    usage), so SERE's "most similar active expert" has little structure to use; a prior that sends a task
    family's tokens to one group of near-copies gives each family its own experts, whose members stay
    interchangeable — the redundancy SERE keeps and plain top-K truncation drops. Training only: at inference
    the router decides from the tokens alone."""
    import torch

    size = num_experts // groups
    g = route_group(task)
    m = attention_mask.reshape(-1).bool()
    total, mass = 0.0, 0.0
    for logits in router_logits:
        p = torch.softmax(logits.reshape(m.numel(), -1)[m].float(), -1)[:, g * size:(g + 1) * size].sum(-1)
        total = total - torch.log(p + 1e-6).mean()
        mass += float(p.mean().detach())
    return total / len(router_logits), mass / len(router_logits)
# v7d (session 14, issue 28 item 3): multiple choice. v7c-lr2 (the committed model) reads the attribute (``attr``
# cross-entropy 0.01) and finds the looked-up value (text lookup 0.80), yet both multiple-choice tasks stay at the
# ln 4 / 2 plateau: the answer never learns *which* option line to read. v6's pointer loss (train_pointer.py) is what
# got image MCQ above chance (CCBench circular 0.48) but, trained from scratch on head 0 of the last layer, it broke
# RAG image placement. v7d fine-tunes v7c-lr2 (``init: v7c-lr2``, from git history once v7d-mid is adopted; SHA-256
# checked) with the option loss and the pointer
# loss on image MCQ *and* the text choice tasks, more of the steps on them, RAG replayed at v7's share; ``v7d-mid``
# trains the pointer on a middle layer's head instead (layer 2 of 4), away from the last layer v6 found RAG using
V7D_TASK_WEIGHTS = {"ocr": 0.05, "ocr_mix": 0.02, "mcq": 0.14, "mcq_hint": 0.08, "mcq_mix": 0.05, "attr": 0.03,
                    "rag": 0.18,
                    "text_arith": 0.04, "text_list": 0.04, "text_lookup": 0.07, "text_choice": 0.12,
                    "text_lookup2": 0.04, "text_choice2": 0.14}
VARIANTS["v7d"] = {**VARIANTS["v7c-lr2"], "task_weights": V7D_TASK_WEIGHTS, "init": "v7c-lr2", "lr": 1e-3,
                   "options": 0.5, "pointer": 0.5, "pointer_layer": -1}
VARIANTS["v7d-mid"] = {**VARIANTS["v7d"], "pointer_layer": 2}
# the v7d-mid checkpoint v7e starts from (``--init v7d-mid``: the committed model of session 14)
V7D_MID_SHA256 = "21b74180c2a3ad813579118ca780e9bd0652582938df6f596c095f815f34bd86"
# v7e (session 15, issue 28 item 2): plain top-2 loses nothing on the text tasks (OpenCompass 86.5 at top-4, top-2,
# SERE K=2 and K=1 alike). The text tasks route onto group 3 (experts 12-15, 55-70 % of their top-4 slots), whose
# members began as near-copies of one seed expert (``group_experts``). The hypothesis v7e tests: any two of them
# compute what all four do, so the truncation the seed shows collapsing a real model is free here. v7e fine-tunes
# v7d-mid with group 3 re-drawn as independent experts (``redraw_group_experts``), the image groups untouched.
# ``v7e-text``: more of the steps on text, at v7c-lr2's learning rate. Outcome (docs/embedded_model_v7.md §11): the
# text tasks were relearnt and plain top-2 still cost them nothing; neither recipe was adopted.
VARIANTS["v7e"] = {**VARIANTS["v7d-mid"], "init": "v7d-mid", "redraw_group": 3}
V7E_TEXT_TASK_WEIGHTS = {**{t: round(w * 0.8, 4) for t, w in V7D_TASK_WEIGHTS.items() if not t.startswith("text_")},
                         "text_arith": 0.08, "text_list": 0.08, "text_lookup": 0.10, "text_choice": 0.12,
                         "text_lookup2": 0.06, "text_choice2": 0.12}
VARIANTS["v7e-text"] = {**VARIANTS["v7e"], "task_weights": V7E_TEXT_TASK_WEIGHTS, "lr": 2e-3}


def redraw_group_experts(model, group: int, groups: int = 4, seed: int = 0) -> int:
    """Re-draw every MoE layer's experts of ``group`` (experts ``group·E/groups`` … ``(group+1)·E/groups − 1``)
    independently: Gaussian weights with each expert's own current standard deviation, so the layer's output scale
    (which the router and the residual stream are tuned to) is kept while what the expert computes is forgotten.
    Returns the number of expert tensors changed. Why: ``group_experts`` made a group's members near-copies; after
    a re-draw they start unrelated and a fine-tune has to make each carry its own part of the function (recipe
    v7e's test of whether near-copies are why plain top-K is free on the text tasks: they were not, §11). The
    router is left as it is: the same tokens keep choosing the group."""
    import torch

    n_experts = model.config.text_config.num_experts
    if n_experts % groups or not 0 <= group < groups:
        raise ValueError(f"group {group} of {groups} does not fit num_experts={n_experts}")
    size = n_experts // groups
    members = slice(group * size, (group + 1) * size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." not in name or p.dim() < 2 or p.shape[0] != n_experts:
                continue
            old = p[members]
            std = old.reshape(size, -1).std(-1).reshape(size, *([1] * (p.dim() - 1)))
            fresh = torch.randn(old.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
            p[members] = fresh * std
            changed += 1
    return changed


def topk_flatness_loss(router_logits, attention_mask, k: int):
    """(loss, mean top-2 share): ``log k − H(w)`` averaged over the real tokens of every MoE layer, where ``w`` is a
    token's router weight renormalised over its top ``k`` (what the MoE block mixes with). Zero when the top-k
    experts are weighted equally.

    Why (session 15, ``benchmarks/routing_concentration.py``): on the text tasks the first two of the top-4
    experts hold ~83 % of the mixture in every recipe so far, so plain top-2 drops only the small rest and the
    text answers do not change, even with the text group's experts re-drawn apart (v7e). v7f tested whether a
    flatter mixture over distinct experts makes truncation cost something: it flattened (top-2 share 0.63) and
    top-2 still cost nothing (docs/embedded_model_v7.md §11). The gradient flows through the kept experts' logits
    only (the top-k choice itself is not differentiable)."""
    import torch

    m = attention_mask.reshape(-1).bool()
    total, top2 = 0.0, 0.0
    for logits in router_logits:
        p = torch.softmax(logits.reshape(m.numel(), -1)[m].float(), -1)
        w = p.topk(k, -1).values
        w = w / w.sum(-1, keepdim=True)
        entropy = -(w * torch.log(w + 1e-9)).sum(-1)
        total = total + (math.log(k) - entropy).mean()
        top2 += float(w[:, :2].sum(-1).mean().detach())
    return total / len(router_logits), top2 / len(router_logits)


# v7f (session 15, probed for 1.5 minutes beside a v7e-text control, docs/embedded_model_v7.md §11): v7e-text plus
# ``topk_flat`` on the text steps. It flattened the text tasks' top-4 mixture (top-2 share 0.63 against 0.82) and
# plain top-2 still cost them nothing: they depend little on which experts run. Kept as the recipe that shows it
VARIANTS["v7f"] = {**VARIANTS["v7e-text"], "topk_flat": 0.1}
# v7g (session 16, issue 28): closed-book recall. Every earlier text task reads its answer from the prompt, and no recipe
# made plain top-2 cost them anything (§11). ``text_recall`` (text_tasks.recall_facts: 90 codes -> 4-digit values that no
# prompt contains) can only be answered from the weights. Outcome of the CPU probes (§12): recall is the text task that
# depends most on which experts run (plain top-1 0.54-0.77 of the facts, SERE K=1 0.99-1.00), while plain top-2 still
# loses only 1-3 of 90. v7g fine-tunes the committed v7d-mid with it beside the replayed mix; ``v7g-text`` trains the
# text tasks alone (a probe: the image tasks are not replayed)
V7G_TASK_WEIGHTS = {**{t: round(w * 0.85, 4) for t, w in V7D_TASK_WEIGHTS.items()}, "text_recall": 0.15}
VARIANTS["v7g"] = {**VARIANTS["v7d-mid"], "init": "v7d-mid", "task_weights": V7G_TASK_WEIGHTS}
VARIANTS["v7g-text"] = {**VARIANTS["v7g"], "task_weights": {"text_arith": 0.1, "text_list": 0.1, "text_lookup": 0.1,
                                                            "text_choice": 0.1, "text_recall": 0.6}, "lr": 2e-3}
# v7g at half the learning rate (session 17): the CPU run g2 of v7g kept recall's shape but lost two held-out RAG directions
# (protection, SERE K=1 over top-1), and g1 at twice the rate lost RAG placement outright: the fine-tune drifts the
# image tasks in proportion to its step size. Trained beside v7g on the H200 to see which keeps every direction
VARIANTS["v7g-lo"] = {**VARIANTS["v7g"], "lr": 5e-4}
# the recall task alone (the CPU probe of session 16: does top-2 cost a closed-book answer what SERE K=2 does not?)
VARIANTS["v7g-recall"] = {**VARIANTS["v7g"], "task_weights": {"text_recall": 1.0}, "text_mix": False, "lr": 2e-3}

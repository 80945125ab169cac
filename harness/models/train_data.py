"""Training examples for the embedded model: task-suite items → the harness's own prompts → token ids + pixels.

Why reuse the loaders' prompt builders: the model is trained on exactly the prompts the harness sends at
evaluation time (the OCRBench content order, VLMEvalKit's MCQ text, the RAG-IGBench template, the mix's
"Image i:" framing), so nothing about the prompt has to generalise. The pixel side reproduces the
Qwen2-VL image processor's patch order (:func:`patchify`, tested against the processor) so that the
training loop can keep images as small uint8 arrays and build ``pixel_values`` itself.

Imports only torch / numpy / PIL / jinja2 (through the RAG-IGBench prompt) and the harness's loaders.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.datasets.base import ImageInput, Sample
from harness.datasets.ccbench import build_prompt
from harness.datasets.mix import _compose
from harness.datasets.rag_igbench import render_prompt
from harness.datasets.synthetic import tasks as st, text_tasks
from harness.models.train_cells import cell_targets, option_targets
from harness.models.train_pointer import pointer_targets

PATCH, TEMPORAL, MERGE = 16, 2, 2
CONTENT_RANGE = 60  # a patch whose pixel range (any channel) exceeds this holds ink or a shape


@dataclass
class Example:
    """One request the model learns to answer: harness content parts, its images, the target answer."""

    task: str
    content: list[dict]
    images: list[Any]  # PIL images
    target: str


def _sample(uid: str, task: str, content: list[dict], n_images: int, tag: str):
    return Sample(uid=uid, dataset=tag, task=task, content=content,
                  images=[ImageInput(source=tag, key=f"{uid}:{i}") for i in range(n_images)], reference={}, meta={})


def ocr_content(item: st.OcrItem) -> list[dict]:
    return [{"type": "image", "index": 0}, {"type": "text", "text": item.question}]  # = ocrbench.make_sample


def mcq_content(item: st.McqItem) -> list[dict]:
    return [{"type": "image", "index": 0}, {"type": "text", "text": build_prompt(item.question, item.options)}]


def attr_content(item: st.McqItem) -> list[dict]:
    """The MCQ's question about its image *without* the options: a training-only grounding request whose answer
    is the attribute word itself (``attr`` task). Why: with shuffled options the letter answer needs two steps —
    read the attribute from the image, then find the option line that names it — and the tiny model plateaus at
    chance learning both at once (docs/embedded_model_v3.md); with fixed options the image → class step alone is
    learnt in ~100 CPU steps. Naming the attribute teaches the first step in the words the options use."""
    return [{"type": "image", "index": 0}, {"type": "text", "text": item.question}]


def hint_content(item: st.McqItem) -> list[dict]:
    """The MCQ request with the answer word written before the question (``mcq_hint``, training only): the
    option lookup ("which line names this word? emit its letter") learnt from text, where the word is a token
    the options share — the second step of the composition, scaffolded (docs/embedded_model_v3.md)."""
    text = f"提示：{item.options[item.answer]}。\n" + build_prompt(item.question, item.options)
    return [{"type": "image", "index": 0}, {"type": "text", "text": text}]


def rag_content(item: st.RagItem) -> list[dict]:
    return render_prompt(item.query, item.documents, [[f"{i}" for i in note] for note in item.kinds])


def mixed(target: Example, context_images: list[Any], rng: random.Random) -> Example:
    """``target`` framed as an ``ocr_cc_mix`` request (harness.datasets.mix._compose): its image among others."""
    position = rng.randrange(len(context_images) + 1)
    t = _sample("t", target.task, target.content, 1, "target")
    ctx = [_sample(f"c{i}", "x", [], 1, "context") for i in range(len(context_images))]
    for c in ctx:
        c.meta["source"] = "context"
    composed = _compose(t, ctx, position, "ocr_cc_mix", "target")
    images = context_images[:position] + target.images[:1] + context_images[position:]
    return Example(target.task + "_mix", composed.content, images, target.target)


def make_example(task: str, rng: random.Random, split: str = "train") -> Example:
    """One example of ``task``: ocr, mcq, rag, ocr_mix, mcq_mix (mix: one image of the other kind beside it),
    attr (an MCQ's question without options, answered by the attribute word) and mcq_hint (the MCQ with its
    answer word written before the question): both training only; text_* (no image, recipe v7)."""
    if task == "ocr":
        it = st.ocr_item(rng, split)
        return Example(task, ocr_content(it), [it.image], it.answers[0])
    if task == "mcq":
        it = st.mcq_item(rng, split)
        return Example(task, mcq_content(it), [it.image], it.answer)
    if task == "attr":
        it = st.mcq_item(rng, split)
        return Example(task, attr_content(it), [it.image], it.options[it.answer])
    if task == "mcq_hint":
        it = st.mcq_item(rng, split)
        return Example(task, hint_content(it), [it.image], it.answer)
    if task == "rag":
        it = st.rag_item(rng, split)
        return Example(task, rag_content(it), [img for note in it.images for img in note], it.raw_answer)
    if task.startswith("text_"):  # recipe v7: text-only, the prompt OpenCompass sends (synthetic/text_tasks.py)
        it = text_tasks.text_item(task, rng, split)
        return Example(task, [{"type": "text", "text": it.prompt}], [], it.answer)
    if task in ("ocr_mix", "mcq_mix"):
        target = make_example(task[:3], rng, split)
        other = st.mcq_item(rng, split).image if task == "ocr_mix" else st.ocr_item(rng, split).image
        return mixed(target, [other], rng)
    raise ValueError(f"unknown task {task!r}")


def patchify(img: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] (H, W multiples of 32) → [H/16 · W/16, 3·2·16·16] in the Qwen2-VL processor's order.

    The processor repeats the frame to the temporal patch size, then orders patches merge unit by merge unit
    (``reshape(t, T, C, h/m, m, P, w/m, m, P).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)``)."""
    h, w, c = img.shape
    x = np.repeat(img.transpose(2, 0, 1)[None], TEMPORAL, axis=0)  # [T, C, H, W]
    gh, gw = h // PATCH, w // PATCH
    x = x.reshape(1, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, c * TEMPORAL * PATCH * PATCH)


def encode(example: Example, tokenizer, image_token_id: int) -> dict[str, Any]:
    """Token ids (prompt with every ``<|image_pad|>`` expanded, then the target and ``<|im_end|>``), the prompt
    length and the images as uint8 arrays. The prompt text is the HF engine's (``HFEngine._prompt``)."""
    parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
             for p in example.content]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=False)
    arrays = [np.asarray(img.convert("RGB"), dtype=np.uint8) for img in example.images]
    counts = iter([(a.shape[0] // PATCH) * (a.shape[1] // PATCH) // (MERGE * MERGE) for a in arrays])
    ids: list[int] = []
    for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]:
        ids.extend([t] * next(counts) if t == image_token_id else [t])
    target = tokenizer(example.target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    prompt_ids = np.asarray(ids, dtype=np.int32)
    options = (option_targets(prompt_ids, tokenizer) if example.task.startswith(("mcq", "text_choice"))
               else np.zeros((0, 2), np.int32))
    return {"task": example.task, "ids": np.asarray(ids + target, dtype=np.int32), "n_prompt": len(ids),
            "images": arrays, "cells": cell_targets(example.images, tokenizer), "options": options}


# ------------------------------------------------------------------ batches (train_tiny and train_eval)
def collate(examples: list[dict], pad_id: int, device, left_pad: bool = False, with_target: bool = True):
    """Padded ids / mask / labels, ``pixel_values`` (the processor's normalisation), grid, content mask."""
    import torch

    seqs = [e["ids"] if with_target else e["ids"][: e["n_prompt"]] for e in examples]
    length = max(len(s) for s in seqs)
    ids = np.full((len(seqs), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), length), dtype=np.int64)
    labels = np.full((len(seqs), length), -100, dtype=np.int64)
    for i, (s, e) in enumerate(zip(seqs, examples)):
        off = length - len(s) if left_pad else 0
        ids[i, off:off + len(s)] = s
        mask[i, off:off + len(s)] = 1
        if with_target:
            labels[i, off + e["n_prompt"]:off + len(s)] = s[e["n_prompt"]:]
    patches, grid = [], []
    for e in examples:
        for a in e["images"]:
            patches.append(patchify(a))
            grid.append([1, a.shape[0] // PATCH, a.shape[1] // PATCH])
    t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    out = {"input_ids": t(ids), "attention_mask": t(mask), "labels": t(labels), "pixel_values": None,
           "image_grid_thw": None, "content": None}
    if patches:  # a text-only batch (recipe v7's text tasks) has no pixels: the vision tower is not run
        pix = np.concatenate(patches)
        pix_t = t(pix)
        per_channel = pix_t.reshape(len(pix), 3, -1)
        content = (per_channel.amax(-1).short() - per_channel.amin(-1).short()).amax(-1) > CONTENT_RANGE
        out.update(pixel_values=(pix_t.float() / 255.0 - 0.5) / 0.5,
                   image_grid_thw=t(np.asarray(grid, dtype=np.int64)), content=content)
    if all("cells" in e for e in examples):  # the cell loss's targets (train_cells.py), one per visual token
        out["cells"] = t(np.concatenate([e["cells"] for e in examples]).astype(np.int64))
    if with_target and not left_pad and all("options" in e for e in examples):  # the option loss (train_cells.py)
        idx = [i * length + int(p) for i, e in enumerate(examples) for p in e["options"][:, 0]]
        tgt = [int(x) for e in examples for x in e["options"][:, 1]]
        out["opt_index"], out["opt_target"] = t(np.asarray(idx, np.int64)), t(np.asarray(tgt, np.int64))

        ptr = [(i, *p) for i, p in enumerate(map(pointer_targets, examples)) if len(p)]
        out["ptr"] = t(np.asarray(ptr, np.int64).reshape(-1, 3))  # the pointer loss's (row, query, key)
    if with_target and not left_pad and all("pos" in e for e in examples):
        pos = np.zeros((3, len(seqs), length), dtype=np.int64)
        for i, e in enumerate(examples):
            pos[:, i, : e["pos"].shape[1]] = e["pos"]
        out["position_ids"] = t(pos)
    return out


def mm_kwargs(model, batch: dict) -> dict:
    """``mm_token_type_ids`` where this transformers version wants it (≥ 5.2x), nothing where it does not."""
    import torch

    if "mm_token_type_ids" not in inspect.signature(model.model.get_rope_index).parameters:
        return {}
    return {"mm_token_type_ids": (batch["input_ids"] == model.config.image_token_id).to(torch.int32)}

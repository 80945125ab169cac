"""Training-time held-out checks of the embedded model (``harness.models.train_tiny``): greedy accuracy per task
and expert usage per task, recorded in the checkpoint's ``harness_model.json``.

Why not :mod:`harness.commands.eval_tiny`: these run inside the training process on the pool it already holds, in a
few seconds, straight after the last step; ``eval_tiny`` is the full evaluation through the harness's engine and
metrics, run afterwards.
"""

from __future__ import annotations

from typing import Any


def ocr_correct(pred: str, answers: list[str]) -> bool:
    """OCRBench's rule (substring after lower/strip; newline → space)."""
    p = pred.lower().strip().replace("\n", " ")
    return any(a.lower().strip().replace("\n", " ") in p for a in answers)


def _pixels(batch: dict) -> dict:
    """The image arguments of a batch; none for a text-only batch (v7's text tasks: generate must not see
    ``pixel_values=None``, it would run the vision tower on it)."""
    if batch.get("pixel_values") is None:
        return {}
    return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}


def evaluate(model, tokenizer, pool: dict[str, list[dict]], device, max_new: int = 160, bs: int = 64) -> dict:
    """Greedy held-out accuracy per task: OCR rule, MCQ letter, RAG exact JSON and exact image list."""
    import re

    import torch

    from harness.models.train_data import collate, mm_kwargs

    model.eval()
    out: dict[str, Any] = {}
    for task, exs in pool.items():
        right = 0
        imgs_right = 0
        for i in range(0, len(exs), bs):
            chunk = exs[i:i + bs]
            batch = collate(chunk, tokenizer.pad_token_id, device, left_pad=True, with_target=False)
            with torch.no_grad():
                gen = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     **_pixels(batch), max_new_tokens=max_new if task == "rag" else 24, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, **mm_kwargs(model, batch))
            for e, row in zip(chunk, gen[:, batch["input_ids"].shape[1]:]):
                pred = tokenizer.decode(row, skip_special_tokens=True)
                want = tokenizer.decode(e["ids"][e["n_prompt"]:], skip_special_tokens=True)
                if task.startswith("ocr"):
                    right += ocr_correct(pred, [want])
                elif task.startswith("mcq"):
                    right += pred.strip()[:1] == want.strip()[:1]
                else:
                    right += pred.strip() == want.strip()
                    imgs_right += re.findall(r"IMG#(\d+)", pred) == re.findall(r"IMG#(\d+)", want)
        out[task] = round(right / max(len(exs), 1), 4)
        if task == "rag":
            out["rag_image_list"] = round(imgs_right / max(len(exs), 1), 4)
    model.train()
    return out


def expert_usage(model, tokenizer, pool: dict[str, list[dict]], device, n: int = 64) -> dict:
    """Share of top-k slots per expert (layer-mean) per task on held-out prompts: how experts specialise."""
    import torch

    from harness.models.train_data import collate, mm_kwargs

    model.eval()
    usage = {}
    for task, exs in pool.items():
        batch = collate(exs[:n], tokenizer.pad_token_id, device)
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **_pixels(batch),
                        output_router_logits=True, **mm_kwargs(model, batch))
        m = batch["attention_mask"].reshape(-1).bool()
        counts = 0
        for logits in out.router_logits:
            top = logits.reshape(m.numel(), -1)[m].topk(model.config.text_config.num_experts_per_tok, -1).indices
            counts = counts + torch.bincount(top.reshape(-1), minlength=logits.shape[-1]).float()
        usage[task] = [round(float(x), 4) for x in (counts / counts.sum()).tolist()]
    model.train()
    return usage

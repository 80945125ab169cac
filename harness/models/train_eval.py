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


def _set_top_k(model, k: int) -> None:
    """Every MoE layer's router keeps its top ``k`` (transformers' Qwen3-VL-MoE router reads ``gate.top_k`` on
    each call and renormalises over what it keeps, as ``moe.top_k`` does at decode time)."""
    for layer in model.model.language_model.layers:
        layer.mlp.gate.top_k = k


def routing_concentration(model, examples: list[dict], top_ks: tuple[int, ...] = (2, 1), groups: int = 4) -> dict:
    """How much of a task's top-k mixture the first experts carry, and what dropping the rest costs, on
    ``examples`` (encoded text examples, ``train_data.encode``; no images), teacher-forced on their answers.

    Returns ``weight_share`` {j: mean share of the renormalised top-k weight held by the first j experts, over
    the prompt and answer tokens of every MoE layer}, ``group_share`` (share of top-k slots in each of ``groups``
    expert groups) and ``answer_logprob`` {k: mean log-probability per answer token with the routers keeping
    only their top k; the model's own k first} with ``answer_logprob_ci95`` (mean ± 1.96 standard errors over
    the examples).

    Why (session 15): plain top-2 left the text tasks' greedy answers unchanged on every recipe, even after their
    expert group was re-drawn as independent experts (v7e). The first two experts of the top-4 hold ~83 % of
    its weight on those tasks, so truncation drops the small rest; yet a recipe that flattened the shares (v7f)
    left the cost as small (docs/embedded_model_v7.md §11). Both are measured here rather than guessed: the
    weight shares say how much truncation removes, the teacher-forced log-probability what it costs."""
    import torch

    k0 = model.config.text_config.num_experts_per_tok
    n_experts = model.config.text_config.num_experts
    size = n_experts // groups
    was_training = model.training
    model.eval()
    share = torch.zeros(k0, dtype=torch.float64)
    slots = torch.zeros(groups, dtype=torch.float64)
    rows = 0
    logprob: dict[int, float] = {}
    interval: dict[int, list[float]] = {}
    try:
        for k in (k0, *top_ks):
            _set_top_k(model, k)
            per_item = []
            for e in examples:
                ids = torch.as_tensor(e["ids"], dtype=torch.long)[None]
                n = int(e["n_prompt"])
                with torch.no_grad():
                    out = model(input_ids=ids, output_router_logits=(k == k0))
                logp = torch.log_softmax(out.logits[0, n - 1:-1].float(), -1)
                per_item.append(float(logp.gather(1, ids[0, n:, None]).mean()))
                if k == k0:
                    for lg in out.router_logits:
                        top = torch.softmax(lg.float(), -1).topk(k0, -1)
                        w = top.values / top.values.sum(-1, keepdim=True)
                        share += w.cumsum(-1).sum(0).double()
                        slots += torch.bincount((top.indices // size).reshape(-1), minlength=groups).double()
                        rows += w.shape[0]
            values = torch.tensor(per_item, dtype=torch.float64)
            mean = float(values.mean()) if len(per_item) else float("nan")
            half = 1.96 * float(values.std()) / len(per_item) ** 0.5 if len(per_item) > 1 else float("nan")
            logprob[k] = round(mean, 4)
            interval[k] = [round(mean - half, 4), round(mean + half, 4)]
    finally:
        _set_top_k(model, k0)
        model.train(was_training)
    return {"weight_share": {j + 1: round(float(share[j] / max(rows, 1)), 4) for j in range(k0)},
            "group_share": [round(float(x), 4) for x in (slots / max(float(slots.sum()), 1.0)).tolist()],
            "answer_logprob": logprob, "answer_logprob_ci95": interval, "examples": len(examples)}

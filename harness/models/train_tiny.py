"""Train the embedded model on the synthetic task suite: ``python -m harness.models.train_tiny --out DIR``.

Seeded end to end (data pool, initialisation, batch order); a few minutes on one GPU, runs on CPU too
(``--steps 50 --pool 0.02`` for a smoke run). Imports only torch / transformers / tokenizers / safetensors /
PIL / numpy (+ jinja2 through the RAG-IGBench prompt) and the harness's own modules, so it runs on a GPU
machine that has no Hydra or W&B.

What the loss is and why:

- next-token cross-entropy on the answer tokens only (the prompt is the harness's exact prompt);
- the router's load-balancing loss (``router_aux_loss_coef``), so all 16 experts stay in use — SERE needs
  secondary experts to re-route — while each task family's token kinds pull the router apart;
- an *attention-focus* loss on the vision block VisionZip scores (the last one): the attention each patch
  receives there (column sums of softmax(QKᵀ) within its image, mean over heads — exactly VisionZip's
  importance) is pulled towards the image's content mask (patches with ink or a shape; the task suite draws
  plain backgrounds, so the mask is a pixel-range test). Without it the tower has no reason to put its
  attention where the information is, and VisionZip's choice would be arbitrary;
- from recipe v4 (the default, ``--cells``), the *cell loss* (:mod:`harness.models.train_cells`): each glyph /
  shape cell's visual token predicts its character / colour through the LM head — what made OCR learnable.

The output directory is a harness checkpoint (:func:`harness.models.tiny.save_checkpoint`) whose
``harness_model.json`` records the training configuration, the generator version, the device, the time, the
final losses, held-out accuracies and the SHA-256 of ``model.safetensors``; ``train_log.jsonl`` beside it
has the loss curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from harness.models.train_recipes import V1_TASK_WEIGHTS as TASK_WEIGHTS  # noqa: F401 (v1 recipe, kept importable)
from harness.models.train_data import CONTENT_RANGE, collate, mm_kwargs  # noqa: F401 (batches: train_data.py)
from harness.datasets.synthetic import tasks as st
from harness.models import train_pointer
from harness.models.tiny import build_config, build_tokenizer, save_checkpoint
from harness.models.train_cells import option_loss, CellProbe
from harness.models.train_data import encode, make_example, PATCH
from harness.models.train_eval import evaluate, expert_usage
from harness.models.train_recipes import (group_experts, redraw_group_experts, route_prior_loss, task_weights_at,
                                          topk_flatness_loss, VARIANTS)
from harness.models.train_vision import dedup_vision_positions, pack_vision_attention, FocusProbe
from harness.models.trained import CHECKPOINT, sha256_file, TRAINED_SPEC, WEIGHTS_LABEL
from harness.models.prior_init import init_dir, PRIORS, resolve, PriorUnavailable

BATCH = {"ocr": 256, "ocr_mix": 128, "mcq": 256, "mcq_mix": 128, "rag": 24, "attr": 256, "mcq_hint": 256,
         # recipe v7's text tasks (synthetic/text_tasks.py): 15-45 tokens, no image, so large batches are cheap
         "text_arith": 512, "text_list": 512, "text_lookup": 512, "text_choice": 512, "text_lookup2": 512,
         "text_choice2": 512, "text_recall": 512}
POOL = {"ocr": 48000, "ocr_mix": 12000, "mcq": 32000, "mcq_mix": 8000, "rag": 6000, "attr": 16000, "mcq_hint": 16000,
        "text_arith": 7000, "text_list": 24000, "text_lookup": 24000, "text_choice": 24000, "text_lookup2": 12000,
        "text_choice2": 12000, "text_recall": 12000}

_TOK = None
_IMAGE_TOKEN = None
_ROPE = None


def _worker_init(tok_dir: str, image_token_id: int, config=None) -> None:
    global _TOK, _IMAGE_TOKEN, _ROPE
    from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    _TOK = AutoTokenizer.from_pretrained(tok_dir)
    _IMAGE_TOKEN = image_token_id
    _ROPE = Qwen3VLMoeForConditionalGeneration(config) if config is not None else None


def rope_positions(model, ids: np.ndarray, images: list[np.ndarray]) -> np.ndarray:
    """[3, L] mRoPE position ids of one sequence, from the model's own ``get_rope_index`` (so training uses
    exactly the positions inference computes), computed once per example instead of once per step."""
    import torch

    batch = {"input_ids": torch.from_numpy(ids.astype(np.int64))[None]}
    grid = (torch.tensor([[1, a.shape[0] // PATCH, a.shape[1] // PATCH] for a in images], dtype=torch.long)
            if images else None)  # a text task (v7): text positions only
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(batch["input_ids"], image_grid_thw=grid,
                                            attention_mask=torch.ones_like(batch["input_ids"]),
                                            **mm_kwargs(model, batch))
    return pos[:, 0].numpy().astype(np.int32)


def _make_chunk(args: tuple[str, str, int, int, int]) -> list[dict]:
    task, split, seed, chunk, n = args
    rng = random.Random(f"{split}:{task}:{seed}:{chunk}")
    out = []
    for _ in range(n):
        e = encode(make_example(task, rng, split), _TOK, _IMAGE_TOKEN)
        if _ROPE is not None:
            e["pos"] = rope_positions(_ROPE, e["ids"], e["images"])
        out.append(e)
    return out


def build_pool(tok_dir: str, image_token_id: int, counts: dict[str, int], split: str, seed: int,
               workers: int, config=None) -> dict[str, list[dict]]:
    """Encoded examples per task, generated in ``workers`` processes; a pure function of (split, seed)."""
    jobs = []
    for task, n in counts.items():
        chunk = 250
        jobs += [(task, split, seed, c, min(chunk, n - c * chunk)) for c in range(math.ceil(n / chunk))]
    if workers <= 1:
        _worker_init(tok_dir, image_token_id, config)
        results = [_make_chunk(j) for j in jobs]
    else:
        with mp.get_context("fork").Pool(workers, _worker_init, (tok_dir, image_token_id, config)) as pool:
            results = pool.map(_make_chunk, jobs, chunksize=1)
    out: dict[str, list[dict]] = {t: [] for t in counts}
    for (task, *_), res in zip(jobs, results):
        out[task].extend(res)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the ``--variant``'s defaults filled in for the recipe flags not given explicitly."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="v4",
                    help="training recipe (harness/models/train_recipes.py); v4 = the committed checkpoint's")
    ap.add_argument("--generator", choices=("1", "2"), default=None, help="task-suite generator version")
    ap.add_argument("--curriculum", type=float, default=None, help="fraction of steps on visual tasks only")
    ap.add_argument("--expert-groups", type=int, default=None, help="grouped expert initialisation (0 = off)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (2.5e-3; v7, a fine-tune: 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=float, default=1.0, help="scale of the training pool (1.0 = POOL)")
    ap.add_argument("--batch-scale", type=float, default=1.0)
    ap.add_argument("--focus", type=float, default=None, help="weight of the attention-focus loss (v1: 0.1)")
    ap.add_argument("--aux", type=float, default=None, help="router load-balancing loss coefficient (v1: 0.005)")
    ap.add_argument("--cells", type=float, default=None,
                    help="weight of the cell loss (train_cells.py; v1-v3: 0, v4: 0.5)")
    ap.add_argument("--options", type=float, default=None,
                    help="weight of the option loss (train_cells.py; before v5: 0, v5: 0.5)")
    ap.add_argument("--pointer", type=float, default=None,
                    help="weight of the pointer loss (train_pointer.py; before v6: 0, v6: 0.5)")
    ap.add_argument("--pointer-layer", type=int, default=None,
                    help="text layer whose head 0 the pointer loss trains (default: the recipe's, else -1 = the "
                         "last, as in v6)")
    ap.add_argument("--init", default=None,
                    help="start from this checkpoint's weights instead of a fresh initialisation: a DIR, 'committed' "
                         "(the model=tiny checkpoint) or an earlier committed model from git history, 'v4' (recipes "
                         "v7-v7c), 'v7c-lr2' (v7d) or 'v7d-mid' (v7e); its tokenizer must equal the recipe's, its SHA-256 is recorded")
    ap.add_argument("--redraw-group", type=int, default=None,
                    help="re-draw this expert group's experts independently before a fine-tune "
                         "(train_recipes.redraw_group_experts; v7e: 3, the text tasks' group; -1 = off)")
    ap.add_argument("--topk-flat", type=float, default=None,
                    help="weight of the top-k flatness loss on text steps (train_recipes.topk_flatness_loss; before "
                         "v7f: 0)")
    ap.add_argument("--route-prior", type=float, default=None,
                    help="weight of the routing prior (train_recipes.route_prior_loss; before v7: 0): each task's "
                         "tokens pulled onto its own group of expert copies, so experts specialise by task")
    ap.add_argument("--text-mix", dest="text_mix", action="store_true", default=None,
                    help="a step that draws a text task trains all the recipe's text tasks at once (BATCH/2 rows of "
                         "each; before v7b: off)")
    ap.add_argument("--no-text-mix", dest="text_mix", action="store_false")
    ap.add_argument("--text-pool", type=float, default=None,
                    help="the text tasks' training pool is --pool times this (default: the recipe's, else 1)")
    ap.add_argument("--eval-n", type=int, default=256, help="held-out examples per task for the final eval")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early (recorded) past this wall time")
    ap.add_argument("--train-minutes", type=float, default=None,
                    help="fit --steps to this training time, measured on the first 30 steps (the steps done are "
                         "recorded: rerun with --steps N to reproduce)")
    ap.add_argument("--refit", action="store_true",
                    help="with --train-minutes: fit the step count again at step 150 (several runs share a GPU)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-pack", dest="pack", action="store_false", help="keep transformers' per-image vision loop")
    args = ap.parse_args(argv)
    recipe = VARIANTS[args.variant]
    for key in ("generator", "curriculum", "expert_groups", "focus", "aux", "cells", "options", "pointer",
                "route_prior", "topk_flat"):
        if getattr(args, key) is None:
            setattr(args, key, recipe.get(key, 0.0))
    if args.lr is None:
        args.lr = recipe.get("lr", 2.5e-3)
    if args.text_mix is None:
        args.text_mix = bool(recipe.get("text_mix", False))
    if args.text_pool is None:
        args.text_pool = recipe.get("text_pool", 1.0)
    if args.pointer_layer is None:
        args.pointer_layer = recipe.get("pointer_layer", -1)
    if args.init is None:
        args.init = recipe.get("init")
    if args.redraw_group is None:
        args.redraw_group = recipe.get("redraw_group", -1)
    args.task_weights = dict(recipe["task_weights"])
    return args


def prior_init_dir(name: str = "v4") -> Path:
    """``--init v4`` / ``--init v7c-lr2``: the committed checkpoint while it is that model, else its files from git
    history (``prior_init``, SHA-256 checked)."""
    try:
        return resolve(name=name)
    except PriorUnavailable as e:
        raise SystemExit(f"--init {name}: {e}; run `python -m harness.models.prior_init --name {name}` where the git "
                         f"history is and carry {init_dir(name).name}, or pass --init DIR with its files (SHA-256 "
                         f"{PRIORS[name][1]})") from e




def pool_counts(args: argparse.Namespace) -> dict[str, int]:
    """Training pool size per task the recipe samples (v1's five tasks; ``attr`` only where a recipe uses it, so
    the v1/v2 pools, held-out draws and checkpoints stay exactly as they were)."""
    text_pool = getattr(args, "text_pool", None) or 1.0

    def scale(task: str) -> float:
        return args.pool * (text_pool if task.startswith("text_") else 1.0)

    return {t: max(8, int(n * scale(t))) for t, n in POOL.items() if t in args.task_weights}


def draw_batch(pool: dict[str, list[dict]], task: str, args: argparse.Namespace, rng) -> tuple[str, list[dict]]:
    """(label, examples) of one training step that drew ``task``. With ``text_mix`` a text task's step draws
    ``BATCH/2`` rows from every text task the recipe trains (label ``text_mix``: the routing prior sends them all to
    the text group), so each text task learns on every text step instead of a quarter of them."""
    if args.text_mix and task.startswith("text_"):
        texts = [t for t in args.task_weights if t.startswith("text_")]
        rows = []
        for t in texts:
            bs = max(2, int(BATCH[t] * args.batch_scale) // 2)
            idx = rng.choice(len(pool[t]), size=min(bs, len(pool[t])), replace=False)
            rows += [pool[t][i] for i in idx]
        return "text_mix", rows
    bs = max(2, int(BATCH[task] * args.batch_scale))
    idx = rng.choice(len(pool[task]), size=min(bs, len(pool[task])), replace=False)
    return task, [pool[task][i] for i in idx]


def per_task_ce(logits, labels, examples: list[dict]) -> dict[str, float]:
    """Answer-token cross-entropy of each task in a mixed batch (logging only)."""
    import torch

    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                           reduction="none")
    n = (labels[:, 1:] != -100).sum(1).clamp(min=1)
    row = (ce.sum(1) / n).tolist()
    out: dict[str, list[float]] = {}
    for e, v in zip(examples, row):
        out.setdefault(e["task"], []).append(v)
    return {t: sum(v) / len(v) for t, v in out.items()}


def build_pools(args: argparse.Namespace, tok_dir: str, config) -> tuple[dict, dict]:
    """(train pool, held-out pool) of the args' generator: a pure function of (generator, seed, pool, eval_n),
    so parallel recipe runs can share one (``benchmarks/train_tiny_v2.py`` builds it once and forks)."""
    st.use_generator(args.generator)
    pool = build_pool(tok_dir, config.image_token_id, pool_counts(args), "train", args.seed, args.workers, config)
    held = build_pool(tok_dir, config.image_token_id, {t: args.eval_n for t in pool_counts(args)}, "heldout", args.seed,
                      args.workers)
    return pool, held


def main(argv: list[str] | None = None, pools: tuple[dict, dict] | None = None) -> int:
    """Train one recipe and write its checkpoint; ``pools`` = (train, held-out) already built for these args."""
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from transformers import Qwen3VLMoeForConditionalGeneration

    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    spec = dataclasses.replace(TRAINED_SPEC, seed=args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    tok_dir = out_dir / "_tokenizer"
    tokenizer.save_pretrained(tok_dir)
    config = build_config(spec, tokenizer)
    config.text_config.router_aux_loss_coef = args.aux
    torch.manual_seed(args.seed)
    init_sha = None
    if args.init:  # a fine-tune (v7): the same architecture and tokenizer, the given checkpoint's weights
        from transformers import AutoTokenizer

        init_dir = (prior_init_dir(args.init) if args.init in PRIORS else CHECKPOINT if args.init == "committed"
                    else Path(args.init))
        if AutoTokenizer.from_pretrained(init_dir).get_vocab() != tokenizer.get_vocab():
            raise SystemExit(f"--init {init_dir}: its tokenizer differs from the recipe's (build_tokenizer)")
        init_sha = sha256_file(init_dir / "model.safetensors")
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(init_dir, dtype=torch.float32)
        model.config.text_config.router_aux_loss_coef = args.aux
        model = model.to(device)
        print(f"initialised from {init_dir} (sha256 {init_sha[:12]})", flush=True)
    else:
        model = Qwen3VLMoeForConditionalGeneration(config).to(torch.float32).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M on {device}", flush=True)

    counts = pool_counts(args)
    st.use_generator(args.generator)
    t0 = time.time()
    pool, held = pools if pools is not None else build_pools(args, str(tok_dir), config)
    data_s = time.time() - t0
    if args.expert_groups and not args.init:  # after the forked data workers: a multi-threaded op before fork can deadlock them
        print(f"grouped expert init: {group_experts(model, args.expert_groups, seed=args.seed)} tensors", flush=True)
    if args.redraw_group >= 0:
        if not args.init:
            raise SystemExit("--redraw-group re-draws a group of an initialised model: it needs --init")
        print(f"group {args.redraw_group} re-drawn: {redraw_group_experts(model, args.redraw_group, seed=args.seed)} "
              "tensors", flush=True)
    lens = {t: float(np.mean([len(e["ids"]) for e in v])) for t, v in pool.items()}
    print(f"data {data_s:.1f} s, mean lengths {lens}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    total = {"steps": args.steps}
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / min(warm, total["steps"] // 10 + 1)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total["steps"]))))
    if args.pack:
        check = collate(pool["mcq"][:16] + pool["ocr"][:16], tokenizer.pad_token_id, device)  # image tasks
        with torch.no_grad():
            ref = model.model.get_image_features(check["pixel_values"], check["image_grid_thw"], return_dict=True)
            ref = torch.cat(list(ref.pooler_output)) if hasattr(ref, "pooler_output") else torch.cat(list(ref[0]))
        saved = {n: getattr(sys.modules[type(model.model.visual).__module__], n, None)
                 for n in ("get_vision_interpolation_indices_and_weights", "get_vision_position_ids")}
        wrapped = dedup_vision_positions(model)
        pack_vision_attention(model)
        with torch.no_grad():
            got = model.model.get_image_features(check["pixel_values"], check["image_grid_thw"], return_dict=True)
            got = torch.cat(list(got.pooler_output)) if hasattr(got, "pooler_output") else torch.cat(list(got[0]))
        err = float((got - ref).abs().max())
        print(f"packed vision path: wrapped {wrapped}, max |diff| {err:.2e}", flush=True)
        if not err < 1e-3:  # this transformers version's helpers are not per-image blocks: undo the wrapping
            mod = sys.modules[type(model.model.visual).__module__]
            for n, f in saved.items():
                if f is not None:
                    setattr(mod, n, f)
            for n in ("rot_pos_emb", "fast_pos_embed_interpolate"):
                model.model.visual.__dict__.pop(n, None)
            print("position helpers left unwrapped", flush=True)
    probe = FocusProbe(model)
    cell_probe = CellProbe(model) if args.cells else None

    pointer_before = train_pointer.install(model, args.pointer_layer) if args.pointer else None
    rng = np.random.default_rng(args.seed)
    tasks = list(args.task_weights)
    log = open(out_dir / "train_log.jsonl", "w", encoding="utf-8")
    ema: dict[str, float] = {}
    t_train = time.time()
    stopped_early = False
    step = 0
    while step < total["steps"]:
        step += 1
        if step == 31 and args.train_minutes:
            per_step = (time.time() - t_train) / 30
            total["steps"] = min(args.steps, max(31, int(args.train_minutes * 60 / per_step)))
            print(f"{per_step * 1e3:.0f} ms/step -> {total['steps']} steps", flush=True)
        if step == 151 and args.train_minutes and args.refit:  # parallel runs: the first 30 steps were optimistic
            per_step = (time.time() - t_train) / 150
            total["steps"] = min(args.steps, max(151, int(args.train_minutes * 60 / per_step)))
            print(f"refit: {per_step * 1e3:.0f} ms/step -> {total['steps']} steps", flush=True)
        weights = task_weights_at(vars(args), step, total["steps"])
        probs = np.asarray([weights[t] for t in tasks])
        task = tasks[rng.choice(len(tasks), p=probs / probs.sum())]
        task, rows = draw_batch(pool, task, args, rng)
        batch = collate(rows, tokenizer.pad_token_id, device)
        extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else mm_kwargs(model, batch)
        pointed = pointer_before is not None and train_pointer.arm(batch)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                    output_router_logits=True, **extra)
        visual = batch["pixel_values"] is not None  # text tasks (v7) run no vision tower: no focus / cell loss
        focus, mass = probe.loss(batch["content"]) if visual else (out.loss.new_zeros(()), float("nan"))
        loss = out.loss + args.focus * focus
        routed = None
        if args.route_prior:
            prior, routed = route_prior_loss(out.router_logits, batch["attention_mask"], task,
                                             model.config.text_config.num_experts)
            loss = loss + args.route_prior * prior
        top2 = None
        if args.topk_flat and task.startswith("text_"):  # text steps only: what the OpenCompass table measures
            flat, top2 = topk_flatness_loss(out.router_logits, batch["attention_mask"],
                                            model.config.text_config.num_experts_per_tok)
            loss = loss + args.topk_flat * flat
        cells_acc = None
        if cell_probe is not None and visual:
            cells, cells_acc = cell_probe.loss(batch["cells"])
            loss = loss + args.cells * cells
        ptr_mass = None
        if pointed:
            pointing, ptr_mass = train_pointer.loss(batch)
            loss = loss + args.pointer * pointing
        opt_acc = None
        if args.options:
            letters, opt_acc = option_loss(out.logits, batch["opt_index"], batch["opt_target"])
            loss = loss + args.options * letters
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        aux = float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
        ce = float(out.loss) - args.aux * aux
        logged = [(f"ce_{task}", ce), ("aux", aux)]
        if visual:
            logged += [("focus", float(focus)), ("mass", float(mass))]
        if routed is not None:
            logged.append((f"group_mass_{task}", routed))
        if top2 is not None:
            logged.append((f"top2_share_{task}", top2))
        if task == "text_mix" and step % 50 == 0:
            with torch.no_grad():
                logged += [(f"ce_{t}", v) for t, v in per_task_ce(out.logits, batch["labels"], rows).items()]
        if cells_acc is not None and cells_acc == cells_acc:  # not NaN: the batch had labelled cells
            logged.append(("cells_acc", cells_acc))
        if opt_acc is not None and opt_acc == opt_acc:
            logged.append(("options_acc", opt_acc))
        if ptr_mass is not None:
            logged.append(("pointer_mass", ptr_mass))
        for k, v in logged:
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        if step % 50 == 0 or step == 1:
            rec = {"step": step, "task": task, "ce": round(ce, 4), "focus": round(float(focus), 4),
                   "content_mass": round(float(mass), 4), "aux": round(aux, 4), "lr": sched.get_last_lr()[0],
                   "elapsed_s": round(time.time() - t_train, 1)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % 250 == 0 or step == 1:
                print(json.dumps({**rec, "ema": {k: round(v, 3) for k, v in ema.items()}}), flush=True)
        if args.max_minutes and time.time() - t_start > args.max_minutes * 60:
            stopped_early = True
            print(f"stopping early at step {step} (--max-minutes {args.max_minutes})", flush=True)
            break
    train_s = time.time() - t_train
    log.close()
    for h in probe.handles:
        h.remove()
    if cell_probe is not None:
        cell_probe.remove()
    if pointer_before is not None:
        train_pointer.uninstall(model, pointer_before)

    t_eval = time.time()
    model.eval()
    accuracy = evaluate(model, tokenizer, held, device)
    usage = expert_usage(model, tokenizer, held, device)
    eval_s = time.time() - t_eval
    print(f"held-out accuracy {accuracy} (eval {eval_s:.1f} s)", flush=True)

    model = model.to("cpu").to(torch.float32)
    model.config.text_config.router_aux_loss_coef = 0.001  # back to the library default: inference ignores it
    marker = {
        "name": "tiny-qwen3-vl-moe-trained", "weights": WEIGHTS_LABEL,
        "meaning": "a machinery-level model trained on the project's synthetic task suite, not a real model's quality",
        "generator_version": st.generator_version(),
        "training": {**vars(args), "batch": BATCH, "pool": counts, "init_sha256": init_sha,
                     "content_range": CONTENT_RANGE, "steps_done": step, "stopped_early": stopped_early},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "params": n_params, "time_s": {"data": round(data_s, 1), "train": round(train_s, 1), "eval": round(eval_s, 1),
                                       "total": round(time.time() - t_start, 1)},
        "final_ema": {k: round(v, 4) for k, v in ema.items()},
        "heldout_accuracy": accuracy, "heldout_eval_n": args.eval_n, "expert_usage": usage,
    }
    save_checkpoint(model, tokenizer, spec, out_dir, marker)
    marker["sha256"] = sha256_file(out_dir / "model.safetensors")
    info = json.loads((out_dir / "harness_model.json").read_text(encoding="utf-8"))
    info["sha256"] = marker["sha256"]
    (out_dir / "harness_model.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    import shutil

    shutil.rmtree(tok_dir, ignore_errors=True)
    print(f"wrote {out_dir} sha256 {marker['sha256']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

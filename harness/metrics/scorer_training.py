"""Train the tiny CLIP and the tiny text embedder on the synthetic RAG-IGBench data (CPU, seeded, minutes).

Why: the committed scorers of ``scoring=default`` (:mod:`harness.metrics.scorer_checkpoints`) must make
``clip_score`` and ``alignment`` respond to answer quality on the embedded model's data. Both start from the
random-init stand-ins of :mod:`harness.metrics.tiny_encoders` (same transformers classes, same files, so the
scorers load them with the code that loads the reference's models) and are fitted to the targets of
:mod:`harness.metrics.scorer_data` in plain torch, through the exact forward the scorers run:

* CLIP: ``get_image_features`` / ``get_text_features`` of the checkpoint's own image processor and tokenizer,
  cosine pushed ≥ ``CLIP_POS`` for (text image, note context) and ≤ ``CLIP_NEG`` for (scene image, same context);
* text embedder: BERT → mean pooling → Dense → normalise (the checkpoint's ``modules.json``), cosine regressed on
  ``0.7 + 0.3·s`` (``s``: :func:`~harness.metrics.scorer_data.content_overlap`).

Each trained directory is then evaluated **through the scorer classes the run uses** (``TransformersClipScorer``,
``TextEmbedder``) on held-out items the training never saw, and the figures are written into its
``harness_model.json`` beside the training configuration and the SHA-256 of its weight files. The command is
``python -m harness.commands.train_scorers``. Nothing here reads the embedded VLM.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.metrics import rag_igbench as rb, scorer_data as sd
from harness.metrics.rag_igbench_answer import image_contexts
from harness.metrics.encoders import _features, _pool, TextEmbedder, TransformersClipScorer
from harness.metrics.scorer_checkpoints import (
    record_hashes, sha256_file, CLIP_CHECKPOINT, CLIP_WEIGHT_FILES, EMBEDDER_CHECKPOINT, EMBEDDER_WEIGHT_FILES,
    WEIGHTS_LABEL)
from harness.metrics.tiny_encoders import build_tiny_clip, build_tiny_text_embedder, TinyClipSpec, TinyTextEmbedderSpec
from harness.models.tiny import MARKER

#: the trained CLIP's architecture: the random stand-in's (a ViT of 64 px, width 32; ≈0.2 M parameters)
CLIP_SPEC = TinyClipSpec(seed=0)
#: the trained embedder: one layer of width 64 (CPU minutes on shared cores), contexts ≤ 128 tokens (±20
#: characters, one token per Chinese character; the vocabulary: bytes, the generator's characters, a few merges)
EMBED_SPEC = TinyTextEmbedderSpec(seed=0, vocab_size=512, hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                  max_position_embeddings=128, dense_out=64)


@dataclass(frozen=True)
class TrainConfig:
    """Every number of a training run (recorded in each checkpoint's marker)."""

    seed: int = 0
    clip_items: int = 200  # train-split RAG items for the CLIP (≈5 images each, preprocessed once)
    clip_steps: int = 150
    clip_batch: int = 64
    clip_lr: float = 3e-3
    embed_items: int = 800
    embed_steps: int = 400
    embed_batch: int = 48
    embed_lr: float = 2e-3
    eval_items: int = 100  # held-out RAG items (the bundled sample's split; never trained on)
    threads: int = 1  # the CI machine's 2 cores are shared


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not progress, leave=False)


def _write_marker(out: Path, info: dict[str, Any]) -> None:
    (out / MARKER).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished build over ``out`` (the old one removed only once the new one is complete)."""
    for path in [tmp, *tmp.rglob("*")]:  # mkdtemp's 0700: the committed files are everyone's to read
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(tmp), str(out))


def _common(cfg: TrainConfig) -> dict[str, Any]:
    import torch

    from harness.datasets.synthetic import tasks as st

    return {"weights": WEIGHTS_LABEL, "generator_version": st.generator_version(), "training": asdict(cfg),
            "torch": torch.__version__, "command": "python -m harness.commands.train_scorers",
            "independent_of": "the embedded VLM (trained on the data generator's items only)"}


def _finish(tmp: Path, out: Path, cfg: TrainConfig, *, name: str, spec: Any, n_parameters: int, n_pairs: int,
            losses: list[float], train_s: float, measured: dict[str, Any], meaning: str,
            weight_files: tuple[str, ...]) -> dict[str, Any]:
    """The marker both scorers record (training, losses, held-out figures, weight hashes), written into the
    finished build, which then replaces ``out``; returns the marker."""
    info = {"name": name, **_common(cfg), "spec": asdict(spec), "n_parameters": n_parameters, "n_pairs": n_pairs,
            "loss_first": statistics.mean(losses[:20]), "loss_last": statistics.mean(losses[-20:]),
            "train_seconds": round(train_s, 1), "heldout": measured, "meaning": meaning,
            "sha256": sha256_file(tmp / "model.safetensors"), "sha256_files": record_hashes(tmp, weight_files)}
    _write_marker(tmp, info)
    _replace_dir(tmp, out)
    return info


# ------------------------------------------------------------------------------------------------- CLIP


def _clip_forward(model: Any, pixels: Any, ids: Any, mask: Any):
    import torch

    img = _features(model.get_image_features(pixel_values=pixels))
    txt = _features(model.get_text_features(input_ids=ids, attention_mask=mask))
    return torch.nn.functional.cosine_similarity(img, txt, dim=-1)


def train_clip(out: Path, cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict[str, Any]:
    """Train the tiny CLIP into ``out`` (replaced when done); returns its marker."""
    import torch
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(cfg.seed)
    rng = random.Random(f"clip:{cfg.seed}")
    t0 = time.time()
    items = sd.rag_items("train", cfg.clip_items, cfg.seed)
    pairs = sd.clip_pairs(items, rng)
    tmp = Path(tempfile.mkdtemp(prefix=".train-clip-", dir=out.parent if out.parent.exists() else None))
    build_tiny_clip(tmp, CLIP_SPEC)
    model = CLIPModel.from_pretrained(tmp).train()
    processor, tokenizer = CLIPImageProcessorPil.from_pretrained(tmp), AutoTokenizer.from_pretrained(tmp)
    images = {id(im): im for im, _, _ in pairs}
    index = {key: i for i, key in enumerate(images)}
    pixels = torch.cat([processor(images=list(images.values())[i:i + 256], return_tensors="pt")["pixel_values"]
                        for i in range(0, len(images), 256)])
    texts = sorted({c for _, c, _ in pairs})
    tindex = {t: i for i, t in enumerate(texts)}
    toks = tokenizer(texts, padding=True, truncation=True, max_length=CLIP_SPEC.context_length, return_tensors="pt")
    img_i = torch.tensor([index[id(im)] for im, _, _ in pairs])
    txt_i = torch.tensor([tindex[c] for _, c, _ in pairs])
    labels = torch.tensor([float(y) for _, _, y in pairs])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.clip_lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    with _bar(cfg.clip_steps, "train CLIP", progress) as bar:
        for step in range(cfg.clip_steps):
            b = torch.randint(len(pairs), (cfg.clip_batch,), generator=gen)
            cos = _clip_forward(model, pixels[img_i[b]], toks["input_ids"][txt_i[b]],
                                toks["attention_mask"][txt_i[b]])
            y = labels[b]
            loss = (y * torch.relu(sd.CLIP_POS - cos) ** 2 + (1 - y) * torch.relu(cos - sd.CLIP_NEG) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for g in opt.param_groups:  # linear decay: a steady end point for a seeded run
                g["lr"] = cfg.clip_lr * (1 - (step + 1) / cfg.clip_steps)
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    model.eval().save_pretrained(tmp)
    train_s = time.time() - t0
    measured = evaluate_clip(tmp, cfg)
    return _finish(tmp, out, cfg, name="tiny-clip-trained-synthetic", spec=CLIP_SPEC,
                   n_parameters=sum(p.numel() for p in model.parameters()), n_pairs=len(pairs), losses=losses,
                   train_s=train_s, measured=measured, weight_files=CLIP_WEIGHT_FILES,
                   meaning="clip_score on the synthetic RAG-IGBench data: 1 for an image the reference places after "
                           "a note (a text image), 0 for a scene image there; it cannot tell two text images apart "
                           "(their words are drawn independently of the notes)")


def evaluate_clip(path: str | Path, cfg: TrainConfig = TrainConfig()) -> dict[str, Any]:
    """Held-out figures of a CLIP directory, through :class:`~harness.metrics.encoders.TransformersClipScorer`:
    mean score of placeable vs scene images in the same contexts, and ``clip_score`` of the reference answers
    against the same answers with their image numbers shuffled among the candidates."""
    scorer = TransformersClipScorer(str(path), device="cpu")
    items = sd.rag_items("heldout", cfg.eval_items, cfg.seed)
    pairs = sd.clip_pairs(items, random.Random(f"clip-eval:{cfg.seed}"), variants=1)
    cos = scorer.cosines([p[0] for p in pairs], [p[1] for p in pairs])
    pos = [rb.clip_map(c) for c, p in zip(cos, pairs) if p[2] == 1]
    neg = [rb.clip_map(c) for c, p in zip(cos, pairs) if p[2] == 0]
    correct, shuffled = [], []
    rng = random.Random(f"clip-shuffle:{cfg.seed}")
    for item in items:
        flat = [im for ims in item.images for im in ims]
        ref, shuf = item.answer, shuffled_placement(item.answer, len(flat), rng)
        for answer, acc in ((ref, correct), (shuf, shuffled)):
            placed = image_contexts(answer)
            acc.append(rb.clip_score([flat[k - 1] for k, _ in placed], [c for _, c in placed], scorer))
    return {"n_items": len(items), "n_pairs": len(pairs),
            "score_placeable_image": round(statistics.mean(pos), 4), "score_scene_image": round(statistics.mean(neg), 4),
            "pair_accuracy": round((sum(s > 0.5 for s in pos) + sum(s <= 0.5 for s in neg)) / len(pairs), 4),
            "clip_score_reference": round(statistics.mean(correct), 4),
            "clip_score_shuffled": round(statistics.mean(shuffled), 4)}


def shuffled_placement(answer: str, n_candidates: int, rng: random.Random) -> str:
    """``answer`` with its image numbers sent through a random permutation of 1..N (positions kept): the
    "shuffled placement" of the sensitivity tests."""
    import re

    perm = list(range(1, n_candidates + 1))
    rng.shuffle(perm)
    return re.sub(r"IMG#(\d+)", lambda m: f"IMG#{perm[int(m.group(1)) - 1]}" if 1 <= int(m.group(1)) <= n_candidates
                  else m.group(0), answer)


# --------------------------------------------------------------------------------------------- embedder


def _embed_forward(model: Any, dense: Any, tokenizer: Any, texts: list[str], max_length: int):
    import torch

    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    return torch.nn.functional.normalize(dense(_pool("mean", hidden, batch["attention_mask"])), dim=-1)


def train_embedder(out: Path, cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict[str, Any]:
    """Train the tiny text embedder into ``out`` (replaced when done); returns its marker."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(cfg.seed)
    rng = random.Random(f"embed:{cfg.seed}")
    t0 = time.time()
    pairs = sd.alignment_pairs(sd.rag_items("train", cfg.embed_items, cfg.seed), rng)
    tmp = Path(tempfile.mkdtemp(prefix=".train-embed-", dir=out.parent if out.parent.exists() else None))
    build_tiny_text_embedder(tmp, EMBED_SPEC, corpus=sd.tokenizer_corpus(), cjk_chars=True)
    model, tokenizer = BertModel.from_pretrained(tmp).train(), AutoTokenizer.from_pretrained(tmp)
    state = load_file(str(tmp / "2_Dense" / "model.safetensors"))
    dense = torch.nn.Linear(EMBED_SPEC.hidden_size, EMBED_SPEC.dense_out)
    dense.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    params = [*model.parameters(), *dense.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.embed_lr, weight_decay=0.01)
    targets = torch.tensor([sd.ALIGN_LO + (1 - sd.ALIGN_LO) * s for _, _, s in pairs])
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    with _bar(cfg.embed_steps, "train text embedder", progress) as bar:
        for step in range(cfg.embed_steps):
            b = torch.randint(len(pairs), (cfg.embed_batch,), generator=gen).tolist()
            emb = _embed_forward(model, dense, tokenizer, [pairs[i][0] for i in b] + [pairs[i][1] for i in b],
                                 EMBED_SPEC.max_position_embeddings)
            cos = (emb[: len(b)] * emb[len(b):]).sum(-1)
            loss = torch.nn.functional.mse_loss(cos, targets[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            for g in opt.param_groups:
                g["lr"] = cfg.embed_lr * (1 - (step + 1) / cfg.embed_steps)
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.5f}")
    model.eval().save_pretrained(tmp)
    save_file({"linear.weight": dense.weight.detach().contiguous(), "linear.bias": dense.bias.detach().contiguous()},
              str(tmp / "2_Dense" / "model.safetensors"), metadata={"format": "pt"})
    train_s = time.time() - t0
    measured = evaluate_embedder(tmp, cfg)
    return _finish(tmp, out, cfg, name="tiny-text-embedder-trained-synthetic", spec=EMBED_SPEC,
                   n_parameters=sum(p.numel() for p in params), n_pairs=len(pairs), losses=losses,
                   train_s=train_s, measured=measured, weight_files=EMBEDDER_WEIGHT_FILES,
                   meaning="alignment on the synthetic RAG-IGBench data: ≈ the Dice overlap of the Chinese "
                           "character bigrams of the model's and the reference's contexts of an image "
                           "(cosine ≈ 0.7 + 0.3·overlap)")


def evaluate_embedder(path: str | Path, cfg: TrainConfig = TrainConfig()) -> dict[str, Any]:
    """Held-out figures of an embedder directory, through :class:`~harness.metrics.encoders.TextEmbedder`: how
    closely alignment follows the content overlap it is meant to measure, and alignment of the reference
    answers against answers whose clauses are all wrong (images in place)."""
    embed = TextEmbedder(str(path), device="cpu")
    items = sd.rag_items("heldout", cfg.eval_items, cfg.seed)
    pairs = sd.alignment_pairs(items, random.Random(f"embed-eval:{cfg.seed}"), variants=2)
    vecs = embed([p[0] for p in pairs] + [p[1] for p in pairs])
    got = [rb.align_map(c) for c in rb._cosines(vecs[: len(pairs)], vecs[len(pairs):])]
    want = [p[2] for p in pairs]
    rng = random.Random(f"embed-wrong:{cfg.seed}")
    ref_scores, wrong_scores = [], []
    for item in items:
        notes = sd.reference_notes(item)
        wrong = sd.render(item.query, [sd.Note(sd._other_clause(rng, n.clause, 3), n.images) for n in notes])
        ref_scores.append(rb.alignment_score(item.answer, item.answer, embed))
        wrong_scores.append(rb.alignment_score(wrong, item.answer, embed))
    return {"n_items": len(items), "n_pairs": len(pairs),
            "mean_abs_error_vs_overlap": round(statistics.mean(abs(g - w) for g, w in zip(got, want)), 4),
            "pearson_vs_overlap": round(statistics.correlation(got, want), 4),
            "alignment_reference": round(statistics.mean(ref_scores), 4),
            "alignment_all_clauses_wrong": round(statistics.mean(wrong_scores), 4)}


def train_all(out_dir: Path, cfg: TrainConfig = TrainConfig(), progress: bool = True,
              only: Callable[[str], bool] = lambda name: True) -> dict[str, dict[str, Any]]:
    """Train both scorers into ``out_dir`` (the committed folder by default); returns their markers."""
    import torch

    torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    if only("clip"):
        done["clip"] = train_clip(out_dir / CLIP_CHECKPOINT.name, cfg, progress)
    if only("embed"):
        done["embed"] = train_embedder(out_dir / EMBEDDER_CHECKPOINT.name, cfg, progress)
    return done

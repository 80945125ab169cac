"""The cell loss (training only): each content cell's visual token predicts, through the language model's own
output head, the token of what the cell holds — its glyph (``A``, ``7``) or its shape's colour word (first token).

Why (docs/embedded_model_v4.md): the vision tower alone tells the 22 glyphs of generator 2 apart in ~50 CPU steps
(a linear probe on the merged tokens: 100 % held-out), yet the whole model trained on OCR sat at loss 2.4 with
exact-match 0 after 300 CPU steps — the language model has to discover *at the same time* which visual token to
read next and how a visual token maps to a character token. With this loss the merged token of a glyph cell
already points at its character in the output space, so reading reduces to "attend to the next content cell and
copy": the same 300 CPU steps reach 0.93 exact match. It is the embedded model's counterpart of the OCR-heavy
pre-training real VLMs get; it changes nothing at inference (the hook is removed before the checkpoint is saved).

Cells come from ``Image.info[CELLS_KEY]``, which generator 2 records while drawing (no extra random draws, so
every item is unchanged); generator-1 images have no cells (their glyphs straddle tokens) and add no loss.
Merged-token order is the processor's: row-major over the image's 32-pixel cells (``train_data.patchify``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from harness.datasets.synthetic.tasks import CELLS_KEY, MERGE_PX

IGNORE = -100


def cell_targets(images: list[Any], tokenizer) -> np.ndarray:
    """[sum of cells] int32: per merged visual token of each PIL image (in order), the token id of its cell's
    glyph or colour word (first token), ``IGNORE`` for a background cell or an image without cell records."""
    out: list[np.ndarray] = []
    for img in images:
        w, h = img.size
        t = np.full((h // MERGE_PX, w // MERGE_PX), IGNORE, dtype=np.int32)
        for (row, col), what in (img.info.get(CELLS_KEY) or {}).items():
            ids = tokenizer(what, add_special_tokens=False)["input_ids"]
            t[row, col] = ids[0]
        out.append(t.reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


_OPTION_VOCAB: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _option_vocab(tokenizer) -> tuple:
    """(``\\n``, ``.``, ``Ġ``, the letters A-D, every ``Ġ``-prefixed word token) of ``tokenizer``, computed once per
    tokenizer: :func:`option_targets` runs on every training example, and the merged-token set is a scan of the
    whole vocabulary."""
    try:
        return _OPTION_VOCAB[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object that cannot be weakly referenced is scanned every time
        pass
    vocab = tokenizer.get_vocab()
    letters = {vocab[c]: vocab[c] for c in "ABCD" if c in vocab}
    # a word whose first token carries the space (the text tasks' digits: ``Ġ7`` ``8``) starts right after the dot
    merged = frozenset(i for t, i in vocab.items() if t.startswith("Ġ") and len(t) > 1)
    found = (vocab.get("Ċ"), vocab.get("."), vocab.get("Ġ"), letters, merged)
    try:
        _OPTION_VOCAB[tokenizer] = found
    except TypeError:
        pass
    return found


def option_targets(ids: np.ndarray, tokenizer) -> np.ndarray:
    """[n, 2] int32 (position, letter token id) of each option line's word in a multiple-choice prompt: the word's
    first token follows ``\\n``, the letter, ``.`` and ``Ġ`` (``harness.datasets.ccbench.build_prompt``'s layout),
    or is itself a ``Ġ``-prefixed token right after the dot (the text choice's options, ``\\nA. 78``: ``Ġ7`` ``8``).

    The *option loss* (recipe v5) trains the language model's output at that position to be the option's letter:
    the text-side counterpart of the cell loss. The MCQ answer needs "find the option whose word matches what is
    seen, emit its letter"; with the letter already readable at the word, the second half becomes a copy
    (docs/embedded_model_v4.md). Prompt positions carry no answer loss, so nothing else is trained there."""
    nl, dot, space, letters, merged = _option_vocab(tokenizer)
    out = []
    for i in range(len(ids) - 3):
        if ids[i] == nl and ids[i + 1] in letters and ids[i + 2] == dot:
            if ids[i + 3] == space and i + 4 < len(ids):
                out.append((i + 4, ids[i + 1]))
            elif ids[i + 3] in merged:
                out.append((i + 3, ids[i + 1]))
    return np.asarray(out, dtype=np.int32).reshape(-1, 2)


def option_loss(logits, index, target):
    """(loss, accuracy) of the letter at the option words: ``logits`` [B, L, V], ``index`` flat positions into
    B·L, ``target`` the letters' token ids; zero loss when the batch has no option."""
    import torch

    if index.numel() == 0:
        return logits.sum() * 0.0, float("nan")
    picked = logits.reshape(-1, logits.shape[-1])[index.to(logits.device)].float()
    target = target.to(logits.device).long()
    loss = torch.nn.functional.cross_entropy(picked, target)
    return loss, float((picked.argmax(-1) == target).float().mean())


class CellProbe:
    """Captures the vision merger's output (the visual tokens the language model receives) during the forward
    pass and gives the cell loss: cross-entropy of ``lm_head(norm(token))`` against :func:`cell_targets`."""

    def __init__(self, model):
        self.model = model
        self.captured: dict[str, Any] = {}

        def hook(module, args, output):
            self.captured["tokens"] = output

        self.handles = [model.model.visual.merger.register_forward_hook(hook)]

    def loss(self, targets):
        """(loss, accuracy on the labelled cells); zero loss when the batch has no labelled cell."""
        import torch

        tokens = self.captured.pop("tokens")
        targets = targets.to(tokens.device).long()
        if tokens.shape[0] != targets.shape[0]:
            raise ValueError(f"{tokens.shape[0]} visual tokens but {targets.shape[0]} cell targets")
        keep = targets != IGNORE
        if not bool(keep.any()):
            return tokens.sum() * 0.0, float("nan")
        logits = self.model.lm_head(self.model.model.language_model.norm(tokens[keep]))
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[keep])
        acc = float((logits.argmax(-1) == targets[keep]).float().mean())
        return loss, acc

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

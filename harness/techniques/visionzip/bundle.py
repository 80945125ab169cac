"""The request-wide VisionZip budget as ONE span of a prompt (plain torch, engine-agnostic).

Why a span: an engine that fixes every multimodal item's length before its vision tower runs (vLLM) cannot
give each image a count that depends on the attention of all images of the request. It can fix the *total*:
the span from the first image's ``<|vision_start|>`` to the last image's ``<|vision_end|>`` (images, the
structural tokens and any text between images) pruned to ``K`` visual tokens has length ``K + T``, with
``T`` its non-visual tokens, whatever the split between images (vLLM does the same for EVS video frames).

:class:`SpanLayout` describes the *unpruned* span and answers, for a selection (kept token indices per
image, from :func:`harness.techniques.visionzip.pruning.select_tokens`):

* which span columns stay (:meth:`SpanLayout.kept_columns`: every non-visual token, the kept visual
  tokens) — the HF engine's "gather the kept columns" (``harness.engines.hf.visionzip``);
* their mRoPE positions, relative to the span start (:meth:`SpanLayout.positions`): Qwen3-VL's layout on
  the *unpruned* span, gathered at the kept columns (kept tokens at their original (t, h, w), text between
  images at its unpruned position); text after the span continues at ``base +`` :meth:`SpanLayout.extent`;
* the provisional token ids an engine puts in the prompt before the selection is known
  (:meth:`SpanLayout.provisional_ids`: the span's non-visual tokens with all ``K`` visual ids in the first
  image's run — the engine replaces every row of the span anyway).

:func:`request_total` is the budget ``select_tokens(scope="request")`` keeps, known from the image sizes
alone. :func:`encode_ints` / :func:`decode_ints` carry small non-negative integers (positions, row indices)
exactly through float channels of any dtype (two channels per integer, base 256: bf16 is exact below 256).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.techniques.visionzip.pruning import budget

__all__ = ["SpanLayout", "request_total", "encode_ints", "decode_ints", "INT_BASE"]

INT_BASE = 256


def request_total(sizes: Sequence[int], keep: float, min_per_image: int = 1) -> int:
    """Visual tokens ``select_tokens(scope="request")`` keeps for images of ``sizes`` tokens:
    ``max(budget(keep, Σ n_i), Σ min(min_per_image, n_i))`` (and ``Σ n_i`` for ``keep = 1``)."""
    total = sum(int(n) for n in sizes)
    floors = sum(min(int(min_per_image), int(n)) for n in sizes)
    return min(total, max(budget(keep, total), floors))


def encode_ints(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, c] non-negative int64 → [n, 2c] of ``dtype`` (hi, lo digits base 256 per column; < 65536)."""
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= INT_BASE * INT_BASE):
        raise ValueError(f"encode_ints carries 0 <= x < {INT_BASE * INT_BASE}, got [{int(x.min())}, {int(x.max())}]")
    hi, lo = x // INT_BASE, x % INT_BASE
    return torch.stack([hi, lo], dim=-1).reshape(x.shape[0], -1).to(dtype)


def decode_ints(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_ints`: [n, 2c] → [n, c] int64."""
    d = y.float().round().long().reshape(y.shape[0], -1, 2)
    return d[..., 0] * INT_BASE + d[..., 1]


@dataclass(frozen=True)
class SpanLayout:
    """The unpruned span: token ids from the first image's ``<|vision_start|>`` to the last ``<|vision_end|>``.

    ``grids``: (t, h, w) patch grid per image, in span order; ``merge``: spatial merge size (an image has
    ``t·h·w / merge²`` visual tokens, one ``image_token_id`` each, in one contiguous run).
    """

    ids: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...]
    merge: int
    image_token_id: int

    def __post_init__(self) -> None:
        runs = self.runs
        if len(runs) != len(self.grids):
            raise ValueError(f"span has {len(runs)} image-token runs for {len(self.grids)} images")
        for (start, n), size in zip(runs, self.sizes):
            if n != size:
                raise ValueError(f"image run at {start} has {n} tokens, its grid gives {size}")

    @classmethod
    def from_prompt(cls, prompt: Sequence[int], runs: Sequence[tuple[int, int]],
                    grids: Sequence[Sequence[int]], merge: int, image_token_id: int,
                    vision_start_id: int, vision_end_id: int) -> tuple[int, "SpanLayout"]:
        """``(offset, layout)`` of the span in ``prompt`` whose image runs (start, length) are ``runs``."""
        if not runs:
            raise ValueError("a span needs at least one image")
        start = int(runs[0][0]) - 1
        end = int(runs[-1][0]) + int(runs[-1][1])  # index of the last <|vision_end|>
        if start < 0 or prompt[start] != vision_start_id or end >= len(prompt) or prompt[end] != vision_end_id:
            raise ValueError("the image runs are not enclosed by <|vision_start|> ... <|vision_end|>")
        layout = cls(tuple(int(t) for t in prompt[start:end + 1]),
                     tuple((int(t), int(h), int(w)) for t, h, w in grids), int(merge), int(image_token_id))
        return start, layout

    # ------------------------------------------------------------------------------------ structure

    @property
    def sizes(self) -> list[int]:
        return [t * h * w // (self.merge * self.merge) for t, h, w in self.grids]

    @property
    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of each maximal run of image tokens in the span."""
        out: list[tuple[int, int]] = []
        i, n = 0, len(self.ids)
        while i < n:
            if self.ids[i] == self.image_token_id:
                j = i
                while j < n and self.ids[j] == self.image_token_id:
                    j += 1
                out.append((i, j - i))
                i = j
            else:
                i += 1
        return out

    @property
    def n_visual(self) -> int:
        return sum(self.sizes)

    @property
    def n_other(self) -> int:
        """Non-visual tokens of the span (structural tokens and text between images)."""
        return len(self.ids) - self.n_visual

    def length(self, n_kept: int) -> int:
        """Length of the span pruned to ``n_kept`` visual tokens."""
        return int(n_kept) + self.n_other

    # ------------------------------------------------------------------------------------ positions

    def positions(self) -> torch.Tensor:
        """[3, len(ids)] int64 mRoPE positions of the unpruned span, relative to its first token (0).

        Qwen3-VL's layout (transformers' ``get_rope_index``, vLLM's ``get_mrope_input_positions``): text
        advances all three rows by one; an image of grid (t, h, w) starts at ``cur`` and puts token (f, y, x)
        of its merged grid at ``cur + (f, y, x)``; the next token starts at ``cur + max(t, h', w')``.
        """
        parts: list[torch.Tensor] = []
        cur, st = 0, 0
        for (start, n), (t, h, w) in zip(self.runs, self.grids):
            hh, ww = h // self.merge, w // self.merge
            text = start - st
            parts.append(torch.arange(text).expand(3, text) + cur)
            cur += text
            idx = torch.arange(n)
            parts.append(torch.stack([idx // (hh * ww), (idx % (hh * ww)) // ww, idx % ww]) + cur)
            cur += max(t, hh, ww)
            st = start + n
        tail = len(self.ids) - st
        parts.append(torch.arange(tail).expand(3, tail) + cur)
        return torch.cat(parts, dim=1).long()

    def extent(self) -> int:
        """Max unpruned position + 1: where the text after the span starts (relative to the span)."""
        return int(self.positions().max()) + 1 if self.ids else 0

    # ------------------------------------------------------------------------------------ selection

    def kept_columns(self, kept: Sequence[torch.Tensor]) -> torch.Tensor:
        """Sorted span indices that stay: every non-visual token and, per image, its kept token indices."""
        if len(kept) != len(self.grids):
            raise ValueError(f"{len(kept)} selections for {len(self.grids)} images")
        flags = torch.tensor([t != self.image_token_id for t in self.ids], dtype=torch.bool)
        for (start, n), idx in zip(self.runs, kept):
            idx = idx.reshape(-1).long().cpu()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise ValueError(f"kept indices out of range for an image of {n} tokens")
            flags[start + idx] = True
        return flags.nonzero().reshape(-1)

    def provisional_ids(self, n_kept: int) -> list[int]:
        """The span's token ids before the split is known: non-visual tokens in place, all ``n_kept``
        visual ids in the first image's run (later runs empty). Same length as the pruned span."""
        out: list[int] = []
        runs = self.runs
        pos = 0
        for k, (start, n) in enumerate(runs):
            out.extend(self.ids[pos:start])
            if k == 0:
                out.extend([self.image_token_id] * int(n_kept))
            pos = start + n
        out.extend(self.ids[pos:])
        return out

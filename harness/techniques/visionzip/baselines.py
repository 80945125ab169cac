"""Trivial baselines of VisionZip (issue 31): the same kept-token count per request, chosen without attention.

A pruning method means something only against what a dumb method keeps with the same budget. Each baseline
below keeps exactly the count VisionZip's :func:`~harness.techniques.visionzip.pruning.select_tokens` would
keep (``budget(keep, Σ n_i)`` per request, or per image for ``scope="image"``, with the same
``min_per_image`` floor), and every kept token keeps its original position (mRoPE (t, h, w)), as VisionZip's:

* ``random``: a uniformly random subset. Scores are i.i.d. uniform draws of a ``torch.Generator`` seeded
  with ``seed`` once per request (the request's images in order), then the same top-k as VisionZip: the
  selection depends on the seed and the images' sizes only, not on the batch the request ran in nor on
  the pixels.
* ``first``: the first tokens in the request's visual-token order (image 0's tokens first, row-major units):
  score = −(index in the request) (``scope="image"``: the first tokens of each image).
* ``pool``: spatial downsampling of each image's merged grid (t·h' rows × w' columns of LLM tokens) to
  its share of the budget by average pooling: the grid is cut into ``k_i`` rectangular cells (``r`` bands
  of rows, each band cut into columns so that the cells number exactly ``k_i``); a cell's token is the
  mean of its tokens, placed at the position of the cell's centre token. The per-image counts ``k_i`` of
  ``scope="request"`` are proportional to the images' sizes (largest remainder, earlier image on ties),
  after the same ``min_per_image`` floor.

``attention`` (the default ``visionzip.method``) is VisionZip itself (:mod:`.pruning`). Only torch is
imported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from harness.techniques.visionzip.pruning import SCOPES, budget, select_tokens

METHODS = ("attention", "random", "pool", "first")
BASELINES = METHODS[1:]

__all__ = ["BASELINES", "METHODS", "baseline_scores", "pool_counts", "pool_cells", "pool_image", "check_method"]


def check_method(method: str, contextual: float = 0.0) -> str:
    """``method`` if it names a method (contextual tokens are VisionZip's own: only ``attention`` merges)."""
    if method not in METHODS:
        raise ValueError(f"visionzip.method={method!r}: expected one of {', '.join(METHODS)}")
    if method != "attention" and contextual > 0:
        raise ValueError(f"visionzip.method={method} keeps tokens without merging: visionzip.contextual must be 0")
    return method


def baseline_scores(method: str, sizes: Sequence[int], seed: int = 0) -> list[torch.Tensor]:
    """Per-token scores (float64, one tensor per image of one request) whose top-k is the baseline's choice.

    ``random``: i.i.d. uniform from a generator seeded with ``seed`` (one per request); ``first``:
    −(index in the request); ``pool``: a proportional priority ((n_i − r) / n_i for rank r in image i), whose
    request-wide top-k gives each image its proportional share (:func:`pool_counts` uses it)."""
    if method == "random":
        gen = torch.Generator().manual_seed(int(seed))
        return [torch.rand(int(n), generator=gen, dtype=torch.float64) for n in sizes]
    if method == "first":
        out, offset = [], 0
        for n in sizes:
            out.append(-torch.arange(offset, offset + int(n), dtype=torch.float64))
            offset += int(n)
        return out
    if method == "pool":
        return [(n - torch.arange(int(n), dtype=torch.float64)) / max(int(n), 1) for n in sizes]
    raise ValueError(f"no baseline scores for method {method!r}")


def pool_counts(sizes: Sequence[int], keep: float, scope: str = "request", min_per_image: int = 1) -> list[int]:
    """Tokens each image keeps under ``pool``: the counts :func:`select_tokens` gives for the same budget,
    split in proportion to the images' sizes."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    sel = select_tokens(baseline_scores("pool", sizes), keep, scope, min_per_image)
    return [int(s.numel()) for s in sel]


def pool_cells(rows: int, cols: int, k: int) -> list[tuple[int, int, int, int]]:
    """``k`` rectangular cells ``(r0, r1, c0, c1)`` tiling a ``rows × cols`` grid, row-major: ``r`` bands of
    rows (``r = clamp(round(sqrt(k·rows/cols)), ceil(k/cols), min(k, rows))``), band ``b`` cut into ``k_b``
    columns (``k`` spread as evenly as possible over the bands, earlier bands first)."""
    n = rows * cols
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= {n}, got {k}")
    r = min(max(round(math.sqrt(k * rows / cols)), math.ceil(k / cols), 1), k, rows)
    band_rows = [rows // r + (1 if b < rows % r else 0) for b in range(r)]
    per_band = [k // r + (1 if b < k % r else 0) for b in range(r)]
    cells, r0 = [], 0
    for h, kb in zip(band_rows, per_band, strict=True):
        c0 = 0
        for c in range(kb):
            w = cols // kb + (1 if c < cols % kb else 0)
            cells.append((r0, r0 + h, c0, c0 + w))
            c0 += w
        r0 += h
    return cells


def pool_image(tokens: torch.Tensor, rows: int, cols: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [k], embeddings [k, ...])``: ``tokens`` [rows·cols, ...] (row-major grid) average-pooled into
    :func:`pool_cells`'s ``k`` cells, each at its centre token's index (increasing). ``k = n`` returns the
    tokens unchanged, ``k = 0`` nothing."""
    n = tokens.shape[0]
    if rows * cols != n:
        raise ValueError(f"grid {rows}x{cols} does not hold {n} tokens")
    if k >= n:
        return torch.arange(n, device=tokens.device), tokens
    if k <= 0:  # min_per_image=0 and a small budget: the image keeps nothing
        return torch.zeros(0, dtype=torch.long, device=tokens.device), tokens[:0]
    acc = torch.float64 if tokens.dtype == torch.float64 else torch.float32
    grid = tokens.to(acc).reshape(rows, cols, *tokens.shape[1:])
    idx, out = [], []
    for r0, r1, c0, c1 in pool_cells(rows, cols, k):
        idx.append(((r0 + r1 - 1) // 2) * cols + (c0 + c1 - 1) // 2)
        out.append(grid[r0:r1, c0:c1].reshape(-1, *tokens.shape[1:]).mean(dim=0))
    return torch.tensor(idx, dtype=torch.long, device=tokens.device), torch.stack(out).to(tokens.dtype)

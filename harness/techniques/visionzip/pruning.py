"""VisionZip for Qwen3-VL: score, select and merge visual tokens (plain torch, engine-agnostic).

Pipeline, for one request holding several images (each a ``grid_thw`` entry of the vision tower):

    q, k of one full-attention vision layer ──attention_received──▶ score per patch
        ──merge_unit_scores──▶ score per LLM visual token (one per merge_size² unit), per image
        ──select_tokens──▶ kept token indices per image (one budget per request, or per image)
        ──compress_image──▶ dominant tokens + contextual tokens (VisionZip's merge of the rest)

Conventions (each tested in ``tests/techniques/test_visionzip.py``):

* **Score = column sum over queries, averaged over heads.** For an image of ``n`` patches,
  ``c_j = 1/H · Σ_h Σ_i softmax_i(scale · q_i·k_j)``. Every softmax row sums to 1, so the scores of an
  image sum to ``n`` and **average exactly 1 whatever n**: a patch that receives an average share of
  attention scores 1 in a 100-patch image and in a 10,000-patch image, which makes images of different
  sizes compete fairly in one request-wide top-k. (The mean over queries would average ``1/n`` and favour
  small images.) Uniform attention gives every patch exactly 1.
* **Patch order.** Qwen3-VL's image processor emits, per temporal frame, the patches of each
  ``merge_size × merge_size`` unit contiguously: order (frame, unit row, unit column, row in unit,
  column in unit). The vision tower keeps that order (its rotary position ids are laid out the same way,
  ``transformers.vision_utils.get_vision_position_ids``) and its patch merger views ``merge_size²``
  consecutive rows as one LLM token. So a unit's score is the mean of ``merge_size²`` consecutive patch
  scores, and LLM visual token ``u`` of an image is unit ``u`` in row-major unit order, frame by frame.
* **Rounding.** A fraction of ``n`` tokens is ``budget(keep, n) = floor(keep·n + 1/2)`` (round half up,
  not Python's round-half-even).
* **Budget and minimum.** ``scope="request"``: each image first reserves its ``min(min_per_image, n_i)``
  best tokens; the rest of the budget ``K = budget(keep, Σ n_i)`` goes to the best remaining tokens of
  the whole request. The total is therefore ``max(K, Σ min(min_per_image, n_i))``: the minimum wins
  over the budget when both cannot hold. ``scope="image"``: image ``i`` keeps
  ``clamp(budget(keep, n_i), min(min_per_image, n_i), n_i)``. Ties in score go to the earlier image,
  then to the lower token index. ``keep=1`` keeps everything.
* **Contextual split.** ``contextual`` is a fraction *of each image's kept count* ``k_i``:
  ``n_ctx = budget(contextual, k_i)`` contextual tokens (0 when the image keeps all its tokens, and at
  most ``k_i − 1`` so that one dominant token remains), ``k_i − n_ctx`` dominant ones. The per-image
  count decided by the selection is unchanged. The official Qwen2.5-VL setting "keep 70% = 65% dominant
  + 5% contextual" is ``keep=0.7, contextual=0.05/0.7``.
* **Contextual merge** follows the official code (dvlab-research/VisionZip, ``clip_encoder.py``): the
  non-dominant tokens, in their original order, get targets at positions ``0, s, 2s, …`` with
  ``s = max(1, n_rest // n_ctx)`` (the first ``n_ctx``); every other non-dominant token goes to the
  target whose key is most cosine-similar (keys averaged over heads, first target on ties); a merged
  token is ``target + mean(assigned tokens)`` (the target itself is not part of the mean; a target with
  nothing assigned stays as it is). :func:`compress_image` places each merged token at its target's
  position, so the kept sequence is ``sorted(dominant ∪ targets)`` and original mRoPE coordinates apply.

Only torch (and the kernel's torch reference module) is imported: the GPU benchmark imports this module as
the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# the score's reference lives beside its kernel (harness.kernels.importance); re-exported here
from harness.kernels.importance_reference import _check_packed, attention_received  # noqa: F401

SCOPES = ("request", "image")


def budget(fraction: float, n: int) -> int:
    """``fraction`` of ``n`` tokens, rounded half up: ``floor(fraction·n + 1/2)``."""
    return int(math.floor(fraction * n + 0.5))


# --------------------------------------------------------------------------------------- scoring


def _grid(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(r) for r in grid_thw]
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def merge_units(
    x: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int = 2
) -> list[torch.Tensor]:
    """Mean of ``x`` [N_patches, ...] over each merge unit, split per ``grid_thw`` entry.

    Patches must be in the vision tower's order (see module docstring): a unit is ``merge_size²``
    consecutive rows. Returns one [t·h·w / merge_size², ...] tensor per entry, computed in float32
    (float64 for float64 input). Works for scores [N] and for keys [N, d] alike.
    """
    grid = _grid(grid_thw)
    unit = merge_size * merge_size
    for t, h, w in grid:
        if h % merge_size or w % merge_size:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) is not divisible by merge_size={merge_size}")
    sizes = [t * h * w for t, h, w in grid]
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"grid_thw covers {sum(sizes)} patches, got {x.shape[0]}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return [c.to(dtype).reshape(-1, unit, *x.shape[1:]).mean(dim=1) for c in x.split(sizes)]


def merge_unit_scores(
    scores: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int = 2
) -> list[torch.Tensor]:
    """Patch scores [N_patches] → one score per LLM visual token, per image (mean over its unit).

    The mean keeps the "average 1 per token" normalisation of :func:`attention_received`.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    return merge_units(scores, grid_thw, merge_size)


# ------------------------------------------------------------------------------------- selection


def _order(scores: torch.Tensor) -> torch.Tensor:
    """Indices by decreasing score; ties by increasing index (deterministic)."""
    return torch.argsort(-scores, stable=True)


def _top_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    return _order(scores)[:k].sort().values


def select_tokens(
    scores: Sequence[torch.Tensor], keep: float, scope: str = "request", min_per_image: int = 1
) -> list[torch.Tensor]:
    """Indices of the kept tokens of each image (sorted, int64), from per-token scores.

    ``scope="request"``: one top-k over all tokens of all images (total ``budget(keep, Σ n_i)``), after
    each image reserved its ``min(min_per_image, n_i)`` best tokens. ``scope="image"``: each image keeps
    ``clamp(budget(keep, n_i), min(min_per_image, n_i), n_i)`` of its best tokens. See the module
    docstring for the exact rule; ties go to the earlier image, then the lower index.
    """
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be in [0, 1], got {keep}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if min_per_image < 0:
        raise ValueError(f"min_per_image must be >= 0, got {min_per_image}")
    scores = [s.reshape(-1) for s in scores]
    if not scores:
        return []
    if any(bool(torch.isnan(s).any()) for s in scores):
        raise ValueError("scores contain NaN")
    sizes = [s.numel() for s in scores]
    floors = [min(min_per_image, n) for n in sizes]

    if scope == "image":
        return [_top_sorted(s, min(n, max(f, budget(keep, n)))) for s, n, f in zip(scores, sizes, floors)]

    flat = torch.cat([s.to(torch.float64) for s in scores])
    selected = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    offset = 0
    for s, n, f in zip(scores, sizes, floors):
        selected[offset + _top_sorted(s, f)] = True
        offset += n
    extra = budget(keep, flat.numel()) - sum(floors)
    if extra > 0:
        order = _order(flat)
        selected[order[~selected[order]][:extra]] = True
    return [part.nonzero().reshape(-1) for part in selected.split(sizes)]


# ------------------------------------------------------------------------------ contextual tokens


def split_budget(n_keep: int, contextual: float, n_total: int) -> tuple[int, int]:
    """Split an image's kept count into ``(n_dominant, n_contextual)``.

    ``n_contextual = budget(contextual, n_keep)``, 0 when ``n_keep >= n_total`` (nothing to merge), at most
    ``n_keep - 1`` (one dominant token stays).
    """
    if not 0.0 <= contextual <= 1.0:
        raise ValueError(f"contextual must be in [0, 1], got {contextual}")
    if not 0 <= n_keep <= n_total:
        raise ValueError(f"need 0 <= n_keep <= n_total, got {n_keep}, {n_total}")
    n_ctx = 0 if n_keep >= n_total else min(budget(contextual, n_keep), max(n_keep - 1, 0))
    return n_keep - n_ctx, n_ctx


def split_dominant(scores: torch.Tensor, kept: torch.Tensor, contextual: float) -> tuple[torch.Tensor, int]:
    """Dominant indices (sorted) and the contextual count for one image's selection ``kept``.

    The dominant tokens are the best ``n_dominant`` of ``kept`` (same tie rule as :func:`select_tokens`).
    """
    n_dom, n_ctx = split_budget(kept.numel(), contextual, scores.numel())
    best = _order(scores[kept])[:n_dom]
    return kept[best].sort().values, n_ctx


def contextual_merge(
    tokens: torch.Tensor, keys: torch.Tensor, dominant_idx: torch.Tensor, n_contextual: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """VisionZip contextual tokens of one image: ``(merged [n_contextual, D], target_idx [n_contextual])``.

    ``tokens`` [n, D] (e.g. the LLM visual tokens), ``keys`` [n, d] or [n, heads, head_dim] (averaged over
    heads, as the official "metric"; per LLM token use :func:`merge_units` on patch keys), ``dominant_idx``
    the indices not to merge. Targets are uniformly strided among the non-dominant tokens; each other
    non-dominant token joins its most cosine-similar target; ``merged = target + mean(assigned)``, in the
    tokens' dtype (accumulated in float32). ``target_idx`` are original indices, increasing. The assignment
    depends only on ``keys`` and ``dominant_idx``, so calling again with other features (deepstack levels)
    merges them the same way.
    """
    n = tokens.shape[0]
    if keys.shape[0] != n:
        raise ValueError(f"tokens and keys disagree on the token count: {n} vs {keys.shape[0]}")
    metric = keys.float().mean(dim=1) if keys.dim() == 3 else keys.float()
    is_rest = torch.ones(n, dtype=torch.bool, device=tokens.device)
    is_rest[dominant_idx] = False
    rest = is_rest.nonzero().reshape(-1)
    if not 0 <= n_contextual <= rest.numel():
        raise ValueError(f"n_contextual={n_contextual} not in [0, {rest.numel()}] (non-dominant tokens)")
    if n_contextual == 0:
        return tokens.new_empty((0, *tokens.shape[1:])), rest[:0]

    step = max(1, rest.numel() // n_contextual)
    is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=tokens.device)
    is_target[torch.arange(0, rest.numel(), step, device=tokens.device)[:n_contextual]] = True
    target_idx, other_idx = rest[is_target], rest[~is_target]

    unit = F.normalize(metric, dim=-1)
    assign = (unit[other_idx] @ unit[target_idx].T).argmax(dim=1)  # first maximum on ties
    acc_dtype = torch.float64 if tokens.dtype == torch.float64 else torch.float32
    sums = torch.zeros((n_contextual, *tokens.shape[1:]), dtype=acc_dtype, device=tokens.device)
    sums.index_add_(0, assign, tokens[other_idx].to(acc_dtype))
    counts = torch.bincount(assign, minlength=n_contextual).clamp(min=1).to(acc_dtype)
    counts = counts.reshape(-1, *([1] * (tokens.dim() - 1)))
    merged = tokens[target_idx].to(acc_dtype) + sums / counts
    return merged.to(tokens.dtype), target_idx


def compress_image(
    tokens: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor, kept: torch.Tensor, contextual: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's VisionZip output: ``(indices [k], embeddings [k, D])`` with ``k = kept.numel()``.

    ``indices`` = sorted(dominant ∪ contextual targets): the original token positions the output rows take
    (gather mRoPE positions / deepstack rows with them). Dominant rows are the original tokens; a target's
    row is its merged token. ``contextual=0`` gives ``(kept, tokens[kept])``.
    """
    dominant, n_ctx = split_dominant(scores, kept, contextual)
    merged, targets = contextual_merge(tokens, keys, dominant, n_ctx)
    indices, order = torch.cat([dominant, targets]).sort()
    rows = torch.cat([tokens[dominant], merged])[order]
    return indices, rows

"""VisionZip in the Hugging Face engine, for Qwen3-VL, Qwen3-VL-MoE and the multimodal Qwen3.5(-MoE)
(``model.generate`` compatible).

Two steps around an ordinary ``model.generate`` call::

    inputs = processor(text=..., images=..., padding=True, return_tensors="pt")   # left padded
    new_inputs, ctx = prepare_visionzip_inputs(model, inputs, cfg, pad_token_id=pad)
    with visionzip_generation(model, ctx):
        out = model.generate(**new_inputs, max_new_tokens=..., do_sample=False)
    # out[:, new_inputs["input_ids"].shape[1]:] are the generated tokens; ctx.requests[row] the statistics

This module is the hook-in: it turns scores into a selection (the algorithm is
:mod:`harness.techniques.visionzip`), rebuilds the inputs and positions, and makes ``generate`` use them. Beside
it, :mod:`harness.engines.hf.visionzip_scoring` runs the vision tower and scores its patches (the one part
that reaches into the tower's internals) and :mod:`harness.techniques.visionzip.stats` holds the per-request
statistics (:class:`~harness.techniques.visionzip.stats.RequestStats`) and their per-source aggregation,
which the run reads without torch.

:func:`prepare_visionzip_inputs` runs the vision tower **once**
(:func:`~harness.engines.hf.visionzip_scoring.encode_and_score`: ``get_image_features``, the model's own
method, with two hooks on the scoring block's attention, so q and k are exactly what that block's attention
consumes, after the rotary embedding, at no extra matmul). Then, per request (one row of the batch):

1. importance per patch = :func:`harness.kernels.importance.compute_importance` (Triton on CUDA, the
   reference on CPU; column sums over queries, mean over heads, each image averages 1), then
   :func:`~harness.techniques.visionzip.pruning.merge_unit_scores` → one score per LLM visual token;
2. :func:`~harness.techniques.visionzip.pruning.select_tokens` with one budget per request (``scope="request"``) or
   per image (``scope="image"``), and :func:`~harness.techniques.visionzip.pruning.compress_image` when
   ``contextual > 0`` (contextual metric: the scoring block's keys *before* the rotary embedding, averaged
   over each merge unit, so that the cosine similarity compares content rather than position);
3. pruning after the patch merger: the merged image tokens and every deepstack level are cut with the
   same indices (contextual tokens are merged the same way at every level: the assignment depends only on
   keys and scores);
4. positions: mRoPE positions are computed on the **unpruned** layout (``get_rope_index``), and the columns
   of the kept tokens are gathered. Kept visual tokens keep their original (t, h, w); **text after an
   image keeps its unpruned position too** (placed as if nothing had been pruned: the positions have a
   gap where pruned tokens were). This is what the model saw in training for the kept tokens and it leaves
   the distance between the question and the image unchanged. ``input_ids``, ``attention_mask``,
   ``mm_token_type_ids`` (any [B, L] tensor of the inputs) and the positions are shortened together and
   **left padding is re-applied** (rows lose different numbers of tokens);
5. ``rope_deltas`` = max unpruned position + 1 − pruned length, per row: decode positions continue at
   max + 1 of the unpruned layout.

How ``generate`` stays consistent (transformers 5.17 on the GPU machine, 5.24 here; both checked):

* ``new_inputs["position_ids"]`` is the 4-row [text; t; h; w] tensor that stock generation builds in
  ``_prepare_position_ids_for_generation`` (row 0 = ``attention_mask.cumsum − 1``, pads 0). When
  ``position_ids`` is passed, ``generate`` does not recompute it, slices it per step and extends it by
  ``last + 1`` per generated token (same code in 5.17 and 5.24), so no rope function is needed for generate.
* :func:`visionzip_generation` patches, on the model instance only and only inside the ``with``:
  ``model.model.get_image_features`` → returns the precomputed pruned features (the vision tower does not
  run again). 5.24 calls it from ``generate`` before prefill (``_prepare_multimodal_encoder_kwargs_for_
  generation``, which reads the signature: ours names ``pixel_values`` and ``image_grid_thw``); 5.17 calls it
  from ``Qwen3VLModel.forward``. Its layout follows what the installed version returned when
  :func:`prepare_visionzip_inputs` ran it: ``pooler_output`` a tuple of per-image tensors (both versions);
  ``deepstack_features`` one concatenated tensor per level (5.17) or one tuple of per-image tensors per
  level (5.24) — detected structurally, no version check.
  ``model.model.get_rope_index`` → returns the pruned positions and deltas when called with exactly the
  pruned ``input_ids`` (a forward without ``position_ids``, e.g. ``model(**inputs)``), else the original.
  ``model.model.rope_deltas`` is set to the pruned deltas (used by ``compute_3d_position_ids`` for decode
  steps without ``position_ids``). All three are restored on exit.

``visionzip.method`` (issue 31): ``attention`` is VisionZip as above; ``random`` / ``first`` replace step 1's scores
with :func:`~harness.techniques.visionzip.baselines.baseline_scores` (the tower runs as stock, no hook, no
importance) and keep the same selection, positions and deepstack pruning; ``pool`` average-pools each image's
grid into its share of the budget (:func:`~harness.techniques.visionzip.baselines.pool_image`, every deepstack
level with the same cells), each pooled token at its cell's centre position.

``keep = 1.0`` is off: :func:`prepare_visionzip_inputs` returns the inputs untouched and ``None``, and
:func:`visionzip_generation` installs nothing. ``force=True`` runs the whole machinery anyway (keeping every
token), which must reproduce stock generation token for token (tested).

Qwen3.5's tower has no deepstack levels (``deepstack_features`` absent from its output): the merged tokens alone
are pruned and its output is rebuilt without them; the rest (rotary pre-hook, ``get_rope_index``, ``rope_deltas``)
is Qwen3-VL's (transformers 5.24; forced keep 1.0 reproduces stock generation there too).

Not supported (clear error): videos, models without a Qwen3-VL-style vision tower (Qwen2.5-VL's windowed
tower reorders patches; not ported).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from harness.engines.hf.visionzip_scoring import _base, encode_and_score
from harness.techniques.visionzip.stats import RequestStats
from harness.techniques.visionzip.baselines import baseline_scores, check_method, pool_counts, pool_image
from harness.techniques.visionzip.pruning import compress_image, merge_unit_scores, merge_units, select_tokens, SCOPES

__all__ = [
    "VisionZipContext",
    "visionzip_enabled",
    "supports_visionzip",
    "prepare_visionzip_inputs",
    "visionzip_generation",
]


# ------------------------------------------------------------------------------------------ types


@dataclass
class VisionZipContext:
    """Everything :func:`visionzip_generation` needs, plus what the caller may record."""

    image_outputs: Any  # pruned vision output, in the installed transformers' layout
    pixel_values_shape: tuple[int, ...]
    image_grid_thw: torch.Tensor
    input_ids: torch.Tensor  # pruned, left padded [B, L']
    attention_mask: torch.Tensor  # [B, L']
    position_ids: torch.Tensor  # [4, B, L'] text row + (t, h, w) rows
    rope_deltas: torch.Tensor  # [B, 1]
    kept_indices: list[torch.Tensor]  # per image (batch order): kept LLM-token indices within the image
    kept_columns: list[torch.Tensor]  # per row: columns of the unpruned (padded) input kept, in order
    unpruned_position_ids: torch.Tensor  # [3, B, L] from get_rope_index on the unpruned input
    requests: list[RequestStats]
    image_scores: list[torch.Tensor]  # per image: score per LLM visual token (float32)
    deepstack_split: bool  # True: deepstack levels are per-image tuples (transformers ≥ 5.2x layout)
    vision_calls: int = 0  # how often the patched get_image_features answered (1 per generate)
    importance_ms: float = 0.0  # time of the importance computation (kernel or reference) for the batch
    lse_reused: bool = False  # the scoring attention's own LSE fed the importance (no kernel LSE pass)

    @property
    def prompt_lengths(self) -> list[int]:
        return [int(x) for x in self.attention_mask.sum(dim=1).tolist()]


# ----------------------------------------------------------------------------------------- checks


def visionzip_enabled(cfg: Any) -> bool:
    """VisionZip is on when ``keep < 1`` (``keep = 1.0`` is the no-op default)."""
    return cfg is not None and float(cfg.keep) < 1.0


def supports_visionzip(model) -> bool:
    """A Qwen-VL vision tower with ``blocks[i].attn.qkv`` and a patch merger: Qwen3-VL / Qwen3-VL-MoE (with
    deepstack mergers, pruned with the same indices) and Qwen3.5(-MoE) (none)."""
    try:
        base = _base(model)
    except NotImplementedError:
        return False
    visual = base.visual
    return (
        hasattr(visual, "blocks")
        and hasattr(visual, "spatial_merge_size")
        and all(hasattr(b, "attn") and hasattr(b.attn, "qkv") for b in visual.blocks)
    )


def _check_cfg(cfg: Any) -> tuple[float, float, str, int, int]:
    keep, contextual = float(cfg.keep), float(cfg.contextual)
    scope, layer, min_per_image = str(cfg.scope), int(cfg.layer), int(cfg.min_per_image)
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"visionzip.keep must be in [0, 1], got {keep}")
    if not 0.0 <= contextual <= 1.0:
        raise ValueError(f"visionzip.contextual must be in [0, 1], got {contextual}")
    if scope not in SCOPES:
        raise ValueError(f"visionzip.scope must be one of {SCOPES}, got {scope!r}")
    if min_per_image < 0:
        raise ValueError(f"visionzip.min_per_image must be >= 0, got {min_per_image}")
    check_method(_method(cfg), contextual)
    return keep, contextual, scope, layer, min_per_image


def _method(cfg: Any) -> str:
    """``visionzip.method`` (``attention`` = VisionZip; ``random`` / ``pool`` / ``first``: the trivial
    baselines of :mod:`harness.techniques.visionzip.baselines`, issue 31)."""
    return str(getattr(cfg, "method", "attention") or "attention")


# --------------------------------------------------------------------------------------- pruning


def _images_per_row(image_mask: torch.Tensor, sizes: list[int]) -> list[list[int]]:
    """Global image indices of each batch row, from the number of image tokens in each row."""
    per_row = image_mask.sum(dim=1).tolist()
    rows: list[list[int]] = []
    j = 0
    for count in per_row:
        mine: list[int] = []
        left = int(count)
        while left > 0:
            if j >= len(sizes) or sizes[j] > left:
                raise ValueError("VisionZip: image tokens in input_ids do not match image_grid_thw")
            mine.append(j)
            left -= sizes[j]
            j += 1
        rows.append(mine)
    if j != len(sizes):
        raise ValueError(f"VisionZip: {len(sizes)} images in image_grid_thw, {j} found in input_ids")
    return rows


def _deepstack_levels(ds: Any, sizes: list[int]) -> tuple[list[list[torch.Tensor]], bool]:
    """Per level, per image deepstack features, and whether the installed layout splits per image."""
    if not ds:
        return [], False
    split = not isinstance(ds[0], torch.Tensor)
    levels = [list(level) if split else list(torch.split(level, sizes)) for level in ds]
    return levels, split


def _mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    out = torch.zeros_like(input_ids, dtype=torch.long)
    out[input_ids == config.image_token_id] = 1
    video = getattr(config, "video_token_id", None)
    if video is not None:
        out[input_ids == video] = 2
    return out


@torch.no_grad()
def prepare_visionzip_inputs(model, inputs: Any, cfg: Any, *, pad_token_id: int | None = None,
                             force: bool = False) -> tuple[dict[str, Any], VisionZipContext | None]:
    """Select visual tokens and build the pruned, left-padded inputs for ``model.generate``.

    ``inputs``: the processor's output (a ``BatchFeature`` or dict) for a left-padded batch, one request per
    row. ``cfg``: a ``VisionZipConfig`` (keep, contextual, scope, layer, min_per_image). Returns
    ``(new_inputs, ctx)``; generate under ``visionzip_generation(model, ctx)``. With ``keep = 1`` and not
    ``force``, or without images, returns ``(dict(inputs), None)`` having done nothing.
    """
    keep, contextual, scope, layer, min_per_image = _check_cfg(cfg)
    inputs = dict(inputs)
    if (keep >= 1.0 and not force) or inputs.get("pixel_values") is None:
        return inputs, None
    if inputs.get("pixel_values_videos") is not None:
        raise NotImplementedError("VisionZip: video inputs are not supported")
    if not supports_visionzip(model):
        raise NotImplementedError(f"VisionZip: {type(model).__name__} is not a Qwen3-VL(-MoE) model")

    base = _base(model)
    config = base.config
    merge = int(base.visual.spatial_merge_size)
    input_ids: torch.Tensor = inputs["input_ids"]
    batch, length = input_ids.shape
    attention_mask = inputs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    real = attention_mask.bool()
    grid: torch.Tensor = inputs["image_grid_thw"]
    pixel_values: torch.Tensor = inputs["pixel_values"]
    mm_types = inputs.get("mm_token_type_ids")
    if mm_types is None:
        mm_types = _mm_token_type_ids(input_ids, config)
    if pad_token_id is None:
        pad_token_id = int(input_ids[~real][0]) if (~real).any() else int(getattr(config, "pad_token_id", 0) or 0)

    # 1. vision tower once, scores per LLM visual token
    timings: dict[str, float] = {}
    method, seed = _method(cfg), int(getattr(cfg, "seed", 0) or 0)
    sizes = (grid.prod(-1) // (merge * merge)).tolist()
    if method == "attention":
        vision_output, patch_scores, _, patch_keys = encode_and_score(
            model, pixel_values, grid, layer=layer, want_keys=contextual > 0, timings=timings
        )
        unit_scores = merge_unit_scores(patch_scores, grid, merge)
        unit_keys = merge_units(patch_keys, grid, merge) if patch_keys is not None else None
    else:  # a trivial baseline (issue 31): the tower runs as stock, nothing is scored by attention
        vision_output = base.get_image_features(pixel_values, grid, return_dict=True)
        unit_scores, unit_keys = [torch.empty(0)] * len(sizes), None
    grid_rows = [(int(t) * int(h) // merge, int(w) // merge) for t, h, w in grid.tolist()]
    pooled = list(vision_output.pooler_output)
    levels, ds_split = _deepstack_levels(getattr(vision_output, "deepstack_features", None), sizes)

    # 2. selection per request, pruning of merged tokens and every deepstack level with the same indices
    image_mask = (input_ids == config.image_token_id) & real
    rows_images = _images_per_row(image_mask, sizes)
    kept_idx: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(sizes)
    new_pooled: list[torch.Tensor] = [pooled[j] for j in range(len(sizes))]
    new_levels = [list(level) for level in levels]
    requests: list[RequestStats] = []
    for images in rows_images:
        if method == "pool":  # average pooling of each image's grid to its share of the budget
            counts = pool_counts([sizes[j] for j in images], keep, scope, min_per_image) if images else []
            for j, k in zip(images, counts):
                rows_j, cols_j = grid_rows[j]
                kept_idx[j], new_pooled[j] = pool_image(pooled[j], rows_j, cols_j, k)
                for lvl in range(len(levels)):
                    new_levels[lvl][j] = pool_image(levels[lvl][j], rows_j, cols_j, k)[1]
            selection, images_sel = [], []
        elif method != "attention":
            picked = baseline_scores(method, [sizes[j] for j in images], seed)
            for j, sc in zip(images, picked):
                unit_scores[j] = sc.float()
            selection, images_sel = select_tokens(picked, keep, scope, min_per_image) if images else [], images
        else:
            selection = select_tokens([unit_scores[j] for j in images], keep, scope, min_per_image) if images else []
            images_sel = images
        for j, kept in zip(images_sel, selection):
            kept = kept.to(pooled[j].device)
            if contextual > 0:
                keys_j, scores_j = unit_keys[j], unit_scores[j].to(pooled[j].device)
                idx, rows = compress_image(pooled[j], keys_j, scores_j, kept, contextual)
                for lvl in range(len(levels)):
                    idx_l, rows_l = compress_image(levels[lvl][j], keys_j, scores_j, kept, contextual)
                    if not torch.equal(idx_l, idx):  # cannot happen: the assignment ignores the features
                        raise RuntimeError("VisionZip: deepstack level merged at other positions than the tokens")
                    new_levels[lvl][j] = rows_l
            else:
                idx, rows = kept, pooled[j][kept]
                for lvl in range(len(levels)):
                    new_levels[lvl][j] = levels[lvl][j][kept]
            kept_idx[j] = idx
            new_pooled[j] = rows
        requests.append(RequestStats(
            visual_tokens_before=sum(sizes[j] for j in images),
            visual_tokens_after=sum(int(kept_idx[j].numel()) for j in images),
            tokens_per_image=[sizes[j] for j in images],
            kept_per_image=[int(kept_idx[j].numel()) for j in images],
        ))

    # 3. positions on the unpruned layout, then gather the kept columns and re-pad on the left
    unpruned_pos, _ = base.get_rope_index(
        input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid, attention_mask=attention_mask
    )
    dev = input_ids.device
    flags = torch.ones(batch, length, dtype=torch.bool, device=dev)
    if sizes:
        keep_flags = torch.cat([
            torch.zeros(n, dtype=torch.bool, device=dev).index_fill_(0, kept_idx[j].to(dev), True)
            for j, n in enumerate(sizes)
        ])
        flags[image_mask] = keep_flags  # image tokens in row-major order = images in batch order
    keep_cols = real & flags
    new_lengths = keep_cols.sum(dim=1).tolist()
    new_len = max(new_lengths) if new_lengths else 0
    kept_columns = [keep_cols[b].nonzero().reshape(-1) for b in range(batch)]

    new_ids = torch.full((batch, new_len), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    new_mask = torch.zeros((batch, new_len), dtype=attention_mask.dtype, device=attention_mask.device)
    new_pos = torch.zeros((4, batch, new_len), dtype=unpruned_pos.dtype, device=unpruned_pos.device)
    deltas = torch.zeros((batch, 1), dtype=torch.long, device=unpruned_pos.device)
    per_token = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == input_ids.shape
                 and k not in ("input_ids", "attention_mask")}
    per_token["mm_token_type_ids"] = mm_types
    new_per_token = {k: torch.zeros((batch, new_len), dtype=v.dtype, device=v.device) for k, v in per_token.items()}
    for b in range(batch):
        cols, n = kept_columns[b], int(new_lengths[b])
        if n == 0:
            continue
        start = new_len - n
        new_ids[b, start:] = input_ids[b, cols]
        new_mask[b, start:] = 1
        new_pos[0, b, start:] = torch.arange(n, device=new_pos.device)
        new_pos[1:, b, start:] = unpruned_pos[:, b, cols.to(unpruned_pos.device)]
        for k, v in per_token.items():
            new_per_token[k][b, start:] = v[b, cols.to(v.device)]
        max_pos = unpruned_pos[:, b, real[b].to(unpruned_pos.device)].max()
        deltas[b, 0] = max_pos + 1 - n

    # 4. the pruned vision output, in the layout this transformers version produced
    extra = {}
    if hasattr(vision_output, "deepstack_features"):  # Qwen3-VL; Qwen3.5's tower has no deepstack levels
        extra["deepstack_features"] = [tuple(level) if ds_split else torch.cat(level, dim=0)
                                       for level in new_levels] if levels else vision_output.deepstack_features
    image_outputs = type(vision_output)(
        last_hidden_state=vision_output.last_hidden_state,
        pooler_output=tuple(new_pooled),
        **extra,
    )

    new_inputs = dict(inputs)
    new_inputs.update(new_per_token)
    new_inputs["input_ids"] = new_ids
    new_inputs["attention_mask"] = new_mask
    new_inputs["position_ids"] = new_pos
    ctx = VisionZipContext(
        image_outputs=image_outputs,
        pixel_values_shape=tuple(pixel_values.shape),
        image_grid_thw=grid,
        input_ids=new_ids,
        attention_mask=new_mask,
        position_ids=new_pos,
        rope_deltas=deltas,
        kept_indices=kept_idx,
        kept_columns=kept_columns,
        unpruned_position_ids=unpruned_pos,
        requests=requests,
        image_scores=unit_scores,
        deepstack_split=ds_split,
        importance_ms=timings.get("importance_ms", 0.0),
        lse_reused=bool(timings.get("lse_reused", False)),
    )
    return new_inputs, ctx


# ------------------------------------------------------------------------------------ generation


@contextmanager
def visionzip_generation(model, ctx: VisionZipContext | None):
    """Make ``model`` use ``ctx``'s pruned image features and positions (no-op for ``ctx=None``).

    Patches ``model.model.get_image_features`` and ``model.model.get_rope_index`` on the instance and sets
    ``model.model.rope_deltas``; all restored on exit. Not re-entrant across threads (one model, one batch).
    """
    if ctx is None:
        yield None
        return
    base = _base(model)
    original_rope = base.get_rope_index
    saved = {name: base.__dict__[name] for name in ("get_image_features", "get_rope_index") if name in base.__dict__}
    saved_deltas = getattr(base, "rope_deltas", None)

    def get_image_features(pixel_values=None, image_grid_thw=None, **kwargs):
        if pixel_values is not None and tuple(pixel_values.shape) != ctx.pixel_values_shape:
            raise RuntimeError("VisionZip: get_image_features called with other images than the prepared ones")
        if image_grid_thw is not None and not torch.equal(image_grid_thw.cpu(), ctx.image_grid_thw.cpu()):
            raise RuntimeError("VisionZip: get_image_features called with another image_grid_thw")
        ctx.vision_calls += 1
        return ctx.image_outputs

    def get_rope_index(input_ids=None, *args, **kwargs):
        if (input_ids is not None and input_ids.shape == ctx.input_ids.shape
                and torch.equal(input_ids, ctx.input_ids.to(input_ids.device))):
            return ctx.position_ids[1:].to(input_ids.device), ctx.rope_deltas.to(input_ids.device)
        return original_rope(input_ids, *args, **kwargs)

    # generate (5.2x) reads the encoder's signature to collect its arguments: keep the real names visible
    get_image_features.__signature__ = inspect.Signature([
        inspect.Parameter("pixel_values", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("image_grid_thw", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ])
    base.get_image_features = get_image_features
    base.get_rope_index = get_rope_index
    base.rope_deltas = ctx.rope_deltas
    try:
        yield ctx
    finally:
        for name in ("get_image_features", "get_rope_index"):
            if name in saved:
                setattr(base, name, saved[name])
            else:
                base.__dict__.pop(name, None)
        base.rope_deltas = saved_deltas

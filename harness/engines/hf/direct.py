"""Tokenizer-free prompt path of the HF engine: requests → ``input_ids`` / ``pixel_values`` without a processor.

Why: a random-initialised model with a real checkpoint's shapes (``model=qwen3_vl_30b_a3b_shapes``) has no
tokenizer or processor files (the GPU machine has no network), and ``dataset=synthetic_load`` asks for prompts of
an exact length in tokens. So this module builds the model inputs itself:

- ``{"type": "synthetic_tokens", "n": N, "seed": s}`` parts → N ids drawn uniformly (seeded) from the ordinary
  vocabulary, clear of every special id of the model's config (``harness.models.real_shapes.synthetic_ids``);
- text parts → the engine's tokenizer (the byte-level ``ShapesTokenizer`` of a shapes model, or a real one);
- image parts → ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``, and the
  image's patches in the Qwen2-VL / Qwen3-VL processor layout (resize to a multiple of patch × merge, rescale to
  [0, 1], normalise with mean = std = 0.5, repeat the frame ``temporal_patch_size`` times, then
  ``[grid_t·grid_h·grid_w, C·T·P·P]`` in merge-window order), with ``image_grid_thw``. Only the resize runs on
  the host: the uint8 pixels go to the device, which normalises and rearranges them (``DEVICE_PATCHIFY``; the
  float32 host version cost ~0.1-1 s of a 30-image request's TTFT).

No chat template is applied: the prompt is exactly the parts in order (a synthetic load measures an engine at a
given prompt length, not a conversation). Batches are left-padded with the pad id, as generation requires. Only
torch, numpy and PIL are imported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from harness.models.real_shapes import synthetic_ids  # re-exported: it lives with the shapes models (layout)

__all__ = ["has_direct_parts", "build_inputs", "patchify", "image_tokens", "resized_size", "synthetic_ids"]


def has_direct_parts(requests: list[Any]) -> bool:
    """True when a request carries parts only this path understands (``synthetic_tokens``)."""
    return any(p.get("type") == "synthetic_tokens" for r in requests for p in r.content)


def _vision(model_config: Any) -> Any:
    return getattr(model_config, "vision_config", None)


def resized_size(width: int, height: int, factor: int) -> tuple[int, int]:
    """(w, h) rounded to the nearest multiple of ``factor`` (at least one factor), as the processor's resize."""
    return (max(factor, round(width / factor) * factor), max(factor, round(height / factor) * factor))


def image_tokens(width: int, height: int, vision: Any) -> int:
    """LLM tokens of one image of ``width`` × ``height`` pixels for this vision config."""
    factor = vision.patch_size * vision.spatial_merge_size
    w, h = resized_size(width, height, factor)
    return (w // vision.patch_size) * (h // vision.patch_size) // vision.spatial_merge_size ** 2


#: ``build_inputs`` patchifies on the target device from the uint8 pixels (True) or on the host in float32 (False,
#: the first version; ``benchmarks/run_path_gaps.py`` times both). Same values either way (tested).
DEVICE_PATCHIFY = True
_LUTS: dict[str, torch.Tensor] = {}


def _normalise_lut(device: Any) -> torch.Tensor:
    """float32 [256]: the host formula ``(byte / 255 - 0.5) / 0.5`` for every byte value, on ``device``. Indexing
    it gives exactly the host's values on any device (a division on the GPU may round differently)."""
    key = str(device)
    lut = _LUTS.get(key)
    if lut is None:
        lut = _LUTS[key] = torch.from_numpy((np.arange(256, dtype=np.float32) / 255.0 - 0.5) / 0.5).to(device)
    return lut


def patchify(image: Any, vision: Any, device: Any = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One PIL image → (patches [grid_h·grid_w, 3·T·P·P] float32, (1, grid_h, grid_w)).

    ``device`` None: normalised and rearranged on the host (numpy, float32). Else only the uint8 pixels cross to
    ``device`` (4x fewer bytes than float32, 8x fewer than the temporally repeated patches) and the normalisation
    (a 256-entry table of the host's values) and the rearrangement run there: the run path's TTFT clock includes
    this (docs/latency.md, "Run path vs benchmark scripts")."""
    from PIL import Image

    p, m, t = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    w, h = resized_size(image.width, image.height, p * m)
    if (w, h) != (image.width, image.height):
        image = image.resize((w, h), Image.BICUBIC)
    if device is None:
        arr = torch.from_numpy((np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0 - 0.5) / 0.5)
    else:
        pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).to(device)   # [H, W, C] uint8
        arr = _normalise_lut(device)[pixels.long()]
    x = arr.permute(2, 0, 1)[None].repeat(t, 1, 1, 1)                                    # [T, C, H, W]
    gh, gw = h // p, w // p
    x = x.reshape(1, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, 3 * t * p * p).contiguous(), (1, gh, gw)


def build_inputs(requests: list[Any], model_config: Any, tokenizer: Any, pad_id: int, device: str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask`` (+ ``pixel_values`` / ``image_grid_thw``) of a batch."""
    vision = _vision(model_config)
    rows: list[list[int]] = []
    patches: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    for req in requests:
        ids: list[int] = []
        for part in req.content:
            kind = part.get("type")
            if kind == "synthetic_tokens":
                ids += synthetic_ids(part["n"], part.get("seed", 0), model_config)
            elif kind == "text":
                ids += list(tokenizer(part["text"], add_special_tokens=False)["input_ids"])
            elif kind == "image":
                if vision is None:
                    raise ValueError("an image part for a text-only model (it has no vision tower)")
                x, grid = patchify(req.images[int(part.get("index", 0))], vision,
                                   device if DEVICE_PATCHIFY else None)
                patches.append(x)
                grids.append(grid)
                n = grid[1] * grid[2] // vision.spatial_merge_size ** 2
                ids += [model_config.vision_start_token_id, *[model_config.image_token_id] * n,
                        model_config.vision_end_token_id]
            else:
                raise ValueError(f"unknown content part type {kind!r}")
        if not ids:
            raise ValueError(f"request {req.uid}: empty prompt")
        rows.append(ids)
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, longest - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, longest - len(r):] = 1
    out = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
    if patches:
        out["pixel_values"] = torch.cat(patches).to(device=device, dtype=dtype)   # on the device already (DEVICE_PATCHIFY)
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long, device=device)
    from transformers import BatchFeature

    return BatchFeature(data=out)


def expected_prompt_tokens(prompt_tokens: int, n_images: int, width: int, height: int, vision: Any) -> int:
    """Prompt length of a ``synthetic_load`` request (text + per image: markers and pads)."""
    per = image_tokens(width, height, vision) + 2 if vision is not None and n_images else 0
    return prompt_tokens + n_images * per if math.isfinite(prompt_tokens) else prompt_tokens

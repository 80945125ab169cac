"""``dataset=synthetic_load``: requests of exact shapes for latency, with no reference answer.

Why: TTFT and TPOT depend on shapes — number of images, image size, prompt length, output length, batch size —
not on what the text says. A real-shape random model (``model=qwen3_vl_30b_a3b_shapes``) has no tokenizer and a
benchmark's prompts have lengths nobody chose, so this loader makes ``num_requests`` requests of
``n_images`` seeded noise images of ``image_width`` × ``image_height`` pixels followed by ``prompt_tokens``
seeded token ids (a ``synthetic_tokens`` part: the HF engine's tokenizer-free path, ``harness.engines.hf.direct``,
draws them from the model's ordinary vocabulary). The output length is ``output_tokens``: the
``generation=synthetic_load`` group this dataset selects sets ``generation.max_new_tokens`` to it and
``generation.ignore_eos=true``, so every request decodes exactly that many tokens and TPOT is over a known count.

Scoring: task ``no_reference`` — every quality metric is null with the reason stated (``harness.metrics.scoring``), never
0: there is nothing to compare an answer with.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.datasets.base import DatasetError, ImageInput, Sample

TASK = "no_reference"
REASON = "synthetic_load: synthetic requests have no reference answer (latency only)"


class NoiseImage(ImageInput):
    """A seeded uniform-noise RGB image, made on ``load`` (nothing on disk)."""

    def __init__(self, width: int, height: int, seed: int):
        super().__init__(source="synthetic_load", key=f"noise:{width}x{height}:{seed}")
        self.width, self.height, self.seed = width, height, seed

    def load(self):
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(self.seed)
        return Image.fromarray(rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8), "RGB")


def check(cfg: Any) -> dict[str, int]:
    """The shape settings as ints; a nonsense value raises :class:`DatasetError` naming the key."""
    out = {}
    for key, low in (("n_images", 0), ("image_width", 1), ("image_height", 1), ("prompt_tokens", 1),
                     ("output_tokens", 1), ("num_requests", 1)):
        value = getattr(cfg, key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DatasetError(f"dataset.{key}={value!r}: expected an integer >= {low}")
        out[key] = value
    return out


def load(cfg: Any, root: Path) -> Iterator[Sample]:
    s = check(cfg)
    n = s["num_requests"] if cfg.limit is None else min(s["num_requests"], int(cfg.limit))
    base = int(cfg.seed) * 1_000_003
    for i in range(n):
        seed = base + i
        images = [NoiseImage(s["image_width"], s["image_height"], seed * 131 + j) for j in range(s["n_images"])]
        content = [{"type": "image", "index": j} for j in range(s["n_images"])]
        content.append({"type": "synthetic_tokens", "n": s["prompt_tokens"], "seed": seed})
        yield Sample(uid=f"load-{i:05d}", dataset="synthetic_load", task=TASK, content=content, images=images,
                     reference={}, meta={**s, "seed": seed})

"""The tokenizer-free image path patchifies on the device from uint8 pixels, with the host path's exact values
(docs/latency.md, "Run path vs benchmark scripts": the run path's TTFT clock includes this input build)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from harness.engines.hf import direct as hf_direct
from harness.engines.hf.direct import build_inputs, patchify

VISION = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
CONFIG = SimpleNamespace(vision_config=VISION, vision_start_token_id=5, image_token_id=6, vision_end_token_id=7,
                         vocab_size=100)


def image(w, h, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("size", [(64, 64), (96, 64), (70, 45)])   # square, oblong, resized
def test_device_path_equals_host_path_bitwise(size):
    img = image(*size, seed=sum(size))
    host, grid = patchify(img, VISION)
    dev, grid_d = patchify(img, VISION, device="cpu")
    assert grid == grid_d and host.dtype == dev.dtype == torch.float32
    assert torch.equal(host, dev)


def test_every_byte_value_normalises_as_on_the_host():
    ramp = Image.fromarray(np.arange(256 * 3, dtype=np.uint16).reshape(16, 16, 3).astype(np.uint8)
                           .repeat(2, 0).repeat(2, 1), "RGB")       # 32 x 32: every byte value, no resize
    assert torch.equal(patchify(ramp, VISION)[0], patchify(ramp, VISION, device="cpu")[0])


def test_only_uint8_pixels_cross_to_the_device(monkeypatch):
    """What crosses host → device for a 3-image request: the raw pixels (3 bytes a pixel) plus ids, not the
    float32 temporally repeated patches (24 bytes a pixel, the first version: ~138 MB for 30 images of 448 px)."""
    moved = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta":
            moved.append(self.numel() * self.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    imgs = [image(64, 64, i) for i in range(3)]
    req = SimpleNamespace(uid="r", images=imgs, content=[{"type": "image", "index": i} for i in range(3)]
                          + [{"type": "synthetic_tokens", "n": 10, "seed": 0}])
    out = build_inputs([req], CONFIG, None, 0, "meta", torch.bfloat16)
    assert out["pixel_values"].device.type == "meta" and tuple(out["pixel_values"].shape) == (3 * 16, 3 * 2 * 16 * 16)
    pixels = 3 * 64 * 64 * 3
    ids = 2 * out["input_ids"].numel() * 8 + 3 * 3 * 8        # input_ids, attention_mask, image_grid_thw
    assert sum(moved) <= pixels + ids + 256 * 4               # + the 1 KB normalisation table
    monkeypatch.setattr(hf_direct, "DEVICE_PATCHIFY", False)  # the host version moves 8x more
    moved.clear()
    build_inputs([req], CONFIG, None, 0, "meta", torch.bfloat16)
    assert sum(moved) > 4 * pixels

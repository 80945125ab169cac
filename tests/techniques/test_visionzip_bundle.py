"""The request-wide budget as one span (harness.techniques.visionzip.bundle) against the HF engine's pruning.

The HF engine (``prepare_visionzip_inputs``, scope=request) is the reference: the span's kept columns and
their mRoPE positions, the text after the span, the total kept — all must equal what :class:`SpanLayout`
derives from the unpruned span and the same per-image selection.
"""

from __future__ import annotations

import random

import pytest
import torch

from harness.config.schema import VisionZipConfig
from harness.techniques.visionzip.pruning import select_tokens
from harness.techniques.visionzip.bundle import SpanLayout, decode_ints, encode_ints, request_total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from harness.models.tiny import TinyModelSpec, ensure_tiny_model

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("bundle-model"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def _inputs(processor, n_images: int, seed: int = 0):
    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image

    rng = random.Random(seed)
    sizes = [(128, 96), (64, 64), (96, 128), (64, 96)]
    imgs = [(text_dense_image if i % 2 == 0 else plain_scene_image)(rng, *sizes[i % 4]) for i in range(n_images)]
    content = []
    for i in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": f"picture {i} shows"}]
    content.append({"type": "text", "text": "so what is the answer"})
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=imgs, return_tensors="pt")


@pytest.mark.parametrize("n_images, keep, contextual", [(1, 0.5, 0.0), (3, 0.4, 0.0), (4, 0.3, 0.25)])
def test_span_layout_reproduces_hf_pruning(tiny, n_images, keep, contextual):
    from harness.engines.hf.visionzip import prepare_visionzip_inputs

    model, processor = tiny
    inputs = _inputs(processor, n_images)
    cfg = VisionZipConfig(keep=keep, contextual=contextual, scope="request")
    new, ctx = prepare_visionzip_inputs(model, inputs, cfg)
    c = model.config
    ids = inputs["input_ids"][0].tolist()
    is_img = [t == c.image_token_id for t in ids]
    runs, i = [], 0
    while i < len(ids):
        if is_img[i]:
            j = i
            while j < len(ids) and is_img[j]:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    offset, layout = SpanLayout.from_prompt(ids, runs, inputs["image_grid_thw"].tolist(), 2, c.image_token_id,
                                            c.vision_start_token_id, c.vision_end_token_id)
    assert layout.sizes == [n for _, n in runs]
    kept = ctx.kept_indices  # one request: images in order
    assert sum(int(k.numel()) for k in kept) == request_total(layout.sizes, keep, 1)
    cols = layout.kept_columns(kept)
    n_pruned = layout.length(sum(int(k.numel()) for k in kept))
    assert cols.numel() == n_pruned
    # the HF pruned prompt: same ids and positions over the span, text after at base + extent
    hf_ids = new["input_ids"][0]
    hf_pos = new["position_ids"][1:, 0]  # [3, L'] (no padding: one request)
    assert hf_ids[offset:offset + n_pruned].tolist() == [layout.ids[int(k)] for k in cols]
    base = offset  # text before the span is sequential from 0
    torch.testing.assert_close(hf_pos[:, offset:offset + n_pruned], layout.positions()[:, cols] + base)
    tail = hf_pos[:, offset + n_pruned:]
    expect = torch.arange(tail.shape[1]).expand(3, -1) + base + layout.extent()
    torch.testing.assert_close(tail, expect)
    prov = layout.provisional_ids(sum(int(k.numel()) for k in kept))
    assert len(prov) == n_pruned and prov.count(c.image_token_id) == int(hf_ids.eq(c.image_token_id).sum())


def test_request_total_is_select_tokens_total():
    g = torch.Generator().manual_seed(0)
    for sizes in ([5], [3, 7, 1], [12, 4, 4, 9]):
        scores = [torch.rand(n, generator=g) for n in sizes]
        for keep in (0.1, 0.3, 0.5, 0.9, 1.0):
            for mpi in (0, 1, 3):
                got = sum(int(k.numel()) for k in select_tokens(scores, keep, "request", mpi))
                assert got == request_total(sizes, keep, mpi), (sizes, keep, mpi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_integer_channels_are_exact(dtype):
    x = torch.tensor([[0, 1, 255], [256, 4095, 65535], [300, 7, 12345]])
    assert torch.equal(decode_ints(encode_ints(x, dtype)), x)
    with pytest.raises(ValueError):
        encode_ints(torch.tensor([[65536]]), dtype)


def test_layout_rejects_inconsistent_spans():
    with pytest.raises(ValueError):  # grid says 4 tokens, the run has 3
        SpanLayout((1, 9, 9, 9, 2), ((1, 4, 4),), 2, 9)
    with pytest.raises(ValueError):  # runs not enclosed by vision start / end
        SpanLayout.from_prompt([5, 9, 9, 9, 9, 2], [(1, 4)], [(1, 4, 4)], 2, 9, 1, 2)

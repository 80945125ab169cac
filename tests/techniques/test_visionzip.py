"""VisionZip reference: score normalisation, patch order, selection rules, contextual merge."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.techniques.visionzip.pruning import (
    attention_received,
    budget,
    compress_image,
    contextual_merge,
    merge_unit_scores,
    merge_units,
    select_tokens,
    split_budget,
    split_dominant,
)

# ------------------------------------------------------------------------------------- scoring


def test_uniform_attention_scores_one_whatever_the_size():
    n = 4 + 16
    q = torch.zeros(n, 2, 8)  # all logits equal → uniform attention
    k = torch.randn(n, 2, 8)
    scores = attention_received(q, k, torch.tensor([0, 4, 20], dtype=torch.int32))
    torch.testing.assert_close(scores, torch.ones(n))


def test_scores_average_one_per_image():
    g = torch.Generator().manual_seed(0)
    seqlens = [3, 10, 1, 25]
    q, k = torch.randn(39, 3, 16, generator=g) * 2, torch.randn(39, 3, 16, generator=g) * 2
    cu = torch.tensor([0, 3, 13, 14, 39], dtype=torch.int32)
    scores = attention_received(q, k, cu)
    assert scores.dtype == torch.float32
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert scores[s:e].mean().item() == pytest.approx(1.0, rel=1e-6)
    assert seqlens == (cu[1:] - cu[:-1]).tolist()


def test_hand_checked_two_tokens_two_heads():
    # head 0: q = [1, 2], k = [0, 1] (d = 1, scale 1); head 1: q = 0 → uniform (each column sums to 1).
    q = torch.tensor([[[1.0], [0.0]], [[2.0], [0.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0], [5.0]], [[1.0], [7.0]]], dtype=torch.float64)
    scores = attention_received(q, k, torch.tensor([0, 2]), scale=1.0)
    p0 = 1 / (1 + math.e)  # row q=1: softmax([0, 1])[0]
    p1 = 1 / (1 + math.e**2)  # row q=2: softmax([0, 2])[0]
    col0 = p0 + p1
    expected = torch.tensor([(col0 + 1) / 2, (2 - col0 + 1) / 2], dtype=torch.float64)
    torch.testing.assert_close(scores, expected)


# ---------------------------------------------------------------------------------- patch order


def _processor_patch_coords(grid_h, grid_w):
    """(row, col) of each patch in the order Qwen's image processor emits them (one frame)."""
    np = pytest.importorskip("numpy")
    proc_mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    proc = proc_mod.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    y, x = np.meshgrid(np.arange(grid_h * 16), np.arange(grid_w * 16), indexing="ij")
    image = np.stack([y, x, np.zeros_like(y)]).astype(np.float32)  # channel 0 = pixel row, 1 = pixel column
    flat, gh, gw = proc.patchify(image, 16, 2, 2)
    assert (gh, gw) == (grid_h, grid_w)
    per_channel = 2 * 16 * 16  # a row is (channel, temporal, 16, 16)
    rows = torch.as_tensor(flat[:, 0] // 16).long()
    cols = torch.as_tensor(flat[:, per_channel] // 16).long()
    return rows, cols


def test_merge_units_follow_the_processor_patch_order():
    grid_h, grid_w = 4, 6
    rows, cols = _processor_patch_coords(grid_h, grid_w)
    score_map = torch.rand(grid_h, grid_w, generator=torch.Generator().manual_seed(1))
    merged = merge_unit_scores(score_map[rows, cols], [[1, grid_h, grid_w]])
    expected = torch.nn.functional.avg_pool2d(score_map[None, None], 2).flatten()  # units, row-major
    assert len(merged) == 1
    torch.testing.assert_close(merged[0], expected)


def test_merge_units_follow_the_vision_tower_positions_for_several_entries():
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])  # an image, then a 2-frame video entry
    pos = vision_utils.get_vision_position_ids(grid, 2)  # (h, w) of each patch, the tower's order
    g = torch.Generator().manual_seed(2)
    maps = [torch.rand(4, 6, generator=g), torch.rand(2, 2, 4, generator=g)]
    frame = torch.cat([torch.zeros(24, dtype=torch.long), torch.arange(2).repeat_interleave(8)])
    scores = torch.cat([maps[0][pos[:24, 0], pos[:24, 1]], maps[1][frame[24:], pos[24:, 0], pos[24:, 1]]])
    merged = merge_unit_scores(scores, grid)
    torch.testing.assert_close(merged[0], torch.nn.functional.avg_pool2d(maps[0][None, None], 2).flatten())
    torch.testing.assert_close(merged[1], torch.nn.functional.avg_pool2d(maps[1][:, None], 2).flatten())


def test_merge_units_keeps_the_mean_and_handles_trailing_dims():
    scores = attention_received(torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.tensor([0, 16, 40]))
    merged = merge_unit_scores(scores, torch.tensor([[1, 4, 4], [1, 4, 6]]))
    assert [m.numel() for m in merged] == [4, 6]
    assert all(m.mean().item() == pytest.approx(1.0, rel=1e-6) for m in merged)
    keys = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    (mk,) = merge_units(keys, [[1, 4, 4]])
    torch.testing.assert_close(mk[0], keys[:4].mean(0))
    with pytest.raises(ValueError):
        merge_unit_scores(scores, [[1, 4, 4]])  # does not cover all patches
    with pytest.raises(ValueError):
        merge_unit_scores(torch.ones(15), [[1, 3, 5]])  # not divisible by merge_size


# ------------------------------------------------------------------------------------ selection

SIMPLE = torch.tensor([4.5, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 4.5])  # 2 salient tokens
DENSE = torch.tensor([1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.0, 1.0])  # detail everywhere


def test_request_scope_gives_the_detail_dense_image_more_tokens():
    simple, dense = select_tokens([SIMPLE, DENSE], keep=0.5, scope="request")
    assert simple.tolist() == [0, 9]
    assert dense.tolist() == [0, 2, 4, 5, 6, 7, 8, 9]


def test_image_scope_keeps_the_same_ratio_per_image():
    simple, dense = select_tokens([SIMPLE, DENSE], keep=0.5, scope="image")
    assert simple.tolist() == [0, 1, 2, 3, 9]  # ties (0.125) → lower index
    assert dense.tolist() == [0, 2, 4, 5, 7]  # ties (1.0) → lower index


def test_budget_rounds_half_up():
    assert [budget(0.5, n) for n in (1, 2, 3, 5)] == [1, 1, 2, 3]
    assert budget(0.7, 10) == 7 and budget(0.6, 784) == 470
    (kept,) = select_tokens([torch.arange(5.0)], keep=0.5, scope="image", min_per_image=0)
    assert kept.tolist() == [2, 3, 4]


@pytest.mark.parametrize("keep", [0.0, 0.25, 0.5, 0.6, 0.7, 1.0])
def test_request_total_is_the_rounded_budget(keep):
    g = torch.Generator().manual_seed(3)
    scores = [torch.rand(n, generator=g) for n in (196, 49, 784, 3)]
    kept = select_tokens(scores, keep=keep, min_per_image=0)
    assert sum(k.numel() for k in kept) == budget(keep, 196 + 49 + 784 + 3)
    for k, s in zip(kept, scores):
        assert k.dtype == torch.long
        assert torch.equal(k, torch.unique(k)) and (k.numel() == 0 or (0 <= k.min() and k.max() < s.numel()))


def test_minimum_per_image_is_reserved_first_and_beats_the_budget():
    low, high = torch.full((8,), 0.01), torch.full((8,), 10.0)
    assert [k.tolist() for k in select_tokens([low, high], keep=0.375, min_per_image=0)] == [[], [0, 1, 2, 3, 4, 5]]
    # budget 6: each image reserves its 2 best, the 2 left go to the best remaining tokens
    assert [k.tolist() for k in select_tokens([low, high], keep=0.375, min_per_image=2)] == [[0, 1], [0, 1, 2, 3]]
    # budget 2 < Σ minimums 4: the minimum wins, total = max(K, Σ floors)
    assert [k.tolist() for k in select_tokens([low, high], keep=0.125, min_per_image=2)] == [[0, 1], [0, 1]]
    kept = select_tokens([low, high, torch.ones(1)], keep=0.0, min_per_image=2)
    assert [k.tolist() for k in kept] == [[0, 1], [0, 1], [0]]  # floors only, capped by the image size
    kept = select_tokens([low, high], keep=0.0, scope="image", min_per_image=3)
    assert [k.numel() for k in kept] == [3, 3]


def test_ties_across_images_go_to_the_earlier_image():
    first, second = select_tokens([torch.ones(4), torch.ones(4)], keep=0.5, min_per_image=0)
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == []


def test_keep_one_is_identity_and_inputs_are_checked():
    scores = [torch.rand(7), torch.rand(0), torch.rand(30)]
    for scope in ("request", "image"):
        assert [k.tolist() for k in select_tokens(scores, 1.0, scope)] == [list(range(s.numel())) for s in scores]
    assert select_tokens([], 0.5) == []
    with pytest.raises(ValueError):
        select_tokens(scores, 1.5)
    with pytest.raises(ValueError):
        select_tokens(scores, 0.5, scope="batch")
    with pytest.raises(ValueError):
        select_tokens([torch.tensor([1.0, float("nan")])], 0.5)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    data=st.data(),
    keep=st.floats(0.0, 1.0),
    min_per_image=st.integers(0, 3),
    scope=st.sampled_from(["request", "image"]),
)
def test_select_tokens_properties(sizes, data, keep, min_per_image, scope):
    scores = [
        torch.tensor(data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=torch.float32) / 4
        for n in sizes
    ]
    kept = select_tokens(scores, keep, scope, min_per_image)
    floors = [min(min_per_image, n) for n in sizes]
    selected = set()
    for i, (k, n, f) in enumerate(zip(kept, sizes, floors)):
        idx = k.tolist()
        assert idx == sorted(set(idx)) and all(0 <= j < n for j in idx)
        assert len(idx) >= f
        selected.update((i, j) for j in idx)
        if scope == "image":
            assert len(idx) == min(n, max(f, budget(keep, n)))

    def rank(i, j):  # the tie rule: higher score, then earlier image, then lower index
        return (-scores[i][j].item(), i, j)

    def image_top(i, m):
        return set(sorted(((i, j) for j in range(sizes[i])), key=lambda t: rank(*t))[:m])

    if scope == "image":
        for i, k in enumerate(kept):
            assert {(i, j) for j in k.tolist()} == image_top(i, k.numel())
        return
    assert len(selected) == max(budget(keep, sum(sizes)), sum(floors))
    reserved = set().union(*(image_top(i, f) for i, f in enumerate(floors)))
    assert reserved <= selected
    everything = {(i, j) for i, n in enumerate(sizes) for j in range(n)}
    extra, dropped = selected - reserved, everything - selected
    if extra and dropped:
        assert max(rank(*t) for t in extra) < min(rank(*t) for t in dropped)


# ---------------------------------------------------------------------------- contextual tokens


def test_split_budget():
    assert split_budget(70, 0.05 / 0.7, 100) == (65, 5)  # the official 65% + 5%
    assert split_budget(100, 0.3, 100) == (100, 0)  # everything kept: nothing to merge
    assert split_budget(1, 0.9, 10) == (1, 0)  # one dominant token stays
    assert split_budget(4, 1.0, 10) == (1, 3)
    assert split_budget(0, 0.5, 10) == (0, 0)
    with pytest.raises(ValueError):
        split_budget(11, 0.1, 10)


def test_contextual_merge_hand_checked():
    # 6 tokens, token 1 dominant → non-dominant [0, 2, 3, 4, 5]; 2 targets: step 5 // 2 = 2 → positions 0, 2
    # → targets are tokens 0 and 3; 2 → 0, 4 → 3, 5 → 0 by key direction.
    keys = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.1], [0.0, 1.0], [0.1, 3.0], [1.0, 0.2]])
    tokens = torch.tensor([[1.0, 0.0], [9.0, 9.0], [2.0, 2.0], [0.0, 1.0], [3.0, 5.0], [4.0, 0.0]])
    merged, targets = contextual_merge(tokens, keys, torch.tensor([1]), 2)
    assert targets.tolist() == [0, 3]
    torch.testing.assert_close(merged, torch.tensor([[1.0 + 3.0, 0.0 + 1.0], [0.0 + 3.0, 1.0 + 5.0]]))


def test_contextual_merge_target_without_members_and_head_keys():
    # keys [n, heads, head_dim] are averaged over heads; target 2 attracts nobody and stays as it is.
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, 0.05]])[:, None, :].expand(4, 3, 2)
    tokens = torch.arange(8.0).reshape(4, 2)
    merged, targets = contextual_merge(tokens, keys, torch.tensor([], dtype=torch.long), 2)
    assert targets.tolist() == [0, 2]
    torch.testing.assert_close(merged, torch.stack([tokens[0] + (tokens[1] + tokens[3]) / 2, tokens[2]]))
    empty, none = contextual_merge(tokens, keys, torch.tensor([0]), 0)
    assert empty.shape == (0, 2) and none.numel() == 0
    with pytest.raises(ValueError):
        contextual_merge(tokens, keys, torch.tensor([0, 1]), 3)


def test_compress_image_shapes_and_placement():
    g = torch.Generator().manual_seed(4)
    n, dim = 40, 6
    tokens, keys = torch.randn(n, dim, generator=g), torch.randn(n, 2, 4, generator=g)
    scores = torch.rand(n, generator=g)
    (kept,) = select_tokens([scores], keep=0.5)
    indices, rows = compress_image(tokens, keys, scores, kept, contextual=0.2)
    assert indices.shape == (20,) and rows.shape == (20, dim)
    assert torch.equal(indices, torch.unique(indices))
    dominant, n_ctx = split_dominant(scores, kept, 0.2)
    assert n_ctx == 4 and dominant.numel() == 16 and set(dominant.tolist()) <= set(kept.tolist())
    is_dominant = torch.isin(indices, dominant)
    torch.testing.assert_close(rows[is_dominant], tokens[indices[is_dominant]])
    assert not torch.isin(indices[~is_dominant], dominant).any()
    plain_idx, plain_rows = compress_image(tokens, keys, scores, kept, contextual=0.0)
    assert torch.equal(plain_idx, kept) and torch.equal(plain_rows, tokens[kept])

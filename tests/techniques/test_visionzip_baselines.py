"""VisionZip's trivial baselines (issue 31): random, first, pool at VisionZip's kept count, original positions."""

from __future__ import annotations

import pytest
import torch

from harness.techniques.visionzip.baselines import (baseline_scores, check_method, pool_cells, pool_counts,
                                                     pool_image)
from harness.techniques.visionzip.pruning import budget, select_tokens

SIZES = [12, 30, 6]  # three images of one request, LLM tokens each


@pytest.mark.parametrize("scope", ["request", "image"])
@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9])
def test_every_baseline_keeps_visionzips_count(scope, keep):
    attention = select_tokens([torch.rand(n) for n in SIZES], keep, scope, 1)
    want = sum(int(s.numel()) for s in attention)
    if scope == "request":
        assert want == budget(keep, sum(SIZES))
    for method in ("random", "first"):
        got = select_tokens(baseline_scores(method, SIZES, seed=3), keep, scope, 1)
        assert sum(int(s.numel()) for s in got) == want, method
    assert sum(pool_counts(SIZES, keep, scope, 1)) == want


def test_random_is_seeded_and_blind_to_content():
    a = select_tokens(baseline_scores("random", SIZES, seed=7), 0.5)
    b = select_tokens(baseline_scores("random", SIZES, seed=7), 0.5)
    c = select_tokens(baseline_scores("random", SIZES, seed=8), 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # uniform: over many seeds every token of the request is kept about half the time
    hits = torch.zeros(sum(SIZES))
    for seed in range(400):
        sel = select_tokens(baseline_scores("random", SIZES, seed=seed), 0.5, min_per_image=0)
        hits += torch.cat([torch.zeros(n).index_fill_(0, s, 1.0) for n, s in zip(SIZES, sel)])
    assert (hits / 400 - 0.5).abs().max() < 0.12


def test_first_keeps_the_first_tokens_of_the_request():
    sel = select_tokens(baseline_scores("first", SIZES), 0.5, "request", min_per_image=1)
    # 24 tokens: each image reserves its first one (3), the other 21 go to image 0 (11 more) and image 1 (10 more)
    assert sel[0].tolist() == list(range(12)) and sel[1].tolist() == list(range(11)) and sel[2].tolist() == [0]
    per_image = select_tokens(baseline_scores("first", SIZES), 0.5, "image")
    assert [s.tolist() for s in per_image] == [list(range(6)), list(range(15)), list(range(3))]


@pytest.mark.parametrize("rows,cols,k", [(4, 4, 4), (4, 6, 5), (3, 5, 15), (6, 2, 1), (5, 7, 11), (2, 9, 7)])
def test_pool_cells_tile_the_grid_into_exactly_k_cells(rows, cols, k):
    cells = pool_cells(rows, cols, k)
    assert len(cells) == k
    cover = torch.zeros(rows, cols, dtype=torch.long)
    for r0, r1, c0, c1 in cells:
        assert r1 > r0 and c1 > c0
        cover[r0:r1, c0:c1] += 1
    assert bool((cover == 1).all())


def test_pool_image_averages_each_cell_at_its_centre_token():
    tokens = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)  # a 4 x 4 grid
    idx, rows = pool_image(tokens, 4, 4, 4)  # four 2 x 2 cells
    assert idx.tolist() == [0, 2, 8, 10]  # centre (rounded down) of each cell, increasing
    grid = tokens.reshape(4, 4, 3)
    assert torch.allclose(rows[0], grid[:2, :2].reshape(-1, 3).mean(0))
    assert torch.allclose(rows[3], grid[2:, 2:].reshape(-1, 3).mean(0))
    same_idx, same = pool_image(tokens, 4, 4, 16)
    assert same_idx.tolist() == list(range(16)) and torch.equal(same, tokens)
    none_idx, none = pool_image(tokens, 4, 4, 0)
    assert none_idx.numel() == 0 and none.shape == (0, 3)


def test_pool_counts_are_proportional_to_image_size():
    counts = pool_counts([100, 300], 0.5)
    assert counts == [50, 150]


def test_check_method():
    assert check_method("pool") == "pool"
    with pytest.raises(ValueError, match="visionzip.method"):
        check_method("bogus")
    with pytest.raises(ValueError, match="contextual"):
        check_method("random", 0.1)

"""The fused SERE re-routing op equals the torch reference id for id (Triton's interpreter on CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.kernels.reroute import reroute_op, reroute_triton
from harness.techniques.sere.reroute import reroute

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7_777

# (T, E, k): T = 1 and odd T; E = 16 and 128 (32 x 4-word bitmask, one and several words); k = 4 and 8.
SHAPES = [(1, 16, 4), (7, 16, 8), (33, 16, 8), (1, 128, 8), (5, 128, 4), (3, 100, 6)]
K_PRIMARY = [1, 2, 4]
RHOS = [0.0, 0.1, 0.5, 1.0]


def make_case(num_tokens, num_experts, k, seed, levels=4, dtype=torch.int64):
    """Distinct ids per row (as a top-k), a similarity with few levels (ties, values equal to rho)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).topk(k).indices.to(dtype)
    sim = torch.randint(0, levels + 1, (num_experts, num_experts), generator=g) / levels
    sim.fill_diagonal_(1.0)
    protected = torch.rand(num_experts, generator=g) < 0.25
    row_mask = torch.rand(num_tokens, generator=g) < 0.7
    return ids.to(DEVICE), sim.to(DEVICE), protected.to(DEVICE), row_mask.to(DEVICE)


def run_poisoned(ids, sim, k_primary, rho, protected=None, row_mask=None, primary="auto"):
    out = torch.full_like(ids, POISON)
    got = reroute_triton(ids, sim, k_primary, rho, protected, row_mask, out=out, primary=primary)
    assert got.data_ptr() == out.data_ptr()
    return got


@pytest.mark.parametrize("primary", ["fused", "separate"])
@pytest.mark.parametrize("use_row_mask", [False, True])
@pytest.mark.parametrize("use_protected", [False, True])
@pytest.mark.parametrize("k_primary", K_PRIMARY)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}".format(*s))
def test_matches_reference(shape, k_primary, use_protected, use_row_mask, primary):
    ids, sim, protected, row_mask = make_case(*shape, seed=sum(shape) + k_primary)
    protected = protected if use_protected else None
    row_mask = row_mask if use_row_mask else None
    for rho in RHOS:
        want = reroute(ids, sim, k_primary, rho, protected, row_mask)
        got = run_poisoned(ids, sim, k_primary, rho, protected, row_mask, primary)
        assert got.dtype == ids.dtype
        assert torch.equal(got, want), f"rho={rho}\n{ids}\n{got}\n{want}"


def test_reroutes_something():
    """Guard against a vacuous grid: the cases above do move slots."""
    ids, sim, _, _ = make_case(7, 16, 8, seed=0)
    assert (reroute_triton(ids, sim, 2, 0.5) != ids).any()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dtype_and_continuous_similarity(dtype):
    ids, _, protected, _ = make_case(9, 128, 8, seed=3, dtype=dtype)
    sim = torch.rand(128, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for rho in (0.0, 0.9):
        got = run_poisoned(ids, sim, 2, rho, protected)
        assert got.dtype == dtype and torch.equal(got, reroute(ids, sim, 2, rho, protected))


@pytest.mark.parametrize("sim_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_similarity_dtypes(sim_dtype):
    ids, sim, _, _ = make_case(6, 16, 8, seed=4, levels=1000)
    sim = sim.to(sim_dtype)
    for rho in (0.1, 0.5):
        assert torch.equal(run_poisoned(ids, sim, 2, rho), reroute(ids, sim, 2, rho))


def test_strided_inputs():
    ids, sim, protected, row_mask = make_case(5, 16, 8, seed=5)
    wide = torch.full((5, 12), 3, dtype=ids.dtype, device=DEVICE)
    wide[:, 2:10] = ids
    ids_view = wide[:, 2:10]                              # row stride 12
    sim_t = sim.t().contiguous().t()                      # column-major similarity
    want = reroute(ids, sim, 2, 0.25, protected, row_mask)
    assert torch.equal(run_poisoned(ids_view, sim_t, 2, 0.25, protected, row_mask), want)
    out_t = torch.full((8, 5), POISON, dtype=ids.dtype, device=DEVICE).t()   # strided output
    reroute_triton(ids, sim, 2, 0.25, protected, row_mask, out=out_t)
    assert torch.equal(out_t, want)


def test_invalid_ids_nan_and_inf():
    ids, sim, _, _ = make_case(6, 16, 8, seed=6)
    ids[0, 0], ids[1, 3], ids[2, 5] = -1, -1, 99
    for rho in (0.0, 0.5, float("-inf")):
        assert torch.equal(run_poisoned(ids, sim, 2, rho), reroute(ids, sim, 2, rho))
    # Hand-made: P = {0, 1}.
    ids = torch.tensor([[0, 5, 6, 7], [1, 8, 9, 10], [-1, 11, 99, 12]], device=DEVICE)
    sim = make_case(1, 16, 1, seed=6)[1]
    sim[5, 0], sim[5, 1] = float("nan"), 0.25          # NaN beside a finite candidate: 5 -> 1
    sim[6] = float("nan")                               # no finite candidate: 6 stays
    sim[7, :2] = float("-inf")                          # only -inf candidates: 7 stays, even at rho=-inf
    for rho in (0.0, 0.25, float("-inf")):
        want = reroute(ids, sim, 1, rho)
        assert want[0].tolist() == [0, 1, 6, 7]
        assert torch.equal(run_poisoned(ids, sim, 1, rho), want)


def test_empty_primary_set_moves_nothing():
    ids, sim, _, _ = make_case(4, 16, 8, seed=7)
    row_mask = torch.zeros(4, dtype=torch.bool, device=DEVICE)
    assert torch.equal(run_poisoned(ids, sim, 2, float("-inf"), row_mask=row_mask), ids)
    ids[:, :2] = -1                                     # no valid primary: P is empty
    assert torch.equal(run_poisoned(ids, sim, 2, float("-inf")), ids)


def test_edge_shapes():
    ids, sim, _, _ = make_case(3, 16, 4, seed=8)
    assert torch.equal(run_poisoned(ids, sim, 4, 0.0), ids)            # k_primary >= k: copy
    assert torch.equal(run_poisoned(ids, sim, 9, 0.0), ids)
    empty = ids[:0]
    assert reroute_triton(empty, sim, 1, 0.0).shape == (0, 4)
    one = ids[:, :1]                                                    # k = 1: nothing secondary
    assert torch.equal(run_poisoned(one, sim, 1, 0.0), one)


def test_reroute_op_dispatch(monkeypatch):
    ids, sim, protected, row_mask = make_case(5, 16, 8, seed=9)
    want = reroute(ids, sim, 2, 0.5, protected, row_mask)
    assert torch.equal(reroute_op(ids, sim, 2, 0.5, protected, row_mask), want)
    if DEVICE == "cpu":                       # without the interpreter, CPU tensors take the reference
        import harness.kernels.reroute as mod

        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr(mod, "reroute_triton", lambda *a, **k: pytest.fail("kernel used on CPU"))
        assert torch.equal(reroute_op(ids, sim, 2, 0.5, protected, row_mask), want)


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.integers(1, 9), num_experts=st.integers(2, 40), k=st.integers(1, 8),
       k_primary=st.integers(1, 4), rho=st.sampled_from([0.0, 0.25, 0.3, 0.75, 1.0]),
       flags=st.tuples(st.booleans(), st.booleans()), seed=st.integers(0, 2**16))
def test_random_cases(num_tokens, num_experts, k, k_primary, rho, flags, seed):
    k = min(k, num_experts)
    ids, sim, protected, row_mask = make_case(num_tokens, num_experts, k, seed)
    protected = protected if flags[0] else None
    row_mask = row_mask if flags[1] else None
    want = reroute(ids, sim, k_primary, rho, protected, row_mask)
    assert torch.equal(run_poisoned(ids, sim, k_primary, rho, protected, row_mask), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    ids, sim, protected, row_mask = make_case(64, 128, 8, seed=10)
    out = torch.full_like(ids, POISON)
    reroute_triton(ids, sim, 2, 0.5, protected, row_mask, out=out)     # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reroute_triton(ids, sim, 2, 0.5, protected, row_mask, out=out)
    for seed in (11, 12):                     # new routing in the same buffers, then replay
        new_ids, _, _, _ = make_case(64, 128, 8, seed=seed)
        ids.copy_(new_ids)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reroute(ids, sim, 2, 0.5, protected, row_mask))


@pytest.mark.parametrize("primary", ["auto", "fused", "separate"])
@pytest.mark.parametrize("use_row_mask", [False, True])
def test_more_rows_than_one_primary_tile(use_row_mask, primary):
    """T = 150 > 64 = BLOCK_N rows: the primary scan runs over three tiles. The only primary expert that
    attracts anything (expert 15) is named by rows past the first tile only, so a scan that stopped after
    one tile (or lost later tiles' bits) would move nothing; a masked-out row beyond the tile must not
    contribute its primary."""
    t, e, k = 150, 16, 4
    g = torch.Generator().manual_seed(7)
    # primaries: experts 0 and 1 (never similar enough); secondaries: 4..13, outside P
    ids = torch.stack([torch.cat([torch.tensor([i % 2]), 4 + torch.randperm(10, generator=g)[:k - 1]])
                       for i in range(t)])
    ids[100, 0] = 15
    ids[140, 0] = 14
    sim = torch.zeros(e, e)
    sim.fill_diagonal_(1.0)
    sim[:, 15] = 0.9
    sim[:, 14] = 0.95
    row_mask = torch.ones(t, dtype=torch.bool)
    if use_row_mask:
        row_mask[140] = False                                    # expert 14's only primary row is masked out
        row_mask[3] = False
    ids, sim, row_mask = ids.to(DEVICE), sim.to(DEVICE), row_mask.to(DEVICE)
    mask = row_mask if use_row_mask else None
    got = run_poisoned(ids, sim, 1, 0.5, None, mask, primary)
    want = reroute(ids, sim, 1, 0.5, None, mask)
    assert torch.equal(got, want)
    assert torch.equal(reroute_op(ids, sim, 1, 0.5, None, mask), want)
    moved_to = set(got[:, 1:][got[:, 1:] != ids[:, 1:]].tolist())
    assert moved_to == ({15} if use_row_mask else {14})        # the attractor from the second / third tile
    if use_row_mask:
        assert torch.equal(got[~row_mask.cpu()], ids[~row_mask.cpu()])


# ---- P built once per step (the primary pass): its words, several tiles per program, the program cap.


@pytest.mark.parametrize("use_row_mask", [False, True])
@pytest.mark.parametrize("shape", [(1, 16, 4), (65, 16, 8), (200, 100, 6), (150, 128, 8)],
                         ids=lambda s: "T{}-E{}-k{}".format(*s))
def test_primary_words_equal_the_reference_primary_set(shape, use_row_mask):
    from harness.kernels.reroute import primary_words, words_to_mask
    from harness.techniques.sere.reroute import primary_mask

    ids, _, _, row_mask = make_case(*shape, seed=sum(shape))
    mask = row_mask if use_row_mask else None
    for kp in (1, 2):
        want = primary_mask(ids, shape[1], kp, mask)
        assert want.any()
        assert torch.equal(words_to_mask(primary_words(ids, shape[1], kp, mask), shape[1]), want)


def test_primary_pass_with_few_programs_and_many_tiles(monkeypatch):
    """MAX_G capped at 2: 300 rows = 5 tiles over 2 programs (3 + 2 tiles), and the per-slot kernel
    reduces fewer partials than its MAX_G tile holds. The attractors sit in the last tiles of each program."""
    import harness.kernels.reroute as mod

    monkeypatch.setattr(mod, "MAX_G", 2)
    assert mod._primary_grid(300) == (2, 192)
    t, e, k = 300, 16, 4
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.cat([torch.tensor([i % 2]), 4 + torch.randperm(10, generator=g)[:k - 1]])
                       for i in range(t)])
    ids[150, 0], ids[299, 0] = 14, 15                     # program 0's third tile, program 1's last tile
    sim = torch.zeros(e, e).fill_diagonal_(1.0)
    sim[:8, 14] = 0.9
    sim[8:, 15] = 0.9
    ids, sim = ids.to(DEVICE), sim.to(DEVICE)
    want = reroute(ids, sim, 1, 0.5)
    got = run_poisoned(ids, sim, 1, 0.5, primary="separate")
    assert torch.equal(got, want)
    assert set(got[:, 1:][got[:, 1:] != ids[:, 1:]].tolist()) == {14, 15}


def test_primary_grid_caps_programs():
    from harness.kernels.reroute import BLOCK_N, MAX_G, _primary_grid

    for num_tokens in (1, 63, 64, 65, 4096, 4097, 16384, 100_000):
        groups, rows = _primary_grid(num_tokens)
        assert 1 <= groups <= MAX_G and rows % BLOCK_N == 0
        assert (groups - 1) * rows < num_tokens <= groups * rows


def test_no_masked_in_rows_moves_nothing_in_both_paths():
    ids, sim, _, _ = make_case(150, 16, 8, seed=11)
    none = torch.zeros(150, dtype=torch.bool, device=DEVICE)
    for primary in ("fused", "separate"):
        assert torch.equal(run_poisoned(ids, sim, 2, float("-inf"), row_mask=none, primary=primary), ids)


def test_bad_primary_mode():
    ids, sim, _, _ = make_case(2, 16, 4, seed=1)
    with pytest.raises(ValueError, match="primary"):
        reroute_triton(ids, sim, 1, 0.0, primary="twice")

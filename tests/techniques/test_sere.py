"""The SERE reference: hand-computed answers, edge cases, and properties against a plain-Python oracle."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.techniques.sere.reroute import expert_union, primary_mask, reroute, reroute_stats

# 6 experts, row = source expert, column = candidate. Deliberately asymmetric at [1, 5] / [5, 1].
SIM6 = torch.tensor([
    #  0     1     2     3     4     5
    [1.00, 0.10, 0.80, 0.40, 0.20, 0.05],  # 0
    [0.10, 1.00, 0.30, 0.40, 0.60, 0.90],  # 1
    [0.80, 0.30, 1.00, 0.20, 0.70, 0.00],  # 2
    [0.40, 0.40, 0.20, 1.00, 0.30, 0.25],  # 3
    [0.20, 0.60, 0.70, 0.30, 1.00, 0.50],  # 4
    [0.05, 0.10, 0.00, 0.25, 0.50, 1.00],  # 5
])
IDS = torch.tensor([[0, 2, 4], [1, 3, 5]])


def oracle(ids, sim, k_primary, rho, protected=None, row_mask=None):
    """The definition, slot by slot, in plain Python (float32 comparisons, as documented)."""
    ids_l, sim_l = ids.tolist(), sim.float().tolist()
    num_experts = len(sim_l)
    rho32 = torch.tensor(rho, dtype=torch.float32).item()
    rows = [True] * len(ids_l) if row_mask is None else row_mask.tolist()
    prot = [False] * num_experts if protected is None else protected.tolist()
    in_p = {e for row, on in zip(ids_l, rows) if on for e in row[:k_primary] if 0 <= e < num_experts}
    out = [list(row) for row in ids_l]
    for t, row in enumerate(ids_l):
        for j in range(k_primary, len(row)):
            e = row[j]
            if not rows[t] or not 0 <= e < num_experts or e in in_p or prot[e]:
                continue
            cands = [(sim_l[e][p], p) for p in sorted(in_p) if not math.isnan(sim_l[e][p])]
            cands = [(s, p) for s, p in cands if s > -math.inf]
            if not cands:
                continue
            best = max(s for s, _ in cands)
            target = min(p for s, p in cands if s == best)
            if best >= rho32:
                out[t][j] = target
    return torch.tensor(out, dtype=ids.dtype)


# --------------------------------------------------------------------------- known answers
# k_primary=1: P = {0, 1}. Secondary slots: 2 -> 0 (0.8), 4 -> 1 (0.6; 2 has 0.7 but is not in P),
# 3 -> tie 0.4/0.4 -> 0 (lowest id), 5 -> 1 (0.1; sim[1, 5] = 0.9 is the wrong direction).
@pytest.mark.parametrize("rho, expected", [
    (0.9, [[0, 2, 4], [1, 3, 5]]),
    (0.5, [[0, 0, 1], [1, 3, 5]]),
    (0.4, [[0, 0, 1], [1, 0, 5]]),   # equality passes (>=), tie -> lowest id
    (0.1, [[0, 0, 1], [1, 0, 1]]),
    (0.0, [[0, 0, 1], [1, 0, 1]]),
])
def test_known_answer_k_primary_1(rho, expected):
    assert reroute(IDS, SIM6, 1, rho).tolist() == expected


# k_primary=2: P = {0, 1, 2, 3}. 4 -> 2 (0.7), 5 -> 3 (0.25).
@pytest.mark.parametrize("rho, expected", [
    (0.5, [[0, 2, 2], [1, 3, 5]]),
    (0.2, [[0, 2, 2], [1, 3, 3]]),
])
def test_known_answer_k_primary_2(rho, expected):
    assert reroute(IDS, SIM6, 2, rho).tolist() == expected


def test_protected_source_never_moves():
    protected = torch.zeros(6, dtype=torch.bool)
    protected[4] = True
    assert reroute(IDS, SIM6, 1, 0.5, protected).tolist() == [[0, 0, 4], [1, 3, 5]]


def test_protection_does_not_change_p_or_attract():
    protected = torch.zeros(6, dtype=torch.bool)
    protected[[0, 2]] = True    # 0 is in P and still attracts; 2 is a secondary source and stays
    assert reroute(IDS, SIM6, 1, 0.5, protected).tolist() == [[0, 2, 1], [1, 3, 5]]
    assert primary_mask(IDS, 6, 1).tolist() == [True, True, False, False, False, False]


def test_row_mask_known_answers():
    # Only row 0: P = {0}; row 1 untouched. 2 -> 0 (0.8); 4 -> 0 only at 0.2 < 0.5: stays.
    got = reroute(IDS, SIM6, 1, 0.5, row_mask=torch.tensor([True, False]))
    assert got.tolist() == [[0, 0, 4], [1, 3, 5]]
    # Only row 1: P = {1}; 3 -> 1 (0.4), 5 -> 1 (0.1); row 0 untouched.
    got = reroute(IDS, SIM6, 1, 0.1, row_mask=torch.tensor([False, True]))
    assert got.tolist() == [[0, 2, 4], [1, 1, 1]]
    # No row: P empty, nothing moves whatever rho.
    got = reroute(IDS, SIM6, 1, -math.inf, row_mask=torch.tensor([False, False]))
    assert torch.equal(got, IDS)


def test_k_primary_at_least_k_is_identity():
    for k_primary in (3, 4, 10):
        got = reroute(IDS, SIM6, k_primary, 0.0)
        assert torch.equal(got, IDS) and got.data_ptr() != IDS.data_ptr()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dtype_preserved(dtype):
    got = reroute(IDS.to(dtype), SIM6, 1, 0.5)
    assert got.dtype == dtype and got.tolist() == [[0, 0, 1], [1, 3, 5]]


def test_invalid_ids_ignored_and_nan_never_attracts():
    ids = torch.tensor([[-1, 0, 4], [1, -1, 5]])
    sim = SIM6.clone()
    sim[4, 1] = float("nan")
    # P = {1} (the -1 primary is ignored). 0 -> 1 (0.1); 4 -> 1 is NaN: no finite candidate, stays.
    assert reroute(ids, sim, 1, 0.0).tolist() == [[-1, 1, 4], [1, -1, 1]]


def test_similarity_dtype_compared_in_float32():
    sim = SIM6.to(torch.bfloat16)
    assert torch.equal(reroute(IDS, sim, 1, 0.3), oracle(IDS, sim, 1, 0.3))


def test_argument_checks():
    with pytest.raises(ValueError):
        reroute(IDS.float(), SIM6, 1, 0.5)
    with pytest.raises(ValueError):
        reroute(IDS, SIM6[:, :5], 1, 0.5)
    with pytest.raises(ValueError):
        reroute(IDS, SIM6, 0, 0.5)
    with pytest.raises(ValueError):
        reroute(IDS, SIM6, 1, torch.tensor(0.5))
    with pytest.raises(ValueError):
        reroute(IDS, SIM6, 1, 0.5, protected=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError):
        reroute(IDS, SIM6, 1, 0.5, row_mask=torch.ones(2))


def test_stats():
    new = reroute(IDS, SIM6, 1, 0.5)          # [[0, 0, 1], [1, 3, 5]]
    assert expert_union(IDS) == 6 and expert_union(new) == 4
    assert expert_union(torch.tensor([[-1, 2, 2]])) == 1
    stats = reroute_stats(IDS, new, k_primary=1)
    assert stats == {"experts_before": 6, "experts_after": 4, "experts_saved": 2,
                     "slots_moved": 2, "slots_considered": 4, "moved_fraction": 0.5}
    assert reroute_stats(IDS, new)["moved_fraction"] == pytest.approx(2 / 6)


# --------------------------------------------------------------------------- properties
@st.composite
def cases(draw):
    num_experts = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(6, num_experts)))
    num_tokens = draw(st.integers(1, 6))
    k_primary = draw(st.integers(1, k + 1))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).topk(k).indices
    levels = draw(st.sampled_from([4, 1000]))               # 4 levels: many ties
    sim = torch.randint(0, levels + 1, (num_experts, num_experts), generator=g) / levels
    rho = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]))
    protected = torch.rand(num_experts, generator=g) < 0.3 if draw(st.booleans()) else None
    row_mask = torch.rand(num_tokens, generator=g) < 0.7 if draw(st.booleans()) else None
    return ids, sim, k_primary, rho, protected, row_mask


@settings(max_examples=150, deadline=None)
@given(cases())
def test_properties(case):
    ids, sim, k_primary, rho, protected, row_mask = case
    new = reroute(ids, sim, k_primary, rho, protected, row_mask)
    assert torch.equal(new, oracle(ids, sim, k_primary, rho, protected, row_mask))
    in_p = primary_mask(ids, sim.shape[0], k_primary, row_mask)
    assert torch.equal(new[:, :k_primary], ids[:, :k_primary])          # primaries never change
    moved = new != ids
    assert bool(in_p[new[moved]].all())                                  # a move lands in P
    if protected is not None:
        assert not bool((moved & protected[ids]).any())                  # protected never moves
    if row_mask is not None:
        assert not bool(moved[~row_mask].any())                          # masked-out rows untouched
    assert expert_union(new) <= expert_union(ids)
    assert torch.equal(reroute(new, sim, k_primary, rho, protected, row_mask), new)   # idempotent


@settings(max_examples=50, deadline=None)
@given(cases())
def test_rho_zero_reroutes_every_secondary_outside_p(case):
    ids, sim, k_primary, _, _, _ = case
    new = reroute(ids, sim, k_primary, 0.0)       # similarities in [0, 1]: every candidate passes
    in_p = primary_mask(ids, sim.shape[0], k_primary)
    assert bool(in_p[new[:, k_primary:]].all())

"""SERE's trivial routing baselines (issue 31): random_p and top_p, plain torch."""

from __future__ import annotations

import pytest
import torch

from harness.techniques.moe_routing import random_p, routing_settings, top_p


def _router(t=6, e=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    ids = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices
    return logits, ids


def test_random_p_moves_only_secondary_slots_outside_p_into_p():
    logits, ids = _router()
    new = random_p(ids, 2, 16, torch.Generator().manual_seed(0))
    p = set(ids[:, :2].reshape(-1).tolist())
    assert torch.equal(new[:, :2], ids[:, :2])
    for old_e, new_e in zip(ids[:, 2:].reshape(-1).tolist(), new[:, 2:].reshape(-1).tolist()):
        assert new_e == old_e if old_e in p else new_e in p
    assert set(new.reshape(-1).tolist()) == p  # the union after is exactly P (SERE's at rho = 0)


def test_random_p_is_seeded_uniform_and_skips_dead_rows():
    logits, ids = _router(t=1, e=64, k=8, seed=1)
    ids = torch.cat([ids, ids])  # row 1 is finished
    live = torch.tensor([True, False])
    picks = torch.stack([random_p(ids, 2, 64, torch.Generator().manual_seed(s), live)[0, 2:] for s in range(300)])
    again = torch.stack([random_p(ids, 2, 64, torch.Generator().manual_seed(s), live)[0, 2:] for s in range(300)])
    assert torch.equal(picks, again)
    members = ids[0, :2].tolist()
    share = (picks == members[0]).float().mean().item()  # 2 members: each about half of the moves
    assert 0.4 < share < 0.6
    assert torch.equal(random_p(ids, 2, 64, torch.Generator().manual_seed(0), live)[1], ids[1])


def test_top_p_keeps_the_fewest_slots_reaching_p_renormalised():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    ids = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
    w, new = top_p(logits, ids, 0.75)
    # row 0: 0.5 < 0.75, 0.5 + 0.3 reaches it → 2 slots; row 1: 0.2 + 0.2 + 0.2 + 0.2 → all 4 (0.6 < 0.75)
    assert torch.allclose(w[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert new[0].tolist() == [0, 1, 0, 0]  # dropped slots: the row's first expert, weight 0
    assert torch.allclose(w[1], torch.full((4,), 0.25)) and torch.equal(new[1], ids[1])
    w1, new1 = top_p(logits, ids, 0.01)  # at least one expert
    assert w1[:, 0].tolist() == [1.0, 1.0] and (w1[:, 1:] == 0).all()
    w_all, new_all = top_p(logits, ids, 1.0)  # p = 1 keeps the router's top-k, renormalised as it does
    probs = torch.softmax(logits, -1).gather(1, ids)
    assert torch.allclose(w_all, probs / probs.sum(1, keepdim=True)) and torch.equal(new_all, ids)


def test_top_p_output_equals_dropping_the_slots():
    logits, ids = _router(t=8, e=16, k=4, seed=3)
    w, new = top_p(logits, ids, 0.4)
    experts = torch.randn(16, 5, dtype=torch.float64)  # expert e's output: a fixed vector
    padded = (w.double()[:, :, None] * experts[new]).sum(1)
    kept = w > 0
    dropped = torch.stack([(w[r][kept[r]].double()[:, None] * experts[ids[r][kept[r]]]).sum(0) for r in range(8)])
    assert torch.allclose(padded, dropped)


def test_routing_settings():
    assert routing_settings({"routing": None}) is None
    s = routing_settings({"routing": "random_p", "k_primary": 1, "p": 0.5, "seed": 4})
    assert (s.routing, s.k_primary, s.seed) == ("random_p", 1, 4)
    for bad in ({"routing": "nope"}, {"routing": "top_p", "p": 0.0}, {"routing": "random_p", "k_primary": 0}):
        with pytest.raises(ValueError):
            routing_settings(bad)

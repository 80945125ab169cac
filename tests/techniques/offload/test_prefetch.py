"""Prefetch admission on scripted accesses (no model): demand loads never wait behind speculative ones, a
prefetch never evicts a recently used or predicted expert, caps per layer / in flight, unchanged accounting."""

from __future__ import annotations

import pytest
import torch

from harness.techniques.offload.cache import ExpertCache
from harness.techniques.offload.policies import rank_gate_guess
from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy
from harness.techniques.offload.prefetch import PrefetchSettings, prefetch_settings


class Handle:
    def __init__(self, name):
        self.name, self.finished = name, False


class FakeMover:
    """Records every load (and on which stream it would run); copies finish only when told (like a busy GPU)."""

    def __init__(self):
        self.loads, self.mode, self.handles = [], None, []

    def set_streams(self, mode):
        self.mode = mode

    def load(self, cache, layer, expert, slot, prefetch, after=None):
        h = Handle(f"{'pf' if prefetch else 'dm'}{layer}.{expert}")
        self.loads.append({"layer": layer, "expert": expert, "slot": slot, "stream": "prefetch" if prefetch
                           else "demand", "after": after})
        self.handles.append(h)
        return h

    def done(self, h):
        return h is None or h.finished

    def wait(self, cache, handles):
        pass

    def record_read(self, layer):
        pass

    def unmap(self, layer, expert):
        pass

    def end_pass(self, cache):
        pass

    def drain(self, cache):
        for h in self.handles:
            h.finished = True

    def finish_all(self):
        self.drain(None)


def make(capacity=2, layers=2, experts=8, settings=None, mover=None, policy="lru"):
    geo = Geometry(layers, experts, 1, capacity, 10)
    pol = make_policy(policy, PolicyContext(geo))
    return ExpertCache(geo, pol, mover, prefetch=settings or PrefetchSettings()), pol


def step(cache, layer_sets, prefetch_after=None):
    """One decode pass: layer l computes ``layer_sets[l]``; after layer l, ``prefetch_after[l]`` pairs."""
    cache.begin_pass("decode", rows=1, row_tokens=1)
    for layer, experts in enumerate(layer_sets):
        cache.acquire(layer, sorted(experts))
        cache.release(layer)
        if prefetch_after and prefetch_after.get(layer):
            cache.prefetch(prefetch_after[layer])
    cache.end_pass()


def test_defaults_and_settings_from_config():
    d = PrefetchSettings()
    assert (d.max_per_layer, d.max_inflight, d.protect_tokens, d.stream) == (1, 2, 2, "separate")
    assert prefetch_settings({"prefetch": {"max_per_layer": 3, "stream": "shared"}}) == PrefetchSettings(
        max_per_layer=3, stream="shared")
    assert prefetch_settings({}) == d
    with pytest.raises(ValueError, match="max_inflight"):
        PrefetchSettings(max_inflight=-1)
    with pytest.raises(ValueError, match="stream"):
        PrefetchSettings(stream="priority")


def test_demand_loads_never_queue_behind_prefetches():
    mover = FakeMover()
    cache, _ = make(capacity=4, settings=PrefetchSettings(max_per_layer=0, max_inflight=1, protect_tokens=0),
                    mover=mover)
    assert mover.mode == "separate"
    # layer 0 computes {0}; the gate then guesses 1, 2, 3 for layer 1: only one prefetch copy may be in flight
    step(cache, [{0}, {5}], {0: [(1, 1), (1, 2), (1, 3)]})
    kinds = [(x["stream"], x["layer"], x["expert"]) for x in mover.loads]
    # demand load of layer 1's expert 5 is issued although the prefetch is still copying (never finished)
    assert kinds == [("demand", 0, 0), ("prefetch", 1, 1), ("demand", 1, 5)]
    s = cache.summary()
    assert s["prefetch_issued"] == 1 and s["prefetch_throttled"] == 2 and s["misses"] == 2


def test_slot_reuse_waits_on_an_unfinished_prefetch():
    mover = FakeMover()
    cache, _ = make(capacity=1, settings=PrefetchSettings(max_per_layer=0, max_inflight=0, protect_tokens=0),
                    mover=mover)
    step(cache, [{0}, {1}])
    for h in mover.handles:
        h.finished = True
    # after layer 0, prefetch layer-1 expert 2 (evicts 1, slot 0); layer 1 needs 3: the demand load evicts the
    # still-copying prefetch and must be ordered after it in the same slot
    step(cache, [{0}, {3}], {0: [(1, 2)]})
    pf = [x for x in mover.loads if x["stream"] == "prefetch"]
    dm = mover.loads[-1]
    assert pf and dm["stream"] == "demand" and dm["expert"] == 3 and dm["slot"] == pf[0]["slot"]
    assert dm["after"] is mover.handles[len(mover.loads) - 2] and dm["after"].name == "pf1.2"
    s = cache.summary()
    assert s["prefetch_wasted"] == 1 and s["wasted_bytes"] == 10 and s["prefetch_precision"] == 0.0


def test_prefetch_never_evicts_a_recently_used_expert():
    # 1 slot per layer; layer 1 used expert 4 in this token; a guess for layer 1 finds only a protected slot
    cache, pol = make(capacity=1, settings=PrefetchSettings(max_per_layer=0, max_inflight=0, protect_tokens=2))
    evicted = []
    pol.on_evict = lambda layer, e, clock: evicted.append((layer, e))  # type: ignore[method-assign]
    step(cache, [{0}, {4}])
    step(cache, [{0}, {4}], {0: [(1, 6)]})  # 4 used 1 token ago: protected → dropped
    assert cache.summary()["prefetch_dropped"] == 1 and evicted == [] and cache.resident(1) == [4]
    step(cache, [{0}, {5}])  # the demand load may evict 4 (demand is never restricted)
    assert evicted == [(1, 4)]
    # 5 used in this token; three tokens later (protection 2) it is no longer protected
    step(cache, [{0}, set()])
    step(cache, [{0}, set()])
    step(cache, [{0}, set()], {0: [(1, 6)]})
    assert evicted[-1] == (1, 5) and cache.resident(1) == [6]


def test_prefetch_never_evicts_an_expert_it_predicts():
    # layer 1 holds 0 (older) and 1 (newer); the guess is [2, 0]: LRU alone would evict 0, but 0 is predicted
    cache, pol = make(capacity=2, settings=PrefetchSettings(max_per_layer=0, max_inflight=0, protect_tokens=0))
    step(cache, [{7}, {0}])
    step(cache, [{7}, {1}])
    evicted = []
    pol.on_evict = lambda layer, e, clock: evicted.append(e)  # type: ignore[method-assign]
    step(cache, [{7}, {0}], {0: [(1, 2), (1, 0)]})
    assert evicted == [1] and cache.resident(1) == [0, 2]
    s = cache.summary()
    assert s["prefetch_redundant"] == 1 and s["prefetch_issued"] == 1


def test_cap_per_layer_keeps_the_best_ranked_and_accounting_counts_issued_only():
    cache, _ = make(capacity=4, settings=PrefetchSettings(max_per_layer=1, max_inflight=0, protect_tokens=0))
    step(cache, [{0}, {5}], {0: [(1, 5), (1, 6), (1, 7)]})  # best first: 5 (issued), 6 and 7 capped
    s = cache.summary()
    assert s["prefetch_issued"] == 1 and s["prefetch_capped"] == 2 and s["prefetch_used"] == 1
    assert s["prefetch_precision"] == 1.0 and s["misses"] == 1 and s["h2d_bytes_decode"] == 20


def test_legacy_settings_issue_every_guess():
    cache, _ = make(capacity=4, settings=PrefetchSettings.legacy())
    step(cache, [{0}, {5}], {0: [(1, 5), (1, 6), (1, 7)]})
    s = cache.summary()
    assert s["prefetch_issued"] == 3 and s["prefetch_used"] == 1 and s["prefetch_precision"] == pytest.approx(1 / 3)
    assert s["prefetch_capped"] == s["prefetch_throttled"] == s["prefetch_dropped"] == 0


def test_gate_guess_ranking():
    # rows' top-k best first: 3 is named by both rows, then 1 (rank 0 in a row) before 2 and 4 (rank 1)
    ids = torch.tensor([[1, 3], [3, 2], [4, 3]])
    assert rank_gate_guess(ids, 8) == [3, 1, 4, 2]
    assert rank_gate_guess(torch.tensor([[9, 0]]), 8) == [0]  # out of range ignored


def test_lease_drops_the_lease_of_a_refused_prefetch():
    import harness.techniques.offload.lease  # noqa: F401 - registers "lease"

    geo = Geometry(2, 8, 1, 4, 10)
    gate = lambda layer, hidden: torch.tensor([[5, 6, 7]])  # noqa: E731
    pol = make_policy("lease", PolicyContext(geo, {"threshold": 0.5, "lease": {"score": "recency"}}, None, gate))
    cache = ExpertCache(geo, pol, None, prefetch=PrefetchSettings(max_per_layer=1, max_inflight=0, protect_tokens=0))
    cache.begin_pass("decode", rows=1, row_tokens=1)
    cache.acquire(0, [0])
    cache.release(0)
    cache.prefetch(pol.prefetch(0, cache.clock, hidden=0))
    assert cache.resident(1) == [5] and set(pol.leases[1]) == {5}  # 6, 7 refused: no lease without the expert

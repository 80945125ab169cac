"""Issue 31's trivial offload baselines, ``lfu`` and ``static_hot``, on scripted traces (no model)."""

from __future__ import annotations

import torch

from harness.techniques.offload.policies import LFUPolicy, StaticHotPolicy, trace_counts
from harness.techniques.offload.policy import Clock, Geometry, PolicyContext, make_policy
from harness.techniques.offload.simulate import simulate

CLOCK = Clock(0, "decode", 1, 1, 0.0)


def _steps(rows):
    """One decode step per entry: a batch of 1 row, 1 MoE layer, top-1."""
    return [torch.tensor([[[e]]]) for e in rows]


def test_lfu_evicts_the_least_frequent_then_the_least_recent():
    pol = make_policy("lfu", PolicyContext(Geometry(1, 8, 1, 3, 1)))
    assert isinstance(pol, LFUPolicy)
    for experts in ([0], [0], [0], [1], [2], [1]):  # counts: 0→3, 1→2, 2→1
        pol.on_access(0, experts, CLOCK)
    assert pol.choose_victims(0, 1, [0, 1, 2], CLOCK) == [2]
    assert pol.choose_victims(0, 2, [0, 1, 2], CLOCK) == [2, 1]
    pol.on_access(0, [2], CLOCK)  # 1 and 2 tie at 2 uses: the least recent (1) goes first
    assert pol.choose_victims(0, 1, [0, 1, 2], CLOCK) == [1]


def test_lfu_keeps_a_frequent_expert_that_lru_would_evict():
    # expert 0 is used often, then a scan of 1, 2, 3 (capacity 2): LRU forgets 0, LFU keeps it
    rows = [0, 0, 0, 0, 1, 2, 0, 3, 0, 1, 0]
    lfu = simulate(_steps(rows), "lfu", 2, 8, warm_after=0)
    lru = simulate(_steps(rows), "lru", 2, 8, warm_after=0)
    assert lfu["hit_rate"] > lru["hit_rate"], (lfu["hit_rate"], lru["hit_rate"])


def test_static_hot_pins_the_trace_hottest_experts():
    trace_ids = torch.tensor([[[0]], [[0]], [[0]], [[1]], [[1]], [[2]], [[3]]])  # hot: 0 (3), 1 (2)
    assert trace_counts(trace_ids, 1, 4) == [[3, 2, 1, 1]]

    class Trace:
        ids = trace_ids

    pol = make_policy("static_hot", PolicyContext(Geometry(1, 4, 1, 2, 1), trace=Trace()))
    assert isinstance(pol, StaticHotPolicy) and pol.hot == [[0, 1]]
    assert pol.choose_victims(0, 1, [0, 1, 3], CLOCK) == [3]  # never a hot one while a cold one is there
    assert pol.choose_victims(0, 1, [0, 1], CLOCK) == [1] and pol.stats()["hot_evictions"] == 1


def test_static_hot_beats_lru_on_a_scan_and_is_refused_without_a_trace():
    rows = [0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 6, 7, 0, 1]  # 0, 1 recur; a scan of cold experts between
    hot = simulate(_steps(rows), "static_hot", 2, 8, warm_after=0)  # trace = the steps themselves (in-sample)
    lru = simulate(_steps(rows), "lru", 2, 8, warm_after=0)
    assert hot["hit_rate"] > lru["hit_rate"], (hot["hit_rate"], lru["hit_rate"])
    try:
        make_policy("static_hot", PolicyContext(Geometry(1, 4, 1, 2, 1)))
    except ValueError as e:
        assert "trace" in str(e)
    else:
        raise AssertionError("static_hot without a trace was accepted")

"""The lease policy's state machine on scripted traces: leases, grace in tokens and in ms (scripted clock),
the dynamic grace rule, the eviction / pre-emption order, long leases from the threshold, the warm-up re-base,
and the policy inside the real cache bookkeeping (simulate)."""

from __future__ import annotations

import pytest

from harness.techniques.offload.lease import LeasePolicy, LeaseSettings, dynamic_grace_ms, lease_params
from harness.techniques.offload.policy import Clock, Geometry, PolicyContext, make_policy


def clock(tokens: int, ms: float = 0.0, phase: str = "decode") -> Clock:
    return Clock(pass_index=tokens, phase=phase, step=tokens, tokens=tokens, ms=ms)


def policy(capacity: int = 4, experts: int = 8, layers: int = 1, **lease) -> LeasePolicy:
    threshold = lease.pop("threshold", 0.5)
    lease.setdefault("score", "none")
    lease.setdefault("prefetch", "none")
    g = Geometry(layers, experts, 2, capacity, 100)
    return make_policy("lease", PolicyContext(g, {"threshold": threshold, "lease": lease}))


def step(p: LeasePolicy, tokens: int, ms: float = 0.0, access: dict[int, list[int]] | None = None) -> Clock:
    c = clock(tokens, ms)
    p.begin_pass(c)
    for layer, experts in (access or {}).items():
        p.on_access(layer, experts, c)
    p.end_pass(c)
    return c


def test_lease_then_grace_in_tokens_then_free():
    p = policy(length=2, grace_ms=0, grace_tokens=3)
    step(p, 1, access={0: [5]})  # lease covers tokens 1..3
    for t in (2, 3):
        assert p.lease_state(0, 5, step(p, t)) == "leased"
    for t in (4, 5, 6):  # grace: 3 tokens
        assert p.lease_state(0, 5, step(p, t)) == "grace"
    assert p.lease_state(0, 5, step(p, 7)) == "free"
    assert p.stats()["grace_started"] == 1
    assert p.lease_state(0, 6, clock(7)) == "untracked"


def test_grace_in_ms_with_a_scripted_clock():
    p = policy(length=1, grace_ms=200.0, grace_tokens=0)
    step(p, 1, ms=0.0, access={0: [3]})  # leased through token 2
    assert p.lease_state(0, 3, step(p, 2, ms=10.0)) == "leased"
    c = step(p, 3, ms=20.0)  # expired: grace until 20 + 200 ms
    assert p.lease_state(0, 3, c) == "grace"
    assert p.lease_state(0, 3, step(p, 50, ms=219.0)) == "grace"  # many tokens, but not 200 ms
    assert p.lease_state(0, 3, step(p, 51, ms=220.0)) == "free"


def test_grace_needs_both_tokens_and_ms():
    p = policy(length=1, grace_ms=100.0, grace_tokens=5)
    step(p, 1, ms=0.0, access={0: [1]})
    step(p, 2, ms=1.0)
    step(p, 3, ms=2.0)  # grace starts: tokens 3..7, ms < 102
    assert p.lease_state(0, 1, step(p, 8, ms=50.0)) == "grace"  # tokens over, ms not
    assert p.lease_state(0, 1, step(p, 9, ms=500.0)) == "free"
    q = policy(length=1, grace_ms=100.0, grace_tokens=5)
    step(q, 1, ms=0.0, access={0: [1]})
    step(q, 3, ms=2.0)
    assert q.lease_state(0, 1, step(q, 4, ms=500.0)) == "grace"  # ms over, tokens not
    assert q.lease_state(0, 1, step(q, 8, ms=501.0)) == "free"


def test_dynamic_grace_follows_memory_utilisation():
    assert dynamic_grace_ms(0.0) == 150.0 and dynamic_grace_ms(1.0) == 200.0 and dynamic_grace_ms(0.5) == 175.0
    assert dynamic_grace_ms(3.0) == 200.0  # clamped
    p = policy(capacity=4, length=1, grace_mode="dynamic", grace_tokens=0)
    step(p, 1, ms=0.0, access={0: [0, 1]})  # 2 of 4 slots held
    step(p, 2, ms=1.0)
    c = step(p, 3, ms=10.0)  # both expire now; the first sees 2 held, the second 2 held (grace counts)
    recs = p.leases[0]
    assert recs[0].grace_ms_end == pytest.approx(10.0 + dynamic_grace_ms(2 / 4))
    assert p.lease_state(0, 0, c) == "grace"
    assert p.lease_state(0, 0, step(p, 4, ms=10.0 + 174.0)) == "grace"
    assert p.lease_state(0, 0, step(p, 5, ms=10.0 + 176.0)) == "free"


def test_renewal_extends_and_a_longer_lease_is_kept():
    p = policy(length=2, grace_ms=0)
    step(p, 1, access={0: [2]})
    step(p, 2, access={0: [2]})  # renewed: now through token 4
    assert p.leases[0][2].until == 4 and p.stats()["renewed"] == 1
    assert p.lease_state(0, 2, step(p, 4)) == "leased"
    assert p.lease_state(0, 2, step(p, 5)) == "free"


def test_eviction_order_and_preemption_counts():
    p = policy(capacity=4, experts=8, length=3, long_length=10, grace_ms=0, grace_tokens=2, score="recency",
               threshold=0.4)
    step(p, 1, access={0: [0, 1]})
    step(p, 2, access={0: [0, 1]})  # recency of 0 and 1 at token 3 = 2/5 = 0.4 >= threshold
    step(p, 3, access={0: [0, 2]})  # 0: long lease (not pre-emptible); 2: short lease
    assert not p.leases[0][0].preemptible and p.leases[0][2].preemptible
    step(p, 4, access={0: [3]})
    step(p, 5)
    step(p, 6, access={0: [3]})
    # token 7: 1 (lease ended at 5) is in grace 6..7; 2 leased to 6 -> grace 7..8; 3 leased to 9; 0 long to 13
    c = step(p, 7)
    states = {e: p.lease_state(0, e, c) for e in range(4)}
    assert states == {0: "leased", 1: "grace", 2: "grace", 3: "leased"}
    c = step(p, 8)
    assert p.lease_state(0, 1, c) == "free" and p.lease_state(0, 2, c) == "grace"
    order = p.choose_victims(0, 4, [0, 1, 2, 3], c)
    assert order == [1, 2, 3, 0]  # free, grace, pre-emptible lease, then the long lease
    s = p.stats()
    assert (s["evict_free"], s["evict_grace"], s["preempted"], s["forced"]) == (1, 1, 1, 1)
    assert s["long"] >= 1 and s["peak_long_leases"] >= 1


def test_untracked_experts_go_first():
    p = policy(capacity=3, length=5)
    c = step(p, 1, access={0: [1]})
    assert p.choose_victims(0, 1, [1, 4], c) == [4]  # 4 was loaded without a lease (e.g. a dropped prefetch)
    assert p.stats()["evict_untracked"] == 1


def test_threshold_decides_long_leases_and_score_none_never_does():
    hi = policy(length=1, long_length=8, score="recency", threshold=0.2)
    for t in range(1, 4):
        step(hi, t, access={0: [6]})
    assert hi.leases[0][6].until == 3 + 8 and not hi.leases[0][6].preemptible
    lo = policy(length=1, long_length=8, score="recency", threshold=0.9)
    for t in range(1, 4):
        step(lo, t, access={0: [6]})
    assert lo.leases[0][6].until == 4 and lo.leases[0][6].preemptible
    none = policy(length=1, long_length=8, score="none", threshold=0.0)
    for t in range(1, 4):
        step(none, t, access={0: [6]})
    assert none.stats()["long"] == 0


def test_lease_and_grace_hits_are_counted_per_access():
    p = policy(length=1, grace_tokens=2, grace_ms=0)
    step(p, 1, access={0: [0]})
    step(p, 2, access={0: [0]})  # leased -> lease hit
    step(p, 4, access={0: [0]})  # lease ended at 3, grace 4..5 -> grace hit
    step(p, 9, access={0: [0]})  # free -> neither
    s = p.stats()
    assert (s["accesses"], s["lease_hits"], s["grace_hits"]) == (4, 1, 1)
    assert s["lease_hit_rate"] == 0.25 and s["grace_hit_rate"] == 0.25


def test_reset_rebases_leases_on_the_new_token_clock():
    p = policy(length=4, grace_tokens=2, grace_ms=0)
    step(p, 10, ms=100.0, access={0: [1]})  # leased through 14
    p.on_reset(clock(0, 0.0))
    assert p.leases[0][1].until == 4 and p.stats()["accesses"] == 0
    assert p.lease_state(0, 1, step(p, 4)) == "leased"
    assert p.lease_state(0, 1, step(p, 5)) == "grace"


def test_prefill_resets_recency_and_grants_short_leases():
    p = policy(length=1, long_length=9, score="recency", threshold=0.2)
    step(p, 1, access={0: [2]})
    step(p, 2, access={0: [2]})
    c = clock(2, phase="prefill")
    p.begin_pass(c)
    p.on_access(0, [2, 3], c)
    assert p.score(0, 2) == 0.0 and p.leases[0][3].preemptible


def test_settings_from_config_and_refusals():
    from harness.config.schema import OffloadConfig

    params = lease_params(OffloadConfig(policy="lease", capacity=4, threshold=0.7), {"batch_size": 2})
    s = LeaseSettings.from_params(params)
    assert s.threshold == 0.7 and s.length == 2 and s.grace_ms == 200.0 and params["batch_size"] == 2
    with pytest.raises(ValueError, match="unknown offload.lease keys"):
        LeaseSettings.from_params({"lease": {"lenght": 3}})
    with pytest.raises(ValueError, match="predictor"):
        LeaseSettings.from_params({"lease": {"score": "predictor"}})
    with pytest.raises(ValueError, match="threshold"):
        LeaseSettings.from_params({"threshold": 2.0})


def test_lease_in_the_cache_bookkeeping_on_a_scripted_trace():
    """simulate(): the cache asks the policy for victims; with capacity 2 and a 3-expert cycle every access
    misses under LRU; the lease policy behaves like LRU there, and its own counters add up."""
    from harness.techniques.offload.simulate import simulate

    steps = [[[[e]]] for e in [0, 1, 2] * 4]  # B=1, L=1, k=1
    lease = simulate(steps, "lease", capacity=2, num_experts=4, params={"lease": {"score": "none",
                                                                                  "prefetch": "none"}})
    lru = simulate(steps, "lru", capacity=2, num_experts=4)
    assert lease["misses"] == lru["misses"] == 12 and lease["evictions"] == 10
    ps = lease["policy_stats"]
    assert ps["accesses"] == 12 and ps["evict_free"] + ps["evict_grace"] + ps["preempted"] + ps["forced"] \
        + ps["evict_untracked"] == 10
    # a 2-expert working set fits: all hits after the two compulsory misses
    steps = [[[[e]]] for e in [0, 1] * 6]
    out = simulate(steps, "lease", capacity=2, num_experts=4, params={"lease": {"score": "recency"}})
    assert out["misses"] == 2 and out["hits"] == 10 and out["policy_stats"]["lease_hits"] >= 9


def test_a_chunked_layer_counts_once_in_the_recency_window():
    p = policy(length=1, score="recency")
    c = clock(1)
    p.begin_pass(c)
    p.on_access(0, [0, 1], c)  # two chunks of one layer in one pass
    p.on_access(0, [2], c)
    assert len(p._recent[0]) == 1 and p._recent[0][0] == frozenset({0, 1, 2})
    step(p, 2, access={0: [2]})
    assert p.score(0, 2) == pytest.approx(2 / 5) and p.score(0, 0) == pytest.approx(1 / 5)

"""Every rule of every policy's contract (the policy docstrings), one test per rule, each written so that
breaking the rule (a flipped tie-break, an off-by-one at the oracle's look-ahead boundary, a lost hook) fails
it. Scripted clocks and candidates only: no tensors beyond tiny id lists, no timing."""

from __future__ import annotations

import pytest
import torch

import harness.techniques.offload.lease  # noqa: F401 - registers "lease"
from harness.techniques.offload.cache import ExpertCache
from harness.techniques.offload.gate_read import GateReader
from harness.techniques.offload.policies import rank_gate_guess
from harness.techniques.offload.policy import Clock, Geometry, OffloadPolicy, PolicyContext, make_policy
from harness.techniques.offload.prefetch import PrefetchSettings


def clk(tokens: int = 1, phase: str = "decode", ms: float = 0.0) -> Clock:
    return Clock(pass_index=tokens, phase=phase, step=tokens, tokens=tokens, ms=ms)


def make(name: str, layers: int = 2, experts: int = 8, capacity: int = 4, params=None, trace=None, gate=None):
    return make_policy(name, PolicyContext(Geometry(layers, experts, 2, capacity, 1), params or {}, trace, gate))


class Steps:
    """An oracle trace: ``steps_by_batch`` → per decode step ``[1, L, k]``."""

    def __init__(self, steps: list[list[list[int]]]):
        self.steps = [torch.tensor([s]) for s in steps]

    def steps_by_batch(self, batch_size: int):
        return self.steps


# -- lru ------------------------------------------------------------------------------------------------
def test_lru_evicts_least_recent_first():
    p = make("lru")
    for e in (3, 1, 2):
        p.on_access(0, [e], clk())
    assert p.choose_victims(0, 2, [1, 2, 3], clk()) == [3, 1]


def test_lru_never_used_goes_before_any_used_and_ties_go_to_the_lowest_id():
    p = make("lru")
    p.on_access(0, [6, 4], clk())  # one call: one tick for both
    assert p.choose_victims(0, 1, [6, 4, 7, 5], clk()) == [5]  # 5 and 7 never used: lowest id
    assert p.choose_victims(0, 3, [6, 4, 7, 5], clk()) == [5, 7, 4]  # 4 and 6 tie on the tick: lowest id


def test_lru_forgets_an_evicted_expert_and_keeps_layers_apart():
    p = make("lru")
    p.on_access(0, [2], clk())
    p.on_access(0, [1], clk())  # 1 more recent than 2
    p.on_evict(0, 1, clk())
    assert p.choose_victims(0, 1, [1, 2], clk()) == [1]  # reloaded, not yet used: never used, goes before 2
    p.on_access(1, [2], clk())  # layer 1's access does not refresh layer 0
    p.on_access(0, [3], clk())
    assert p.choose_victims(0, 1, [2, 3], clk()) == [2]


# -- lru+gate -------------------------------------------------------------------------------------------
def test_gate_prefetch_targets_the_next_layer_in_rank_order_and_counts_as_just_used():
    p = make("lru+gate", layers=3, gate=lambda layer, h: torch.tensor([[5, 2]]))
    p.on_access(1, [7], clk())
    assert list(p.prefetch(0, clk(), hidden=0)) == [(1, 5), (1, 2)]
    assert p.choose_victims(1, 1, [2, 5, 7], clk()) == [7]  # 2 and 5 were touched after 7


def test_gate_prefetch_only_in_decode_with_a_hidden_state_and_a_next_layer():
    p = make("lru+gate", layers=2, gate=lambda layer, h: torch.tensor([[5]]))
    assert list(p.prefetch(1, clk(), hidden=0)) == []  # last layer: nothing after it
    assert list(p.prefetch(0, clk(), hidden=None)) == []
    assert list(p.prefetch(0, clk(phase="prefill"), hidden=0)) == []
    q = make("lru+gate", layers=2, params={"prefetch_prefill": True}, gate=lambda layer, h: torch.tensor([[5]]))
    assert list(q.prefetch(0, clk(phase="prefill"), hidden=0)) == [(1, 5)]


def test_rank_gate_guess_count_then_best_rank_then_id():
    assert rank_gate_guess(torch.tensor([[2, 1], [1, 2]]), 8) == [1, 2]  # same count, same best rank: id
    assert rank_gate_guess(torch.tensor([[4, 1], [3, 1]]), 8) == [1, 3, 4]  # count first
    assert rank_gate_guess(torch.tensor([[4, 1], [3, 5]]), 8) == [3, 4, 1, 5]  # then best rank, then id
    assert rank_gate_guess([[6, 6, 9, 2]], 8) == [6, 2]  # one host row: its order, duplicates and out of range dropped
    assert rank_gate_guess([[1, 3], [3, 0]], 8) == [3, 1, 0]  # host rows ranked as tensor rows


# -- oracle ---------------------------------------------------------------------------------------------
def oracle(steps):
    return make("oracle", layers=1, trace=Steps([[s] for s in steps]))


def test_oracle_a_use_at_the_current_step_counts_as_the_next_use():
    # trace steps 0..2; decode clock.tokens=1 is trace step 0 (the boundary): 1 is used now, 2 at step 1
    p = oracle([[1, 0], [2, 0], [3, 0]])
    assert p.choose_victims(0, 1, [1, 2], clk(1)) == [2]
    assert p.choose_victims(0, 1, [1, 2], clk(2)) == [1]  # at step 1, 1 is never used again


def test_oracle_prefill_looks_ahead_from_the_next_decode_step():
    p = oracle([[1, 0], [2, 0]])
    # prefill at clock.tokens=0: now = 0 = the first decode step's trace index
    assert p.choose_victims(0, 1, [1, 2], clk(0, phase="prefill")) == [2]


def test_oracle_never_used_again_goes_first_then_farthest_then_lowest_id():
    p = oracle([[4, 5], [6, 7], [4, 7]])
    assert p.choose_victims(0, 1, [3, 4, 6], clk(1)) == [3]  # 3 never used
    assert p.choose_victims(0, 2, [1, 3, 4, 6], clk(1)) == [1, 3]  # both never used: lowest id first
    assert p.choose_victims(0, 1, [4, 6], clk(1)) == [6]  # 4 at step 0, 6 at step 1: farthest goes


def test_oracle_counts_steps_that_differ_from_the_trace_and_accesses_beyond_it():
    p = oracle([[1, 2]])
    p.on_access(0, [1, 2], clk(1))
    assert p.stats()["trace_mismatch_steps"] == 0
    p.on_access(0, [1, 3], clk(1))
    p.on_access(0, [1], clk(2))
    s = p.stats()
    assert s["trace_mismatch_steps"] == 1 and s["accesses_beyond_trace"] == 1
    p.on_access(0, [9], clk(0, phase="prefill"))  # a prefill is never checked against the decode trace
    p.on_access(0, [9], clk(5, phase="prefill"))
    s = p.stats()
    assert s["trace_mismatch_steps"] == 1 and s["accesses_beyond_trace"] == 1


# -- lfu / static_hot -----------------------------------------------------------------------------------
def test_lfu_count_then_recency_then_id_and_counts_survive_eviction():
    p = make("lfu")
    p.on_access(0, [1, 2], clk())
    p.on_access(0, [1], clk())
    p.on_evict(0, 1, clk())
    p.on_access(0, [3], clk())
    assert p.choose_victims(0, 1, [1, 2, 3], clk()) == [2]  # 1 keeps its count 2; 2 and 3 once, 2 less recent
    assert p.choose_victims(0, 2, [1, 2, 3], clk()) == [2, 3]
    q = make("lfu")
    q.on_access(0, [5, 4], clk())  # same count, same tick: lowest id
    assert q.choose_victims(0, 1, [4, 5], clk()) == [4]


def test_static_hot_evicts_the_coldest_and_on_ties_the_expert_outside_the_hot_set():
    tr = Steps([[[1, 2]], [[1, 3]]])
    p = make("static_hot", layers=1, capacity=2, trace=tr)
    assert p.hot == [[1, 2]]  # 1 twice; 2 and 3 once: the lower id wins the second slot
    assert p.choose_victims(0, 1, [1, 2, 3], clk()) == [3]  # tie on counts: the one the hot set left out
    assert p.choose_victims(0, 2, [1, 2, 3], clk()) == [3, 2] and p.stats()["hot_evictions"] == 1
    assert p.choose_victims(0, 1, [0, 1], clk()) == [0]  # never in the trace: count 0


# -- lease ----------------------------------------------------------------------------------------------
def lease(**kw):
    params = {"threshold": kw.pop("threshold", 0.5), "lease": {"score": "none", "prefetch": "none", **kw}}
    return make("lease", layers=2, experts=16, params=params)


def test_lease_victim_order_classes_and_id_tie_break():
    p = lease(length=1, grace_ms=0, grace_tokens=2)
    p.begin_pass(clk(1))
    p.on_access(0, [2], clk(1))  # leased through 2, grace 3..4, free from 5
    p.begin_pass(clk(3))
    p.on_access(0, [5, 4], clk(3))  # leased through 4, same score and end: lowest id first
    p.begin_pass(clk(3))
    assert [k[0] for k in (p.victim_key(0, e, clk(3)) for e in (9, 2, 4))] == [0, 2, 3]
    assert p.choose_victims(0, 4, [5, 4, 2, 9], clk(3)) == [9, 2, 4, 5]
    p.begin_pass(clk(5))
    assert p.victim_key(0, 2, clk(5))[0] == 1  # grace over: free


def test_lease_free_experts_least_recent_first_and_grace_earliest_end_first():
    p = lease(length=1, grace_ms=0, grace_tokens=1)
    p.begin_pass(clk(1))
    p.on_access(0, [7], clk(1))
    p.on_access(0, [3], clk(1))  # 3 used after 7
    for t in (2, 3, 4, 5):
        p.begin_pass(clk(t))
    assert p.choose_victims(0, 2, [3, 7], clk(5)) == [7, 3]  # both free: least recent first, not lowest id
    q = lease(length=1, grace_ms=0, grace_tokens=3)
    q.begin_pass(clk(1))
    q.on_access(0, [9], clk(1))  # grace ends at 2 + 3
    q.begin_pass(clk(2))
    q.on_access(0, [1], clk(2))  # grace ends at 3 + 3
    q.begin_pass(clk(4))
    assert q.choose_victims(0, 2, [1, 9], clk(4)) == [9, 1]


def test_lease_preemptible_lowest_score_first_and_long_leases_last():
    p = make("lease", layers=1, experts=16, params={"threshold": 0.5, "lease": {"score": "recency", "prefetch": "none",
                                                                               "length": 8, "long_length": 16}})
    for t in range(1, 5):  # 1 in every step: recency score reaches 0.6 -> a long, non-pre-emptible lease
        p.begin_pass(clk(t))
        p.on_access(0, [1] + ([2] if t == 4 else []), clk(t))
    p.begin_pass(clk(5))
    keys = {e: p.victim_key(0, e, clk(5)) for e in (1, 2)}
    assert keys[1][:2] == (3, 1) and keys[2][:2] == (3, 0)
    assert p.choose_victims(0, 1, [1, 2], clk(5)) == [2]
    assert p.stats()["preempted"] == 1 and p.stats()["forced"] == 0
    assert p.choose_victims(0, 1, [1], clk(5)) == [1] and p.stats()["forced"] == 1


def test_lease_prefetch_grants_only_for_issued_loads():
    g = Geometry(2, 8, 1, 4, 1)
    pol = make_policy("lease", PolicyContext(g, {"threshold": 0.5, "lease": {"score": "recency"}}, None,
                                             lambda layer, h: [[5, 6, 7]]))
    cache = ExpertCache(g, pol, None, prefetch=PrefetchSettings(max_per_layer=2, max_inflight=0, protect_tokens=0))
    cache.begin_pass("decode", rows=1, row_tokens=1)
    cache.acquire(0, [0])
    cache.release(0)
    pairs = list(pol.prefetch(0, cache.clock, hidden=0))
    assert pairs == [(1, 5), (1, 6), (1, 7)] and pol.leases[1] == {}  # asking grants nothing
    cache.prefetch(pairs)
    assert sorted(pol.leases[1]) == [5, 6] == cache.resident(1)
    assert all(r.preemptible and r.until == cache.clock.tokens + pol.s.length for r in pol.leases[1].values())


# -- the cache's hook order -----------------------------------------------------------------------------
class Recorder(OffloadPolicy):
    name = "recorder"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls: list[tuple] = []

    def on_access(self, layer, experts, clock):
        self.calls.append(("access", layer, tuple(experts)))

    def choose_victims(self, layer, n, candidates, clock):
        self.calls.append(("victims", layer))
        return list(candidates[:n])

    def prefetch(self, layer, clock, hidden=None):
        return [(layer + 1, 7)] if layer + 1 < self.geometry.num_layers else []

    def on_prefetch_issued(self, layer, experts, clock):
        self.calls.append(("issued", layer, tuple(experts)))

    def end_pass(self, clock):
        self.calls.append(("end",))


class Mover:
    """Counts when the cache records a layer's read (the kernel was issued)."""

    def __init__(self, log):
        self.log = log

    def load(self, cache, layer, expert, slot, prefetch, after=None):
        return None

    def done(self, h):
        return True

    def wait(self, cache, handles):
        pass

    def record_read(self, layer):
        self.log.append(("read", layer))

    def unmap(self, layer, expert):
        pass

    def end_pass(self, cache):
        pass

    def drain(self, cache):
        pass


def test_on_access_is_delivered_after_the_kernel_and_before_any_later_hook():
    g = Geometry(2, 8, 2, 2, 1)
    pol = Recorder(PolicyContext(g))
    mover = Mover(pol.calls)
    cache = ExpertCache(g, pol, mover, prefetch=PrefetchSettings.legacy())
    cache.begin_pass("decode", rows=1, row_tokens=1)
    cache.acquire(0, [0, 1])
    assert pol.calls == []  # nothing between the routing read and the kernel launch
    cache.release(0)
    assert pol.calls == [("read", 0), ("access", 0, (0, 1))]
    cache.prefetch(pol.prefetch(0, cache.clock))
    cache.acquire(1, [2, 3])  # 7 was prefetched into layer 1: a victim for the demand loads
    cache.acquire(1, [4])  # no release in between: the first chunk's on_access still comes before its victims
    cache.release(1)
    cache.end_pass()
    assert pol.calls[2:] == [("issued", 1, (7,)), ("victims", 1), ("access", 1, (2, 3)), ("victims", 1),
                             ("read", 1), ("access", 1, (4,)), ("end",)]


# -- the gate read --------------------------------------------------------------------------------------
def test_gate_reader_reads_the_next_guess_with_the_layer_and_answers_from_the_host():
    calls = []

    def router(layer, h):
        calls.append(layer)
        return torch.tensor([[layer * 10 + 1, layer * 10 + 2]])

    r = GateReader(router, num_layers=3)
    h = torch.zeros(1, 4)
    assert r.read(0, torch.tensor([[3, 4]]), h) == [[3, 4]]
    assert r(1, h) == [[11, 12]] and calls == [1] and r.reads == 1 and r.fallbacks == 0
    other = torch.zeros(1, 4)
    assert r(1, other).tolist() == [[11, 12]] and r.fallbacks == 1  # another hidden: the router itself
    assert r.read(2, torch.tensor([[5, 6]]), h) == [[5, 6]] and calls == [1, 1]  # last layer: no guess
    assert GateReader(None, 3).read(0, torch.tensor([[1, 2], [3, 4]]), h) == [[1, 2], [3, 4]]

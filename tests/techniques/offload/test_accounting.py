"""Cache bookkeeping on scripted traces (no model): hit/miss/bytes numbers computed by hand, LRU and Belady order."""

from __future__ import annotations

import pytest

from harness.techniques.offload.cache import ExpertCache
from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy
from harness.techniques.offload.simulate import replay, simulate


def one_layer(seq):
    """A 1-layer trace, one row, top-1: ``[[ [e] ]]`` per step."""
    return [[[[e]]] for e in seq]


def test_lru_hand_computed():
    # capacity 2, accesses 0 1 0 2 1 0: LRU → M M H M(evict 1) M(evict 0) M(evict 2) = 1 hit of 6
    out = simulate(one_layer([0, 1, 0, 2, 1, 0]), "lru", capacity=2, num_experts=4, expert_bytes=10, warm_after=3)
    assert (out["accesses"], out["hits"], out["misses"]) == (6, 1, 5)
    assert out["hit_rate"] == pytest.approx(1 / 6)
    assert out["hit_rate_cold"] == pytest.approx(1 / 3) and out["hit_rate_warm"] == 0.0
    assert out["evictions"] == 3 and out["compulsory_misses"] == 3
    assert out["h2d_bytes_decode"] == 50 and out["h2d_bytes_per_token"] == pytest.approx(50 / 6)
    assert out["new_experts_per_layer_token"] == pytest.approx(5 / 6)


def test_belady_hand_computed():
    # same trace, Belady: M M H M(evict 0? next use of 0 is t5, of 1 is t4 → evict 0) H M(evict 2 or 1: both
    # never again → lowest id... 1 is never used again, 2 never again: tie → evict 1 (smaller id first after -inf))
    out = simulate(one_layer([0, 1, 0, 2, 1, 0]), "oracle", capacity=2, num_experts=4)
    assert (out["hits"], out["misses"]) == (2, 4)
    assert out["policy_stats"]["trace_mismatch_steps"] == 0


def test_lru_eviction_order():
    policy = make_policy("lru", PolicyContext(Geometry(1, 8, 1, 3, 1)))
    cache = ExpertCache(policy.geometry, policy)
    evicted = []
    policy.on_evict = lambda layer, e, clock: evicted.append(e)  # type: ignore[method-assign]
    replay(cache, one_layer([5, 6, 7, 5, 1, 2, 6]))
    # after 5 6 7 5: recency 6 < 7 < 5; 1 evicts 6; 2 evicts 7; 6 evicts 5
    assert evicted == [6, 7, 5]


def test_oracle_eviction_order():
    seq = [1, 2, 3, 4, 1, 2, 5, 3]
    policy = make_policy("oracle", PolicyContext(Geometry(1, 8, 1, 3, 1), {}, _Trace(one_layer(seq))))
    cache = ExpertCache(policy.geometry, policy)
    evicted = []
    policy.on_evict = lambda layer, e, clock: evicted.append(e)  # type: ignore[method-assign]
    replay(cache, one_layer(seq))
    # t3 (4): next uses 1→4, 2→5, 3→7 → evict 3; t4 1 hit, t5 2 hit; t6 (5): 1,2,4 never again → 1 (lowest id);
    # t7 (3): 2, 4, 5 never again → 2
    assert evicted == [3, 1, 2]


def test_staging_copies_every_access():
    out = simulate([[[[0, 1]], [[2, 3]]]] * 3, "staging", capacity=2, num_experts=4, expert_bytes=7)
    assert out["hits"] == 0 and out["misses"] == 12 and out["h2d_bytes_decode"] == 12 * 7
    assert out["evictions"] == 0


def test_none_is_all_hits():
    out = simulate([[[[0, 1]], [[2, 3]]]] * 3, "none", capacity=1, num_experts=4)
    assert out["hit_rate"] == 1.0 and out["h2d_bytes_decode"] == 0


def test_prefetch_precision_and_recall():
    # 2 layers, capacity 1; a scripted gate predicts layer-1 expert = 3 always. Layer-1 truth: 3, 3, 2.
    steps = [[[[0], [3]]], [[[0], [3]]], [[[0], [2]]]]
    gate = lambda layer, hidden: __import__("torch").tensor([[3]])  # noqa: E731
    out = simulate(steps, "lru+gate", capacity=1, num_experts=4, expert_bytes=5, gate=gate,
                   hiddens=[[0, 0]] * 3)
    # t0: L0 miss(0); prefetch L1 e3 (issued 1); L1 access 3: prefetch hit. t1: L0 hit; prefetch 3 redundant;
    # L1 hit (plain). t2: L0 hit; prefetch 3 redundant; L1 needs 2: miss, evicts 3 (used, not wasted).
    assert out["prefetch_issued"] == 1 and out["prefetch_used"] == 1 and out["prefetch_precision"] == 1.0
    assert out["prefetch_redundant"] == 2 and out["prefetch_wasted"] == 0
    assert (out["hits"], out["misses"]) == (4, 2)
    # needed from the host: t0 L0 (miss), t0 L1 (prefetch hit), t2 L1 (miss) → on-time recall 1/3
    assert out["prefetch_recall_on_time"] == pytest.approx(1 / 3)
    assert out["h2d_bytes_decode"] == 3 * 5


def test_bad_policy_refused():
    with pytest.raises(ValueError, match="unknown offload policy"):
        simulate(one_layer([0]), "mru", capacity=1, num_experts=2)
    with pytest.raises(ValueError, match="needs a routing trace"):
        make_policy("oracle", PolicyContext(Geometry(1, 2, 1, 1, 1)))


class _Trace:
    def __init__(self, steps):
        self.steps = steps

    def steps_by_batch(self, b):
        import torch

        return [torch.tensor(s) for s in self.steps]


def test_policy_sees_tokens_and_embeddings_in_the_engine(monkeypatch):
    """A policy with needs_embeddings gets the pass's ids [B, S] and input embeddings [B, S, H] (S = 1 in decode)."""
    from types import SimpleNamespace

    from harness.engines.base import Request
    from harness.engines.hf.engine import HFEngine
    from harness.models.trained import trained_checkpoint
    from harness.techniques.offload.policies import LRUPolicy
    from harness.techniques.offload.policy import register_policy

    seen = []

    @register_policy("probe-embeddings")
    class Probe(LRUPolicy):
        needs_embeddings = True

        def begin_pass(self, clock, tokens=None, embeddings=None):
            seen.append((clock.phase, clock.step, tuple(tokens.shape), tuple(embeddings.shape)))

    path, _ = trained_checkpoint()
    cfg = SimpleNamespace(device="cpu", dtype="float32", batch_size=2, attn_implementation="sdpa",
                          experts_implementation="auto", cuda_graphs=False)
    eng = HFEngine(str(path), cfg, SimpleNamespace(max_new_tokens=3, ignore_eos=True),
                   sere_cfg=SimpleNamespace(k=None), offload_cfg={"policy": "probe-embeddings", "capacity": 8})
    try:
        gens = eng.generate([Request(uid="0", content=[{"type": "text", "text": "describe the city at night"}])])
    finally:
        eng.close()
    assert gens[0].error is None and gens[0].output_tokens == 3, gens[0]
    assert seen[0][0] == "prefill" and seen[0][2][1] > 1 and seen[0][3][:2] == seen[0][2]
    assert [s[:3] for s in seen[1:]] == [("decode", 1, (1, 1)), ("decode", 2, (1, 1))]
    assert all(s[3][:2] == (1, 1) for s in seen[1:])


def test_per_row_token_hit_rate():
    # B = 2, one layer, top-1, capacity 2. t0: rows name 0, 0 → 1 access (miss), 2 row-accesses.
    # t1: rows name 0, 1 → 0 hit (1 row), 1 miss (1 row). Access hit rate 1/3; per row-token 1/4.
    out = simulate([[[[0]], [[0]]], [[[0]], [[1]]]], "lru", capacity=2, num_experts=4)
    assert out["accesses"] == 3 and out["hit_rate"] == pytest.approx(1 / 3)
    assert out["row_accesses"] == 4 and out["hit_rate_per_row_token"] == pytest.approx(1 / 4)


def test_capacity_from_gb_and_refusals():
    from harness.engines.hf.offload import resolve_capacity

    # 4 layers × 1 MB experts: 0.02 GB → 5 slots per layer
    assert resolve_capacity({"capacity": None, "capacity_gb": 0.02}, 4, 16, 1_000_000) == 5
    assert resolve_capacity({"capacity": 7, "capacity_gb": None}, 4, 16, 1_000_000) == 7
    with pytest.raises(ValueError, match="capacity"):
        resolve_capacity({"capacity": None, "capacity_gb": 0.001}, 4, 16, 1_000_000)  # 0 slots
    with pytest.raises(ValueError, match="capacity"):
        resolve_capacity({"capacity": 17, "capacity_gb": None}, 4, 16, 1_000_000)


def test_chunked_layer_streams_through_few_slots():
    # one layer needs 5 experts with 2 slots: 3 chunks, every access a miss, each expert loaded once
    out = simulate([[[[0, 1, 2, 3, 4]]]], "lru", capacity=2, num_experts=8)
    assert out["chunked_layer_passes"] == 1 and out["misses"] == 5 and out["evictions"] == 3


def test_simulate_trace_regroups_ids_and_embeddings():
    import torch

    from harness.techniques.offload.policies import LRUPolicy
    from harness.techniques.offload.policy import register_policy
    from harness.techniques.offload.simulate import simulate_trace
    from harness.techniques.offload.trace import RoutingTrace

    # 3 requests (lengths 2, 1, 2), 1 layer, top-1; embeddings = [request, step] so the regrouping is visible
    request = torch.tensor([0, 0, 1, 2, 2])
    step = torch.tensor([0, 1, 0, 0, 1])
    ids = torch.tensor([0, 1, 2, 0, 3]).reshape(5, 1, 1)
    trace = RoutingTrace(ids, torch.zeros(ids.shape), torch.stack([request, step], 1).float(), request, step,
                         torch.arange(1), {"num_experts": 4})
    seen = []

    @register_policy("probe-trace-embeds")
    class Probe(LRUPolicy):
        needs_embeddings = True

        def begin_pass(self, clock, tokens=None, embeddings=None):
            if clock.phase == "decode":
                seen.append((clock.step, embeddings[:, 0].tolist()))

    out = simulate_trace(trace, 2, "probe-trace-embeds", capacity=2)
    # batch 0 = requests 0, 1: step 1 rows (0,0), (1,0); step 2 row (0,1). batch 1 = request 2: steps 1, 2
    assert seen == [(1, [[0, 0], [1, 0]]), (2, [[0, 1]]), (1, [[2, 0]]), (2, [[2, 1]])]
    assert out["decode_steps"] == 4 and out["accesses"] == 5
    oracle = simulate_trace(trace, 2, "oracle", capacity=1)
    assert oracle["policy_stats"]["trace_mismatch_steps"] == 0

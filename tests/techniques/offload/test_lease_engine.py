"""``offload.policy=lease`` in the HF engine generates exactly the resident model's greedy tokens (the embedded
trained tiny model, capacity 5 of 16 experts per layer so evictions and pre-emptions happen), with each score
source: recency (default, with gate prefetch), none (leases + grace only, no prefetch) and the stability
predictor (an artifact of the right shape, read from offload.lease.predictor)."""

from __future__ import annotations

import engine_run
import pytest
import torch

from harness.models.trained import trained_checkpoint

MAX_NEW = 10


def offload_cfg(policy, capacity=5, threshold=0.5, **lease):
    return {"policy": policy, "capacity": capacity, "capacity_gb": None, "gpu_budget_gb": None, "trace": None,
            "record_trace": None, "warm_after_tokens": 4, "resident_summary": None, "params": {},
            "threshold": threshold, "lease": lease}


def run(offload=None):
    return engine_run.run(engine_run.make_engine(offload, 2, MAX_NEW))


@pytest.fixture(scope="module")
def resident():
    return run()


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    from harness.techniques.offload.predictor import save_predictor, train_predictor
    from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(trained_checkpoint()[0]).text_config  # every text layer is a MoE layer
    torch.set_num_threads(1)
    tr = synthetic_trace(SyntheticSpec(num_layers=cfg.num_hidden_layers, num_experts=16, top_k=4,
                                       hidden=cfg.hidden_size, requests=6, tokens=12))
    model, report = train_predictor([tr], epochs=1)
    return str(save_predictor(model, report, tmp_path_factory.mktemp("pred") / "p"))


@pytest.mark.parametrize("variant", ["recency", "none", "predictor"])
def test_lease_tokens_identical_to_resident(variant, resident, predictor):
    lease = {"score": variant}
    if variant == "none":
        lease.update(prefetch="none", grace_ms=0.0, grace_tokens=1)
    if variant == "predictor":
        lease["predictor"] = predictor
    cfg = offload_cfg("lease", threshold=0.3, **lease)
    if variant == "recency":  # 5 slots, top-4 at B=2: the default protection (2 tokens) would refuse them all
        cfg["prefetch"] = {"protect_tokens": 0}
    texts, n, stats = run(cfg)
    assert (texts, n) == resident[:2]
    ps = stats["policy_stats"]
    assert stats["policy"] == "lease" and stats["misses"] > 0 and stats["evictions"] > 0
    assert ps["score"] == variant and ps["accesses"] > 0 and ps["threshold"] == 0.3
    assert 0 <= ps["lease_hit_rate"] <= 1
    evicted = ps["evict_free"] + ps["evict_grace"] + ps["preempted"] + ps["forced"] + ps["evict_untracked"]
    assert evicted >= 1
    if variant == "recency":
        assert stats["prefetch_issued"] > 0
    if variant == "none":
        assert stats["prefetch_issued"] == 0 and ps["long"] == 0
    if variant == "predictor":
        assert ps["scored"] == ps["accesses"] and ps["mean_score"] is not None

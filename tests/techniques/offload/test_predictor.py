"""The stability predictor: its target and baseline computed by hand on a tiny trace, the ROC AUC, training on a
small synthetic trace (beats predicting the mean there, where embeddings carry the regime by construction),
the artifact round trip, the online scorer = the batch model, and the lease policy reading the artifact."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.techniques.offload.predictor import (OnlineScorer, PredictorSpec, StabilityPredictor, auc, context_windows,
                                       load_predictor, main, recency_scores, save_predictor, stability_per_expert,
                                       stability_targets, train_predictor)
from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace
from harness.techniques.offload.trace import RoutingTrace, save_trace


def hand_trace() -> RoutingTrace:
    # one request of 4 tokens (then a second of 2), one layer, k = 2
    ids = torch.tensor([[[0, 1]], [[0, 2]], [[0, 1]], [[3, 1]], [[5, 6]], [[5, 7]]])
    n = ids.shape[0]
    emb = torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 1
    return RoutingTrace(ids, torch.full(ids.shape, 0.5), emb, torch.tensor([0, 0, 0, 0, 1, 1]),
                        torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([0]), {"num_experts": 8})


def test_target_by_hand():
    tr = hand_trace()
    per, valid = stability_per_expert(tr, horizon=2)
    # request 0, t0: expert 0 appears at t1, t2 (2 of W=2); expert 1 at t2 (1 of 2)
    assert per[0, 0].tolist() == [1.0, 0.5]
    # t2 (W = 1, only t3 left): expert 0 absent at t3, expert 1 present
    assert per[2, 0].tolist() == [0.0, 1.0]
    # t3 is the request's last token: no window
    assert valid.tolist() == [True, True, True, False, True, False]
    tgt, _ = stability_targets(tr, horizon=2)
    # t1: expert 0 at t2 not t3 (1/2), expert 2 never (0/2)
    assert tgt[0, 0].item() == pytest.approx(0.75) and tgt[1, 0].item() == pytest.approx(0.25)
    assert tgt[4, 0].item() == pytest.approx(0.5)  # request 1: 5 again at t1, 6 not
    # default horizon 5: t0 sees t1..t3 (W = 3): expert 0 in 2 of 3, expert 1 in 2 of 3
    tgt5, _ = stability_targets(tr)
    assert tgt5[0, 0].item() == pytest.approx(2 / 3)


def test_recency_baseline_and_windows_by_hand():
    tr = hand_trace()
    rec = recency_scores(tr, horizon=2)
    # t0: nothing before; t2: expert 0 in t0 and t1 (2/2), expert 1 in t0 (1/2) -> 0.75; request 1 restarts
    assert rec[0, 0].item() == 0.0 and rec[2, 0].item() == pytest.approx(0.75) and rec[4, 0].item() == 0.0
    win = context_windows(tr)
    assert win.shape == (6, 4, 3)
    assert torch.equal(win[2, 0], tr.embeds[2]) and torch.equal(win[2, 2], tr.embeds[0])
    assert win[2, 3].abs().sum() == 0 and win[4, 1].abs().sum() == 0  # before the request's start: zeros


def test_auc_by_hand():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1, 0, 0])) == pytest.approx(0.75)  # a tie counts half
    assert math.isnan(auc(torch.tensor([0.3, 0.2]), torch.tensor([1, 1])))  # one class only


def test_spec_comes_to_about_50k_parameters():
    for h, nl in ((2048, 48), (64, 4), (4096, 32)):
        n = StabilityPredictor(PredictorSpec(hidden_size=h, num_layers=nl)).num_trainable()
        assert 40_000 <= n <= 60_000, (h, nl, n)


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    tr = synthetic_trace(SyntheticSpec(num_layers=3, num_experts=16, top_k=2, hidden=16, requests=20, tokens=40,
                                       p_reuse_stable=0.98, p_reuse_shift=0.1, decay=0.5, seed=1))
    model, report = train_predictor([tr], epochs=12, seed=0)
    return tr, model, report


def test_training_report_and_gain_over_the_mean(trained):
    tr, model, report = trained
    sp = report["split"]
    assert sp["train"] + sp["validation"] + sp["held_out"] == 20 and sp["held_out"] == 4
    h = report["held_out"]
    for key in ("predictor", "baseline_mean", "baseline_recency"):
        assert set(h[key]) == {"mse", "mae", "pearson", "auc", "accuracy"}
    # on this trace the embedding carries the regime that sets reuse: the MLP must beat the constant
    assert h["predictor"]["mse"] < h["baseline_mean"]["mse"]
    assert h["predictor"]["auc"] > 0.6


def test_artifact_round_trip_and_online_scorer(trained, tmp_path):
    tr, model, report = trained
    path = save_predictor(model, report, tmp_path / "pred")
    back = load_predictor(path)
    win = context_windows(tr)[:50]
    with torch.no_grad():
        assert torch.allclose(back(win), model(win))
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["format"] == "harness-stability-predictor/1" and meta["params"] == model.num_trainable()
    # streaming the first request token by token gives the windowed batch result
    sc = OnlineScorer(back)
    first = tr.request_slices()[0]
    online = torch.cat([sc.score(tr.embeds[i:i + 1]) for i in range(first.start, first.start + 6)])
    with torch.no_grad():
        assert torch.allclose(online, back(context_windows(tr)[first.start:first.start + 6]), atol=1e-6)


def test_cli_train_and_lease_policy_reads_the_artifact(tmp_path):
    from harness.techniques.offload.simulate import simulate

    torch.set_num_threads(1)
    tr = synthetic_trace(SyntheticSpec(num_layers=2, num_experts=8, top_k=2, hidden=8, requests=6, tokens=16))
    tpath = save_trace(tr, tmp_path / "trace")
    assert main(["train", str(tpath), "--out", str(tmp_path / "p"), "--epochs", "2"]) == 0
    art = tmp_path / "p.pt"
    assert art.exists() and json.loads((tmp_path / "p.json").read_text())["traces"][0]["source"] == "synthetic"
    steps = tr.steps_by_batch(1)
    emb = [tr.embeds[i:i + 1].unsqueeze(1) for i in range(tr.num_tokens)]
    starts = [s.start for s in tr.request_slices()]
    out = simulate(steps, "lease", capacity=4, num_experts=8, embeds=emb, new_batch_at=starts,
                   params={"threshold": 0.0, "lease": {"score": "predictor", "predictor": str(art)}})
    ps = out["policy_stats"]
    # threshold 0: every decode lease is long; scores were read for every decode access
    assert ps["scored"] == ps["accesses"] > 0 and ps["long"] > 0 and 0.0 <= ps["mean_score"] <= 1.0
    with pytest.raises(ValueError, match="outputs"):  # a predictor of another model (2 layers, not 3)
        _three_layer_policy(str(art))


def _three_layer_policy(predictor: str):
    from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy

    return make_policy("lease", PolicyContext(Geometry(3, 8, 2, 4, 1), {"lease": {"score": "predictor",
                                                                                  "predictor": predictor}}))

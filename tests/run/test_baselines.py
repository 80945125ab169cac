"""Issue 31's trivial baselines end to end on the embedded default model (CPU): each one changes what the model
sees, records itself in summary.json, and would fail here if it did nothing. One multirun process per family
(imports and the model load once), 2 samples, 4 new tokens."""

from __future__ import annotations

import json

import pytest

from tests.run.test_experiment import harness_cmd


def _multirun(tmp_path_factory, name, *overrides, limit="2", tokens=4):
    root = tmp_path_factory.mktemp(name)
    proc = harness_cmd("-m", f"hydra.sweep.dir={root}/sweep", "wandb.mode=disabled", "cache.enabled=false",
                       f"dataset.limit={limit}", f"generation.max_new_tokens={tokens}", *overrides, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((root / "sweep").glob("*/summary.json"), key=lambda p: int(p.parent.name))
    return [json.loads(p.read_text()) for p in runs], [p.parent for p in runs]


@pytest.mark.slow
def test_visionzip_baselines_prune_at_the_same_budget_and_visionzip_beats_random_on_ocr(tmp_path_factory):
    """The four methods of the VisionZip family at keep 0.75 on the bundled OCRBench sample (10 held-out rows), as
    sweeps/baselines_equal_budget runs them. Each baseline keeps VisionZip's count without attention scoring, and
    VisionZip reads more texts than random pruning: measured 3 of 10 against 0 (CPU, float32, greedy; pool 1, first
    2), asserted with a margin of one flipped answer. At keep 0.25 every method reads 0 of 10 on this model
    (docs/embedded_model.md: OCR 0.00 at keep 0.25), so the issue's keep-0.25 direction cannot be asserted here."""
    summaries, dirs = _multirun(tmp_path_factory, "vz", "visionzip.method=attention,random,pool,first",
                                "visionzip.keep=0.75", "visionzip.seed=0", "dataset=ocrbench_sample",
                                limit="null", tokens=12)
    assert [s["visionzip"]["method"] for s in summaries] == ["attention", "random", "pool", "first"]
    records = {}
    for s, d in zip(summaries, dirs):
        vz = s["visionzip"]
        assert vz["keep_rate"] == pytest.approx(0.75, abs=0.02) and vz["visual_tokens_kept"] < vz["visual_tokens_in"]
        samples = [json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()]
        assert all(r["visual_tokens"] == r["visionzip"]["visual_tokens_after"] < r["visionzip"]["visual_tokens_before"]
                   for r in samples)
        records[vz["method"]] = {r["uid"]: r["scores"]["score"] for r in samples}
        if vz["method"] != "attention":  # no attention scoring ran: the baseline, not VisionZip, chose
            assert vz["importance_ms_total"] == 0.0
    assert summaries[1]["visionzip"]["visual_tokens_kept"] == summaries[0]["visionzip"]["visual_tokens_kept"]
    assert len(records["attention"]) == len(records["random"]) == 10
    won = sum(records["attention"][u] - records["random"][u] for u in records["attention"])
    assert won >= 2, records


@pytest.mark.slow
def test_routing_baselines_change_the_decode_routing(tmp_path_factory):
    summaries, _ = _multirun(tmp_path_factory, "moe", "moe.routing=random_p,top_p", "moe.k_primary=1", "moe.p=0.5",
                             "moe.seed=5")
    rand, topp = (s["moe"] for s in summaries)
    assert (rand["routing"], rand["k_primary"], rand["seed"]) == ("random_p", 1, 5)
    assert rand["steps"] > 0 and rand["moved_fraction"] > 0
    assert rand["expert_union_after"] == pytest.approx(rand["primary_union"])
    assert rand["expert_union_after"] < rand["expert_union_before"]
    assert (topp["routing"], topp["p"]) == ("top_p", 0.5)
    assert topp["steps"] > 0 and topp["expert_union_after"] < topp["expert_union_before"]


def test_a_bad_baseline_name_exits_2_with_one_line(tmp_path):
    for override in ("visionzip.method=bogus", "moe.routing=bogus"):
        proc = harness_cmd(override, "wandb.mode=disabled", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and override.split("=")[0] in lines[0], lines

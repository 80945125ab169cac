"""Paired A/B timing inside one run (issue 31 item 3, harness/latency/paired.py + variants.py): the variants alternate
on the same batches in one process, the engine is put back as configured, and the speed-up's paired interval is
computed from the (batch, round) pairs. The engine here is scripted — its "times" are set by the variant it is in —
so the tests check the bookkeeping and the statistics, never a real timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.engines.base import Generation, Request
from harness.latency.paired import PairedTiming, compare, paired_ratio, rotation, unit_means
from harness.latency.variants import paired_variants

pytest.importorskip("scipy")


class Handle:
    def __init__(self):
        self.mode = "decode"


class SwitchableEngine:
    """An engine whose TTFT says which variant ran: VisionZip 10 ms, random 12 ms, baseline 20 ms (+ batch index)."""

    def __init__(self):
        self.vz_cfg = SimpleNamespace(keep=0.5, method="attention", contextual=0.0, scope="request")
        self.sere = Handle()
        self.moe = None
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []

    def state(self) -> str:
        if self.vz_cfg is None:
            assert self.sere.mode == "off"
            return "baseline"
        assert self.sere.mode == "decode"
        return self.vz_cfg.method

    def generate_batch(self, batch):
        st = self.state()
        self.calls.append(("gen", st, tuple(r.uid for r in batch)))
        ttft = {"attention": 10.0, "random": 12.0, "baseline": 20.0}[st] + int(batch[0].uid[1:])
        return [Generation(uid=r.uid, text="x", prompt_tokens=8 if st == "baseline" else 4, output_tokens=3,
                           ttft_ms=ttft, tpot_ms=ttft / 10, e2e_ms=ttft * 1.2) for r in batch]

    def warmup(self, batch):
        self.calls.append(("warm", self.state(), tuple(r.uid for r in batch)))
        return self.generate_batch(batch)[:0] or None


def _cfg():
    return SimpleNamespace(visionzip=SimpleNamespace(keep=0.5, scope="request", contextual=0.0),
                           sere=SimpleNamespace(k=2, rho=0.1, protect=0), moe=SimpleNamespace(top_k=None))


def test_rotation_alternates_which_variant_runs_first():
    assert [rotation(["a", "b"], r, 0) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert rotation(["a", "b", "c"], 1, 1) == ["c", "a", "b"]


def test_variants_switch_the_engine_and_put_it_back():
    engine = SwitchableEngine()
    configured = engine.vz_cfg
    variants = paired_variants(engine, _cfg(), ["random"])
    assert [v.role for v in variants] == ["technique", "baseline", "trivial"]
    assert variants[2].name == "random keep=0.5"
    variants[1].apply()
    assert engine.vz_cfg is None and engine.sere.mode == "off"
    variants[2].apply()
    assert engine.vz_cfg.method == "random" and engine.vz_cfg.contextual == 0.0 and engine.sere.mode == "decode"
    assert configured.method == "attention"  # the trivial variant is a copy
    variants[1].restore()
    assert engine.vz_cfg is configured and engine.sere.mode == "decode"
    with pytest.raises(ValueError, match="no technique"):
        paired_variants(SimpleNamespace(vz_cfg=None, sere=None, moe=None), _cfg())


def test_paired_timing_interleaves_every_batch_and_gives_the_paired_speedup():
    engine = SwitchableEngine()
    variants = paired_variants(engine, _cfg(), ["random"])
    cfg = SimpleNamespace(paired_rounds=4, confidence=0.95, bootstrap_resamples=500, warmup="per_shape",
                          on_compile="retime", max_retime=2, repeats=1, bucket=None)
    timing = PairedTiming(engine, cfg, variants, warmup_rounds=1)
    batches = [[Request(f"r{i}", []), Request(f"r{i + 1}", [])] for i in (0, 2)]
    timing.warm_up(batches)
    assert {c[1] for c in engine.calls if c[0] == "warm"} == {"attention", "baseline", "random"}
    engine.calls.clear()
    timing.run(batches)
    gens = [c for c in engine.calls if c[0] == "gen"]
    assert len(gens) == 4 * 2 * 3  # rounds x batches x variants
    # each batch runs under every variant back to back, and the first one changes from round to round
    for k in range(0, len(gens), 3):
        assert {g[1] for g in gens[k:k + 3]} == {"attention", "baseline", "random"}
        assert len({g[2] for g in gens[k:k + 3]}) == 1
    assert [gens[k][1] for k in range(0, 24, 6)] == ["attention", "baseline", "random", "attention"]
    assert engine.vz_cfg.method == "attention" and engine.sere.mode == "decode"  # put back
    block, comparisons = timing.summary(seed=1)
    base = block["speedup"]["baseline"]["ttft_ms"]
    # batch 0: 20/10, batch 2: 22/12 -> mean(20, 22) / mean(10, 12)
    assert base["estimate"] == pytest.approx(21 / 11) and base["n"] == 8 and base["significant"] is True
    assert base["ci"][0] <= base["estimate"] <= base["ci"][1] and base["ci"][0] > 1
    assert {(c["against"], c["metric"]) for c in comparisons} >= {("baseline", "ttft_ms"),
                                                                 ("random keep=0.5", "ttft_ms")}
    assert all(c["kind"] == "ratio" and c["variant"] == variants[0].name for c in comparisons)
    assert [v["role"] for v in block["variants"]] == ["technique", "baseline", "trivial"]
    assert len(timing.samples()) == 4 * 4 * 3  # requests x rounds x variants


def test_paired_ratio_and_units():
    assert paired_ratio([2.0, 2.0], [1.0, 1.0]) == {"estimate": 2.0, "ci": [2.0, 2.0], "n": 2, "significant": True}
    same = paired_ratio([1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.1, 3.9], n_resamples=500)
    assert same["ci"][0] < 1.0 < same["ci"][1] and same["significant"] is False
    assert paired_ratio([], [])["estimate"] is None and paired_ratio([1.0], [2.0])["ci"] is None
    samples = [{"uid": "a", "batch": 0, "pass": 0, "ttft_ms": 4.0}, {"uid": "b", "batch": 0, "pass": 0, "ttft_ms": 6.0},
               {"uid": "a", "batch": 0, "pass": 1, "ttft_ms": 9.0, "excluded": True},
               {"uid": "b", "batch": 0, "pass": 1, "ttft_ms": 9.0}]
    assert unit_means(samples, "ttft_ms") == {(0, 0): 5.0}  # a unit with an excluded timing is dropped whole
    res = compare({"t": samples, "b": [dict(s, ttft_ms=10.0, excluded=False) for s in samples]}, "t", "b")
    assert res["ttft_ms"]["n"] == 1 and res["ttft_ms"]["dropped"] == 1 and res["ttft_ms"]["estimate"] == 2.0


@pytest.mark.slow
def test_paired_timing_on_the_embedded_model_really_switches_visionzip_off_and_on(tmp_path):
    """End to end (HF engine, embedded model, 2 OCR samples): the baseline side ran every visual token, the
    technique and the random side the same pruned count; summary.json carries latency.paired and the comparisons
    the report reads; answers and scores are the scored pass's (the paired phase never re-scores)."""
    import json

    from tests.run.test_sere_resume import compose_cfg
    from harness.run.experiment import run_experiment

    cfg = compose_cfg("sere.k=null", "visionzip.keep=0.5", "dataset.limit=2", "generation.max_new_tokens=3",
                      "cache.enabled=false", "latency.paired=true", "latency.paired_rounds=2",
                      "latency.paired_with=[random]")
    summary = run_experiment(cfg, tmp_path / "run")
    paired = summary["latency"]["paired"]
    names = [v["name"] for v in paired["variants"]]
    assert [v["role"] for v in paired["variants"]] == ["technique", "baseline", "trivial"]
    lines = [json.loads(line) for line in (tmp_path / "run" / "paired_timings.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 3  # requests x rounds x variants
    tokens = {n: {line["prompt_tokens"] for line in lines if line["variant"] == n} for n in names}
    assert max(tokens[names[0]]) < min(tokens["baseline"]) and tokens[names[0]] == tokens[names[2]]
    assert {(c["against"], c["metric"]) for c in summary["comparisons"]} >= {("baseline", "ttft_ms"),
                                                                             ("random keep=0.5", "ttft_ms")}
    assert summary["metrics"]["n"] == 2 and summary["latency"]["n_measured"] == 2

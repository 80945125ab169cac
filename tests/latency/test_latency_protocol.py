"""The latency measurement protocol (harness/latency/, docs/latency.md), on CPU with scripted engines and clocks:
warm-up coverage and its verification, repeats with their intervals and spread, the report's significance
marking, the device lock and the launcher's concurrency warning. No test reads a real clock."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.engines import ENGINES
from harness.engines.base import Generation, Request
from harness.latency.runner import TimedBatches
from harness.latency.shapes import bucket, observed_key, warmup_plan
from harness.latency.stats import bootstrap_ci, coefficient_of_variation, intervals_overlap, repeat_summary

ROOT = Path(__file__).resolve().parents[2]


class Cfg:
    """A ``latency`` config block (attribute access, as OmegaConf's)."""

    def __init__(self, **kw):
        self.__dict__.update({"warmup": "per_shape", "bucket": None, "on_compile": "retime", "max_retime": 2,
                              "repeats": 1, **kw})


class FakeEngine:
    """Prompt lengths per uid; ``captures_on``: call numbers (1-based) of generate_batch that capture a graph;
    ``pruned``: the length a generation reports (VisionZip) when it differs from the processor's."""

    def __init__(self, lengths, captures_on=(), pruned=None, warm_returns=True, plans=True):
        self.lengths, self.captures_on, self.pruned = lengths, set(captures_on), pruned or {}
        self.captures = self.calls = 0
        self.warmed: list[list[str]] = []
        self.warm_returns = warm_returns
        if not plans:
            self.prompt_length = None

    def _gens(self, batch, tag):
        return [Generation(r.uid, text=f"{tag}", prompt_tokens=self.pruned.get(r.uid, self.lengths[r.uid]),
                           output_tokens=3, ttft_ms=10.0 * self.calls, tpot_ms=1.0 * self.calls,
                           e2e_ms=12.0 * self.calls) for r in batch]

    def generate_batch(self, batch):
        self.calls += 1
        if self.calls in self.captures_on:
            self.captures += 1
        return self._gens(batch, f"call{self.calls}")

    def warmup(self, batch):
        self.warmed.append([r.uid for r in batch])
        return self._gens(batch, "warm") if self.warm_returns else None

    def prompt_length(self, batch):
        return max(self.lengths[r.uid] for r in batch)

    def compile_counters(self):
        return {"cuda_graph_captures": self.captures}


def reqs(*uids):
    return [Request(u, [{"type": "text", "text": u}]) for u in uids]


LENGTHS = {"a": 100, "b": 120, "c": 300, "d": 310, "e": 90, "f": 100}
BATCHES = [reqs("a", "b"), reqs("c", "d"), reqs("e", "f")]  # buckets 128, 512, 128


# ------------------------------------------------------------------------------------------ shape keys


def test_buckets_and_keys():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 100, 128, 129)] == [0, 1, 2, 4, 4, 8, 128, 128, 256]
    assert [bucket(n, 64) for n in (1, 64, 65)] == [64, 64, 128]
    gens = [Generation("x", prompt_tokens=90), Generation("y", prompt_tokens=130), Generation("z", error="boom")]
    assert observed_key(gens, "baseline") == (3, 256, "baseline")  # the failed request's length does not count
    assert warmup_plan(BATCHES, [(2, 128, "t"), (2, 512, "t"), (2, 128, "t")]) == [0, 1]
    assert warmup_plan(BATCHES, [None, None, None]) == [0]  # nothing planned: at least the first batch


# ------------------------------------------------------------------------------------- warm-up coverage


def test_per_shape_warmup_covers_every_timed_shape_and_timed_batches_are_clean():
    engine = FakeEngine(LENGTHS)
    timer = TimedBatches(engine, Cfg(), "baseline")
    timer.warm_up(BATCHES)
    assert engine.warmed == [["a", "b"], ["c", "d"]]  # one per shape key; e,f shares a,b's
    for i, b in enumerate(BATCHES):
        timer.time_batch(b, 0, i)
    assert timer.events == [] and engine.calls == 3
    block = timer.protocol_block()
    assert block["warmup_batches"] == 2 and block["batches_retimed"] == block["batches_excluded"] == 0
    assert {(s["batch_size"], s["prompt_bucket"]) for s in block["shapes_warmed"]} == {(2, 128), (2, 512)}


def test_more_shapes_than_captured_decoder_states_is_warned():
    """Found on the H200: the HF static decoder keeps engine.graph_states graphs; a run cycling through more
    (batch, prompt bucket) shapes recaptures one per batch, which warm-up cannot prevent: the summary says so."""
    from harness.run.outcome import latency_warnings

    engine = FakeEngine(LENGTHS)
    engine.graph_states = lambda: 1  # HF on CUDA reports its decoder's capacity; other engines have no such method
    timer = TimedBatches(engine, Cfg(), "baseline")
    timer.warm_up(BATCHES)
    for i, b in enumerate(BATCHES):
        timer.time_batch(b, 0, i)
    block = timer.protocol_block()
    assert block["graph_states"] == 1 and block["shapes_needing_states"] == 2
    (warning,) = [w for w in latency_warnings({"protocol": block}) if "graph_states" in w]
    assert "2 (batch size, prompt length) shapes" in warning and "keeps 1 captured graphs" in warning
    engine.graph_states = lambda: 2  # enough states: no warning
    assert not [w for w in latency_warnings({"protocol": timer.protocol_block()}) if "graph_states" in w]
    assert "graph_states" not in TimedBatches(FakeEngine(LENGTHS), Cfg(), "baseline").protocol_block()


def test_first_batch_warmup_misses_a_shape_which_is_detected_and_retimed():
    engine = FakeEngine(LENGTHS)
    timer = TimedBatches(engine, Cfg(warmup="first_batch"), "baseline")
    timer.warm_up(BATCHES)
    assert engine.warmed == [["a", "b"]]
    out = [timer.time_batch(b, 0, i) for i, b in enumerate(BATCHES)]
    # batch 1 (c, d: bucket 512) was never warmed: timed on call 2, re-timed on call 3; answers from call 2
    assert [e["action"] for e in timer.events] == ["retimed"] and timer.events[0]["batch"] == 1
    assert "first-seen shape [2, 512, 'baseline']" in timer.events[0]["reasons"]
    assert [g.text for g in out[1]] == ["call2", "call2"]
    assert out[1][0].ttft_ms == 30.0 and out[1][0].extra["timing"] == {"retimed": 1, "excluded": False,
                                                                        "reasons": None}
    assert [s["ttft_ms"] for s in timer.samples if s["batch"] == 1] == [30.0, 30.0]  # the clean timing only
    assert out[2][0].text == "call4" and "timing" not in out[2][0].extra  # e,f: warm (a,b's shape)


def test_warmup_reports_the_pruned_shape_so_visionzip_batches_are_not_flagged():
    # the processor says 1000 tokens, VisionZip prunes to 600 before prefill: the warm-up's generations say so
    engine = FakeEngine({"a": 1000, "b": 1000}, pruned={"a": 600, "b": 600})
    timer = TimedBatches(engine, Cfg(), "visionzip keep=0.6")
    timer.warm_up([reqs("a", "b")])
    timer.time_batch(reqs("a", "b"))
    assert timer.events == []
    assert timer.protocol_block()["shapes_warmed"][0]["prompt_bucket"] == 1024  # bucket(600)


@pytest.mark.parametrize("policy,actions,excluded", [("retime", ["retimed"], False),
                                                     ("exclude", ["excluded"], True),
                                                     ("keep", ["kept"], False)])
def test_a_graph_capture_inside_a_timed_batch_is_retimed_excluded_or_kept(policy, actions, excluded):
    engine = FakeEngine(LENGTHS, captures_on={1})  # the first timed call captures a CUDA graph
    timer = TimedBatches(engine, Cfg(on_compile=policy), "baseline")
    timer.warm_up(BATCHES[:1])
    out = timer.time_batch(BATCHES[0], 0, 0)
    assert [e["action"] for e in timer.events] == actions
    assert timer.events[0]["reasons"] == ["cuda_graph_captures +1"]
    assert all(s["excluded"] is excluded for s in timer.samples)
    assert out[0].text == "call1"  # the answer is always the first call's
    assert timer.protocol_block()["samples_excluded"] == (2 if excluded else 0)


def test_a_batch_that_compiles_every_time_is_excluded_after_max_retime():
    engine = FakeEngine(LENGTHS, captures_on={1, 2, 3, 4})
    timer = TimedBatches(engine, Cfg(max_retime=2), "baseline")
    timer.warm_up(BATCHES[:1])
    timer.time_batch(BATCHES[0], 0, 0)
    assert [e["action"] for e in timer.events] == ["retimed", "retimed", "excluded"] and engine.calls == 3
    assert repeat_summary(timer.samples)["ttft_ms"]["n"] == 0  # nothing trusted, nothing reported


def test_torch_compile_counters_are_read_when_dynamo_is_loaded(monkeypatch):
    import sys
    import types
    from collections import Counter, defaultdict

    from harness.latency.watch import snapshot

    counters = defaultdict(Counter)
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.SimpleNamespace(counters=counters))
    engine = FakeEngine(LENGTHS)
    before = snapshot(engine)
    counters["frames"]["total"] += 1
    counters["stats"]["unique_graphs"] += 2
    after = snapshot(engine)
    assert after["dynamo_frames"] - before["dynamo_frames"] == 1
    assert after["dynamo_graphs"] - before["dynamo_graphs"] == 2


def test_an_engine_without_warmup_or_shapes_is_checked_by_its_counters_only():
    engine = FakeEngine(LENGTHS, warm_returns=False, plans=False)
    timer = TimedBatches(engine, Cfg(), "baseline")
    timer.warm_up(BATCHES)
    assert engine.warmed == [["a", "b"]]  # nothing planned: the first batch
    for i, b in enumerate(BATCHES):
        timer.time_batch(b, 0, i)
    assert timer.events == [] and "first-seen shape" not in timer.protocol_block()["detectors"]


# ------------------------------------------------------------------- repeats and intervals, scripted clock


def test_statistics_of_repeats():
    assert coefficient_of_variation([115.0, 135.0, 155.0]) == pytest.approx(20.0 / 135.0)
    assert coefficient_of_variation([1.0]) is None
    assert bootstrap_ci([5.0]) is None and bootstrap_ci([7.0, 7.0, 7.0]) == [7.0, 7.0]
    lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0, 10.0], seed=0)
    assert 1.0 <= lo < statistics.fmean([1, 2, 3, 4, 10]) < hi <= 10.0
    assert intervals_overlap([1, 2], [1.5, 3]) is True and intervals_overlap([1, 2], [2.5, 3]) is False
    assert intervals_overlap(None, [1, 2]) is None


class ClockedEngine:
    """A scripted engine on a scripted clock: request i of pass p has TTFT 100 + 10 i + 20 p ms and TPOT 5 + p ms;
    its answer names the pass, so a test sees which pass was scored."""

    name = "clocked"

    def __init__(self, *args, **kwargs):
        self.calls = 0
        self.index: dict[str, int] = {}

    def warmup(self, batch):
        return [Generation(r.uid, prompt_tokens=100, output_tokens=2, ttft_ms=1.0, tpot_ms=1.0, e2e_ms=2.0)
                for r in batch]

    def generate_batch(self, batch):
        p = self.calls // 2  # 4 requests, batches of 2: two calls per pass
        self.calls += 1
        out = []
        for r in batch:
            i = self.index.setdefault(r.uid, len(self.index))
            ttft, tpot = 100.0 + 10 * i + 20 * p, 5.0 + p
            out.append(Generation(r.uid, text=json.dumps({"answer": f"pass {p}"}), prompt_tokens=100,
                                  output_tokens=11, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=ttft + 10 * tpot))
        return out

    def describe(self):
        return {"engine": "clocked", "engine_version": "1", "device": "cpu", "dtype": "float32", "batch_size": 2}

    def close(self):
        pass


def test_repeats_on_a_scripted_clock_through_the_run(tmp_path, monkeypatch):
    from harness.run.experiment import run_experiment

    monkeypatch.setenv("HARNESS_DEVICE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setitem(ENGINES, "clocked", f"{__name__}:ClockedEngine")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "engine.name=clocked", "engine.batch_size=2", "wandb.mode=disabled", "dataset.limit=4",
            "model.embedded=false", "model.path=unused", "latency.repeats=3", "cache.enabled=false",
            "latency.bootstrap_resamples=500"])
    GlobalHydra.instance().clear()
    summary = run_experiment(cfg, tmp_path / "run")
    lat = summary["latency"]
    ttft = [100.0 + 10 * i + 20 * p for p in range(3) for i in range(4)]
    assert lat["ttft_ms"]["n"] == 12 and lat["ttft_ms"]["mean"] == pytest.approx(np.mean(ttft))
    for q in (50, 90, 99):
        assert lat["ttft_ms"][f"p{q}"] == pytest.approx(np.percentile(ttft, q))
    assert lat["ttft_ms"]["pass_means"] == pytest.approx([115.0, 135.0, 155.0])
    assert lat["ttft_ms"]["cv"] == pytest.approx(20.0 / 135.0)  # std of the pass means / their mean
    assert lat["tpot_ms"]["cv"] == pytest.approx(1.0 / 6.0)
    # the interval of the mean resamples requests (their mean over passes: 120, 130, 140, 150)
    lo, hi = lat["ttft_ms"]["ci"]
    assert lo < 135.0 < hi and 120.0 <= lo and hi <= 150.0
    assert lat["ttft_ms"]["ci"] == pytest.approx(bootstrap_ci([120.0, 130.0, 140.0, 150.0], 0.95, 500, seed=0))
    assert lat["noisy"] == ["ttft_ms", "tpot_ms", "e2e_ms"]  # CV 15 % / 17 % > latency.max_cv = 0.1
    assert any(w.startswith("latency spread too large: TTFT 15%") for w in summary["warnings"])
    assert lat["protocol"]["passes_timed"] == 3 and lat["protocol"]["events"] == []
    assert lat["protocol"]["device"]["concurrent"] is False
    # answers and scores from the first pass only; every timing in timings.jsonl
    answers = [json.loads(line)["answer"] for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert len(answers) == 4 and all('"pass 0"' in a for a in answers)
    timings = [json.loads(line) for line in (tmp_path / "run/timings.jsonl").read_text().splitlines()]
    assert sorted({t["pass"] for t in timings}) == [0, 1, 2] and len(timings) == 12


# ----------------------------------------------------------------------------- the report's significance


def _summary(path: Path, keep: float, p50: float, ci, partial: bool = False) -> None:
    path.mkdir(parents=True)
    lat = {"ttft_ms": {"p50": p50, "mean": p50, "n": 12, **({"ci": ci} if ci else {})},
           "tpot_ms": {"p50": 5.0, "n": 12}, "partial": partial, "n_measured": 7 if partial else 12,
           "n_cached": 5 if partial else 0, "repeats": 3 if ci else 1}
    (path / "summary.json").write_text(json.dumps({
        "run": {"engine": "hf", "device_name": "cpu", "dtype": "float32", "weights": "real",
                "model": {"name": "m"}},
        "config": {"dataset": {"name": "rag_igbench"}, "visionzip": {"keep": keep}, "sere": {"k": None},
                   "engine": {"batch_size": 4}, "generation": {"max_new_tokens": 8}},
        "metrics": {"n_samples": 12, "rouge1": 0.5}, "latency": lat}))


def test_report_marks_overlapping_intervals_as_not_significant_and_partial_against_full(tmp_path):
    from harness.report.build import build_report

    _summary(tmp_path / "base", 1.0, 100.0, [95.0, 105.0])
    _summary(tmp_path / "fast", 0.6, 60.0, [55.0, 65.0])      # intervals apart, but across runs: never significant
    _summary(tmp_path / "same", 0.8, 98.0, [92.0, 104.0])     # overlapping: n.s.
    _summary(tmp_path / "resumed", 0.5, 50.0, [45.0, 55.0], partial=True)
    _summary(tmp_path / "old", 0.7, 80.0, None)               # written before latency.*: unknown
    res = build_report([tmp_path], tmp_path / "report")
    rows = {r["run_dir"]: r for r in res.rows}
    # issue 25: the baseline ran at another time, so within-run intervals cannot make a speed-up significant
    assert rows["fast"]["ttft_significant"] is None and rows["fast"]["ttft_comparison"] == "across runs"
    assert rows["same"]["ttft_significant"] is False
    assert rows["old"]["ttft_significant"] is None and rows["base"]["ttft_significant"] is None
    assert rows["resumed"]["latency_mixed"] and not rows["fast"]["latency_mixed"]
    md = res.markdown.read_text()
    assert "| 1.67× across runs |" in md and "| 1.02× n.s. |" in md and "| 1.25× across runs |" in md
    assert "| 2.00× across runs partial/full |" in md
    assert "1 speed-ups compare a partial (resumed) latency with a full one" in md
    assert "TTFT mean [CI] (ms)" in md and "60.0 [55.0, 65.0]" in md


# ------------------------------------------------------------------------- concurrency: lock and launcher


def test_device_lock_serialises_sequential_jobs_and_detects_concurrent_ones(tmp_path, monkeypatch):
    from harness.latency.device_lock import DeviceLock, device_key

    monkeypatch.setenv("HARNESS_DEVICE_LOCK_DIR", str(tmp_path))
    assert device_key("cpu") == "cpu" and device_key("auto", {"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    assert device_key("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == "cuda-visible[2,3]-1"
    with DeviceLock("cpu") as first:
        with DeviceLock("cpu") as second:  # starts while the first measures: it sees it
            assert second.concurrent_at_start
            first.end_of_measurement()  # and the first sees the second at its end
            assert first.info()["concurrent"]
        assert not first.concurrent_at_start
    with DeviceLock("cpu", sequential=True) as holder:
        assert holder.holder() and "pid" in holder.holder()
        with pytest.raises(TimeoutError, match="still in use"):
            with DeviceLock("cpu", sequential=True, timeout_s=0.2, poll_s=0.05):
                pass
    with DeviceLock("cpu", sequential=True) as again:  # released: taken at once
        assert again.waited_s < 0.2 and not again.info()["concurrent"]


@pytest.mark.parametrize("launcher,sequential,expect", [
    ("local", False, "runs up to 4 of the 4 jobs"),
    ("local", True, "take turns"),
    (None, False, None),  # the basic launcher: one job after another
])
def test_launcher_concurrency_warning(launcher, sequential, expect):
    from harness.latency.launcher import concurrency_warning

    register_configs()
    GlobalHydra.instance().clear()
    overrides = [f"latency.sequential={str(sequential).lower()}"] + ([f"hydra/launcher={launcher}"] if launcher else [])
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    text = concurrency_warning(cfg, 4)
    assert (text is None) if expect is None else (expect in text)
    assert concurrency_warning(cfg, 1) is None  # a single job shares nothing

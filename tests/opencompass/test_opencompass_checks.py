"""``python -m harness.opencompass``'s values and its dependency, checked before any OpenCompass import (issue 26;
docs/validation.md "OpenCompass values"). Runs in both venvs: in the main venv (no OpenCompass) the missing
dependency is real; in .venv-opencompass it is simulated."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.config.checks import ConfigError
from harness.config.schema import Config
from harness.opencompass.runner import MISSING_OPENCOMPASS, check_opencompass
from harness.opencompass.suites import OpenCompassDependencyMissing

ROOT = Path(__file__).resolve().parents[2]


def cfg(**over):
    c = OmegaConf.structured(Config)
    for k, v in over.items():
        OmegaConf.update(c, k, v, merge=False)
    return c


def installed() -> bool:
    try:
        importlib.metadata.version("opencompass")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


BAD = [
    ("opencompass.suite", "bogus", "expected one of ci_sample, sere_paper"),
    ("opencompass.limit", 0, "expected null (every row) or an integer >= 1"),
    ("opencompass.ci_items", 0, "an integer >= 1"),
    ("opencompass.max_out_len", -5, "an integer >= 1"),
    ("opencompass.max_seq_len", 0, "an integer >= 1"),
    ("opencompass.num_gpus", -1, "an integer >= 0"),
    ("opencompass.model_abbr", " ", "a non-empty string"),
    ("opencompass.max_num_workers", 0, "an integer >= 1 (parallel OpenCompass tasks)"),
    ("opencompass.timeout_s", 0, "a number > 0 (seconds)"),
    ("opencompass.data_cache", "/no/such/dir", "an existing directory"),
]


@pytest.mark.parametrize("key,value,allowed", BAD)
def test_bad_values_refused_before_any_opencompass_import(key, value, allowed, monkeypatch):
    monkeypatch.delitem(sys.modules, "mmengine", raising=False)
    with pytest.raises(ConfigError) as e:
        check_opencompass(cfg(**{key: value}))
    assert str(e.value).startswith(f"{key}=") and allowed in str(e.value) and "\n" not in str(e.value)
    assert "mmengine" not in sys.modules and "opencompass.cli" not in sys.modules


def test_a_python_without_opencompass_gets_the_documented_line(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_dist)
    with pytest.raises(OpenCompassDependencyMissing) as e:
        check_opencompass(cfg(**{"opencompass.suite": "ci_sample"}))
    assert str(e.value) == MISSING_OPENCOMPASS.format(what="OpenCompass", python=sys.executable)
    assert ".venv-opencompass" in str(e.value) and "bash .ci/opencompass_lane.sh venv" in str(e.value)


@pytest.mark.skipif(installed(), reason="the main venv's case: OpenCompass really missing")
@pytest.mark.parametrize("args,first", [
    (["opencompass.suite=ci_sample"], "error: OpenCompass is not installed in this Python"),
    (["opencompass.suite=bogus"], "error: opencompass.suite='bogus' is not allowed"),
    (["opencompass.timeout_s=abc"], "error: opencompass.timeout_s: Value 'abc'"),
])
def test_the_command_in_the_main_venv_ends_in_one_line(args, first, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.opencompass", *args, "wandb.mode=disabled",
                           f"hydra.run.dir={tmp_path / 'r'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(first), proc.stderr[-2000:]
    assert not (tmp_path / "r" / "config.yaml").exists()

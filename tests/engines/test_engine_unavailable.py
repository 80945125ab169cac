"""What the chosen engine needs but this environment lacks is one line and exit code 2, not a library's traceback:
a package an engine class requires (``engine=vllm`` in a Python without vLLM), a checkpoint transformers cannot
read (``model.path`` without a usable ``config.json``; a hub id neither cached nor downloadable)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.engines import ENGINES, make_engine
from harness.engines.base import EngineUnavailable


class _NeedsMissing:
    requires = ("harness_no_such_package_xyz",)
    install_hint = "pip install harness-no-such-package"
    built = False

    def __init__(self, *args, **kwargs):
        type(self).built = True


def test_a_missing_required_package_is_named_before_the_engine_builds():
    ENGINES.register("needs_missing", _NeedsMissing)
    try:
        with pytest.raises(EngineUnavailable) as e:
            make_engine("needs_missing", "/nowhere", None, None)
    finally:
        del ENGINES["needs_missing"]
    assert "engine=needs_missing needs harness_no_such_package_xyz" in str(e.value)
    assert "pip install harness-no-such-package" in str(e.value) and sys.executable in str(e.value)
    assert not _NeedsMissing.built


def test_the_vllm_engine_declares_what_it_needs():
    cls = ENGINES.load("vllm")
    assert cls.requires == ("vllm",) and ".ci/vllm_lane.sh venv" in cls.install_hint


def test_an_unreadable_checkpoint_is_one_line_and_exit_code_2(tmp_path):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    run = subprocess.run([sys.executable, "-m", "harness", "model.embedded=false", f"model.path={empty}",
                          f"hydra.run.dir={tmp_path / 'run'}", "wandb.mode=disabled"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model.path={empty}: ") and "config.json" in last
    assert "Traceback" not in run.stderr

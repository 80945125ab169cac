"""The OpenCompass lane: these tests run in ``.venv-opencompass`` (``.ci/opencompass_lane.sh``), where the
``opencompass`` package is installed. In the main venv (no OpenCompass) nothing here is collected.

End-to-end runs start ``python -m harness.opencompass`` in a subprocess (OpenCompass itself starts a process
per task), ~30-60 s each on two cores: the five settings of the seed's table (SERE off, ``sere.k=2``, ``sere.k=1``, ``moe.top_k=2``,
``moe.top_k=1``) run once per session and every test reads their run directories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI_ITEMS = 4  # held-out rows per text task (4 tasks)
MAX_NEW_TOKENS = 12  # the longest answer (a list of six digits) is 11 tokens


def _opencompass_installed() -> bool:
    # Not importlib.util.find_spec("opencompass"): with tests/ on sys.path this very folder is a namespace
    # package called "opencompass". The distribution is what tells.
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("opencompass")
        return True
    except PackageNotFoundError:
        return False


if not _opencompass_installed():  # the main venv: this lane runs in .venv-opencompass
    # except the checks made before any OpenCompass import (a Python without OpenCompass is their case)
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_opencompass_checks.py"]
else:
    os.environ["TRITON_INTERPRET"] = "0"  # tests/conftest.py sets it for the kernel tests; nothing here needs it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The seed's table (baseline / SERE K=2 / SERE K=1 / plain truncation) at the seed table's rho 0.5. In proportion:
# the seed truncates its top-8 to 2 (a quarter), which is plain top-1 of the embedded model's top-4; top-2 is the
# half. The recall file (closed book, recipe v7g) is where truncation costs; the prompt-reading files are answered
# alike by every setting (test_opencompass_directions.py)
SETTINGS = {"off": [], "sere_k2": ["sere.k=2", "sere.rho=0.5"], "sere_k1": ["sere.k=1", "sere.rho=0.5"],
            "top_k2": ["moe.top_k=2"], "top_k1": ["moe.top_k=1"]}


def run_harness_opencompass(run_dir: Path, overrides: list[str], timeout: int = 420) -> subprocess.CompletedProcess:
    """``python -m harness.opencompass`` on the CI sample suite with ``overrides``, in ``run_dir``."""
    cmd = [sys.executable, "-m", "harness.opencompass", "opencompass.suite=ci_sample",
           f"opencompass.ci_items={CI_ITEMS}", f"generation.max_new_tokens={MAX_NEW_TOKENS}", "wandb.mode=disabled",
           f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def oc_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """setting -> (run directory, summary.json) for every setting, run once."""
    base = tmp_path_factory.mktemp("oc_runs")
    out = {}
    for name, overrides in SETTINGS.items():
        run_dir = base / name
        proc = run_harness_opencompass(run_dir, overrides)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        out[name] = (run_dir, json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
    return out

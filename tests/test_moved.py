"""Old module paths keep working for one release after issue 24's folder moves (harness/_moved.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from harness import _moved

ROOT = Path(__file__).resolve().parents[1]


def _file_of(dotted: str) -> Path:
    return ROOT / Path(*dotted.split("."))


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED.items()))
def test_every_old_name_is_free_and_its_new_home_exists(old, new):
    # the finder answers first: an old name that is a file again would be shadowed by it
    assert not _file_of(old).with_suffix(".py").exists() and not (_file_of(old) / "__init__.py").exists(), old
    assert _file_of(new).with_suffix(".py").exists() or (_file_of(new) / "__init__.py").exists(), new


def test_an_old_module_name_imports_its_new_module_with_a_warning():
    sys.modules.pop("harness.engines.hf_routing", None)
    with pytest.warns(DeprecationWarning, match="harness.engines.hf_routing moved to harness.engines.hf.routing"):
        old = importlib.import_module("harness.engines.hf_routing")
    assert old is importlib.import_module("harness.engines.hf.routing")  # one module: patching one patches both


def test_a_module_of_a_moved_package_imports_from_its_new_home():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("harness.offload.lease")
    assert old is importlib.import_module("harness.techniques.offload.lease")


def test_an_old_module_that_became_a_package_forwards_its_names():
    from harness.run.experiment import run_experiment
    with pytest.warns(DeprecationWarning, match="harness.run.run_experiment moved"):
        from harness.run import run_experiment as old
    assert old is run_experiment
    from harness.run import cache  # a submodule of the new package still imports as a submodule
    assert cache.__name__ == "harness.run.cache"
    with pytest.raises(ImportError):
        from harness.run import no_such_name  # noqa: F401


def test_an_old_python_m_entry_point_says_where_it_moved_and_runs_there():
    proc = subprocess.run([sys.executable, "-m", "harness.techniques.sere_calibration", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "moved to python -m harness.commands.sere_calibrate" in proc.stderr
    assert "usage: python -m harness.commands.sere_calibrate" in proc.stdout

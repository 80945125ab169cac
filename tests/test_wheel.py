"""The wheel: built from this checkout, installed (not editable) into a fresh venv, it runs ``python -m harness``,
a sweep and ``python -m harness.report`` from a directory that is not the repository.

Nothing is downloaded: the wheel is built without build isolation (setuptools of the running venv) and
installed with ``--no-deps --no-index``; its dependencies come from the running venv through a site directory
of links to that venv's site-packages (and the ``PYTHONPATH`` folders it runs with) **minus** the editable ``moe-vlm-harness`` (so ``import harness`` can only
find the wheel's copy) and minus open_clip (the ``[clip]`` extra: the default run must need only the base
install). About a minute on two CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the base install must do without: the editable harness itself and the [clip] extra
EXCLUDED = ("__editable__", "moe_vlm_harness", "open_clip", "__pycache__")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _build_wheel(tmp: Path) -> Path:
    """A wheel from a copy of the sources (the build writes build/ and *.egg-info beside them)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "harness", src / "harness", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(out), str(src)], cwd=tmp, env=_clean_env(tmp))
    (wheel,) = out.glob("moe_vlm_harness-*.whl")
    return wheel


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HARNESS_CACHE=str(tmp / "cache"), WANDB_MODE="disabled", WANDB_SILENT="true",
               HF_HUB_OFFLINE="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _dependency_dirs() -> list[Path]:
    """Where the running interpreter finds the dependencies, in its own order: the ``PYTHONPATH`` folders other
    than this checkout (the GPU machine brings Hydra, wandb and the metric libraries there, not in its venv),
    then the venv's site-packages. A name found twice is taken from the first, as ``import`` would."""
    extra = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    dirs = [p for p in extra if p.is_dir() and p.resolve() != ROOT]
    return [*dirs, Path(sysconfig.get_paths()["purelib"])]


def _venv_with_base_deps(tmp: Path) -> Path:
    """A fresh venv whose site-packages sees the running venv's packages except :data:`EXCLUDED`."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    farm = tmp / "deps"
    farm.mkdir()
    for folder in _dependency_dirs():
        for entry in folder.iterdir():
            if not entry.name.lower().startswith(EXCLUDED) and not (farm / entry.name).exists():
                (farm / entry.name).symlink_to(entry)
    # addsitedir (not a plain path line) so the dependencies' own .pth files are processed as in their venv
    (site / "zz_harness_test_deps.pth").write_text(f"import site; site.addsitedir({str(farm)!r})\n")
    return python


@pytest.mark.slow
def test_wheel_runs_the_harness_a_sweep_and_the_report_from_anywhere(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for packaged in ("harness/conf/config.yaml", "harness/conf/model/tiny.yaml", "harness/conf/baseline.yaml",
                     "harness/sweeps/baseline.yaml", "harness/conf/hydra/launcher/slurm.yaml",
                     "harness/datasets/bundled/rag_igbench_sample/data.jsonl", "harness/metrics/cn_stopwords.txt"):
        assert packaged in names, f"{packaged} is not in the wheel"
    assert any(n.startswith("harness/datasets/prompts/") for n in names)

    python = _venv_with_base_deps(tmp_path)
    env = _clean_env(tmp_path)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp_path, env=env)
    work = tmp_path / "work"  # not the repository: nothing here shadows the installed package
    work.mkdir()
    where = _run([str(python), "-c", "import harness, importlib.util; print(harness.__file__); "
                  "print(importlib.util.find_spec('open_clip'))"], cwd=work, env=env).stdout.split()
    assert where[0].startswith(str(tmp_path / "venv")) and where[1] == "None"

    # 1. a sweep found by name in the installed package (2 jobs); its first job is the default run (tiny model,
    # bundled RAG sample, the trained scorers shipped in the wheel: base install only). One process for both: each
    # `python -m harness` pays the imports again (~30 s on the loaded 2-core CI machine).
    quick = ["dataset.limit=2", "generation.max_new_tokens=4", "engine.warmup=0", "wandb.mode=disabled"]
    _run([str(python), "-m", "harness", "-m", "--config-name", "baseline", "hydra.sweep.dir=sweep",
          "dataset=rag_igbench_sample,ocrbench_sample", *quick], cwd=work, env=env)
    assert sorted(p.parent.name for p in (work / "sweep").glob("*/summary.json")) == ["0", "1"]
    summary = json.loads((work / "sweep" / "0" / "summary.json").read_text())
    assert summary["config"]["dataset"]["name"] == "rag_igbench"
    assert summary["metrics"]["n_samples"] == 2 and "clip_score" in summary["metrics"]
    assert summary["run"]["scoring"]["clip_weights"] == "trained-synthetic"  # shipped in the wheel

    # 2. the report over the sweep
    _run([str(python), "-m", "harness.report", "sweep", "--out", "report"], cwd=work, env=env)
    assert (work / "report" / "report.md").is_file()

    # and a refused value still exits 2 in one line from the installed package
    proc = subprocess.run([str(python), "-m", "harness", "visionzip.keep=1.5"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: visionzip.keep=1.5" in proc.stderr

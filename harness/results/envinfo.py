"""What a result was measured on: versions, hardware, git commit.

Every result file (run summaries, kernel benchmarks) embeds this block so that a figure can always be
traced back to the engine, library versions and device that produced it. Only torch is imported, and
lazily, so benchmarks on a bare GPU machine can use it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from harness import __version__


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


PROJECT_NAME = "moe-vlm-harness"


def _is_this_project(toplevel: Path, package_dir: Path) -> bool:
    """Whether the git work tree at ``toplevel`` is this project's checkout: the ``harness`` package sits at its
    root and its ``pyproject.toml`` names the project (not, say, a larger repository that merely contains a copy
    of the project, or a virtualenv with the installed package)."""
    if (toplevel / "harness").resolve() != package_dir.resolve():
        return False
    try:
        text = (toplevel / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return any(line.replace(" ", "") in (f'name="{PROJECT_NAME}"', f"name='{PROJECT_NAME}'")
               for line in text.splitlines())


def git_commit(package_dir: str | os.PathLike | None = None) -> str | None:
    """The project's own commit (``-dirty`` appended when its tracked files have local changes), or None.

    Only the git repository whose root holds this ``harness`` package and this project's ``pyproject.toml``
    counts: a wheel installed into a venv inside another checkout, or the project copied into a larger
    repository, records None rather than that other repository's commit. ``HARNESS_GIT_COMMIT`` overrides it
    for copies of the tree that carry no ``.git`` (e.g. the GPU machine)."""
    if os.environ.get("HARNESS_GIT_COMMIT"):
        return os.environ["HARNESS_GIT_COMMIT"]
    here = Path(package_dir) if package_dir else Path(__file__).resolve().parents[1]
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or not _is_this_project(Path(top.stdout.strip()), here):
            return None
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        sha = proc.stdout.strip()
        if proc.returncode != 0 or len(sha) != 40:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str | None = None) -> str:
    """Human name of the accelerator (``NVIDIA H200``) or of the CPU."""
    import torch

    if (device is None or str(device).startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device) if device else None)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU ({cpu}, {os.cpu_count()} cores)"


def collect_environment(device: str | None = None) -> dict[str, Any]:
    """Versions and hardware, as recorded in every result file."""
    import torch

    return {
        "harness_version": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "triton_version": package_version("triton"),
        "transformers_version": package_version("transformers"),
        "cuda": torch.version.cuda,
        "device_name": device_name(device),
        "hostname": platform.node(),
    }

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
from typing import Any

from harness import __version__


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(cwd: str | None = None) -> str | None:
    """The commit of the source tree (``-dirty`` appended when it has local changes), or None.

    ``HARNESS_GIT_COMMIT`` overrides it for copies of the tree that carry no ``.git``."""
    if os.environ.get("HARNESS_GIT_COMMIT"):  # copies of the tree without .git (e.g. the GPU machine)
        return os.environ["HARNESS_GIT_COMMIT"]
    here = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
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

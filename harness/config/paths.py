"""Where relative paths in a config point, in one place.

Why: a harness installed from a wheel has no "project root", and a rerun from another directory must find the
same generation cache. So there are three kinds of location, each with one rule:

- files shipped inside the package (bundled samples, prompts): ``${harness_pkg:datasets/bundled/...}`` in a
  config resolves to the absolute path inside the installed ``harness`` package;
- the user's own files (``dataset.path=data/x.jsonl``): relative paths resolve from the directory the command
  was typed in (Hydra does not change directory: ``hydra.job.chdir=false``);
- state shared by runs (built models, calibration artefacts, the generation cache): under
  ``$HARNESS_CACHE`` (default ``~/.cache/moe-vlm-harness``), ``${harness_cache:generations}`` in a config.

Only the standard library is imported at module level (GPU benchmarks import this without Hydra).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # harness/ (this file is harness/config/paths.py)

# The Hydra config directory, absolute, so the configs are found whatever the working directory and however a
# command is started (``python -m harness``, ``python -m harness.opencompass``, the ``python -m`` tools).
CONF_DIR = str(PACKAGE_DIR / "conf")


def cache_home() -> Path:
    """``$HARNESS_CACHE`` or ``~/.cache/moe-vlm-harness``: built models, calibration artefacts, generations."""
    root = os.environ.get("HARNESS_CACHE") or os.path.join(Path.home(), ".cache", "moe-vlm-harness")
    return Path(root).expanduser()


def package_path(relative: str = "") -> str:
    """Absolute path of ``relative`` inside the installed ``harness`` package (``${harness_pkg:...}``)."""
    return str(PACKAGE_DIR / relative) if relative else str(PACKAGE_DIR)


def cache_path(relative: str = "") -> str:
    """Absolute path of ``relative`` under :func:`cache_home` (``${harness_cache:...}``)."""
    return str(cache_home() / relative) if relative else str(cache_home())


def resolve_user_path(path: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """A config path as the user meant it: ``~`` expanded, relative paths from ``base`` (default: the working
    directory the command was typed in)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base or os.getcwd()) / p


def register_resolvers() -> None:
    """Register ``harness_pkg`` and ``harness_cache`` with OmegaConf (idempotent)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("harness_pkg", package_path, replace=True)
    OmegaConf.register_new_resolver("harness_cache", cache_path, replace=True)

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


# ------------------------------------------------- files the harness creates in shared places (issue 26)

#: open flags of a new file: never through a link (O_EXCL refuses any existing name, a planted link included)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_new(path: str | os.PathLike[str], mode: int = 0o644, append: bool = False) -> int:
    """A descriptor of a file created here and now (``O_CREAT | O_EXCL | O_NOFOLLOW``, ``mode`` less the umask):
    an existing name — a link someone planted included — is refused (``FileExistsError``), never followed."""
    return os.open(path, _NEW | (os.O_APPEND if append else 0), mode)


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> Path:
    """Write ``path`` whole or not at all: a new temporary file beside it (:func:`open_new`; its name says host
    and pid, so a later writer can tell a dead writer's leftover), fsync, rename over ``path`` (a link at
    ``path`` is replaced, not followed)."""
    import socket
    import uuid

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    fd = open_new(tmp, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path


def remove_stale_temporaries(directory: str | os.PathLike[str], name: str) -> int:
    """Remove ``.<name>.<host>.<pid>.*.tmp`` files of *this host* whose writer is dead (a killed artifact build
    leaves its temporary file: without this it stayed in the cache forever). Returns how many were removed."""
    import socket

    removed = 0
    host = socket.gethostname()
    for tmp in Path(directory).glob(f".{name}.{host}.*.tmp"):
        pid = tmp.name[len(f".{name}.{host}."):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive: its writer is still writing
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            tmp.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def writable_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why nothing can be written in ``directory`` (created when missing), or None: a probe file is created
    (:func:`open_new`), written, fsynced and removed — a read-only mount, a directory of another user and a full
    disk all show here, before any work is done."""
    import errno

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    if not d.is_dir():
        return "is not a directory"
    probe = d / f".harness-write-probe-{os.getpid()}"
    try:
        fd = open_new(probe, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "it is on a read-only file system",
                errno.EACCES: "it is not writable by you"}.get(e.errno, e.strerror or str(e))
        return f"is not writable ({what})"
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None

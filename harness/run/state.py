"""The state of one run directory across attempts: who holds it, whether an attempt was interrupted, and whether
its W&B logging completed.

Why a state file rather than inferring from the result files: the earlier rule "``samples.jsonl`` without
``summary.json`` means interrupted" broke when the resume itself was killed during start-up (it had already set
the old ``samples.jsonl`` aside and not yet written a new one, so the next attempt saw a fresh directory and
regenerated everything), and it could not tell that a run killed while logging to W&B after ``summary.json``
never reached W&B. ``run_state.json`` is written atomically *before* anything else of an attempt:

- ``status``: ``running`` from the start of an attempt until its ``summary.json`` is written, then ``finished``.
  An attempt that finds ``running`` resumes (replays the generation cache), however early the last one died;
- ``attempt``: 1 for the first attempt, +1 per rerun; ``attempts``: start time, pid and host of each;
- ``wandb``: the W&B run id used by every attempt of this directory (so an online rerun continues the same W&B
  run) and ``logged`` (true once W&B logging of the finished run completed). A directory with its
  ``summary.json`` but ``logged`` false is logged to W&B by the rerun instead of being skipped.

:class:`RunLock` keeps a second process out of a directory in use (two processes appending to one
``samples.jsonl`` would interleave their timings): an exclusive ``flock`` on ``<run_dir>/.lock``, which the
kernel releases when its holder dies, so the lock of a killed process is taken over without any clean-up. Only
the standard library is imported here.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import uuid
from pathlib import Path
from typing import Any

from harness.config.checks import StorageError
from harness.config.paths import cache_home, resolve_user_path, writable_problem, write_atomic

log = logging.getLogger(__name__)

# flock errors that mean "this file system has no locks", not "someone holds it"
NO_LOCKS = {errno.ENOSYS, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

STATE_FILE = "run_state.json"
LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another live process is running in this run directory."""


class RunLock:
    """An exclusive, non-blocking lock on a run directory (``with RunLock(run_dir):``).

    The lock file records the holder (pid, host, start time) for the error message; the lock itself is the
    ``flock``, so a holder killed with SIGKILL leaves a file that the next process simply re-locks."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a link planted at .lock (it would be truncated below); only a regular file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirLocked(f"{self.path} is a symbolic link (a lock is never taken through one): remove it"
                                   ) from None
            err = storage_error(e, self.path.parent, "hydra.run.dir")
            if err is e:
                raise
            raise err from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirLocked(f"{self.path} is not a regular file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in NO_LOCKS:  # e.g. Lustre mounted without -o flock: run, unprotected, and say so
                log.warning("%s: this file system does not support locks (%s); the run directory is not "
                            "protected against a second process", self.path.parent, e)
                os.close(fd)
                return self
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirLocked(
                f"run directory {self.path.parent} is in use by {holder or 'another process'}; wait for it to "
                "finish or choose another hydra.run.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": _now()}).encode() + b"\n")
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


#: errors of a write that the user, not the harness, must fix (space, quota, a read-only or foreign directory)
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
#: of those, the ones only a write gives (a run's read of a weight file may also give EACCES)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def storage_error(exc: OSError, where: str | os.PathLike[str] | None = None, key: str = "hydra.run.dir",
                  resume: str = "", errnos: set[int] | None = None) -> Exception:
    """The one line for a write the disk refused (:class:`harness.config.checks.StorageError`, exit code 2):
    the path, the OS's reason and what to do. Other ``OSError`` s are returned unchanged (a crash)."""
    if exc.errno not in (STORAGE_ERRNOS if errnos is None else errnos):
        return exc
    path = exc.filename or where
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "free space there (or point it elsewhere) and rerun the same command"
    else:
        todo = f"make it writable, or set {key} to a directory you can write, and rerun"
    return StorageError(f"{path}: {exc.strerror or exc} ({key}): {todo}{'; ' + resume if resume else ''}")


def check_storage(cfg: Any, run_dir: Path, finished: Any = None) -> dict[str, Any] | None:
    """Before anything of an attempt is written: every directory the run will write (run directory, generation
    cache, SERE's artifact cache when it builds artifacts) takes a probe file
    (:func:`harness.config.paths.writable_problem`), or :class:`~harness.config.checks.StorageError` (exit 2)
    names it, why, and what to do. A finished run on read-only media is returned by ``finished()`` (its
    ``summary.json`` for this configuration), not refused: reading it needs no write."""
    problem = writable_problem(run_dir)
    if problem is not None:
        done = finished() if finished is not None and cfg.cache.enabled and cfg.cache.read != "never" else None
        if done is not None:
            log.warning("%s %s: finished earlier with this configuration; its summary.json is read, not rerun",
                        run_dir, problem)
            return done
        raise StorageError(f"run directory {run_dir} {problem}: set hydra.run.dir to a directory you can write "
                           "(or free space there) and rerun")
    if cfg.cache.enabled:
        path = resolve_user_path(cfg.cache.path)
        problem = writable_problem(path)
        if problem is not None:
            raise StorageError(f"cache.path={path} {problem}: set cache.path to a directory you can write, or "
                               "cache.enabled=false, and rerun")
    sere = cfg.get("sere")
    if sere is not None and sere.k is not None and (not sere.similarity
                                                    or (int(sere.protect or 0) > 0 and not sere.protection)):
        path = cache_home() / "sere"
        problem = writable_problem(path)
        if problem is not None:
            raise StorageError(f"SERE's artifact cache {path} {problem}: set HARNESS_CACHE to a directory you can "
                               "write, or give sere.similarity=FILE (and sere.protection=FILE), and rerun")
    return None


def _read_holder(fd: int) -> str | None:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The directory's ``run_state.json`` (None when absent or unreadable: a directory of an older harness)."""
    try:
        state = json.loads((Path(run_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Atomically (temporary file, fsync, rename): a kill never leaves half a state file."""
    write_atomic(Path(run_dir) / STATE_FILE, (json.dumps(state, indent=1) + "\n").encode("utf-8"))


def was_interrupted(run_dir: Path, state: dict[str, Any] | None) -> bool:
    """Whether an earlier attempt in ``run_dir`` started and never wrote its ``summary.json``.

    With a state file: its ``status`` says so (``running`` = died at any point, start-up included). Without
    one (a directory written by an older harness): an interrupted attempt left ``samples.jsonl`` (or set-aside
    ``samples.jsonl.interrupted-*`` files) and no ``summary.json``."""
    if state is not None:
        return state.get("status") == "running"
    run_dir = Path(run_dir)
    if (run_dir / "summary.json").exists():
        return False
    return (run_dir / "samples.jsonl").exists() or any(run_dir.glob("samples.jsonl.interrupted-*"))


def begin_attempt(run_dir: Path) -> tuple[dict[str, Any], bool]:
    """Record the start of an attempt (call with the :class:`RunLock` held) and set the previous attempt's
    ``samples.jsonl`` aside. Returns (state, resuming): ``resuming`` when the previous attempt was interrupted.

    The state (``status: running``) is written *before* the old ``samples.jsonl`` is renamed, so a kill at any
    point of this start-up leaves a directory the next attempt still resumes."""
    run_dir = Path(run_dir)
    old = read_state(run_dir)
    resuming = was_interrupted(run_dir, old)
    state = {
        "status": "running",
        "attempt": int((old or {}).get("attempt", 0)) + 1,
        "attempts": [*((old or {}).get("attempts") or []),
                     {"started": _now(), "pid": os.getpid(), "host": socket.gethostname(), "resumed": resuming}],
        "wandb": {"id": ((old or {}).get("wandb") or {}).get("id") or uuid.uuid4().hex[:12], "logged": False,
                  "dir": None},
    }
    write_state(run_dir, state)
    set_aside_samples(run_dir, interrupted=resuming)
    return state, resuming


def set_aside_samples(run_dir: Path, interrupted: bool) -> Path | None:
    """Rename an existing ``samples.jsonl`` (never append to it): ``samples.jsonl.interrupted-N`` when its
    attempt was interrupted, ``samples.jsonl.old-N`` when it belongs to a finished run of another config."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.exists():
        return None
    n = len(list(path.parent.glob("samples.jsonl.interrupted-*"))) + len(list(path.parent.glob("samples.jsonl.old-*")))
    target = path.with_name(f"samples.jsonl.{'interrupted' if interrupted else 'old'}-{n + 1}")
    path.rename(target)
    return target


def mark_finished(run_dir: Path, state: dict[str, Any]) -> None:
    """``summary.json`` is written: a rerun with this configuration no longer regenerates anything."""
    state["status"] = "finished"
    if state.get("attempts"):
        state["attempts"][-1]["finished"] = _now()
    write_state(run_dir, state)


def mark_failed(run_dir: Path, state: dict[str, Any], reason: str, **details: Any) -> None:
    """The run ended without a valid result (e.g. SERE configured but not engaged: ``sere_graphs``): status
    ``failed`` with the reason; no ``summary.json`` is written, so a rerun starts again."""
    state["status"] = "failed"
    state["reason"] = reason
    state.update(details)
    if state.get("attempts"):
        state["attempts"][-1]["failed"] = _now()
    write_state(run_dir, state)


def mark_wandb_logged(run_dir: Path, state: dict[str, Any], wandb_dir: str | None) -> None:
    """W&B logging of the finished run completed (summary, samples table, artifact): nothing left to redo."""
    state["wandb"] = {**(state.get("wandb") or {}), "logged": True, "dir": wandb_dir}
    write_state(run_dir, state)


def wandb_pending(state: dict[str, Any] | None, wandb_mode: str) -> bool:
    """A finished run whose W&B logging never completed (killed while logging after ``summary.json``)."""
    if wandb_mode == "disabled":
        return False
    return not ((state or {}).get("wandb") or {}).get("logged", state is None)

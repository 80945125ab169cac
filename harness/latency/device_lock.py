"""Jobs that share one device: take turns (``latency.sequential=true``) and notice when they did not.

A latency job holds a lock file per device of this host (``<tmp>/harness-device-locks-<uid>/<device>.lock``, a
``flock``: the kernel drops it when its holder dies, so a killed job never blocks the next) from before its
model loads until its last timed pass ends:

* ``sequential=true``: an exclusive lock. A second job on the device waits (logging who it waits for) — the
  launcher may start every job of a sweep at once (``hydra/launcher=local``), the device still runs them one
  at a time. ``latency.lock_timeout_s`` bounds the wait.
* ``sequential=false``: a shared lock, after a non-blocking try of the exclusive one at the start and again at
  the end of measurement. A try that fails means another harness job was measuring on the device at that
  moment: ``summary.json`` ``latency.protocol.device.concurrent`` records it and ``warnings`` says the figures
  were disturbed. Of two overlapping jobs the later-starting one always sees the other.

The device is named without touching CUDA (the lock is taken before the model loads): ``cpu``, or ``cuda`` with
the job's ``CUDA_VISIBLE_DEVICES`` (Slurm gives each job its own GPUs, so their keys differ and they do not wait
for each other) and the configured index. Only the standard library is imported.

Why the lock directory is private (issue 26): a shared ``/tmp/harness-device-locks`` could be created first by
another local user, who could then plant a link at a lock path and make a run truncate (``ftruncate``) or create
any file the run may write. So the directory is per user (``harness-device-locks-<uid>``, created ``0o700``) and
is refused — :class:`UnsafeLockDir`, exit 2 with one line — unless it is a real directory (not a link) owned by
this user and writable by nobody else; lock files are opened with ``O_NOFOLLOW``, created ``0o600``, and refused
unless they are regular files owned by this user. Jobs of *different* users therefore do not see each other's
locks (they never could safely); ``HARNESS_DEVICE_LOCK_DIR`` is held to the same rules.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_DIR_ENV = "HARNESS_DEVICE_LOCK_DIR"  # tests and shared-node setups may point this elsewhere


def device_key(engine_device: str, env: dict[str, str] | None = None) -> str:
    """A name for the device(s) a job will time on, from config and environment only."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    wants_cuda = engine_device.startswith("cuda") or (
        engine_device == "auto" and visible != "" and (visible is not None or Path("/dev/nvidia0").exists()))
    if not wants_cuda:
        return "cpu"
    index = engine_device.split(":", 1)[1] if ":" in engine_device else "0"
    return f"cuda-visible[{visible if visible is not None else 'all'}]-{index}"


class UnsafeLockDir(RuntimeError):
    """The lock directory (or a lock file in it) could be controlled by another user: the job stops (exit 2)."""


def lock_dir(env: dict[str, str] | None = None) -> Path:
    """This user's lock directory: ``$HARNESS_DEVICE_LOCK_DIR``, else ``<tmp>/harness-device-locks-<uid>``."""
    env = os.environ if env is None else env
    return Path(env.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / f"harness-device-locks-{os.getuid()}")


def check_private_dir(root: Path) -> None:
    """Refuse a directory another user could write into (or has swapped for a link): see the module docstring."""
    hint = f"remove it, or set {LOCK_DIR_ENV} to a directory only you can write"
    try:
        st = os.lstat(root)
    except OSError as e:
        raise UnsafeLockDir(f"device lock directory {root} cannot be checked ({e.strerror}): {hint}") from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafeLockDir(f"device lock directory {root} is {what}: {hint}")
    if st.st_uid != os.getuid():
        raise UnsafeLockDir(f"device lock directory {root} is owned by uid {st.st_uid}, not by you "
                            f"(uid {os.getuid()}): {hint}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeLockDir(f"device lock directory {root} is writable by other users "
                            f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 700 it, or {hint}")


def _lock_path(key: str) -> Path:
    root = lock_dir()
    if not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:  # created meanwhile, by a sibling job or by someone else: checked below
            pass
    check_private_dir(root)
    return root / (re.sub(r"[^A-Za-z0-9_.,\[\]-]+", "_", key) + ".lock")


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file, never through a link and only if it is this user's regular file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise UnsafeLockDir(f"device lock file {path} is not a regular file of yours: remove it")
    return fd


class DeviceLock:
    """``with DeviceLock(key, sequential=...) as lock:`` around a job's model load and timed passes."""

    def __init__(self, key: str, *, sequential: bool = False, timeout_s: float | None = None,
                 poll_s: float = 0.5):
        self.key, self.sequential, self.timeout_s, self.poll_s = key, bool(sequential), timeout_s, poll_s
        self.path = _lock_path(key)
        self._fd: int | None = None
        self.waited_s = 0.0
        self.concurrent_at_start = False
        self.concurrent_at_end = False
        self.available = True  # False on a file system without flock: nothing is locked or detected

    def _flock(self, mode: int) -> bool:
        import fcntl

        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __enter__(self) -> "DeviceLock":
        try:
            import fcntl

            self._fd = open_lock_file(self.path)
        except (ImportError, OSError) as e:
            if isinstance(e, OSError) and e.errno == errno.ELOOP:  # O_NOFOLLOW met a link planted at the lock path
                raise UnsafeLockDir(f"device lock file {self.path} is a symbolic link: remove it") from e
            log.warning("device lock %s unavailable (%s): latency jobs are neither serialised nor checked",
                        self.path, e)
            self.available = False
            return self
        try:
            if self._flock(fcntl.LOCK_EX):
                if not self.sequential:
                    fcntl.flock(self._fd, fcntl.LOCK_SH)  # downgrade: others may measure, and will see us
            elif self.sequential:
                self._wait(fcntl)
            else:
                self.concurrent_at_start = True
                log.info("another harness job is measuring on device %s: this job's latency is disturbed "
                         "(latency.sequential=true makes them take turns; summary.json warnings says so)", self.key)
                self._flock(fcntl.LOCK_SH)  # best effort: a sequential holder keeps it exclusive
        except TimeoutError:  # an OSError too: not "locks unavailable", the job gives up
            os.close(self._fd)
            self._fd = None
            raise
        except OSError as e:  # e.g. ENOLCK on a file system without locks
            log.warning("device lock %s unavailable (%s)", self.path, e)
            self.available = False
            return self
        if self.sequential:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        return self

    def _wait(self, fcntl: Any) -> None:
        holder = self.holder()
        log.warning("device %s is in use by %s: waiting for it (latency.sequential=true)", self.key,
                    holder or "another harness job")
        t0 = time.monotonic()
        while not self._flock(fcntl.LOCK_EX):
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"device {self.key} still in use by {holder or 'another harness job'} after "
                                   f"latency.lock_timeout_s={self.timeout_s:g} s")
            time.sleep(self.poll_s)
        self.waited_s = time.monotonic() - t0

    def holder(self) -> str | None:
        """Who holds the lock exclusively, as its holder wrote it (pid, host, since), if readable."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                info = json.loads(os.read(fd, 4096).decode() or "{}")
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None
        if not isinstance(info, dict):
            return None
        return f"pid {info['pid']} on {info.get('host')} (since {info.get('since')})" if info.get("pid") else None

    def end_of_measurement(self) -> None:
        """A non-sequential job checks again whether another one is measuring now."""
        if not self.available or self.sequential or self._fd is None:
            return
        import fcntl

        if self._flock(fcntl.LOCK_EX):
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        else:  # a conversion may drop the lock held before it: take the shared one again
            self.concurrent_at_end = True
            self._flock(fcntl.LOCK_SH)

    def info(self) -> dict[str, Any]:
        """``summary.json`` ``latency.protocol.device``."""
        return {"key": self.key, "sequential": self.sequential, "lock": str(self.path),
                "checked": self.available, "waited_s": round(self.waited_s, 3),
                "concurrent": self.concurrent_at_start or self.concurrent_at_end,
                "concurrent_at_start": self.concurrent_at_start, "concurrent_at_end": self.concurrent_at_end}

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            if self.sequential:
                try:
                    os.ftruncate(self._fd, 0)
                except OSError:
                    pass
            os.close(self._fd)  # closing drops the flock
            self._fd = None

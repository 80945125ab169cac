"""The device lock cannot be turned against its user (issue 26): a link planted at a lock path is never
followed, a lock directory another user controls is refused with one line, and locking itself still works."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness.latency.device_lock import DeviceLock, UnsafeLockDir, lock_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lock directory, as the harness creates it."""
    root = tmp_path / "locks"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("HARNESS_DEVICE_LOCK_DIR", str(root))
    return root


@pytest.mark.parametrize("sequential", [True, False])
def test_a_link_at_the_lock_path_is_not_followed(locks: Path, tmp_path: Path, sequential: bool):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (locks / "cpu.lock").symlink_to(victim)
    with pytest.raises(UnsafeLockDir, match="cpu.lock is a symbolic link"):
        with DeviceLock("cpu", sequential=sequential):
            pass
    assert victim.read_text() == "precious"  # the old code's O_CREAT + ftruncate emptied it


def test_a_dangling_link_creates_nothing(locks: Path, tmp_path: Path):
    target = tmp_path / "created-through-the-link"
    (locks / "cpu.lock").symlink_to(target)
    with pytest.raises(UnsafeLockDir):
        with DeviceLock("cpu", sequential=True):
            pass
    assert not target.exists()


def test_a_fifo_at_the_lock_path_is_refused(locks: Path):
    os.mkfifo(locks / "cpu.lock", 0o600)
    with pytest.raises(UnsafeLockDir, match="not a regular file"):
        with DeviceLock("cpu"):
            pass


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_a_group_or_world_writable_directory_is_refused(locks: Path, mode: int):
    locks.chmod(mode)
    with pytest.raises(UnsafeLockDir, match=r"writable by other users .*chmod 700") as err:
        DeviceLock("cpu")
    assert "\n" not in str(err.value)


def test_a_directory_of_another_user_is_refused(locks: Path, monkeypatch: pytest.MonkeyPatch):
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # the directory now belongs to "someone else"
    with pytest.raises(UnsafeLockDir, match=rf"owned by uid {me}, not by you \(uid {me + 1}\)"):
        DeviceLock("cpu")


def test_a_linked_lock_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "locks").symlink_to(real)
    monkeypatch.setenv("HARNESS_DEVICE_LOCK_DIR", str(tmp_path / "locks"))
    with pytest.raises(UnsafeLockDir, match="is a symbolic link"):
        DeviceLock("cpu")


def test_default_directory_is_per_user_and_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HARNESS_DEVICE_LOCK_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    old = os.umask(0)  # even with no umask the directory and files are private
    try:
        with DeviceLock("cpu", sequential=True) as lock:
            assert lock.available and lock.holder()
    finally:
        os.umask(old)
    root = lock_dir()
    assert root == tmp_path / f"harness-device-locks-{os.getuid()}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "cpu.lock").stat().st_mode) == 0o600


def test_normal_locking_still_works(locks: Path):
    with DeviceLock("cpu", sequential=True) as holder:
        assert holder.available and "pid" in holder.holder()
        with pytest.raises(TimeoutError, match="still in use"):
            with DeviceLock("cpu", sequential=True, timeout_s=0.1, poll_s=0.02):
                pass
    with DeviceLock("cpu") as first, DeviceLock("cpu") as second:
        assert second.concurrent_at_start and not first.concurrent_at_start


def test_cli_exits_2_with_one_line(tmp_path: Path):
    """End to end: an unsafe lock directory stops ``python -m harness`` before the model loads."""
    shared = tmp_path / "shared-locks"
    shared.mkdir()
    shared.chmod(0o777)
    env = {**os.environ, "HARNESS_DEVICE_LOCK_DIR": str(shared), "HARNESS_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "harness", f"hydra.run.dir={tmp_path / 'run'}",
                           "wandb.mode=disabled", "dataset.limit=1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # beside the progress bar
    assert len(errors) == 1 and errors[0].startswith("error: device lock directory"), proc.stderr[-2000:]
    assert "writable by other users" in errors[0]
    assert "Traceback" not in proc.stderr

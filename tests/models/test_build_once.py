"""harness.models.tiny.build_once: temporary directories of killed builds are cleaned up by the next build, those of
live builds are not (issue 12, item 5)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.models.tiny import MARKER, build_once


def _build(tmp: Path) -> None:
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / MARKER).write_text("{}")


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_killed_build_s_temporary_directory_is_removed_by_the_next_build(tmp_path):
    target = tmp_path / "tiny-model-abc"
    # a build SIGKILLed mid-way (a real process, so its flock really dies with it)
    killed = subprocess.Popen([sys.executable, "-c", (
        "import os, signal; from pathlib import Path; from harness.models.tiny import build_once\n"
        "def build(tmp):\n    (tmp / 'part').write_bytes(b'x'); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"build_once(Path({str(target)!r}), build)")])
    assert killed.wait(timeout=60) == -signal.SIGKILL
    (left,) = tmp_path.glob("tiny-model-abc.*")  # old code: these accumulated for ever
    assert (left / "part").exists()
    _age(left, 3600)
    # a build still running in another process: its directory is locked and stays
    live = tmp_path / "tiny-model-abc.live1234"
    live.mkdir()
    _age(live, 3600)
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # a fresh one (between mkdtemp and its flock) stays too
    young = tmp_path / "tiny-model-abc.young567"
    young.mkdir()
    try:
        assert build_once(target, _build) == target
    finally:
        os.close(fd)
    assert (target / MARKER).exists()
    assert not left.exists() and live.exists() and young.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-model-abc", "tiny-model-abc.live1234",
                                                          "tiny-model-abc.young567"]
    # a killed build's leftover next to a complete target is removed by the next call too
    late = tmp_path / "tiny-model-abc.late8910"
    late.mkdir()
    _age(late, 3600)
    assert build_once(target, _build) == target and not late.exists()

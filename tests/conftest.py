"""Shared test set-up.

- Triton kernels are tested on CPU through Triton's interpreter, which must be switched on before ``triton`` is
  first imported, hence here, at collection time.
- Subprocesses (``python -m harness`` ...) import this checkout: its root is put *in front of* the
  ``PYTHONPATH`` the suite was started with, never in its place (the GPU machine brings Hydra, wandb and the
  metric libraries on ``PYTHONPATH``; a subprocess that lost them failed there). Tests pass ``os.environ`` on.
- Under pytest-xdist (``.ci/run``: ``-n 2``) each worker gets its share of the CPU threads, and every session
  (each worker, each CI lane) its own device-lock directory, so the harness runs of one session do not record
  another's as "concurrent" on the device.
"""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ["OMP_NUM_THREADS"] = _threads  # the subprocesses a test starts share the worker's share too
    torch.set_num_threads(int(_threads))


# Under pytest-xdist (.ci/run: --dist loadscope --no-loadscope-reorder) a module runs whole on one worker and the
# modules are handed out in collection order: the longest go first, so that no worker is left alone with one of
# them at the end (alphabetically, test_sensitivity.py would start last). Seconds per module in a run on two
# loaded cores (pytest --durations, 2026-12-02; all the other modules together: ~900 s).
LONGEST_FIRST = (
    "tests/engines/hf/test_hf_decode_forward.py",    # ~250 s: interpreted decode steps
    "tests/run/test_sensitivity.py",                  # 224 s alone (1,500 s while SERE runs used the interpreter)
    "tests/config/test_config.py",                       # 355 s loaded: 287 Hydra compositions
    "tests/run/test_crash.py",                        # 220 s
    "tests/kernels/test_sere_stats.py",           # 220 s
    "tests/engines/test_real_shapes.py",          # 210 s
    "tests/engines/hf/test_hf_experts.py",           # 205 s
    "tests/kernels/test_reroute.py",              # 205 s
    "tests/engines/hf/test_hf_attention_decode.py",  # 200 s
    "tests/run/test_experiment.py",                          # 185 s
    "tests/run/test_sweeps.py",                       # 180 s
    "tests/techniques/offload/test_cli_offload.py",          # 175 s
    "tests/latency/test_paired_timing.py",             # session 8's end-to-end tests, not yet timed alone
    "tests/run/test_baselines.py",
    "tests/metrics/test_trained_scorers.py",
    "tests/engines/hf/test_hf_families.py",
    "tests/test_wheel.py",                        # 74 s (one harness process fewer)
    "tests/kernels/test_fused_routing.py",        # 66 s: both launch plans in the interpreter
    # the vLLM lane (.ci/vllm_lane.sh, its own session on two workers): seconds inside CI, 2026-12-03
    "tests/vllm/test_vllm_families.py",           # ~360 s: five engines, one per family
    "tests/vllm/test_vllm_disagg.py",             # ~300 s: three engines
    "tests/vllm/test_vllm_run.py",                # ~230 s: four `python -m harness engine=vllm`
    "tests/vllm/test_vllm_shapes.py",             # ~130 s: three runs
    "tests/vllm/test_vllm_serve.py",              # ~90 s: two `vllm serve`
    "tests/vllm/test_vllm_topk.py",               # ~60 s
    "tests/vllm/test_vllm_plugin.py",             # ~45 s: fresh processes
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as before


@pytest.fixture(scope="session", autouse=True)
def _private_device_lock_dir(tmp_path_factory):
    """``HARNESS_DEVICE_LOCK_DIR`` of this session (tests that test the lock set their own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_DEVICE_LOCK_DIR", str(tmp_path_factory.mktemp("device-locks")))
        yield

"""``python -m harness offload.policy=lru offload.capacity=...`` runs end to end and writes the ``offload`` block;
a bad offload setting is refused with exit code 2 before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def harness_cmd(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "HARNESS_CACHE": str(cwd / "hc")}
    return subprocess.run([sys.executable, "-m", "harness", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_lru_run_writes_the_offload_block(tmp_path):
    run_dir = tmp_path / "run"
    proc = harness_cmd(f"hydra.run.dir={run_dir}", "wandb.mode=disabled", "generation.max_new_tokens=6",
                       "dataset.limit=2", "offload.policy=lru", "offload.capacity=6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    off = summary["offload"]
    assert off["policy"] == "lru" and off["capacity_per_layer"] == 6 and off["num_experts"] == 16
    assert off["decode_steps"] > 0 and off["accesses"] > 0 and off["hits"] + off["misses"] == off["accesses"]
    assert off["h2d_bytes_decode"] == off["misses"] * off["expert_bytes"]  # no prefetch under plain LRU
    assert off["decode_ms_per_token"] > 0 and off["ttft_ms_mean"] > 0 and off["decode_steps_match"]
    if torch.cuda.is_available():  # the GPU machine runs this file too: peak memory is then measured
        assert off["memory"]["peak_allocated_bytes"] > 0
    else:
        assert off["memory"]["peak_allocated_bytes"] is None and "no CUDA" in off["memory"]["reason"]
    settings = summary["run"]["engine_settings"]
    assert settings["experts_implementation"] == "harness_offload_moe" and settings["offload"] == "lru"
    assert summary["config"]["offload"]["policy"] == "lru"


def test_bad_offload_setting_is_refused(tmp_path):
    proc = harness_cmd("wandb.mode=disabled", "offload.policy=lru", "offload.capacity=0", cwd=tmp_path)
    assert proc.returncode == 2 and "offload.capacity=0" in proc.stderr

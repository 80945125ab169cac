"""benchmarks/bench_routing_op.py's parallel compile step: each ``--warm-only`` process gets the caller's flags
with its own T, and a process that fails (a variant that disagrees with its reference) stops the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_routing_op as bro  # noqa: E402


def test_warm_argv_drops_the_per_process_flags_in_both_spellings():
    argv = ["--tokens", "1,4", "--variants", "one_sere2,multi_sere2", "--out=/tmp/x.json", "--rounds", "5",
            "--compile-jobs", "4", "--baseline-multi=old.py", "--tokens=64"]
    assert bro.warm_argv(argv) == ["--variants", "one_sere2,multi_sere2", "--rounds", "5", "--baseline-multi=old.py"]


def test_compile_in_parallel_runs_one_warm_process_per_length_and_stops_on_a_failure(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, capture_output, text):
        calls.append(cmd)
        t = int(cmd[cmd.index("--tokens") + 1])
        return subprocess.CompletedProcess(cmd, 1 if t == 16 else 0, stdout=f"T={t}\n", stderr="")

    argv = ["--variants", "one_sere2", "--compile-jobs", "3"]
    monkeypatch.setattr(bro.subprocess, "run", fake_run)
    bro.compile_in_parallel([1, 4], 3, argv)
    assert sorted(c[c.index("--tokens") + 1] for c in calls) == ["1", "4"]
    assert all("--warm-only" in c and c[2:4] == ["--variants", "one_sere2"] and "--compile-jobs" not in c
               for c in calls)
    assert "compiled 2 step lengths" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"T=\[16\]"):
        bro.compile_in_parallel([1, 16, 64], 3, argv)
    assert "compile T=16 failed" in capsys.readouterr().err


def test_each_dispatched_row_names_the_forced_variant_of_its_plan_and_tiling():
    from harness.kernels.fused_routing import ONE_PROGRAM_MAX_TOKENS

    assert bro.dispatched_as("fused_sere2", 1) == "one_sere2_w1"
    assert bro.dispatched_as("fused_top2", 2) == "one_top2_w2"
    assert bro.dispatched_as("fused_stock", ONE_PROGRAM_MAX_TOKENS) == "one_stock"
    assert bro.dispatched_as("fused_sere2", ONE_PROGRAM_MAX_TOKENS + 1) == "multi_sere2_t1w1r2"
    assert bro.dispatched_as("fused_top2", 64) == "multi_top2_t1w1"
    assert set(bro.DISPATCHED) <= {f"fused_{v}" for v in ("stock", "sere2", "sere1", "top2", "sere2_nostats")}

"""Offload values that used to fail after the model loaded, or never (issue 26), checked before it loads:
``offload.record_trace`` targets (docs/validation.md "Offload values"), an infinite cache size. The
composed-config cases are in tests/config/test_config.py ``OFFLOAD_CASES``; these are the path rules on their own."""

from __future__ import annotations

import math
import os

import pytest

from harness.run.rules_offload import finite_above_zero, trace_target_problem


def test_infinite_and_nan_sizes_are_refused():
    check = finite_above_zero("the whole cache")
    assert check.ok(0.5) and check.ok(80)
    assert not any(check.ok(v) for v in (math.inf, -math.inf, math.nan, 0, -1, True, "1"))
    assert check.text() == "a finite number > 0 (the whole cache)"


@pytest.mark.parametrize("target", ["/dev/full", "/dev/null.pt", "/dev/shm/x/trace", "/proc/self/trace",
                                    "/sys/kernel/trace"])
def test_pseudo_file_systems_are_refused(target):
    problem = trace_target_problem(target)
    assert problem is not None and "outside /dev, /proc, /sys" in problem


def test_a_link_into_dev_is_refused(tmp_path):
    (tmp_path / "dev").symlink_to("/dev")
    assert "outside /dev" in trace_target_problem(str(tmp_path / "dev" / "trace"))


def test_existing_non_regular_targets_are_refused(tmp_path):
    (tmp_path / "run.pt").mkdir()
    assert "run.pt" in trace_target_problem(str(tmp_path / "run"))
    (tmp_path / "b.json").mkdir()
    assert "b.json" in trace_target_problem(str(tmp_path / "b.pt"))  # either file of the pair


def test_a_file_where_a_folder_belongs_is_refused(tmp_path):
    (tmp_path / "plain").write_text("x")
    assert "not one" in trace_target_problem(str(tmp_path / "plain" / "sub" / "trace"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_a_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert "not writable" in trace_target_problem(str(ro / "trace"))
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("value", ["", "  ", "a\x00b", 3])
def test_empty_or_nul_paths_are_refused(value):
    assert trace_target_problem(value) == "a non-empty path without NUL bytes"


def test_writable_targets_are_accepted_and_nothing_is_created(tmp_path):
    for target in ("run1", "run1.pt", "run1.json", "new/deeper/run1"):
        assert trace_target_problem(str(tmp_path / target)) is None, target
    (tmp_path / "old.pt").write_bytes(b"x")  # an earlier trace is overwritten, as before
    assert trace_target_problem(str(tmp_path / "old")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.pt"]  # checked without touching the disk

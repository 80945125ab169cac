"""The offload benchmark's protocol (benchmarks/offload_protocol.py): rotated rounds, paired ratios, and a
verdict only from non-overlapping intervals."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from offload_protocol import compare, paired_ratio, rounds, verdict  # noqa: E402


def test_rounds_rotate_so_every_variant_takes_every_position():
    r = rounds(["a", "b", "c"], 4)
    assert r == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert rounds([], 3) == []


def test_verdict_needs_intervals_that_do_not_overlap():
    assert verdict({"ci": [1.0, 2.0]}, {"ci": [2.5, 3.0]}) == "faster"
    assert verdict({"ci": [3.1, 4.0]}, {"ci": [2.5, 3.0]}) == "slower"
    assert verdict({"ci": [1.0, 2.6]}, {"ci": [2.5, 3.0]}) == "n.s."
    assert verdict({"ci": None}, {"ci": [2.5, 3.0]}) == "n.s."


def test_compare_pairs_rounds_and_reports_share_of_resident():
    ms = {"none": [1.0, 1.1, 0.9, 1.0, 1.05], "lru": [2.0, 2.2, 1.8, 2.0, 2.1], "lease": [4.0, 4.4, 3.6, 4.0, 4.2]}
    c = compare(ms)
    assert c["lease"]["vs_lru"]["values"] == pytest.approx([2.0] * 5)
    assert c["lease"]["verdict_vs_lru"] == "slower" and c["none"]["verdict_vs_lru"] == "faster"
    assert c["lease"]["share_of_resident"]["mean"] == pytest.approx(0.25, rel=0.01)
    assert "vs_lru" not in c["lru"] and "share_of_resident" not in c["none"]
    assert c["lru"]["spread"] == pytest.approx(0.4 / 2.0)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])

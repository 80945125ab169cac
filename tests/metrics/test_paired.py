"""Paired quality intervals (issue 31): harness/metrics/paired.py and its command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.commands.paired_quality import main
from harness.metrics.paired import paired_delta, paired_metrics, verdict


def test_paired_interval_sees_a_small_shift_that_unpaired_spread_hides():
    rng = np.random.default_rng(0)
    base = rng.random(40)  # samples differ a lot from each other ...
    tech = base + 0.03 + 0.01 * rng.standard_normal(40)  # ... the technique moves each one a little
    got = paired_delta(tech, base, seed=1)
    assert got["n"] == 40 and got["delta"] == pytest.approx(float((tech - base).mean()))
    assert 0 < got["low"] < got["delta"] < got["high"] < 0.06 and got["verdict"] == "+"
    assert got["p_wilcoxon"] < 1e-3
    # the unpaired spread of either run is an order of magnitude wider than the shift
    assert base.std() / np.sqrt(40) > got["high"] - got["low"]
    assert paired_delta(tech, base, seed=1) == got  # seeded: the same interval twice


def test_degenerate_and_null_cases():
    same = paired_delta([0.2, 0.5, 0.9], [0.2, 0.5, 0.9])
    assert (same["delta"], same["low"], same["high"], same["p_wilcoxon"], same["verdict"]) == (0, 0, 0, 1.0, "n.s.")
    noise = paired_delta([1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1])
    assert noise["low"] < 0 < noise["high"] and noise["verdict"] == "n.s."
    assert paired_delta([], [])["delta"] is None
    assert verdict(-0.2, -0.1) == "−" and verdict(0.0, 0.3) == "n.s."
    with pytest.raises(ValueError):
        paired_delta([1], [1, 2])


def _rec(uid, rouge, invalid=False, error=None):
    return {"uid": uid, "error": error, "scores": None if error else {"rouge1": rouge, "format_invalid": invalid,
                                                                       "hallucinated_image": False}}


def test_paired_metrics_matches_by_uid_and_counts_invalid_apart(tmp_path):
    a = [_rec("1", 0.5), _rec("2", 0.0, invalid=True), _rec("3", None, error="boom"), _rec("4", 0.3), _rec("9", 1.0)]
    b = [_rec("4", 0.1), _rec("3", 0.2), _rec("2", 0.4), _rec("1", 0.4)]
    got = paired_metrics(a, b)
    assert list(got["metrics"]) == ["rouge1"]  # flags are not metrics
    assert (got["pairs"], got["unmatched"], got["errors_a"], got["errors_b"], got["invalid_a"], got["invalid_b"]) == \
        (4, 1, 1, 0, 1, 0)
    m = got["metrics"]["rouge1"]
    assert m["n"] == 3 and m["delta"] == pytest.approx(((0.5 - 0.4) + (0.0 - 0.4) + (0.3 - 0.1)) / 3)

    for name, recs in (("tech", a), ("base", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "paired.json"
    assert main([str(tmp_path / "base"), str(tmp_path / "tech"), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["runs"][0]["metrics"]["rouge1"]["n"] == 3 and saved["runs"][0]["invalid_a"] == 1

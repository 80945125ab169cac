"""The stratified paired bootstrap for macro averages (issue 31, harness/metrics/paired.py): OpenCompass's average is
a mean over datasets, so its delta is the mean of the per-dataset deltas and its interval resamples items within
each dataset."""

from __future__ import annotations

import numpy as np
import pytest

from harness.metrics.paired import paired_delta, stratified_paired_delta, stratified_paired_metrics

pytest.importorskip("scipy")


def test_macro_delta_is_the_mean_of_per_dataset_deltas_not_of_pooled_items():
    big_a, big_b = [1.0] * 30 + [0.0] * 10, [0.0] * 10 + [1.0] * 10 + [0.0] * 20  # 40 items: delta +0.5
    small_a, small_b = [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]  # 4 items: delta -0.75
    got = stratified_paired_delta({"big": (big_a, big_b), "small": (small_a, small_b)}, scale=100.0, seed=3)
    per_big = np.mean(np.subtract(big_a, big_b)) * 100
    per_small = np.mean(np.subtract(small_a, small_b)) * 100
    assert got["delta"] == pytest.approx((per_big + per_small) / 2) == pytest.approx(-12.5)
    pooled = paired_delta(big_a + small_a, big_b + small_b)["delta"] * 100
    assert pooled == pytest.approx(100 * 17 / 44) and got["delta"] != pytest.approx(pooled)
    assert got["strata"]["big"]["delta"] == pytest.approx(50.0)
    assert got["strata"]["small"]["delta"] == pytest.approx(-75.0)
    assert got["mean_a"] == pytest.approx((75.0 + 25.0) / 2) and got["mean_b"] == pytest.approx((25.0 + 100.0) / 2)
    assert got["low"] < got["delta"] < got["high"] and (got["n"], got["n_strata"]) == (44, 2)
    assert stratified_paired_delta({"big": (big_a, big_b), "small": (small_a, small_b)}, scale=100.0, seed=3) == got


def test_a_constant_stratum_shifts_the_interval_and_halves_the_other_ones_width():
    rng = np.random.default_rng(0)
    a, b = (rng.random(60) < 0.7).astype(float), (rng.random(60) < 0.4).astype(float)
    alone = paired_delta(a, b, seed=5)
    got = stratified_paired_delta({"x": (a, b), "same": ([1.0, 1.0], [0.0, 0.0])}, seed=5)  # d = 1 throughout
    assert got["low"] == pytest.approx((alone["low"] + 1.0) / 2)
    assert got["high"] == pytest.approx((alone["high"] + 1.0) / 2)
    assert got["verdict"] == "+"


def test_null_and_degenerate_cases():
    noise = stratified_paired_delta({"a": ([1, 0] * 10, [0, 1] * 10), "b": ([0, 1, 1, 0] * 3, [1, 0, 0, 1] * 3)})
    assert noise["delta"] == pytest.approx(0.0) and noise["low"] < 0 < noise["high"] and noise["verdict"] == "n.s."
    same = stratified_paired_delta({"a": ([1, 0, 1], [1, 0, 1]), "b": ([0.5], [0.25])})
    assert (same["delta"], same["low"], same["high"]) == (0.125, 0.125, 0.125)
    none = stratified_paired_delta({"a": ([], [])})
    assert none["delta"] is None and none["empty"] == ["a"] and none["verdict"] == "n.s."


def test_records_are_grouped_by_dataset_and_matched_by_uid():
    def rec(uid, v, dataset=None, error=None):
        r = {"uid": uid, "error": error, "scores": {} if error else {"correct": v}}
        return {**r, "dataset": dataset} if dataset else r

    a = [rec("gsm8k/0", 1), rec("gsm8k/1", 1), rec("mmlu/0", 0), rec("mmlu/1", 1, error="boom"), rec("x/9", 1),
         rec("odd", 1, dataset="cmmlu")]
    b = [rec("gsm8k/1", 0), rec("gsm8k/0", 0), rec("mmlu/0", 1), rec("mmlu/1", 0), rec("odd", 0, dataset="cmmlu")]
    got = stratified_paired_metrics(a, b, "correct", scale=100.0)
    assert (got["pairs"], got["unmatched"], got["errors_a"], got["errors_b"]) == (5, 1, 1, 0)
    assert {k: v["delta"] for k, v in got["strata"].items()} == {"gsm8k": 100.0, "mmlu": -100.0, "cmmlu": 100.0}
    assert got["strata"]["mmlu"]["n"] == 1 and got["delta"] == pytest.approx(100.0 / 3)

"""OpenCompass runs in the report (issue 31, harness/report/opencompass_rows.py): the macro average's delta with a
stratified paired interval, each dataset's accuracy delta with its paired interval and verdict, and the unpaired
difference for runs without samples.jsonl. Synthetic summary.json + samples.jsonl pairs, offline."""

from __future__ import annotations

import json

import pytest

from harness.report import build as rp

pytest.importorskip("matplotlib")
pytest.importorskip("scipy")

# item outcomes per dataset (0/1); datasets of unequal sizes, so pooling items would give another average
BASE = {"big": [1] * 20 + [0] * 20, "small": [1, 0] * 4}
BETTER = {"big": [1] * 40, "small": [1, 0] * 4}  # +50 points on big (every wrong item right), small unchanged
NOISY = {"big": [0] * 10 + [1] * 20 + [0] * 10, "small": [0, 1] * 4}  # as many items lost as won on both: n.s.


def _oc_run(root, name, items, *, sere_k=None, top_k=None, samples=True, accuracy=None):
    run = root / name
    run.mkdir(parents=True)
    acc = accuracy or {ds: 100.0 * sum(v) / len(v) for ds, v in items.items()}
    s = {"run": {"schema_version": 1, "engine": "hf", "weights": "real", "model": {"name": "m"},
                 "opencompass": {"suite": "toy"}},
         "config": {"dataset": {"name": "opencompass"}, "visionzip": {"keep": 1.0}, "sere": {"k": sere_k},
                    "moe": {"top_k": top_k}},
         "metrics": {"opencompass": {**{ds: {"accuracy": a} for ds, a in acc.items()},
                                     "average": sum(acc.values()) / len(acc), "average_over": list(acc)}},
         "latency": {"ttft_ms": {"p50": 100.0, "mean": 100.0}, "tpot_ms": {"p50": 10.0, "mean": 10.0}}}
    (run / "summary.json").write_text(json.dumps(s))
    if samples:
        (run / "samples.jsonl").write_text("".join(
            json.dumps({"uid": f"{ds}/{i}", "dataset": ds, "task": "opencompass",
                        "scores": {"correct": float(v), f"correct/{ds}": float(v)}}) + "\n"
            for ds, vs in items.items() for i, v in enumerate(vs)))
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("oc")
    _oc_run(root / "runs", "base", BASE)
    _oc_run(root / "runs", "better", BETTER, sere_k=2)
    _oc_run(root / "runs", "noisy", NOISY, top_k=2)
    _oc_run(root / "runs", "nosamples", BETTER, sere_k=1, samples=False)
    res = rp.build_report([root / "runs"], root / "out")
    return res, {r["run_dir"]: r for r in res.rows}


def test_a_clear_gain_gets_a_significant_stratified_interval_on_the_macro_average(report):
    _, rows = report
    r = rows["better"]
    assert "opencompass_average" in r["quality_metrics"]
    assert r["opencompass_average_delta"] == pytest.approx(25.0)  # (50 + 0) / 2
    lo, hi = r["opencompass_average_delta_ci"]
    assert 0 < lo < 25.0 < hi and r["opencompass_average_delta_significant"] is True
    assert r["comparisons"]["opencompass_average"]["n"] == 48
    assert "stratified" in r["comparisons"]["opencompass_average"]["method"]
    big, small = r["opencompass_deltas"]["big"], r["opencompass_deltas"]["small"]
    assert (big["delta"], big["kind"], big["verdict"], big["n"]) == (50.0, "paired", "yes", 40)
    assert 0 < big["lo"] < 50.0 < big["hi"]
    assert (small["delta"], small["lo"], small["hi"], small["verdict"]) == (0.0, 0.0, 0.0, "n.s.")
    assert (big["accuracy"], big["baseline"]) == (100.0, 50.0)


def test_macro_delta_is_the_mean_of_per_dataset_deltas_when_sizes_differ(report):
    _, rows = report
    r = rows["better"]
    per = [d["delta"] for d in r["opencompass_deltas"].values()]
    assert r["opencompass_average_delta"] == pytest.approx(sum(per) / len(per))
    pooled = 100.0 * (sum(BETTER["big"] + BETTER["small"]) - sum(BASE["big"] + BASE["small"])) / 48
    assert pooled == pytest.approx(41.67, abs=0.01) and r["opencompass_average_delta"] != pytest.approx(pooled)
    # the interval is the big dataset's halved (small is constant): far narrower than pooled items would claim
    big = r["opencompass_deltas"]["big"]
    assert r["opencompass_average_delta_ci"] == pytest.approx((big["lo"] / 2, big["hi"] / 2))


def test_a_wash_is_not_significant(report):
    _, rows = report
    r = rows["noisy"]
    lo, hi = r["opencompass_average_delta_ci"]
    assert r["opencompass_average_delta"] == pytest.approx(0.0) and lo < 0 < hi
    assert r["opencompass_average_delta_significant"] is False
    assert {d["verdict"] for d in r["opencompass_deltas"].values()} == {"n.s."}


def test_runs_without_samples_get_the_unpaired_difference(report):
    _, rows = report
    r = rows["nosamples"]
    assert r["opencompass_average_delta"] == pytest.approx(25.0) and r["opencompass_average_delta_ci"] is None
    assert r["opencompass_average_delta_significant"] is None
    big = r["opencompass_deltas"]["big"]
    assert (big["delta"], big["lo"], big["kind"], big["verdict"]) == (50.0, None, "across runs", "n/a")
    assert rows["base"]["opencompass_deltas"] == {}


def test_report_md_has_the_per_dataset_section(report):
    res, _ = report
    md = res.markdown.read_text(encoding="utf-8")
    section = md.split("## OpenCompass per dataset", 1)[1]
    better = [line for line in section.splitlines() if line.startswith("| `better`")]
    assert [line.split(" | ")[2] for line in better] == ["**average** (macro)", "big", "small"]
    assert "+50.00 [" in better[1] and "| **yes** | 40 |" in better[1]
    assert "| +0.00 [+0.00, +0.00] | n.s. | 8 |" in better[2]
    nos = [line for line in section.splitlines() if line.startswith("| `nosamples`")]
    assert "| +50.00 | n/a | n/a |" in nos[1]
    # the runs table's Δ quality carries the average's paired interval
    runs = md.split("## Runs", 1)[1].split("\n## ", 1)[0]
    assert "| +25.00 [" in runs


def test_an_average_over_a_dataset_without_items_stays_unpaired(tmp_path):
    """A dataset of the average with no per-item outcomes (an AccEvaluator suite): the paired items would describe
    another average, so the average keeps the unpaired difference; the datasets with items keep theirs."""
    _oc_run(tmp_path, "base", BASE, accuracy={"big": 50.0, "small": 50.0, "qa": 40.0})
    _oc_run(tmp_path, "better", BETTER, sere_k=2, accuracy={"big": 100.0, "small": 50.0, "qa": 40.0})
    rows = {r["run_dir"]: r for r in rp.load_rows([tmp_path])}
    r = rows["better"]
    assert r["opencompass_average_delta_ci"] is None and r["opencompass_average_delta"] == pytest.approx(50 / 3)
    assert r["opencompass_deltas"]["big"]["kind"] == "paired" and r["opencompass_deltas"]["qa"]["kind"] == "across runs"


def test_frontier_cell_of_an_opencompass_run_is_the_stratified_macro_delta(tmp_path):
    """The frontier's "against a trivial baseline" cell (harness/report/frontier.py ``quality_against``) on
    ``opencompass_average``: the mean of per-dataset deltas with its stratified interval, not the pooled items'."""
    from harness.report.frontier import quality_against

    a, b = _oc_run(tmp_path, "a", BETTER, sere_k=1), _oc_run(tmp_path, "b", BASE, top_k=1)
    row = {"_samples": str(a / "samples.jsonl"), "run_dir": str(a)}
    other = {"_samples": str(b / "samples.jsonl"), "run_dir": str(b)}
    q = quality_against(row, other, "opencompass_average")
    assert q["delta"] == pytest.approx(25.0)  # (50 + 0) / 2; pooling the 48 items would give 41.7
    assert q["low"] > 0 and q["n"] == 48
    assert q["invalid_a"] == 0 and q["invalid_b"] == 0

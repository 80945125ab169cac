"""OpenCompass end to end on the embedded model through the HF engine: SERE off, ``sere.k=2``, ``moe.top_k=1``.

What must hold: OpenCompass's own runner and evaluators ran (its output directory, its summary CSV, its
predictions), the predictions it scored are the harness engine's generations with the run's technique
installed, and ``summary.json`` carries ``metrics.opencompass`` (per dataset + unweighted average),
``run.opencompass_version``, latency and the technique's statistics; the prompts OpenCompass sends are the ones
the embedded model was trained on (recipe v7's text tasks). These runs test the machinery; the accuracy directions
the committed model shows are asserted in test_opencompass_directions.py.
"""

from __future__ import annotations

import csv
import json
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import CI_ITEMS, MAX_NEW_TOKENS

from harness.opencompass.suites import CLOSED_BOOK_SCALE, closed_book_items

DATASETS = ("harness_text_qa", "harness_text_recall", "harness_text_choice")
# the QA file: three tasks; the recall file: CLOSED_BOOK_SCALE distinct facts per CI item
N_ROWS = {"harness_text_qa": 3 * CI_ITEMS, "harness_text_recall": CLOSED_BOOK_SCALE * CI_ITEMS,
          "harness_text_choice": CI_ITEMS}


@pytest.mark.parametrize("setting", ["off", "sere_k2", "top_k1"])
def test_summary_keys(oc_runs, setting):
    run_dir, s = oc_runs[setting]
    oc = s["metrics"]["opencompass"]
    for abbr in DATASETS:
        assert 0.0 <= oc[abbr]["accuracy"] <= 100.0
    assert oc["average_over"] == list(DATASETS)
    assert oc["average"] == pytest.approx(sum(oc[a]["accuracy"] for a in DATASETS) / len(DATASETS))
    run = s["run"]
    assert run["opencompass_version"] == version("opencompass")
    assert run["engine"] == "hf" and run["weights"] == "trained-synthetic"  # the default embedded model
    assert run["opencompass"]["model_abbr"] == run["model"]["name"]
    assert Path(run["opencompass"]["output_dir"]).is_relative_to(run_dir)  # OpenCompass's outputs kept in the run
    assert s["latency"]["n_measured"] == sum(N_ROWS.values()) and s["latency"]["tpot_ms"]["n"] > 0
    assert (run_dir / "opencompass" / "config.py").exists() and (run_dir / "opencompass" / "opencompass.log").exists()


def test_techniques_installed_and_recorded(oc_runs):
    _, off = oc_runs["off"]
    _, sere = oc_runs["sere_k2"]
    _, topk = oc_runs["top_k1"]
    assert "sere" not in off and "moe" not in off
    assert sere["config"]["sere"]["k"] == 2 and sere["sere"]["k_primary"] == 2 and sere["sere"]["steps"] > 0
    assert sere["config"]["sere"]["rho"] == 0.5
    assert topk["config"]["moe"]["top_k"] == 1 and topk["moe"]["top_k"] == 1
    # plain top-1 of a top-4 router: one expert per token after, so the union cannot grow
    assert topk["moe"]["expert_union_after"] <= topk["moe"]["expert_union_before"]
    assert topk["moe"]["expert_union_after"] < topk["moe"]["expert_union_before"]


def _predictions_file(run_dir: Path, abbr: str) -> Path:
    """OpenCompass's predictions of dataset ``abbr``: ``<output_dir>/predictions/<model abbr>/<abbr>.json``."""
    oc = json.loads((run_dir / "summary.json").read_text())["run"]["opencompass"]
    return Path(oc["output_dir"]) / "predictions" / oc["model_abbr"] / f"{abbr}.json"


def _oc_predictions(run_dir: Path, abbr: str) -> list[str]:
    preds = json.loads(_predictions_file(run_dir, abbr).read_text(encoding="utf-8"))
    return [preds[str(i)]["prediction"] for i in range(len(preds))]


@pytest.mark.parametrize("setting", ["off", "sere_k2", "top_k1"])
def test_opencompass_scored_the_harness_engine_generations(oc_runs, setting):
    """OpenCompass's prediction files hold exactly what the harness engine generated (the trace), in order."""
    run_dir, _ = oc_runs[setting]
    trace = [json.loads(line) for line in (run_dir / "opencompass" / "harness_trace.jsonl").read_text().splitlines()]
    by_prompt = {t["prompt"]: t["answer"] for t in trace}
    assert all(t["output_tokens"] <= MAX_NEW_TOKENS for t in trace)
    for abbr in DATASETS:
        preds = json.loads(_predictions_file(run_dir, abbr).read_text(encoding="utf-8"))
        assert len(preds) == N_ROWS[abbr]
        for item in preds.values():
            assert item["prediction"] == by_prompt[item["origin_prompt"]]


def test_prompts_are_the_trained_ones(oc_runs):
    """What OpenCompass sent the engine (the trace) is exactly ``text_tasks.oc_prompt`` of the held-out rows: the
    prompt the text tasks are trained on (a change in OpenCompass's rendering would otherwise read as a model
    that forgot them)."""
    from harness.datasets.synthetic import text_tasks

    run_dir, _ = oc_runs["off"]
    trace = [json.loads(line) for line in (run_dir / "opencompass" / "harness_trace.jsonl").read_text().splitlines()]
    want = {it.prompt for t in text_tasks.TEXT_TASKS for it in text_tasks.items(t, "heldout", CI_ITEMS, 0)}
    want |= {it.prompt for it in closed_book_items("text_recall", CLOSED_BOOK_SCALE * CI_ITEMS, 0)}
    assert {t["prompt"] for t in trace} == want


def test_top_k_changes_generations(oc_runs):
    """moe.top_k=1 on a top-4 router changes what the model says (else the hook would not be in the path; measured:
    one list answer of 16 items cut short)."""
    off = [p for abbr in DATASETS for p in _oc_predictions(oc_runs["off"][0], abbr)]
    top = [p for abbr in DATASETS for p in _oc_predictions(oc_runs["top_k1"][0], abbr)]
    assert off != top


def test_summary_csv_is_the_source(oc_runs):
    """metrics.opencompass is OpenCompass's summariser's number, not a recomputation."""
    _, s = oc_runs["off"]
    out = Path(s["run"]["opencompass"]["output_dir"])
    (csv_path,) = sorted((out / "summary").glob("summary_*.csv"))
    rows = {r["dataset"]: r for r in csv.DictReader(csv_path.open(encoding="utf-8"))}
    for abbr in DATASETS:
        assert float(rows[abbr][s["run"]["opencompass"]["model_abbr"]]) == pytest.approx(s["metrics"]["opencompass"][abbr]["accuracy"],
                                                                       abs=0.01)


def test_items_compare_pairwise_per_dataset(oc_runs):
    """Each run writes OpenCompass's per-item outcomes as samples.jsonl (uid ``<dataset>/<item>``), so two runs of
    the suite compare item by item: ``paired_quality`` gives every dataset its paired interval (issue 31). The
    items agree with OpenCompass's own accuracy."""
    from harness.commands.paired_quality import compare
    from harness.metrics.paired import read_samples

    run_off, s_off = oc_runs["off"]
    recs = read_samples(run_off)
    items = s_off["run"]["opencompass"]["items"]
    assert items["n"] == len(recs) == sum(N_ROWS.values()) and items["errors"] == sum(1 for r in recs if r.get("error"))
    scored = []
    for abbr in DATASETS:
        mine = [r for r in recs if r["dataset"] == abbr]
        assert len(mine) == N_ROWS[abbr]
        if any(r.get("error") for r in mine):  # an evaluator without per-item outcomes: every item counted
            assert all("no per-item outcome" in r["error"] for r in mine), mine[0]
            continue
        values = [r["scores"][f"correct/{abbr}"] for r in mine]
        assert 100.0 * sum(values) / len(values) == pytest.approx(s_off["metrics"]["opencompass"][abbr]["accuracy"], abs=0.01)
        scored.append(abbr)
    assert "harness_text_choice" in scored  # OptionSimAccEvaluator reports per-item outcomes
    (row,) = compare(run_off, [oc_runs["top_k1"][0]])
    assert row["pairs"] == sum(N_ROWS.values()) and row["unmatched"] == 0
    for abbr in scored:
        m = row["metrics"][f"correct/{abbr}"]
        assert m["n"] == N_ROWS[abbr] and m["verdict"] in ("n.s.", "+", "−") and m["low"] <= m["delta"] <= m["high"]

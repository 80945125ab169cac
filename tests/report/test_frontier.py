"""The frontier table (issue 31 item 4, harness/report/frontier.py): each technique against the baseline and its
trivial baselines at equal budget, from result files (synthetic numbers): matching by budget, paired quality deltas
over the shared samples, the verdict, paired speed-ups when the run timed the baseline in its own process, and
top-p listed apart."""

from __future__ import annotations

import json

import pytest

from harness.report import build as rp

pytest.importorskip("matplotlib")
pytest.importorskip("scipy")


def _run(root, name, *, dataset, vz=None, sere_k=None, moe=None, metrics, scores, ttft=100.0, comparisons=None,
         union=None):
    run = root / name
    run.mkdir(parents=True)
    cfg = {"dataset": {"name": dataset}, "visionzip": {"keep": 1.0, **(vz or {})}, "sere": {"k": sere_k},
           "moe": moe or {}}
    s = {"run": {"schema_version": 1, "engine": "hf", "weights": "real", "model": {"name": "m"}},
         "config": cfg, "metrics": {"n_samples": len(scores), **metrics},
         "latency": {"ttft_ms": {"p50": ttft, "mean": ttft}, "tpot_ms": {"p50": 10.0, "mean": 10.0}}}
    if comparisons:
        s["comparisons"] = comparisons
    if union is not None:
        s["moe" if moe else "sere"] = {"expert_union_after": union}
    (run / "summary.json").write_text(json.dumps(s))
    key = "score" if dataset == "ocrbench" else "edit_score"
    (run / "samples.jsonl").write_text("".join(json.dumps({"uid": str(i), "scores": {key: v}, "error": None}) + "\n"
                                               for i, v in enumerate(scores)))


def test_frontier_matches_budgets_pairs_samples_and_gives_a_verdict(tmp_path):
    ocr = dict(dataset="ocrbench")
    _run(tmp_path, "full", **ocr, metrics={"ocrbench_score": 800.0}, scores=[1, 1, 1, 1, 1, 1, 1, 0, 1, 0])
    paired = [{"metric": "ttft_ms", "against": "random keep=0.75", "kind": "ratio", "estimate": 0.9,
               "ci": [0.85, 0.95], "confidence": 0.95, "n": 10, "method": "paired"}]
    _run(tmp_path, "vz", **ocr, vz={"keep": 0.75}, metrics={"ocrbench_score": 600.0},
         scores=[1, 1, 1, 1, 1, 1, 0, 0, 0, 0], ttft=50.0, comparisons=paired)
    _run(tmp_path, "random", **ocr, vz={"keep": 0.75, "method": "random"}, metrics={"ocrbench_score": 0.0},
         scores=[0] * 10, ttft=45.0)
    _run(tmp_path, "pool", **ocr, vz={"keep": 0.75, "method": "pool"}, metrics={"ocrbench_score": 600.0},
         scores=[1, 1, 0, 1, 1, 1, 0, 1, 0, 0], ttft=45.0)
    _run(tmp_path, "first", **ocr, vz={"keep": 0.75, "method": "first"}, metrics={"ocrbench_score": 1000.0},
         scores=[1] * 10, ttft=45.0)
    _run(tmp_path, "random50", **ocr, vz={"keep": 0.5, "method": "random"}, metrics={"ocrbench_score": 0.0},
         scores=[0] * 10)  # no VisionZip run at keep 0.5: matched to nothing
    rag = dict(dataset="rag_igbench")
    _run(tmp_path, "rag_full", **rag, metrics={"edit_score": 0.5}, scores=[0.5, 0.6, 0.4, 0.5])
    _run(tmp_path, "sere1", **rag, sere_k=1, metrics={"edit_score": 0.3}, scores=[0.3, 0.4, 0.2, 0.3], union=2.3)
    _run(tmp_path, "rand_p", **rag, moe={"routing": "random_p", "k_primary": 1}, metrics={"edit_score": 0.1},
         scores=[0.1, 0.2, 0.0, 0.1], union=2.4)
    _run(tmp_path, "top_p", **rag, moe={"routing": "top_p", "p": 0.25}, metrics={"edit_score": 0.4},
         scores=[0.4, 0.5, 0.3, 0.4], union=3.1)
    from harness.report.frontier import frontier_markdown
    from harness.report.plots import plot_frontier

    all_rows = rp.load_rows([tmp_path])  # what build_report tabulates (its plots of every run are tested elsewhere)
    text = frontier_markdown(all_rows)
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[5:11]): line for line in text.splitlines()
             if line.startswith("| ocrbench") or line.startswith("| rag_igbench")}
    rows = {key[1]: key for key in lines}
    # VisionZip (6 of 10) against random (0 of 10): +600, every pair >= 0 -> yes, with the run's paired speed-up
    assert rows["random"] == ("2.00× across runs", "random", "+600 [+300, +900]", "0.90× [0.85, 0.95]", "0 / 0",
                              "**yes**")
    assert rows["first"][2].startswith("-400") and rows["first"][5] == "**no**"  # first reads all 10
    assert rows["pool"][2].startswith("+0") and rows["pool"][5] == "**n.s.**"
    assert rows["pool"][3] == "0.90× across runs"  # not timed in the VisionZip run's process
    assert rows["random re-route"][2] == "+0.200 [+0.200, +0.200]" and rows["random re-route"][5] == "**yes**"
    assert "random50" not in text and "keep 0.5" not in text
    apart = text.split("Not matched to a budget", 1)[1]
    assert "top_p p0.25" in apart and "| 3.10 |" in apart and "top_p" not in text.split("Not matched", 1)[0]
    assert plot_frontier(all_rows, tmp_path / "frontier.png", title="t") == tmp_path / "frontier.png"
    assert (tmp_path / "frontier.svg").is_file()
    vz = next(r for r in all_rows if r["run_dir"] == "vz")
    # OCRBench's run-level score pairs on each sample's 0/1 score, scaled to the benchmark's 1000
    assert vz["ocrbench_score_delta"] == pytest.approx(-200.0) and vz["ocrbench_score_delta_ci"][1] == 0.0

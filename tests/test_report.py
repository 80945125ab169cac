"""harness.report: built from result directories alone (tests/fixtures/report, synthetic numbers), offline."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import report as rp

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/report"

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return rp.build_report([FIXTURES], out)


def by_dir(rows):
    return {r["run_dir"]: r for r in rows}


def test_every_summary_becomes_a_row(built):
    assert len(built.rows) == 13
    rows = by_dir(built.rows)
    base = rows["multirun/visionzip_keep/2026-01-01_00-00-00/0"]
    assert base["family"] == "baseline" and base["sweep"] == "visionzip_keep/2026-01-01_00-00-00"  # multirun.yaml
    sere = rows["multirun/sere_grid/2026-01-02_00-00-00/1"]
    assert sere["sweep"] == "sere_grid/2026-01-02_00-00-00" and sere["job"] == "1"  # run.sweep block
    assert (sere["family"], sere["sere_k"], sere["sere_rho"], sere["sere_protect"]) == ("sere", 2, 0.3, 16)
    assert sere["label"] == "K2 ρ0.3 P16"
    vz = rows["multirun/visionzip_keep/2026-01-01_00-00-00/6"]
    assert (vz["family"], vz["vz_keep"], vz["vz_scope"], vz["label"]) == ("visionzip", 0.6, "image", "keep 0.6·img")
    assert vz["vz_by_source"] == {"ocrbench": 0.6, "ccbench": 0.6}


def test_baseline_deltas_are_per_platform_and_dataset(built):
    rows = by_dir(built.rows)
    r = rows["multirun/visionzip_keep/2026-01-01_00-00-00/2"]  # keep 0.6 on RAG-IGBench
    assert r["ttft_speedup"] == pytest.approx(1850 / 1290)
    assert r["comprehensive_delta"] == pytest.approx(0.497 - 0.512)
    mix = rows["multirun/visionzip_keep/2026-01-01_00-00-00/7"]
    assert mix["ocrbench_score_delta"] == pytest.approx(731 - 812)
    tiny = rows["runs/2026-01-03/00-00-00_rag_igbench"]  # its own platform: its own baseline, not the 30B's
    assert tiny["random_init"] and tiny["ttft_speedup"] == pytest.approx(1.0)


def test_pareto_front():
    pts = [(10, 0.5), (5, 0.4), (6, 0.3), (20, 0.6), (10, 0.5), (30, 0.6)]
    assert rp.pareto_front(pts) == [1, 0, 4, 3]  # ties both stay; (6, .3) and (30, .6) are dominated
    assert rp.pareto_front([]) == []


def test_quality_metric_choice():
    assert rp.quality_metrics_for([{"rouge1": 0.3, "comprehensive": None}]) == ["rouge1"]
    assert rp.quality_metrics_for([{"rouge1": 0.3}, {"comprehensive": 0.2}]) == ["comprehensive"]
    assert rp.quality_metrics_for([{"ocrbench_score": 700, "mcq_accuracy": 0.5}]) == ["ocrbench_score",
                                                                                      "mcq_accuracy"]


def test_markdown_table_and_warnings(built):
    md = built.markdown.read_text(encoding="utf-8")
    assert "random-init weights in 1 of 13 runs" in md and "**RANDOM** (random-init)" in md
    assert "latency partial in 1 runs" in md and "7/12 partial" in md
    table = [l for l in md.splitlines() if l.startswith("| ")]
    assert len(table) == 1 + 13 + 1 + 3 + 1 + 4  # runs (+header), keep-rate table (+header), SERE table (+header)
    header = table[0]
    for col in ("comprehensive", "OCRBench score", "CCBench accuracy", "TTFT p50 (ms)", "TTFT p90 (ms)",
                "TPOT p50 (ms)", "TPOT p90 (ms)", "engine", "weights"):
        assert col in header, col
    assert "| 1.43× |" in md  # keep 0.6 TTFT speed-up on RAG-IGBench
    assert "## Pareto fronts" in md and "K2 ρ0.3 P16 (17.2 ms, 0.505)" in md
    assert "| `multirun/visionzip_keep/2026-01-01_00-00-00/5` | ocr_cc_mix | keep 0.6 | 0.6 | 60.0% | 46.0% | 74.0% |" in md
    assert "None" not in md


def test_plots_and_csv(built):
    names = sorted(p.name for p in built.plots)
    assert names == ["keep_rate_by_source.png", "quality_vs_tpot.png", "quality_vs_ttft.png"]
    for p in built.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 20_000
    with open(built.out_dir / "runs.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 13 and {"ttft_p50", "tpot_p90", "vz_keep_rate_ocrbench", "weights"} <= set(rows[0])


def test_missing_optional_blocks_are_tolerated(tmp_path):
    """An old-style summary (no visionzip/sere blocks, no p90, no weights) still reports, with n/a."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "run": {"engine": "hf"}, "config": {"dataset": {"name": "ocrbench"}},
        "metrics": {"ocrbench_score": 512.0}, "latency": {"ttft_ms": {"p50": 100.0}}}))
    res = rp.build_report([run], tmp_path / "out")
    (row,) = res.rows
    assert row["family"] == "baseline" and row["tpot_p50"] is None and row["weights"] == "?"
    md = res.markdown.read_text(encoding="utf-8")
    assert "| 512 |" in md and "n/a" in md
    assert [p.name for p in res.plots] == ["quality_vs_ttft.png"]  # no TPOT, no keep rates: no such plots


def test_no_summary_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        rp.build_report([tmp_path])
    assert rp.main([str(tmp_path / "nowhere")]) == 2


def test_cli_writes_next_to_the_results_by_default(tmp_path):
    shutil.copytree(FIXTURES / "multirun/sere_grid", tmp_path / "sere_grid")
    proc = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "sere_grid")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "sere_grid/report/report.md").is_file()
    assert "4 runs" in proc.stdout
    # the report's own directory holds no summary.json, so reading the sweep again gives the same runs
    assert len(rp.load_rows([tmp_path / "sere_grid"])) == 4


def test_wandb_report_is_built_offline(tmp_path, monkeypatch):
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from wandb_workspaces import expr

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    def no_network(*a, **k):
        raise AssertionError("the report must not be saved offline")

    monkeypatch.setattr(wr.Report, "save", no_network)
    res = rp.build_report([FIXTURES], tmp_path, wandb_target="my-team/moe-vlm-harness")
    report = res.wandb_report
    assert isinstance(report, wr.Report) and res.wandb_url is None
    assert (report.entity, report.project) == ("my-team", "moe-vlm-harness")
    grid = next(b for b in report.blocks if isinstance(b, wr.PanelGrid))
    assert {rs.name for rs in grid.runsets} == {"sere_grid/2026-01-02_00-00-00", "visionzip_keep/2026-01-01_00-00-00"}
    for rs in grid.runsets:  # one run set per sweep, selected by W&B group = sweep id
        assert rs.filters == f"Metric('Group') == '{rs.name}'"
        expr.expr_to_filters(rs.filters)  # the filter parses
    scatter = [p for p in grid.panels if isinstance(p, wr.ScatterPlot)]
    assert {(p.x.name, p.y.name) for p in scatter} >= {("latency/ttft_ms/p50", "metrics/comprehensive"),
                                                      ("latency/tpot_ms/p50", "metrics/comprehensive"),
                                                      ("latency/ttft_ms/p50", "metrics/ocrbench_score"),
                                                      ("latency/ttft_ms/p50", "metrics/mcq_accuracy")}
    assert any(isinstance(p, wr.BarPlot) for p in grid.panels)
    for p in grid.panels:
        p._to_model()  # every panel converts to W&B's internal form without a server
    spec = json.loads((tmp_path / "wandb_report.json").read_text())
    assert spec["entity"] == "my-team" and spec["title"].startswith("Sweep ")
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        rp.build_report([FIXTURES], tmp_path / "x", wandb_target="just-a-project")


def test_sweep_status(capsys):
    st = rp.sweep_status(FIXTURES / "multirun/visionzip_keep/2026-01-01_00-00-00")
    assert (st["expected"], st["finished"], st["running_or_interrupted"], st["failed"], st["not_started"]) == \
        (16, 8, ["8"], ["9"], 6)
    assert rp.main(["--status", str(FIXTURES / "multirun/visionzip_keep/2026-01-01_00-00-00")]) == 0
    assert "8/16 finished, 1 running or interrupted" in capsys.readouterr().out
    assert rp.main(["--status", str(FIXTURES)]) == 2  # not a sweep directory


def test_fixtures_are_reproducible(tmp_path):
    """tests/fixtures/report is what make_report_fixtures.py writes (so the numbers are documented as synthetic)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", ROOT / "tests/fixtures/make_report_fixtures.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    mk.OUT = tmp_path / "report"
    mk.main()
    ours = sorted(p.relative_to(mk.OUT) for p in mk.OUT.rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file())
    assert ours == theirs
    for rel in ours:
        assert (mk.OUT / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel

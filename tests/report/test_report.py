"""harness.report.build: built from result directories alone (tests/fixtures/report, synthetic numbers), offline."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report import build as rp

ROOT = Path(__file__).resolve().parents[2]
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
    assert "| 1.43× across runs |" in md  # keep 0.6 TTFT speed-up on RAG-IGBench, against a baseline run apart
    assert "## Pareto fronts" in md and "K2 ρ0.3 P16 (17.2 ms, 0.505)" in md
    assert "| `multirun/visionzip_keep/2026-01-01_00-00-00/5` | ocr_cc_mix | keep 0.6 | 0.6 | 60.0% | 46.0% | 74.0% |" in md
    assert "None" not in md


def test_plots_and_csv(built):
    names = sorted(p.name for p in built.plots)
    assert names == ["keep_rate_by_source.png", "quality_vs_tpot.png", "quality_vs_ttft.png"]
    for p in built.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 20_000
    assert [p.name for p in built.vector_plots] == [p.with_suffix(".svg").name for p in built.plots]  # issue 25
    for p in built.vector_plots:
        assert b"<svg" in p.read_bytes()[:2000]
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
    assert spec["entity"] == "my-team" and spec["title"].startswith("visionzip, sere vs baseline")
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


# ------------------------------------------------------------------------------------------ issue 12, item 6


def _summary(tmp_path, name, *, comprehensive=0.5, scoring=None, keep=1.0, by_source=None, ttft=100.0):
    run = tmp_path / name
    run.mkdir(parents=True)
    s = {"run": {"engine": "hf", "weights": "real", "model": {"name": "m"}, **({"scoring": scoring} if scoring else {})},
         "config": {"dataset": {"name": "rag_igbench"}, "visionzip": {"keep": keep}},
         "metrics": {"comprehensive": comprehensive, "n_samples": 4},
         "latency": {"ttft_ms": {"p50": ttft, "p90": ttft * 1.2}}}
    if by_source:
        s["visionzip"] = {"keep": keep, "by_source": by_source}
    (run / "summary.json").write_text(json.dumps(s))
    return run


def test_a_malformed_summary_is_skipped_with_a_warning_naming_it(tmp_path):
    """Old code: one bad summary.json next to good ones crashed the whole report."""
    shutil.copytree(FIXTURES / "multirun/sere_grid", tmp_path / "sere_grid")
    bad = {"torn": '{"run": {"engine": "hf"', "list": "[]", "wrongtype": '{"run": "hf", "metrics": {}}',
           "latin1": None}
    for name, text in bad.items():
        (tmp_path / "sere_grid" / name).mkdir()
        path = tmp_path / "sere_grid" / name / "summary.json"
        path.write_bytes(text.encode() if text is not None else b'{"run": "\xe9t\xe9"}')
    res = rp.build_report([tmp_path / "sere_grid"], tmp_path / "out")
    assert len(res.rows) == 4
    assert sorted(p.parent.name for p, _ in res.skipped) == sorted(bad)
    why = {p.parent.name: reason for p, reason in res.skipped}
    assert "not readable JSON" in why["torn"] and "a JSON list" in why["list"] and "run not an object" in why["wrongtype"]
    md = res.markdown.read_text(encoding="utf-8")
    assert "4 summary.json skipped" in md and "torn/summary.json" in md
    proc = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "sere_grid"), "--out",
                           str(tmp_path / "out2")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"warning: skipped {tmp_path / 'sere_grid' / 'torn' / 'summary.json'}: not readable JSON" in proc.stderr
    assert "4 runs" in proc.stdout
    only_bad = tmp_path / "only_bad"
    (only_bad / "x").mkdir(parents=True)
    (only_bad / "x" / "summary.json").write_text("[]")
    with pytest.raises(ValueError, match="no readable summary.json"):
        rp.build_report([only_bad], tmp_path / "out3")


def test_a_sweep_with_unfinished_jobs_says_how_many(tmp_path):
    """Old code: a running sweep was reported as if it were complete."""
    sweep = tmp_path / "visionzip_keep"
    shutil.copytree(FIXTURES / "multirun/visionzip_keep/2026-01-01_00-00-00", sweep)
    (sweep / "10").mkdir()
    (sweep / "10" / "config.yaml").write_text("seed: 0\n")  # started: config.yaml written, nothing else yet
    loose = _summary(tmp_path, "runs/a").parent / "b"
    loose.mkdir()
    (loose / "config.yaml").write_text("seed: 0\n")
    res = rp.build_report([tmp_path], tmp_path / "out")
    (st,) = res.unfinished["sweeps"]
    assert (st["finished"], st["expected"], st["running_or_interrupted"], st["failed"], st["not_started"]) == \
        (8, 16, ["8", "10"], ["9"], 5)
    assert res.unfinished["runs"] == [str(loose.resolve())]
    md = res.markdown.read_text(encoding="utf-8")
    assert "8 of 16 jobs finished — 2 running or interrupted, 1 failed, 5 not started; job 9 failed: failed" in md
    assert "1 run directories without summary.json" in md


def test_random_init_scorers_are_flagged_like_random_weights(tmp_path):
    rnd = {"clip_model": "tiny-clip", "clip_weights": "random-init", "embed_model": "e", "embed_weights": "random-init"}
    real = {"clip_model": "ViT-L-14", "clip_weights": "pretrained", "embed_model": "e", "embed_weights": "pretrained"}
    _summary(tmp_path, "r1", scoring=rnd, comprehensive=0.5)
    _summary(tmp_path, "r2", scoring=real, comprehensive=0.6, keep=0.6, ttft=80.0)
    res = rp.build_report([tmp_path], tmp_path / "out", metrics=["comprehensive"])  # asked for: shown, flagged
    rows = by_dir(res.rows)
    assert rows["r1"]["random_scorers"] == ["clip", "embed"] and rows["r2"]["random_scorers"] == []
    md = res.markdown.read_text(encoding="utf-8")
    assert "random-init scorers (clip, embed) in 1 of 2 runs" in md
    assert "| 0.500 † |" in md and "| 0.600 |" in md and "**RANDOM** (clip, embed)" in md
    from harness.report.plots import quality_figure

    fig = quality_figure(rp.panels(res.rows, ["comprehensive"]), "ttft", title="t")
    (ax,) = [a for a in fig.axes if a.get_visible() and a.get_title()]
    assert "RANDOM-INIT SCORERS (clip, embed)" in ax.get_title() and "random-init scorers" in fig._suptitle.get_text()


def test_plot_labels_do_not_overlap_and_titles_fit(tmp_path):
    """Old code: labels of close points were drawn on top of each other and a long sweep title ran off the figure."""
    from harness.report.plots import quality_figure

    rows = rp.load_rows([FIXTURES])
    title = "Sweep " + ", ".join(f"sweep_{i}/2026-01-0{i}_00-00-00" for i in range(1, 7))
    fig = quality_figure(rp.panels(rows), "ttft", title=title)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    for text in [fig._suptitle] + [a.title for a in fig.axes]:
        box = text.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, text.get_text()
    n_labels = 0
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        n_labels += len(boxes)
        inside = ax.get_window_extent(renderer)
        for i, a in enumerate(boxes):
            assert inside.x0 <= a.x0 and a.x1 <= inside.x1 and inside.y0 <= a.y0 and a.y1 <= inside.y1
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (ax.get_title(), a, b)
    assert n_labels == 13 + 4  # every run labelled (the mix runs appear in two panels)


def test_keep_rate_plot_shows_only_runs_that_mix_sources(tmp_path):
    """Old code: a single-source VisionZip run got a one-bar group and padded every other group with empty slots."""
    from harness.report.plots import keep_rate_figure, keep_rate_runs

    _summary(tmp_path, "single", keep=0.6, by_source={"rag_igbench": 0.6})
    res = rp.build_report([tmp_path], tmp_path / "out")
    assert [p.name for p in res.plots] == ["quality_vs_ttft.png"]  # no keep plot for one source
    _summary(tmp_path, "mix", keep=0.5, by_source={"ocrbench": 0.7, "ccbench": 0.3})
    rows = rp.load_rows([tmp_path])
    assert [r["run_dir"] for r in keep_rate_runs(rows)] == ["mix"]
    fig = keep_rate_figure(rows, title="t")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["keep 0.5\nrag_igbench"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts())[:2] == ["ccbench", "nominal keep (visionzip.keep)"]


def test_top_k_truncation_runs_are_never_the_baseline():
    """A ``moe.top_k`` run computes fewer experts: it is its own family (SERE's comparison row), not the baseline."""
    from harness.report.build import FAMILY_COLOR, FAMILY_ORDER, _technique
    from harness.results.tracking import technique_label, technique_tags

    def cfg(top_k=None, k=None, keep=1.0):
        return {"visionzip": {"keep": keep}, "sere": {"k": k, "rho": 0.1}, "moe": {"top_k": top_k, "scope": "decode"}}

    cases = {(None, None, 1.0): "baseline", (2, None, 1.0): "top-k", (3, 1, 1.0): "top-k+sere",
             (2, None, 0.6): "visionzip+top-k", (None, 2, 0.6): "visionzip+sere"}
    for (top_k, k, keep), family in cases.items():
        t = _technique({"config": cfg(top_k, k, keep)})
        assert t["family"] == family and technique_label(cfg(top_k, k, keep)) == family
        assert family in FAMILY_ORDER and family in FAMILY_COLOR
    assert _technique({"config": cfg(2)})["label"] == "top-2" and _technique({"config": cfg(2)})["moe_top_k"] == 2
    assert "moe.top_k=2" in technique_tags(cfg(2), {"run": {}})


# ------------------------------------------------------------------------------------------ issue 25


def _rag(tmp_path, name, *, scoring=None, keep=1.0, sere_k=None, ttft=100.0, ttft_ci=None, comparisons=None,
         metrics=None, dataset="rag_igbench"):
    run = tmp_path / name
    run.mkdir(parents=True)
    lat = {"ttft_ms": {"p50": ttft, "p90": ttft * 1.2, "mean": ttft, **({"ci": ttft_ci} if ttft_ci else {})},
           "tpot_ms": {"p50": 10.0, "mean": 10.0}}
    s = {"run": {"schema_version": 1, "engine": "hf", "weights": "real", "model": {"name": "m"},
                 **({"scoring": scoring} if scoring else {})},
         "config": {"dataset": {"name": dataset}, "visionzip": {"keep": keep}, "sere": {"k": sere_k}},
         "metrics": metrics or {"comprehensive": 0.5, "rouge1": 0.3, "clip_score": 0.2, "n_samples": 4},
         "latency": lat}
    if comparisons:
        s["comparisons"] = comparisons
    (run / "summary.json").write_text(json.dumps(s))
    return run


RND = {"clip_model": "tiny-clip", "clip_weights": "random-init", "embed_model": "e", "embed_weights": "random-init"}


def test_a_random_scorer_metric_is_never_the_default_and_metric_chooses(tmp_path):
    """Old code: `comprehensive` (random-init CLIP and embedder under default scoring) headlined every plot."""
    _rag(tmp_path, "base", scoring=RND)
    _rag(tmp_path, "vz", scoring=RND, keep=0.5, ttft=80.0)
    rows = rp.load_rows([tmp_path])
    assert rp.quality_metrics_for(rows) == ["rouge1"]
    assert [p.metric for p in rp.panels(rows)] == ["rouge1"]
    assert rp.quality_metrics_for(rows, ["edit_score", "rouge1"]) == ["rouge1"]  # only what the runs have
    res = rp.build_report([tmp_path], tmp_path / "out", metrics=["rouge1", "clip_score"])
    assert [p.metric for p in rp.panels(res.rows, ["rouge1", "clip_score"])] == ["rouge1", "clip_score"]
    md = res.markdown.read_text(encoding="utf-8")
    assert "Quality compared on: RAG-IGBench Rouge-1, RAG-IGBench CLIP score (`--metric`)" in md
    assert rp.main([str(tmp_path), "--out", str(tmp_path / "o2"), "--metric", "rouge1", "--metric", "kendall"]) == 0
    assert rp.main([str(tmp_path), "--out", str(tmp_path / "o3"), "--metric", "comprehensve"]) == 2


def test_ocrbench_runs_are_not_flagged_for_scorers_they_do_not_use(tmp_path):
    _rag(tmp_path, "ocr", scoring=RND, dataset="ocrbench", metrics={"ocrbench_score": 500.0, "n_samples": 4})
    (row,) = rp.load_rows([tmp_path])
    assert row["random_scorers"] == [] and rp.quality_metrics_for([row]) == ["ocrbench_score"]


def test_speedups_across_runs_are_never_significant_and_paired_ones_carry_their_interval(tmp_path):
    """Old code: SERE (decode-only) got a 2.30× / 10.2× TTFT speed-up against a baseline run minutes earlier,
    unmarked; within-run intervals cannot see the drift between runs."""
    _rag(tmp_path, "base", ttft=636.0, ttft_ci=[630.0, 642.0])
    _rag(tmp_path, "sere", sere_k=2, ttft=62.0, ttft_ci=[61.0, 63.0])  # intervals far apart: still not significant
    _rag(tmp_path, "vz", keep=0.6, ttft=630.0, ttft_ci=[600.0, 650.0])  # overlapping: n.s.
    paired = [{"metric": "ttft_ms", "against": "baseline", "kind": "ratio", "estimate": 1.5, "ci": [1.3, 1.7],
               "confidence": 0.95, "n": 12, "method": "paired bootstrap, A/B interleaved"},
              {"metric": "tpot_ms", "against": "baseline", "kind": "ratio", "estimate": 1.02, "ci": [0.97, 1.07]},
              {"metric": "comprehensive", "against": "baseline", "kind": "difference", "estimate": -0.01,
               "ci": [-0.03, 0.01]}]
    _rag(tmp_path, "vz_paired", keep=0.5, ttft=90.0, comparisons=paired)
    res = rp.build_report([tmp_path], tmp_path / "out")
    rows = by_dir(res.rows)
    assert rows["sere"]["ttft_speedup"] == pytest.approx(636 / 62)
    assert (rows["sere"]["ttft_comparison"], rows["sere"]["ttft_significant"]) == ("across runs", None)
    assert (rows["vz"]["ttft_comparison"], rows["vz"]["ttft_significant"]) == ("across runs", False)
    p = rows["vz_paired"]
    assert (p["ttft_speedup"], p["ttft_speedup_ci"], p["ttft_comparison"], p["ttft_significant"]) == \
        (1.5, (1.3, 1.7), "paired", True)
    assert (p["tpot_comparison"], p["tpot_significant"]) == ("paired", False)
    assert p["comprehensive_delta"] == -0.01 and p["comprehensive_delta_ci"] == (-0.03, 0.01)
    assert p["comprehensive_delta_significant"] is False
    md = res.markdown.read_text(encoding="utf-8")
    assert "| 10.26× across runs |" in md and "| 1.01× n.s. |" in md
    assert "| 1.50× [1.30, 1.70] |" in md and "| 1.02× [0.97, 1.07] n.s. |" in md
    assert "| -0.010 [-0.030, +0.010] n.s. |" in md
    assert "latency speed-ups compare runs measured at different times" in md
    assert "first job of sweep" not in md  # no sweep here
    fixture_md = rp.build_report([FIXTURES], tmp_path / "fx").markdown.read_text(encoding="utf-8")
    assert "the baseline was the first job of sweep `visionzip_keep/2026-01-01_00-00-00`" in fixture_md
    from harness.report.plots import quality_figure

    fig = quality_figure(rp.panels(res.rows), "ttft", title="t")
    assert "no difference here is significant on its own" in fig._suptitle.get_text()


def test_plots_draw_intervals_not_p90_whiskers(tmp_path):
    from harness.report.plots import latency_points, quality_figure

    _rag(tmp_path, "base", ttft=100.0, ttft_ci=[90.0, 110.0])
    _rag(tmp_path, "vz", keep=0.6, ttft=80.0, ttft_ci=[70.0, 85.0])
    rows = rp.load_rows([tmp_path])
    stat, pts, errs = latency_points(rows, "ttft")
    assert stat == "mean" and sorted(errs) == [(70.0, 85.0), (90.0, 110.0)]
    fig = quality_figure(rp.panels(rows), "ttft", title="visionzip vs baseline")
    ax = next(a for a in fig.axes if a.get_visible() and a.get_title())
    assert "interval of the mean" in ax.get_xlabel() and "p90" not in ax.get_xlabel()
    assert fig._suptitle.get_text().startswith("visionzip vs baseline")
    assert latency_points(rows, "tpot")[0] == "p50"  # no interval: the p50, no bars


def test_wandb_report_not_logged_in_is_one_line_not_a_crash(tmp_path, monkeypatch):
    """Old code: `--wandb` without `WANDB_MODE=offline` crashed "not logged in"."""
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))

    def no_network(*a, **k):
        raise AssertionError("not logged in: must not try to save")

    monkeypatch.setattr(wr.Report, "save", no_network)
    _rag(tmp_path, "runs/base")
    res = rp.build_report([tmp_path / "runs"], tmp_path / "out", wandb_target="team/proj")
    assert res.wandb_url is None and "not logged in" in res.wandb_not_saved and "wandb sync" in res.wandb_not_saved
    assert "\n" not in res.wandb_not_saved and (tmp_path / "out/wandb_report.json").is_file()


def test_quality_deltas_get_paired_intervals_from_the_runs_samples(tmp_path):
    """Issue 31's paired quality intervals through the report: the same samples scored under the baseline and the
    technique, a paired bootstrap over samples; `n.s.` when the interval holds 0."""
    pytest.importorskip("scipy")

    def samples(run, values):
        (tmp_path / run / "samples.jsonl").write_text("".join(
            json.dumps({"uid": str(i), "scores": {"rouge1": v}, "error": None}) + "\n" for i, v in enumerate(values)))

    _rag(tmp_path, "base", metrics={"rouge1": 0.65, "n_samples": 4})
    _rag(tmp_path, "worse", keep=0.5, metrics={"rouge1": 0.55, "n_samples": 4})
    _rag(tmp_path, "same", keep=0.6, metrics={"rouge1": 0.65, "n_samples": 4})
    samples("base", [0.5, 0.6, 0.7, 0.8])
    samples("worse", [0.4, 0.5, 0.6, 0.7])  # every sample 0.1 lower: a degenerate interval, significant
    samples("same", [0.7, 0.4, 0.9, 0.6])  # differences of both signs: the interval holds 0
    res = rp.build_report([tmp_path], tmp_path / "out")
    rows = by_dir(res.rows)
    w, s = rows["worse"], rows["same"]
    assert w["rouge1_delta"] == pytest.approx(-0.1) and w["rouge1_delta_ci"] == pytest.approx((-0.1, -0.1))
    assert w["rouge1_delta_significant"] is True
    assert s["rouge1_delta_ci"][0] < 0 < s["rouge1_delta_ci"][1] and s["rouge1_delta_significant"] is False
    md = res.markdown.read_text(encoding="utf-8")
    assert "| -0.100 [-0.100, -0.100] |" in md and "n.s." in md


def test_served_runs_show_where_their_ttft_went(tmp_path):
    """A vllm serve run's ``load.server_phases`` (the server's /metrics means) becomes a row of the "Where the TTFT
    went" section: the prefill VisionZip can shorten beside the front end it cannot. Runs without phases (HF, in
    process) have no row there, and a report of none has no section."""
    base = _summary(tmp_path, "base", ttft=1000.0)
    vz = _summary(tmp_path, "vz", keep=0.5, ttft=990.0)
    s = json.loads((vz / "summary.json").read_text())
    s["load"] = {"server_phases": {"client_ttft_ms": 990.0, "front_end_ms": 700.0, "queue_ms": 20.0,
                                   "prefill_ms": 270.0, "decode_ms": 0.0, "requests": 20}}
    (vz / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "out"
    rp.build_report([base, vz], out)
    text = (out / "report.md").read_text()
    assert "## Where the TTFT went" in text
    section = text.split("## Where the TTFT went", 1)[1].split("\n## ", 1)[0]
    assert "| 990.0 | 700.0 | 20.0 | 270.0 | 0.0 |" in section and "`base`" not in section
    out2 = tmp_path / "out2"
    rp.build_report([base], out2)
    assert "Where the TTFT went" not in (out2 / "report.md").read_text()

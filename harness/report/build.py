"""``python -m harness.report PATH [PATH ...] [--out DIR] [--metric NAME ...] [--wandb ENTITY/PROJECT]``: a report
from result directories.

Reads every ``summary.json`` below the given paths (a run directory, a sweep directory, ``results/``) through the
results schema (harness/results/schema.py) and nothing else, so it works on copied or archived results without
W&B. Writes into ``--out`` (default: ``<first path>/report``):

- ``report.md``: one row per run (technique settings, quality, TTFT/TPOT p50/p90, speed-up and quality change
  against the baseline of the same model/engine/dataset, engine, weights, scorers), warnings for random-init
  weights and random-init scorers (``run.scoring``), malformed ``summary.json`` files skipped, unfinished sweep
  jobs / run directories (``config.yaml`` without ``summary.json``), partial latency and speed-ups measured
  across runs, the Pareto front of each panel, VisionZip keep rate per image source (harness/report/markdown.py);
- ``runs.csv``: the same rows, every column;
- ``frontier.md`` (also a section of ``report.md``) and ``frontier.png`` (+ ``.svg``): each technique against the
  baseline and against its trivial baselines at equal budget, with the verdict "beats it: yes / no / n.s."
  (harness/report/frontier.py, issue 31);
- in ``report.md``, ``## OpenCompass per dataset`` for OpenCompass runs (``python -m harness.opencompass``): per
  run the macro average and each dataset's accuracy, the baseline's, the delta with its paired 95 % interval over
  the items both runs scored (``samples.jsonl``) and the verdict "better than baseline: yes / no / n.s." (n/a
  without both runs' items: the unpaired difference of the summaries). The average ``opencompass_average`` is a
  mean over datasets, so its interval (the runs table's Δ quality) is a stratified paired bootstrap — items
  resampled within each dataset, the per-dataset deltas averaged — not one over pooled items
  (harness/report/opencompass_rows.py, harness/metrics/paired.py);
- ``quality_vs_ttft.png``, ``quality_vs_tpot.png`` (+ ``.svg``): quality against latency (the mean with the run's
  interval of the mean as error bars when every run has one, else the p50), one panel per (dataset, quality
  metric), the Pareto front drawn and the baseline (VisionZip off and SERE off) highlighted;
- ``keep_rate_by_source.png`` (+ ``.svg``): VisionZip's achieved keep rate per image source, for runs whose images
  came from several sources (the OCRBench + CCBench mix). Plots: harness/report/plots.py.

Quality metric: ``--metric`` (repeatable), else per dataset the first whose scorers are meaningful for the runs
(a random-init scorer's metric is never the default: harness/report/deltas.py ``quality_metrics_for``). Speed-ups:
``across runs`` (never significant: drift between runs is unseen), ``n.s.``, or a paired within-run comparison
with its interval (``summary.json`` ``comparisons``; harness/report/deltas.py ``compare_latency`` /
``compare_quality`` — where issue 31's paired A/B timing and paired quality intervals plug in).

A malformed ``summary.json`` (not JSON, not an object, a block of the wrong type) is skipped with a warning naming
it; the other runs are reported.

``--status`` only prints how far each given sweep directory is (for a Slurm array still running).

``--wandb ENTITY/PROJECT`` also builds a W&B report (``wandb_workspaces.reports.v2``) with the same panels on
the runs' W&B summaries (``metrics/*``, ``latency/*/p50``), one run set per sweep (W&B group). It is saved only
when W&B is online and logged in (``--no-save``: never); otherwise one line says why and how to upload the runs
first, and its specification is written to ``wandb_report.json``.

Missing pieces are expected (older runs, techniques still landing): any key may be absent, and the report
says "n/a" rather than failing.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import logging

from harness.report.frontier import frontier_markdown
from harness.report.opencompass_rows import opencompass_markdown
from harness.report.wandb_report import build_wandb_report, wandb_report_spec, why_not_saved

log = logging.getLogger("harness.report")  # the report's logger (its name before the folder move)

from harness.report.rows import (  # noqa: E402,F401 (the rows, harness/report/rows.py: re-exported here)
    _by_source,
    FAMILY_COLOR,
    FAMILY_ORDER,
    find_summaries,
    _fmt,
    _get,
    _label_setups,
    LATENCY_AXES,
    latency_protocol_columns,
    load_row,
    load_rows,
    MalformedSummary,
    _num,
    QUALITY,
    RANDOM_SCORER_METRICS,
    random_scorers,
    _short,
    _sort_key,
    _sweep_of,
    _technique,
)
from harness.report.deltas import (  # noqa: E402,F401 (the baseline comparisons, harness/report/deltas.py: re-exported)
    _add_baseline_deltas,
    _interval,
    _mean,
    quality_metrics_for,
    RAG_METRICS,
)
from harness.report.panels import Panel, panels, pareto_front  # noqa: E402,F401 (harness/report/panels.py: re-exported)


# the plots live in harness/report/plots.py (re-exported here: callers use harness.report.build.plot_*)
from harness.report.plots import plot_frontier, plot_keep_rate_by_source, plot_quality_vs_latency  # noqa: E402


# --------------------------------------------------------------------------------------------- markdown


# report.md: harness/report/markdown.py
from harness.report.markdown import markdown  # noqa: E402


# --------------------------------------------------------------------------------------------- entry points


@dataclass
class ReportResult:
    rows: list[dict[str, Any]]
    out_dir: Path
    markdown: Path
    plots: list[Path] = field(default_factory=list)
    wandb_report: Any = None
    wandb_url: str | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # malformed summary.json files, with why
    unfinished: dict[str, Any] = field(default_factory=dict)  # harness.report.build.unfinished
    wandb_not_saved: str | None = None  # why the W&B report was not saved, and what to do first (one line)
    vector_plots: list[Path] = field(default_factory=list)  # the SVG beside each PNG


CSV_SKIP = {"vz_by_source", "_setup", "_samples", "random_scorer_metrics", "comparisons", "quality_metrics",
            "_comparisons_all", "opencompass_accuracy", "opencompass_average_over", "opencompass_deltas"}


def default_title(rows: Sequence[dict[str, Any]]) -> str:
    """What the report compares: ``visionzip, sere vs baseline · rag_igbench · Qwen3-VL-30B-A3B``."""
    families = sorted({r["family"] for r in rows}, key=FAMILY_ORDER.index)
    variants = [f for f in families if f != "baseline"]
    what = (", ".join(variants) + (" vs baseline" if "baseline" in families else " (no baseline)")
            if variants else "baseline")
    datasets = ", ".join(dict.fromkeys(r["dataset"] for r in rows))
    models = ", ".join(dict.fromkeys(r["model"] for r in rows))
    return f"{what} · {datasets} · {models}"


def check_metrics(requested: Sequence[str] | None) -> list[str] | None:
    """``--metric`` values, each a quality metric the report knows (ValueError naming the known ones)."""
    if not requested:
        return None
    unknown = [m for m in requested if m not in QUALITY]
    if unknown:
        raise ValueError(f"--metric {', '.join(unknown)}: unknown; one of {', '.join(QUALITY)}")
    return list(dict.fromkeys(requested))


def build_report(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None, *,
                 wandb_target: str | None = None, title: str | None = None, save_wandb: bool | None = None,
                 metrics: Sequence[str] | None = None) -> ReportResult:
    """Build the report files (and the W&B report object when ``wandb_target`` = ``ENTITY/PROJECT``).
    ``metrics``: the quality metrics to compare (``--metric``); default: each setup's first meaningful one."""
    paths = [Path(p) for p in paths]
    requested = check_metrics(metrics)
    skipped: list[tuple[Path, str]] = []
    rows = load_rows(paths, skipped, requested)
    pending = unfinished(paths)
    out = Path(out_dir) if out_dir else (paths[0] if paths[0].is_dir() else paths[0].parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    sweeps = sorted({r["sweep"] for r in rows if r["sweep"]})
    title = title or default_title(rows)
    all_panels = panels(rows, requested)
    plots = [p for p in (
        plot_quality_vs_latency(all_panels, "ttft", out / "quality_vs_ttft.png", title=title),
        plot_quality_vs_latency(all_panels, "tpot", out / "quality_vs_tpot.png", title=title),
        plot_keep_rate_by_source(rows, out / "keep_rate_by_source.png", title=title),
        plot_frontier(rows, out / "frontier.png", title=title),
    ) if p is not None]
    md = markdown(rows, all_panels, plots, title=title, sources=[str(p) for p in paths], skipped=skipped,
                  pending=pending, requested=requested, sweeps=sweeps)

    frontier = frontier_markdown(rows)  # issue 31: each technique against its trivial baselines at equal budget
    (out / "frontier.md").write_text(frontier + "\n", encoding="utf-8")
    if "|" in frontier:
        md += "\n\n" + frontier.replace("# Frontier", "## Frontier", 1)

    per_dataset = opencompass_markdown(rows)  # OpenCompass runs: each dataset's accuracy delta, paired
    if per_dataset:
        md += "\n\n" + per_dataset
    (out / "report.md").write_text(md + "\n", encoding="utf-8")
    keys = [k for k in rows[0] if k not in CSV_SKIP]
    sources = sorted({s for r in rows for s in r["vz_by_source"]})
    with open(out / "runs.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(keys + [f"vz_keep_rate_{s}" for s in sources])
        for r in rows:
            w.writerow([r.get(k) for k in keys] + [r["vz_by_source"].get(s) for s in sources])
    result = ReportResult(rows=rows, out_dir=out, markdown=out / "report.md", plots=plots, skipped=skipped,
                          unfinished=pending, vector_plots=[p.with_suffix(".svg") for p in plots
                                                            if p.with_suffix(".svg").is_file()])
    if wandb_target:
        entity, _, project = wandb_target.partition("/")
        if not entity or not project:
            raise ValueError(f"--wandb {wandb_target!r}: expected ENTITY/PROJECT")

        table = md.split("## Runs", 1)[1].split("## Plots", 1)[0].strip()
        report = build_wandb_report(rows, all_panels, entity, project, title=title, table_md=table)
        result.wandb_report = report
        (out / "wandb_report.json").write_bytes(wandb_report_spec(report))
        if save_wandb is not False:
            result.wandb_not_saved = why_not_saved()
        if save_wandb is not False and result.wandb_not_saved is None:
            try:
                report.save()
                result.wandb_url = report.url
            except Exception as e:  # noqa: BLE001 - the local report is written; W&B's refusal in one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                result.wandb_not_saved = (f"W&B report built, not saved: {type(e).__name__}: {first}; the "
                                          "specification is in wandb_report.json")
    return result


# how far sweeps and runs are (``--status``, the report's "unfinished" warnings): harness/report/status.py
from harness.report.status import sweep_status, unfinished, unfinished_lines  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories, sweep directories or results/ (every summary.json "
                                             "below is read)")
    ap.add_argument("--out", help="output directory (default: <first path>/report)")
    ap.add_argument("--title", help="report title (default: what is compared — techniques, datasets, models)")
    ap.add_argument("--metric", action="append", metavar="NAME",
                    help="quality metric to compare (repeatable; default: the first whose scorers are meaningful "
                         "for the runs); one of " + ", ".join(QUALITY))
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also build a W&B report for this project")
    ap.add_argument("--no-save", action="store_true", help="build the W&B report but do not save it")
    ap.add_argument("--status", action="store_true", help="only print how far each sweep directory is "
                                                          "(jobs finished / running or interrupted / failed)")
    args = ap.parse_args(argv)
    if args.status:
        try:
            for p in args.paths:
                st = sweep_status(p)
                print(f"{st['sweep']}: {st['finished']}/{st['expected'] if st['expected'] is not None else '?'} "
                      f"finished, {len(st['running_or_interrupted'])} running or interrupted "
                      f"{st['running_or_interrupted'] or ''}, {len(st['failed'])} failed {st['failed'] or ''}, "
                      f"{st['not_started'] if st['not_started'] is not None else '?'} not started")
                for job, why in (st.get("failed_reasons") or {}).items():
                    print(f"  job {job} failed: {why}")
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        res = build_report(args.paths, args.out, wandb_target=args.wandb, title=args.title,
                           save_wandb=False if args.no_save else None, metrics=args.metric)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, reason in res.skipped:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)
    for line in unfinished_lines(res.unfinished):
        print(f"warning: unfinished: {line.replace('`', '')}", file=sys.stderr)
    print(f"{len(res.rows)} runs → {res.markdown}" + (" (+ frontier.md)" if (res.out_dir / "frontier.md").is_file()
                                                        else ""))
    for p in res.plots:
        print(f"  {p}" + (" (+ .svg)" if p.with_suffix(".svg") in res.vector_plots else ""))
    if res.wandb_report is not None:
        if res.wandb_url:
            print(f"  W&B report: {res.wandb_url}")
        else:
            print(f"  {res.wandb_not_saved or 'W&B report built, not saved (--no-save); the specification is in '}"
                  + ("" if res.wandb_not_saved else str(res.out_dir / "wandb_report.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The W&B side of ``python -m harness.report --wandb ENTITY/PROJECT``: the same panels as the offline report
(quality against TTFT/TPOT p50 per sweep group, keep rate per image source, a parallel-coordinates plot of the
settings) built as a ``wandb_workspaces`` report. Built offline; saved only when W&B is online."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from harness.report.panels import Panel
from harness.report.rows import LATENCY_AXES, QUALITY


def wandb_summary_key(metric: str) -> str:
    """The W&B summary key harness.results.tracking logs a ``summary.json`` metric under."""
    return f"metrics/{metric}"


def build_wandb_report(rows: Sequence[dict[str, Any]], all_panels: Sequence[Panel], entity: str, project: str,
                       *, title: str, table_md: str):
    """The W&B report object (``wandb_workspaces.reports.v2.Report``); built offline, not saved here."""
    import wandb_workspaces.reports.v2 as wr

    groups = sorted({r["sweep"] for r in rows if r["sweep"]})
    if groups:
        runsets = [wr.Runset(entity=entity, project=project, name=g, filters=f"Metric('Group') == '{g}'")
                   for g in groups]
    else:
        runsets = [wr.Runset(entity=entity, project=project, name="all runs")]
    metric_panels = []
    seen = set()
    for panel in all_panels:
        for short, name, _ in LATENCY_AXES:
            if (panel.metric, short) in seen:
                continue
            seen.add((panel.metric, short))
            metric_panels.append(wr.ScatterPlot(
                title=f"{QUALITY[panel.metric][0]} vs {name} p50 (ms)",
                x=wr.SummaryMetric(f"latency/{short}_ms/p50"), y=wr.SummaryMetric(wandb_summary_key(panel.metric))))
    sources = sorted({s for r in rows for s in r["vz_by_source"]})
    if sources:
        metric_panels.append(wr.BarPlot(title="VisionZip keep rate per image source",
                                        metrics=[wr.SummaryMetric(f"visionzip/by_source/{s}/keep_rate")
                                                 for s in sources], orientation="v"))
    metric_panels.append(wr.ParallelCoordinatesPlot(
        title="Settings → latency and quality",
        columns=[wr.ParallelCoordinatesPlotColumn(metric=m) for m in (
            wr.Config("visionzip.keep"), wr.Config("sere.k"), wr.Config("sere.rho"), wr.Config("sere.protect"),
            wr.SummaryMetric("latency/ttft_ms/p50"), wr.SummaryMetric("latency/tpot_ms/p50"),
            *[wr.SummaryMetric(wandb_summary_key(m)) for m in dict.fromkeys(p.metric for p in all_panels)])]))
    warn = []
    if any(r["random_init"] for r in rows):
        warn.append(wr.P("⚠ Some runs use random-init weights: their quality numbers are meaningless."))
    if any(r["random_scorers"] for r in rows):
        warn.append(wr.P("⚠ Some runs were scored by random-init scorers: their CLIP score, alignment and "
                         "comprehensive are meaningless."))
    if any(r.get(f"{x}_comparison") == "across runs" for r in rows for x in ("ttft", "tpot")):
        warn.append(wr.P("⚠ Latency of runs measured at different times: drift between the runs is in none of "
                         "their intervals, so no speed-up here is significant on its own (report.md marks them "
                         "'across runs')."))
    blocks = [
        wr.H1(title),
        wr.P(f"{len(rows)} runs; sweeps: {', '.join(groups) or 'n/a'}. Built by python -m harness.report."),
        *warn,
        wr.PanelGrid(runsets=runsets, panels=metric_panels),
        wr.H2("Runs"),
        wr.MarkdownBlock(text=table_md),
    ]
    return wr.Report(entity=entity, project=project, title=title[:128],
                     description="Quality vs latency of VisionZip / SERE settings (moe-vlm-harness)", blocks=blocks)


def wandb_report_spec(report) -> bytes:
    """The report's specification as JSON, without network (the server-side form needs the project's id)."""
    import pydantic

    return pydantic.TypeAdapter(type(report)).dump_json(report, indent=1)


def _wandb_offline() -> bool:
    return os.environ.get("WANDB_MODE", "").lower() in {"offline", "disabled", "dryrun"}


def _logged_in() -> bool:
    """An API key W&B would use: ``WANDB_API_KEY``, or the ``~/.netrc`` entry ``wandb login`` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def why_not_saved() -> str | None:
    """One line saying why the report cannot be saved to W&B now and what to do first; None when it can."""
    how = ("upload the runs first (`wandb sync <run_dir>/wandb/offline-run-*`), then build again with --wandb; "
           "the specification is in wandb_report.json")
    if _wandb_offline():
        return f"W&B report built, not saved: WANDB_MODE={os.environ.get('WANDB_MODE')}; {how}"
    if not _logged_in():
        return f"W&B report built, not saved: not logged in to W&B (`wandb login` or WANDB_API_KEY); {how}"
    return None

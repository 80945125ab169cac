"""``report.md`` of ``python -m harness.report``: warnings first (random-init weights or scorers, malformed
summaries skipped, unfinished sweeps, partial latency, no baseline), then one row per run, the plots, the Pareto
fronts, VisionZip keep rates per source and SERE decode statistics. Rows come from ``harness.report.load_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|")


def markdown(rows: Sequence[dict[str, Any]], all_panels: Sequence[Any], plots: Sequence[Path], *, title: str,
             sources: Sequence[str], skipped: Sequence[tuple[Path, str]] = (),
             pending: Mapping[str, Any] | None = None) -> str:
    from harness.report import LATENCY_AXES, QUALITY, _fmt, pareto_front, quality_metrics_for
    from harness.report_status import unfinished_lines

    metrics = [m for m in QUALITY if any(r.get(m) is not None for r in rows)]
    n_random = sum(r["random_init"] for r in rows)
    n_partial = sum(r["latency_partial"] for r in rows)
    lines = [f"# {title}", "",
             f"{len(rows)} runs from {', '.join(f'`{s}`' for s in sources)}; generated "
             f"{datetime.now(timezone.utc).isoformat(timespec='seconds')} by `python -m harness.report`.", ""]
    if n_random:
        lines += [f"> **⚠ random-init weights in {n_random} of {len(rows)} runs** (marked **RANDOM** below): "
                  "their quality numbers measure nothing; only their latency means something.", ""]
    n_rscorer = sum(bool(r["random_scorers"]) for r in rows)
    if n_rscorer:
        kinds = sorted({k for r in rows for k in r["random_scorers"]})
        lines += [f"> **⚠ random-init scorers ({', '.join(kinds)}) in {n_rscorer} of {len(rows)} runs** (marked "
                  "**RANDOM** in the scorers column, their scores with †): CLIP score / alignment and the "
                  "comprehensive mean of those runs measure nothing.", ""]
    if skipped:
        lines += [f"> **⚠ {len(skipped)} summary.json skipped** (malformed): "
                  + "; ".join(f"`{p}` ({_md_escape(why)})" for p, why in skipped), ""]
    for line in unfinished_lines(pending or {}):
        lines += [f"> **⚠ unfinished** {line}: this report covers the finished runs only.", ""]
    if any(r["weights"] == "trained-synthetic" for r in rows):
        lines += ["> `trained-synthetic` weights: the embedded model trained on the project's synthetic task suite "
                  "(docs/embedded_model.md) — a machinery-level model, not a real model's quality.", ""]
    if n_partial:
        lines += [f"> **⚠ latency partial in {n_partial} runs** (marked `partial`): some generations were "
                  "replayed from the generation cache, so TTFT/TPOT cover only the requests timed in that run "
                  "(`timed/n`).", ""]
    if not any(r["family"] == "baseline" for r in rows):
        lines += ["> No baseline run (VisionZip off and SERE off) among these: speed-ups and quality changes "
                  "are n/a. Run `sweeps/baseline.yaml` and give its directory too.", ""]
    head = ["#", "run", "dataset", "technique", "keep", "scope", "top-K", "K", "ρ", "prot."]
    head += [f"{QUALITY[m][0].replace('RAG-IGBench ', '')}" for m in metrics]
    head += ["Δ quality", "TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)", "TTFT ×", "TPOT ×",
             "timed/n", "engine", "weights", "scorers"]
    lines += ["## Runs", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows, 1):
        prim = next((m for m in quality_metrics_for([r])), None)
        delta = r.get(f"{prim}_delta") if prim else None
        qual = [(_fmt(r[m] * QUALITY[m][2], QUALITY[m][3]) + (" †" if m in r["random_scorer_metrics"] else "")
                 if r[m] is not None else "–") for m in metrics]
        n_timed = r["latency_n_measured"] if r["latency_n_measured"] is not None else r["ttft_n"]
        timed = f"{_fmt(n_timed, '{}')}/{_fmt(r['n_samples'], '{}')}" + (" partial" if r["latency_partial"] else "")
        dataset = r["dataset"] + (f" ({r['dataset_variant']})" if r["dataset_variant"] else "")
        cells = [str(i), f"`{r['run_dir']}`", dataset, ("**baseline**" if r["family"] == "baseline"
                                                            else r["family"]),
                 _fmt(r["vz_keep"], "{:g}"), r["vz_scope"] or "–",
                 (f"{r['moe_top_k']}" + (" (all)" if r["moe_scope"] == "all" else "")) if r["moe_top_k"] else "–",
                 r["sere_k"] if r["sere_k"] is not None else "–",
                 _fmt(r["sere_rho"], "{:g}") if r["sere_k"] is not None else "–",
                 r["sere_protect"] if r["sere_k"] is not None else "–", *qual,
                 (_fmt(delta * QUALITY[prim][2], QUALITY[prim][3].replace("{:", "{:+")) if delta is not None
                  else "n/a"),
                 _fmt(r["ttft_p50"]), _fmt(r["ttft_p90"]), _fmt(r["tpot_p50"]), _fmt(r["tpot_p90"]),
                 _fmt(r["ttft_speedup"], "{:.2f}×"), _fmt(r["tpot_speedup"], "{:.2f}×"), timed,
                 f"{r['engine']} {r['engine_version'] or ''} {r['dtype'] or ''} bs{r['batch_size']}".strip(),
                 "**RANDOM** (random-init)" if r["random_init"] else r["weights"],
                 f"**RANDOM** ({', '.join(r['random_scorers'])})" if r["random_scorers"] else "–"]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    lines += ["", "Quality: the benchmark's own score over all samples (failed and unparsable answers count 0). "
              "Δ quality: against the mean of the baseline runs of the same setup (model, engine, device, dtype, "
              "batch size, dataset selection, max_new_tokens), on the row's first quality column. TTFT × / TPOT ×: baseline p50 / run p50 (> 1 is faster).", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    fronts = []
    for panel in all_panels:
        for short, name, _ in LATENCY_AXES:
            pts = [(r, r[f"{short}_p50"], r[panel.metric]) for r in panel.rows if r[f"{short}_p50"] is not None]
            if len(pts) > 1:
                idx = pareto_front([(x, y) for _, x, y in pts])
                fronts.append(f"- **{panel.title}** vs {name}: " + ", ".join(
                    f"{pts[i][0]['label']} ({_fmt(pts[i][1])} ms, "
                    f"{_fmt(pts[i][2] * QUALITY[panel.metric][2], QUALITY[panel.metric][3])})" for i in idx))
    if fronts:
        lines += ["## Pareto fronts (lower latency p50, higher quality)", "", *fronts, ""]
    vz_rows = [r for r in rows if r["vz_by_source"]]
    if vz_rows:
        sources_ = sorted({s for r in vz_rows for s in r["vz_by_source"]})
        lines += ["## VisionZip keep rate per image source", "",
                  "| run | dataset | setting | nominal keep | achieved keep | " + " | ".join(sources_) + " |",
                  "|" + "---|" * (5 + len(sources_))]
        for r in vz_rows:
            lines.append("| " + " | ".join(_md_escape(c) for c in [
                f"`{r['run_dir']}`", r["dataset"], r["label"], _fmt(r["vz_keep"], "{:g}"),
                _fmt(r["vz_keep_rate"] and 100 * r["vz_keep_rate"], "{:.1f}%"),
                *[_fmt(100 * r["vz_by_source"][s], "{:.1f}%") if s in r["vz_by_source"] else "–" for s in sources_]
            ]) + " |")
        lines.append("")
    sere_rows = [r for r in rows if r["sere_experts_after"] is not None]
    if sere_rows:
        lines += ["## SERE decode statistics", "",
                  "| run | setting | experts/layer/step before | after | moved secondary slots |",
                  "|---|---|---|---|---|"]
        for r in sere_rows:
            lines.append(f"| `{r['run_dir']}` | {r['label']} | {_fmt(r['sere_experts_before'], '{:.2f}')} | "
                         f"{_fmt(r['sere_experts_after'], '{:.2f}')} | "
                         f"{_fmt(r['sere_moved_fraction'] and 100 * r['sere_moved_fraction'], '{:.1f}%')} |")
        lines.append("")
    return "\n".join(lines)



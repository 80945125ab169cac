"""``report.md`` of ``python -m harness.report``: warnings first (random-init weights or scorers, malformed
summaries skipped, unfinished sweeps, partial latency, no baseline), then one row per run, where the TTFT of the
``vllm serve`` runs went, the plots, the Pareto fronts, VisionZip keep rates per source and SERE decode statistics. Rows come from ``harness.report.build.load_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.report.panels import pareto_front
from harness.report.rows import _fmt, LATENCY_AXES, PHASE_KEYS, QUALITY
from harness.report.status import unfinished_lines


def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|")


def _speedup(r: Mapping[str, Any], short: str) -> str:
    """``1.43×`` + what the comparison rests on: ``[1.21, 1.66]`` (paired, within one run: its interval),
    ``n.s.`` (not significant), ``across runs`` (against a baseline measured at another time: drift unseen, never
    called significant), ``partial/full`` (partial and full latency meet)."""
    text = _fmt(r.get(f"{short}_speedup"), "{:.2f}×")
    if r.get(f"{short}_speedup") is None:
        return text
    ci = r.get(f"{short}_speedup_ci")
    if ci:
        text += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
    if r.get(f"{short}_significant") is False:
        text += " n.s."
    elif r.get(f"{short}_comparison") == "across runs":
        text += " across runs"
    if r.get("latency_mixed"):
        text += " partial/full"
    return text


def _delta(r: Mapping[str, Any], metric: str | None) -> str:
    """The quality change on ``metric``: ``+0.012``, or with a paired interval ``+0.012 [-0.003, +0.027] n.s.``."""
    delta = r.get(f"{metric}_delta") if metric else None
    if delta is None:
        return "n/a"
    _, _, scale, spec = QUALITY[metric]
    signed = spec.replace("{:", "{:+")
    text = _fmt(delta * scale, signed)
    ci = r.get(f"{metric}_delta_ci")
    if ci:
        text += f" [{_fmt(ci[0] * scale, signed)}, {_fmt(ci[1] * scale, signed)}]"
        if r.get(f"{metric}_delta_significant") is False:
            text += " n.s."
    return text


def _mean_ci(r: Mapping[str, Any], short: str) -> str:
    mean, lo, hi = r.get(f"{short}_mean"), r.get(f"{short}_ci_lo"), r.get(f"{short}_ci_hi")
    return _fmt(mean) + (f" [{lo:.1f}, {hi:.1f}]" if lo is not None and hi is not None else "")


def _passes(r: Mapping[str, Any]) -> str:
    cvs = [r.get(f"{s}_cv") for s in ("ttft", "tpot") if r.get(f"{s}_cv") is not None]
    text = f"{r.get('latency_repeats', 1)}" + (f" · {max(cvs):.0%}" if cvs else "")
    flags = [f for f, on in (("noisy", r.get("latency_noisy")), ("concurrent", r.get("latency_concurrent")),
                             (f"{r.get('latency_excluded_batches')} excl.", r.get("latency_excluded_batches")))
             if on]
    return text + (" " + " ".join(flags) if flags else "")


def phase_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the TTFT of each ``vllm serve`` run went (``load.server_phases``: the server's own means). Why: a
    technique that shortens the GPU's prefill (VisionZip) can vanish inside a client TTFT dominated by the front
    end; this section shows the prefill beside it, per run."""
    served = [r for r in rows if r.get("phase_prefill") is not None]
    if not served:
        return []
    out = ["## Where the TTFT went (vllm serve runs, the server's /metrics means)", "",
           "| run | technique | client TTFT (ms) | front end | engine queue | prefill | decode |", "|---|---|---|---|---|---|---|"]
    for r in served:
        out.append("| " + " | ".join(_md_escape(c) for c in [
            f"`{r['run_dir']}`", r.get("label") or r.get("family") or "–",
            *(_fmt(r.get(f"phase_{k}")) for k in PHASE_KEYS)]) + " |")
    return out + ["", "Means over each run's measured requests, from the server's own histograms "
                  "(harness/engines/vllm/server_phases.py): prefill = scheduled → first token (vision encoder and "
                  "prefill on the GPU), engine queue = waiting for a batch slot, front end = client TTFT − queue − "
                  "prefill (upload, parsing, image decoding and processing, hand-over). Across runs, without "
                  "intervals: read them as where the time goes, not as speed-ups.", ""]


def markdown(rows: Sequence[dict[str, Any]], all_panels: Sequence[Any], plots: Sequence[Path], *, title: str,
             sources: Sequence[str], skipped: Sequence[tuple[Path, str]] = (),
             pending: Mapping[str, Any] | None = None, requested: Sequence[str] | None = None,
             sweeps: Sequence[str] = ()) -> str:
    metrics = [m for m in (requested or QUALITY) if any(r.get(m) is not None for r in rows)]
    n_random = sum(r["random_init"] for r in rows)
    n_partial = sum(r["latency_partial"] for r in rows)
    lines = [f"# {title}", "",
             f"{len(rows)} runs from {', '.join(f'`{s}`' for s in sources)}; generated "
             f"{datetime.now(timezone.utc).isoformat(timespec='seconds')} by `python -m harness.report`"
             + (f"; sweeps {', '.join(f'`{x}`' for x in sweeps)}" if sweeps else "") + ".", ""]
    shown = sorted({m for r in rows for m in r.get("quality_metrics", ())}, key=list(QUALITY).index)
    if shown:
        lines += [f"Quality compared on: {', '.join(QUALITY[m][0] for m in shown)}"
                  + (" (`--metric`)." if requested else " (the default: the first metric whose scorers are "
                     "meaningful for these runs; choose with `--metric`)."), ""]
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
    n_noisy = sum(bool(r.get("latency_noisy")) for r in rows)
    if n_noisy:
        lines += [f"> **⚠ latency spread too large in {n_noisy} runs** (marked `noisy`): their pass-to-pass "
                  "coefficient of variation exceeds `latency.max_cv`; a speed-up smaller than that spread is noise.", ""]
    n_conc = sum(bool(r.get("latency_concurrent")) for r in rows)
    if n_conc:
        lines += [f"> **⚠ {n_conc} runs were timed while another harness job measured on the same device** (marked "
                  "`concurrent`): their latency is disturbed; rerun with `latency.sequential=true`.", ""]
    n_mixed = sum(bool(r.get("latency_mixed")) for r in rows)
    if n_mixed:
        lines += [f"> **⚠ {n_mixed} speed-ups compare a partial (resumed) latency with a full one** (marked "
                  "`partial/full`): the two cover different requests.", ""]
    n_across = sum(r.get(f"{s}_comparison") == "across runs" and r.get(f"{s}_significant") is not False
                   for r in rows for s in ("ttft", "tpot"))
    if n_across:
        lines += [f"> **⚠ {n_across} latency speed-ups compare runs measured at different times** (marked "
                  "`across runs`): drift between the runs — machine load, the cold start a sweep's first job pays — "
                  "is in neither run's interval, so none of them is called significant. A comparison that holds "
                  "times the variant and the baseline in one process (paired A/B timing: `summary.json` "
                  "`comparisons`, shown with its interval).", ""]
    cold = sorted({r["sweep"] for r in rows if r["family"] == "baseline" and r.get("sweep") and str(r.get("job")) == "0"
                   and any(x.get("sweep") == r["sweep"] and x["family"] != "baseline" for x in rows)})
    if cold:
        lines += [f"> **⚠ the baseline was the first job of sweep {', '.join(f'`{c}`' for c in cold)}**: a sweep's "
                  "first job pays cold-start costs the per-shape warm-up does not remove, so the other jobs' "
                  "speed-ups against it are inflated (on the H200 a decode-only SERE showed a 10× TTFT "
                  "\"speed-up\" this way).", ""]
    if not any(r["family"] == "baseline" for r in rows):
        lines += ["> No baseline run (VisionZip off and SERE off) among these: speed-ups and quality changes "
                  "are n/a. Run `sweeps/baseline.yaml` and give its directory too.", ""]
    head = ["#", "run", "dataset", "technique", "keep", "scope", "top-K", "K", "ρ", "prot."]
    head += [f"{QUALITY[m][0].replace('RAG-IGBench ', '')}" for m in metrics]
    head += ["Δ quality", "TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)", "TTFT ×", "TPOT ×",
             "timed/n", "engine", "weights", "scorers"]
    with_ci = any(r.get("ttft_ci_lo") is not None or r.get("tpot_ci_lo") is not None for r in rows)
    if with_ci:  # the measurement protocol's intervals (harness/latency/): placed after the speed-ups
        at = head.index("timed/n")
        head[at:at] = ["TTFT mean [CI] (ms)", "TPOT mean [CI] (ms)", "passes · CV"]
    lines += ["## Runs", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows, 1):
        prim = next(iter(r.get("quality_metrics") or ()), None)
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
                 _delta(r, prim),
                 _fmt(r["ttft_p50"]), _fmt(r["ttft_p90"]), _fmt(r["tpot_p50"]), _fmt(r["tpot_p90"]),
                 _speedup(r, "ttft"), _speedup(r, "tpot"),
                 *([_mean_ci(r, "ttft"), _mean_ci(r, "tpot"), _passes(r)] if with_ci else []), timed,
                 f"{r['engine']} {r['engine_version'] or ''} {r['dtype'] or ''} bs{r['batch_size']}".strip(),
                 "**RANDOM** (random-init)" if r["random_init"] else r["weights"],
                 f"**RANDOM** ({', '.join(r['random_scorers'])})" if r["random_scorers"] else "–"]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    lines += ["", "Quality: the benchmark's own score over all samples (failed and unparsable answers count 0). "
              "Δ quality: against the mean of the baseline runs of the same setup (model, engine, device, dtype, "
              "batch size, dataset selection, max_new_tokens), on the setup's first compared metric; with an "
              "interval when the run scored itself against the baseline on the same samples (paired). "
              "TTFT × / TPOT ×: baseline p50 / run p50 (> 1 is faster). With an interval `[lo, hi]`: measured "
              "against the baseline in one process (paired A/B timing), significant unless marked **n.s.** "
              "(the interval holds 1). `across runs`: the baseline ran at another time, so drift between the "
              "runs is unseen and the speed-up is never called significant; **n.s.**: not significant even "
              "within the runs, their intervals of the mean overlap (bootstrap over requests; several "
              "baselines: the hull of their intervals). `partial/full`: one side's latency covers only the "
              "requests timed after a resume (docs/latency.md).", ""]
    lines += phase_lines(rows)
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



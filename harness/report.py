"""``python -m harness.report PATH [PATH ...] [--out DIR] [--wandb ENTITY/PROJECT]``: a report from result directories.

Reads every ``summary.json`` below the given paths (a run directory, a sweep directory, ``results/``) and
nothing else, so it works on copied or archived results without W&B. Writes into ``--out`` (default:
``<first path>/report``):

- ``report.md``: one row per run (technique settings, quality, TTFT/TPOT p50/p90, speed-up and quality change
  against the baseline of the same model/engine/dataset, engine, weights), warnings for random-init weights
  and partial latency, the Pareto front of each panel, VisionZip keep rate per image source;
- ``runs.csv``: the same rows, every column;
- ``quality_vs_ttft.png``, ``quality_vs_tpot.png``: quality against latency (p50, whisker to p90), one panel
  per (dataset, quality metric) — RAG-IGBench: ``comprehensive`` when present, else the first of
  ``rouge1, edit_score, kendall, clip_score, alignment``; OCRBench: ``ocrbench_score``; CCBench / MCQ:
  ``mcq_accuracy`` — with the Pareto front (lower latency, higher quality) drawn and the baseline
  (VisionZip off and SERE off) highlighted;
- ``keep_rate_by_source.png``: VisionZip's achieved keep rate per image source (the OCRBench + CCBench mix),
  when the runs recorded it.

``--status`` only prints how far each given sweep directory is (for a Slurm array still running).

``--wandb ENTITY/PROJECT`` also builds a W&B report (``wandb_workspaces.reports.v2``) with the same panels on
the runs' W&B summaries (``metrics/*``, ``latency/*/p50``), one run set per sweep (W&B group). It is saved
only when W&B is not offline (``WANDB_MODE`` not ``offline``/``disabled`` and ``--no-save`` not given);
otherwise its specification is written to ``wandb_report.json``.

Missing pieces are expected (older runs, techniques still landing): any key may be absent, and the report
says "n/a" rather than failing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# Quality metrics, per benchmark: (summary key, display name, unit, scale for display, format)
RAG_METRICS = ("comprehensive", "rouge1", "edit_score", "kendall", "clip_score", "alignment")
QUALITY = {
    "comprehensive": ("RAG-IGBench comprehensive", "score (0-1)", 1.0, "{:.3f}"),
    "rouge1": ("RAG-IGBench Rouge-1", "F1 (0-1)", 1.0, "{:.3f}"),
    "edit_score": ("RAG-IGBench edit score", "score (0-1)", 1.0, "{:.3f}"),
    "kendall": ("RAG-IGBench Kendall", "score (0-1)", 1.0, "{:.3f}"),
    "clip_score": ("RAG-IGBench CLIP score", "score", 1.0, "{:.3f}"),
    "alignment": ("RAG-IGBench alignment", "score (0-1)", 1.0, "{:.3f}"),
    "ocrbench_score": ("OCRBench score", "score (0-1000)", 1.0, "{:.0f}"),
    "mcq_accuracy": ("CCBench accuracy (circular)", "accuracy (%)", 100.0, "{:.1f}"),
}
FAMILY_ORDER = ("baseline", "visionzip", "sere", "visionzip+sere")
FAMILY_COLOR = {"baseline": "black", "visionzip": "tab:blue", "sere": "tab:orange", "visionzip+sere": "tab:purple"}
LATENCY_AXES = (("ttft", "TTFT", "time to first token"), ("tpot", "TPOT", "time per output token"))


# --------------------------------------------------------------------------------------------- loading


def _get(d: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return default
        d = d[key]
    return d


def _num(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def find_summaries(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every ``summary.json`` at or below each path (sorted, deduplicated; W&B and submitit folders skipped)."""
    found: set[Path] = set()
    for p in map(Path, paths):
        if p.is_file() and p.name == "summary.json":
            found.add(p.resolve())
        elif p.is_dir():
            for s in p.rglob("summary.json"):
                if not any(part in {"wandb", ".submitit"} for part in s.relative_to(p).parts):
                    found.add(s.resolve())
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return sorted(found)


def _sweep_of(summary: Mapping[str, Any], run_dir: Path) -> tuple[str | None, str]:
    """(sweep id, job name): ``run.sweep`` when the run recorded it, else the nearest parent holding Hydra's
    ``multirun.yaml`` (id = its path below ``multirun/``), else the run's W&B group."""
    sweep = _get(summary, "run", "sweep")
    if isinstance(sweep, Mapping) and sweep.get("id"):
        return str(sweep["id"]), str(sweep.get("job_num", run_dir.name))
    for parent in run_dir.parents:
        if (parent / "multirun.yaml").is_file():
            parts = parent.parts
            rel = parts[parts.index("multirun") + 1:] if "multirun" in parts else parts[-1:]
            return "/".join(rel), str(run_dir.relative_to(parent))
    return _get(summary, "config", "wandb", "group"), run_dir.name


def _technique(summary: Mapping[str, Any]) -> dict[str, Any]:
    cfg = summary.get("config") or {}
    vz = {**(cfg.get("visionzip") or {}), **{k: v for k, v in (summary.get("visionzip") or {}).items()
                                             if k in {"keep", "scope", "contextual"}}}
    sere = cfg.get("sere") or {}
    keep = _num(vz.get("keep"))
    vz_on = keep is not None and keep < 1.0
    sere_on = sere.get("k") is not None
    family = ("visionzip+sere" if vz_on and sere_on else "visionzip" if vz_on else "sere" if sere_on
              else "baseline")
    parts = []
    if vz_on:
        parts.append(f"keep {keep:g}" + ("·img" if vz.get("scope") == "image" else "")
                     + (f" ctx{_num(vz.get('contextual')):g}" if _num(vz.get("contextual")) else ""))
    if sere_on:
        parts.append(f"K{sere['k']} ρ{_num(sere.get('rho')) or 0:g}"
                     + (f" P{sere.get('protect')}" if int(sere.get("protect") or 0) else ""))
    return {
        "family": family,
        "label": " + ".join(parts) or "baseline",
        "vz_keep": keep if keep is not None else 1.0,
        "vz_scope": vz.get("scope") if vz_on else None,
        "vz_contextual": _num(vz.get("contextual")) if vz_on else None,
        "sere_k": sere.get("k") if sere_on else None,
        "sere_rho": _num(sere.get("rho")) if sere_on else None,
        "sere_protect": int(sere.get("protect") or 0) if sere_on else None,
    }


def _by_source(vz: Mapping[str, Any]) -> dict[str, float]:
    """Per-source keep rates from ``summary.json["visionzip"]`` (``by_source`` / ``per_source`` /
    ``keep_rate_by_source``; each entry a number or a mapping with ``keep_rate``)."""
    for key in ("by_source", "per_source", "keep_rate_by_source"):
        block = vz.get(key)
        if isinstance(block, Mapping) and block:
            out = {}
            for src, v in block.items():
                rate = _num(v.get("keep_rate") if isinstance(v, Mapping) else v)
                if rate is not None:
                    out[str(src)] = rate
            return out
    return {}


def load_row(path: Path, root: Path | None = None) -> dict[str, Any]:
    """One flat row from one ``summary.json``."""
    s = json.loads(path.read_text(encoding="utf-8"))
    run, cfg, metrics, lat = (s.get(k) or {} for k in ("run", "config", "metrics", "latency"))
    run_dir = path.parent
    sweep, job = _sweep_of(s, run_dir)
    vz = s.get("visionzip") or {}
    sere = s.get("sere") or {}
    model = run.get("model") or {}
    weights = run.get("weights") or model.get("weights") or _get(cfg, "model", "weights")
    row: dict[str, Any] = {
        "run_dir": str(run_dir.relative_to(root)) if root and run_dir.is_relative_to(root) else str(run_dir),
        "sweep": sweep,
        "job": job,
        "dataset": _get(cfg, "dataset", "name") or "?",
        "model": model.get("name") or _get(cfg, "model", "name") or "?",
        "weights": weights or "?",
        "random_init": weights == "random-init",
        "engine": run.get("engine") or _get(cfg, "engine", "name") or "?",
        "engine_version": run.get("engine_version"),
        "device": run.get("device_name"),
        "dtype": run.get("dtype"),
        "batch_size": _get(run, "engine_settings", "batch_size", default=_get(cfg, "engine", "batch_size")),
        "max_new_tokens": _get(cfg, "generation", "max_new_tokens"),
        "n_samples": next((v for v in (metrics.get("n_samples"), metrics.get("n"), metrics.get("n_rows"),
                                        _get(lat, "n_requests")) if v is not None), None),
        "errors": metrics.get("errors"),
        "start_time": run.get("start_time"),
        **_technique(s),
    }
    for key in QUALITY:
        row[key] = _num(metrics.get(key))
    for short, _, _ in LATENCY_AXES:
        for p in ("p50", "p90", "p99", "mean"):
            row[f"{short}_{p}"] = _num(_get(lat, f"{short}_ms", p))
        row[f"{short}_n"] = _get(lat, f"{short}_ms", "n")
    row["e2e_p50"] = _num(_get(lat, "e2e_ms", "p50"))
    row["tokens_per_s"] = _num(lat.get("output_tokens_per_s"))
    row["latency_partial"] = bool(lat.get("partial"))
    row["latency_n_measured"] = lat.get("n_measured", lat.get("completed"))
    row["latency_n_cached"] = lat.get("n_cached", 0)
    row["vz_keep_rate"] = _num(vz.get("keep_rate"))
    if row["vz_keep_rate"] is None and _num(vz.get("visual_tokens_in")):
        row["vz_keep_rate"] = (_num(vz.get("visual_tokens_kept")) or 0) / _num(vz["visual_tokens_in"])
    row["vz_tokens_in"] = vz.get("visual_tokens_in")
    row["vz_tokens_kept"] = vz.get("visual_tokens_kept")
    row["vz_by_source"] = _by_source(vz)
    row["sere_experts_before"] = _num(sere.get("expert_union_before"))
    row["sere_experts_after"] = _num(sere.get("expert_union_after"))
    row["sere_moved_fraction"] = _num(sere.get("moved_fraction"))
    row["platform"] = " · ".join(str(x) for x in (row["model"], row["engine"], row["device"], row["dtype"],
                                                  f"bs{row['batch_size']}") if x is not None)
    # what else must match for two runs to be compared: the dataset selection and the generation length
    row["_setup"] = {**{k: v for k, v in (cfg.get("dataset") or {}).items() if k != "name"},
                     "max_new_tokens": row["max_new_tokens"]}
    row["dataset_variant"] = ""
    row["setup"] = ""
    return row


def _label_setups(rows: list[dict[str, Any]]) -> None:
    """``dataset_variant``: the dataset / generation settings that differ between runs of one dataset name (so
    a ``dataset.limit=2`` smoke run is never another run's baseline); ``setup``: the comparison group."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["dataset"], []).append(r)
    for group in by_name.values():
        keys = sorted({k for r in group for k in r["_setup"]})
        differ = [k for k in keys if len({json.dumps(r["_setup"].get(k), sort_keys=True, default=str)
                                          for r in group}) > 1]
        for r in group:
            r["dataset_variant"] = ", ".join(f"{k}={_short(r['_setup'].get(k))}" for k in differ)
            r["setup"] = " | ".join((r["platform"], r["dataset"], r["dataset_variant"]))


def _short(v: Any) -> str:
    if isinstance(v, str) and ("/" in v or len(v) > 24):
        return "…/" + v.rstrip("/").rsplit("/", 1)[-1][-24:]
    if isinstance(v, Mapping):
        return "{…}"
    return str(v)


def _sort_key(r: Mapping[str, Any]) -> tuple:
    return (r["platform"], r["dataset"], r["dataset_variant"], FAMILY_ORDER.index(r["family"]), -(r["vz_keep"] or 1.0),
            r["vz_scope"] or "", r["sere_k"] or 0, r["sere_rho"] or 0.0, r["sere_protect"] or 0, r["run_dir"])


def load_rows(paths: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    summaries = find_summaries(paths)
    if not summaries:
        raise FileNotFoundError(f"no summary.json below {', '.join(map(str, paths))}")
    roots = [Path(p).resolve() for p in paths]
    root = Path(os.path.commonpath(roots)) if roots else None
    if root and root.is_file():
        root = root.parent
    rows = [load_row(p, root) for p in summaries]
    _label_setups(rows)
    rows.sort(key=_sort_key)
    _add_baseline_deltas(rows)
    return rows


# --------------------------------------------------------------------------------------------- analysis


def quality_metrics_for(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The quality metrics shown for a set of runs of one dataset: RAG-IGBench's first available of
    ``RAG_METRICS``, plus ``ocrbench_score`` and ``mcq_accuracy`` when present."""
    out = []
    rag = next((m for m in RAG_METRICS if any(r.get(m) is not None for r in rows)), None)
    if rag:
        out.append(rag)
    out += [m for m in ("ocrbench_score", "mcq_accuracy") if any(r.get(m) is not None for r in rows)]
    return out


def _add_baseline_deltas(rows: list[dict[str, Any]]) -> None:
    """Speed-up (baseline p50 / run p50) and quality change against the baseline run of the same setup
    (platform, dataset and its selection, generation length); the mean when the baseline ran several times."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    for group in groups.values():
        base = [r for r in group if r["family"] == "baseline"]
        metrics = quality_metrics_for(group)
        for r in group:
            r["baseline_runs"] = len(base)
            for short in ("ttft", "tpot"):
                b = _mean(x[f"{short}_p50"] for x in base)
                v = r[f"{short}_p50"]
                r[f"{short}_speedup"] = b / v if b and v else None
            for m in metrics:
                b = _mean(x[m] for x in base)
                r[f"{m}_delta"] = r[m] - b if b is not None and r[m] is not None else None


def _mean(values: Iterable[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats (latency x lower-or-equal and quality y higher-or-equal, one
    strictly), sorted by latency."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))


@dataclass
class Panel:
    platform: str
    dataset: str
    variant: str
    metric: str
    rows: list[dict[str, Any]]

    @property
    def title(self) -> str:
        return f"{QUALITY[self.metric][0]} · {self.dataset}" + (f" ({self.variant})" if self.variant else "")


def panels(rows: Sequence[dict[str, Any]]) -> list[Panel]:
    """One panel per (setup, quality metric)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    return [Panel(g[0]["platform"], g[0]["dataset"], g[0]["dataset_variant"], m,
                  [r for r in g if r.get(m) is not None])
            for g in groups.values() for m in quality_metrics_for(g)]


# --------------------------------------------------------------------------------------------- plots


def _fmt(x: Any, spec: str = "{:.1f}") -> str:
    return "n/a" if x is None else spec.format(x)


def plot_quality_vs_latency(all_panels: Sequence[Panel], short: str, out: Path, *, title: str) -> Path | None:
    """One figure, one subplot per panel: quality against ``short`` latency (p50, whisker to p90)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    name, long = next((n, lng) for s, n, lng in LATENCY_AXES if s == short)
    usable = [p for p in all_panels if any(r[f"{short}_p50"] is not None for r in p.rows)]
    if not usable:
        return None
    several_platforms = len({p.platform for p in usable}) > 1
    ncols = min(2, len(usable))
    nrows = math.ceil(len(usable) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.2 * ncols, 5.2 * nrows), squeeze=False, layout="constrained")
    any_random = any(r["random_init"] for p in usable for r in p.rows)
    any_partial = any(r["latency_partial"] for p in usable for r in p.rows)
    for ax, panel in zip(axes.flat, usable):
        label, unit, scale, _ = QUALITY[panel.metric]
        pts = [(r, r[f"{short}_p50"], r[panel.metric] * scale) for r in panel.rows if r[f"{short}_p50"] is not None]
        front = set(pareto_front([(x, y) for _, x, y in pts]))
        fx = sorted(((x, y) for i, (_, x, y) in enumerate(pts) if i in front))
        if len(fx) > 1:
            ax.step([x for x, _ in fx], [y for _, y in fx], where="post", color="tab:green", lw=1.4, ls="--",
                    zorder=1)
        for i, (r, x, y) in enumerate(pts):
            color = FAMILY_COLOR[r["family"]]
            p90 = r[f"{short}_p90"]
            if p90 is not None and p90 > x:
                ax.plot([x, p90], [y, y], color=color, lw=0.8, alpha=0.45, zorder=2)
            base = r["family"] == "baseline"
            marker = "*" if base else "s" if r["vz_scope"] == "image" else "^" if r["sere_protect"] else "o"
            ax.scatter([x], [y], s=260 if base else 55, marker=marker,
                       facecolors="none" if r["latency_partial"] else color, edgecolors=color,
                       linewidths=1.6 if base else 1.0, zorder=4 if base else 3)
            if i in front:
                ax.scatter([x], [y], s=170 if not base else 420, facecolors="none", edgecolors="tab:green",
                           linewidths=1.2, zorder=2.5)
            if len(pts) <= 40 or i in front or base:
                ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7,
                            color="0.25")
        ax.set_xlabel(f"{name} p50 (ms) — whisker to p90")
        ax.set_ylabel(f"{label} [{unit}]")
        random_init = any(r["random_init"] for r in panel.rows)
        ax.set_title(panel.title + (f"\n{panel.platform}" if several_platforms else "")
                     + ("\n⚠ RANDOM-INIT WEIGHTS: quality meaningless" if random_init else ""),
                     fontsize=10, color="firebrick" if random_init else "black")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.12, y=0.12)
    for ax in list(axes.flat)[len(usable):]:
        ax.set_visible(False)
    families = sorted({r["family"] for p in usable for r in p.rows}, key=FAMILY_ORDER.index)
    handles = [Line2D([], [], marker="*" if f == "baseline" else "o", ls="", color=FAMILY_COLOR[f],
                      markersize=12 if f == "baseline" else 7, label=f) for f in families]
    if any(r["vz_scope"] == "image" for p in usable for r in p.rows):
        handles.append(Line2D([], [], marker="s", ls="", color="0.4", label="VisionZip scope=image"))
    if any(r["sere_protect"] for p in usable for r in p.rows):
        handles.append(Line2D([], [], marker="^", ls="", color="0.4", label="SERE protection on"))
    handles.append(Line2D([], [], color="tab:green", ls="--", label="Pareto front (faster & better)"))
    if any_partial:
        handles.append(Line2D([], [], marker="o", ls="", markerfacecolor="none", color="0.4",
                              label="latency partial (cache replay)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    suptitle = f"{title}: quality vs {name} ({long})"
    if any_random:
        suptitle += "\n⚠ random-init weights in some runs: their quality numbers are meaningless (latency only)"
    fig.suptitle(suptitle, fontsize=12, color="firebrick" if any_random else "black")
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_keep_rate_by_source(rows: Sequence[dict[str, Any]], out: Path, *, title: str) -> Path | None:
    """Grouped bars: achieved keep rate per image source for every VisionZip run that recorded it."""
    runs = [r for r in rows if r["vz_by_source"]]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({s for r in runs for s in r["vz_by_source"]})
    width = 0.8 / len(sources)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(runs) + 2), 5.0), layout="constrained")
    for j, src in enumerate(sources):
        xs = [i + (j - (len(sources) - 1) / 2) * width for i in range(len(runs))]
        ys = [100 * r["vz_by_source"].get(src, float("nan")) for r in runs]
        ax.bar(xs, ys, width=width, label=src)
    for i, r in enumerate(runs):
        ax.hlines(100 * r["vz_keep"], i - 0.45, i + 0.45, colors="black", linestyles="--", lw=1)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([f"{r['label']}\n{r['dataset']}" for r in runs], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("visual tokens kept (% of the source's tokens)")
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_xlabel("run (VisionZip setting, dataset)")
    ax.plot([], [], "k--", lw=1, label="nominal keep (visionzip.keep)")
    ax.legend(fontsize=8, title="image source", title_fontsize=8, loc="upper center", ncol=len(sources) + 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"VisionZip keep rate per image source\n{title}", fontsize=10, wrap=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------- markdown


def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|")


def markdown(rows: Sequence[dict[str, Any]], all_panels: Sequence[Panel], plots: Sequence[Path], *, title: str,
             sources: Sequence[str]) -> str:
    metrics = [m for m in QUALITY if any(r.get(m) is not None for r in rows)]
    n_random = sum(r["random_init"] for r in rows)
    n_partial = sum(r["latency_partial"] for r in rows)
    lines = [f"# {title}", "",
             f"{len(rows)} runs from {', '.join(f'`{s}`' for s in sources)}; generated "
             f"{datetime.now(timezone.utc).isoformat(timespec='seconds')} by `python -m harness.report`.", ""]
    if n_random:
        lines += [f"> **⚠ random-init weights in {n_random} of {len(rows)} runs** (marked **RANDOM** below): "
                  "their quality numbers measure nothing; only their latency means something.", ""]
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
    head = ["#", "run", "dataset", "technique", "keep", "scope", "K", "ρ", "prot."]
    head += [f"{QUALITY[m][0].replace('RAG-IGBench ', '')}" for m in metrics]
    head += ["Δ quality", "TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)", "TTFT ×", "TPOT ×",
             "timed/n", "engine", "weights"]
    lines += ["## Runs", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows, 1):
        prim = next((m for m in quality_metrics_for([r])), None)
        delta = r.get(f"{prim}_delta") if prim else None
        qual = [(_fmt(r[m] * QUALITY[m][2], QUALITY[m][3]) if r[m] is not None else "–") for m in metrics]
        n_timed = r["latency_n_measured"] if r["latency_n_measured"] is not None else r["ttft_n"]
        timed = f"{_fmt(n_timed, '{}')}/{_fmt(r['n_samples'], '{}')}" + (" partial" if r["latency_partial"] else "")
        dataset = r["dataset"] + (f" ({r['dataset_variant']})" if r["dataset_variant"] else "")
        cells = [str(i), f"`{r['run_dir']}`", dataset, ("**baseline**" if r["family"] == "baseline"
                                                            else r["family"]),
                 _fmt(r["vz_keep"], "{:g}"), r["vz_scope"] or "–", r["sere_k"] if r["sere_k"] is not None else "–",
                 _fmt(r["sere_rho"], "{:g}") if r["sere_k"] is not None else "–",
                 r["sere_protect"] if r["sere_k"] is not None else "–", *qual,
                 (_fmt(delta * QUALITY[prim][2], QUALITY[prim][3].replace("{:", "{:+")) if delta is not None
                  else "n/a"),
                 _fmt(r["ttft_p50"]), _fmt(r["ttft_p90"]), _fmt(r["tpot_p50"]), _fmt(r["tpot_p90"]),
                 _fmt(r["ttft_speedup"], "{:.2f}×"), _fmt(r["tpot_speedup"], "{:.2f}×"), timed,
                 f"{r['engine']} {r['engine_version'] or ''} {r['dtype'] or ''} bs{r['batch_size']}".strip(),
                 "**RANDOM** (random-init)" if r["random_init"] else r["weights"]]
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


# --------------------------------------------------------------------------------------------- W&B


def wandb_summary_key(metric: str) -> str:
    """The W&B summary key harness.tracking logs a ``summary.json`` metric under."""
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


# --------------------------------------------------------------------------------------------- entry points


@dataclass
class ReportResult:
    rows: list[dict[str, Any]]
    out_dir: Path
    markdown: Path
    plots: list[Path] = field(default_factory=list)
    wandb_report: Any = None
    wandb_url: str | None = None


CSV_SKIP = {"vz_by_source", "_setup"}


def build_report(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None, *,
                 wandb_target: str | None = None, title: str | None = None, save_wandb: bool | None = None
                 ) -> ReportResult:
    """Build the report files (and the W&B report object when ``wandb_target`` = ``ENTITY/PROJECT``)."""
    paths = [Path(p) for p in paths]
    rows = load_rows(paths)
    out = Path(out_dir) if out_dir else (paths[0] if paths[0].is_dir() else paths[0].parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    sweeps = sorted({r["sweep"] for r in rows if r["sweep"]})
    title = title or ("Sweep " + ", ".join(sweeps) if sweeps else f"Runs under {paths[0]}")
    all_panels = panels(rows)
    plots = [p for p in (
        plot_quality_vs_latency(all_panels, "ttft", out / "quality_vs_ttft.png", title=title),
        plot_quality_vs_latency(all_panels, "tpot", out / "quality_vs_tpot.png", title=title),
        plot_keep_rate_by_source(rows, out / "keep_rate_by_source.png", title=title),
    ) if p is not None]
    md = markdown(rows, all_panels, plots, title=title, sources=[str(p) for p in paths])
    (out / "report.md").write_text(md + "\n", encoding="utf-8")
    keys = [k for k in rows[0] if k not in CSV_SKIP]
    sources = sorted({s for r in rows for s in r["vz_by_source"]})
    with open(out / "runs.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(keys + [f"vz_keep_rate_{s}" for s in sources])
        for r in rows:
            w.writerow([r.get(k) for k in keys] + [r["vz_by_source"].get(s) for s in sources])
    result = ReportResult(rows=rows, out_dir=out, markdown=out / "report.md", plots=plots)
    if wandb_target:
        entity, _, project = wandb_target.partition("/")
        if not entity or not project:
            raise ValueError(f"--wandb {wandb_target!r}: expected ENTITY/PROJECT")
        table = md.split("## Runs", 1)[1].split("## Plots", 1)[0].strip()
        report = build_wandb_report(rows, all_panels, entity, project, title=title, table_md=table)
        result.wandb_report = report
        (out / "wandb_report.json").write_bytes(wandb_report_spec(report))
        if save_wandb is None:
            save_wandb = not _wandb_offline()
        if save_wandb:
            report.save()
            result.wandb_url = report.url
    return result


def sweep_status(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """How far a sweep is: jobs expected (from Hydra's ``multirun.yaml``: sweeper params + command line, basic
    sweeper semantics), finished (``summary.json``), interrupted or running (``samples.jsonl`` only), failed
    (a ``.progress/<job>.json`` marker saying so, harness.progress), not started."""
    import yaml

    d = Path(sweep_dir)
    mr = d / "multirun.yaml"
    if not mr.is_file():
        raise FileNotFoundError(f"{d}: no multirun.yaml (not a Hydra sweep directory)")
    hydra = (yaml.safe_load(mr.read_text(encoding="utf-8")) or {}).get("hydra") or {}
    expected = None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [f"{k}={v}" for k, v in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
        task = (hydra.get("overrides") or {}).get("task") or []
        parsed = OverridesParser.create().parse_overrides([*params, *task])
        expected = sum(len(b) for b in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - another sweeper: count what is there
        pass
    jobs = sorted((p for p in d.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    finished = [p.name for p in jobs if (p / "summary.json").is_file()]
    started = [p.name for p in jobs if (p / "samples.jsonl").is_file() and p.name not in finished]
    failed = []
    for m in (d / ".progress").glob("*.json") if (d / ".progress").is_dir() else []:
        try:
            if json.loads(m.read_text())["status"] != "completed" and m.stem not in finished:
                failed.append(m.stem)
        except (ValueError, KeyError):
            pass
    seen = len(set(finished) | set(started) | set(failed))
    return {"sweep": str(d), "expected": expected, "finished": len(finished), "failed": sorted(failed, key=int),
            "running_or_interrupted": [j for j in started if j not in failed],
            "not_started": (expected - seen) if expected is not None else None}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories, sweep directories or results/ (every summary.json "
                                             "below is read)")
    ap.add_argument("--out", help="output directory (default: <first path>/report)")
    ap.add_argument("--title", help="report title (default: from the sweep ids)")
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
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        res = build_report(args.paths, args.out, wandb_target=args.wandb, title=args.title,
                           save_wandb=False if args.no_save else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(res.rows)} runs → {res.markdown}")
    for p in res.plots:
        print(f"  {p}")
    if res.wandb_report is not None:
        print(f"  W&B report: {res.wandb_url or 'built, not saved (offline); spec in ' + str(res.out_dir / 'wandb_report.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

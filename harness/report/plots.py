"""The PNG plots of ``python -m harness.report`` (split from ``harness/report/build.py``, which loads and tabulates).

- :func:`quality_figure` / :func:`plot_quality_vs_latency`: quality against TTFT or TPOT — the mean with the
  run's interval of the mean as an error bar when every run has one (``latency.repeats``), else the p50 —
  one subplot per (setup, quality metric), Pareto front dashed, baseline a star. Point labels are placed so they
  neither overlap each other nor leave their subplot (:func:`place_labels`); titles are wrapped to the figure's
  width (a long sweep list used to run off the figure); random-init model weights *and* random-init scorers are
  flagged in red on the subplots they affect.
- :func:`plot_keep_rate_by_source`: VisionZip's achieved keep rate per image source, for the runs where several
  sources compete for one budget (a single-source run's keep rate is in the report's table: a plot of one bar
  per run showed nothing the table does not, and it padded the other runs' bar groups with empty slots).

Each figure is written as PNG and as SVG beside it. matplotlib is imported lazily, with the Agg backend.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Sequence

from harness.report.panels import pareto_front
from harness.report.rows import FAMILY_COLOR, FAMILY_ORDER, LATENCY_AXES, QUALITY

# offsets (points) tried for a point's label, nearest first: right/left, above/below, then further out
_OFFSETS = [(dx, dy) for dy in (4, -12, 14, -22, 24, -32, 34, -42) for dx in (6, -6)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrap_title(text: str, fig_width_in: float, fontsize: float) -> str:
    """``text`` wrapped so each line fits a figure ``fig_width_in`` inches wide at ``fontsize`` points (average
    glyph ≈ 0.6 em; existing line breaks kept)."""
    chars = max(20, int(fig_width_in * 72 * 0.92 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) if line else line for line in text.split("\n"))


def place_labels(ax: Any, points: Sequence[tuple[float, float, str]], fontsize: float = 7,
                 markers: Sequence[tuple[float, float, float]] = ()) -> list[Any]:
    """Annotate each (x, y, label) at the first offset whose text box overlaps no label placed before, no marker
    (``markers``: (x, y, radius in points)) and stays inside the axes (else the least-overlapping offset). Needs
    the figure's layout done (a draw first)."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    placed: list[Any] = []  # bounding boxes of markers and of labels placed so far
    for x, y, radius in markers:
        cx, cy = ax.transData.transform((x, y))
        placed.append(Bbox.from_extents(cx - radius * px, cy - radius * px, cx + radius * px, cy + radius * px))
    texts = []
    for x, y, label in points:
        best = None
        for dx, dy in _OFFSETS:
            t = ax.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize,
                            color="0.25", ha="left" if dx > 0 else "right", va="bottom" if dy > 0 else "top")
            t.set_in_layout(False)  # placed against the final layout: must not move it
            box = t.get_window_extent(renderer)
            overlap = sum(_area(box, other) for other in placed)
            outside = box.width * box.height - _area(box, inside)
            cost = overlap + outside
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, t, box)
            else:
                t.remove()
            if cost == 0:
                break
        placed.append(best[2])
        texts.append(best[1])
    return texts


def _area(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _random_note(panel_rows: Sequence[dict[str, Any]], metric: str) -> str | None:
    """The red warning of one subplot: random model weights, and random scorers where they feed ``metric``."""
    notes = []
    if any(r["random_init"] for r in panel_rows):
        notes.append("RANDOM-INIT WEIGHTS")
    scorers = sorted({k for r in panel_rows if metric in r.get("random_scorer_metrics", ()) for k in
                      r.get("random_scorers", ())})
    if scorers:
        notes.append(f"RANDOM-INIT SCORERS ({', '.join(scorers)})")
    return "⚠ " + " + ".join(notes) + ": quality meaningless" if notes else None


def quality_figure(all_panels: Sequence[Any], short: str, *, title: str):
    """The figure of :func:`plot_quality_vs_latency` (not saved), or None when no panel has this latency."""
    from matplotlib.lines import Line2D

    plt = _pyplot()
    name, long = next((n, lng) for s, n, lng in LATENCY_AXES if s == short)
    usable = [p for p in all_panels if any(r[f"{short}_p50"] is not None for r in p.rows)]
    if not usable:
        return None
    several_platforms = len({p.platform for p in usable}) > 1
    ncols = min(2, len(usable))
    nrows = math.ceil(len(usable) / ncols)
    width = 7.2 * ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 5.2 * nrows), squeeze=False, layout="constrained")
    any_random = any(r["random_init"] for p in usable for r in p.rows)
    any_random_scorer = any(p.metric in r.get("random_scorer_metrics", ()) for p in usable for r in p.rows)
    any_partial = any(r["latency_partial"] for p in usable for r in p.rows)
    to_label = []
    for ax, panel in zip(axes.flat, usable):
        label, unit, scale, _ = QUALITY[panel.metric]
        stat, pts, errs = latency_points(panel.rows, short)
        pts = [(r, x, r[panel.metric] * scale) for r, x in pts]
        front = set(pareto_front([(x, y) for _, x, y in pts]))
        fx = sorted(((x, y) for i, (_, x, y) in enumerate(pts) if i in front))
        if len(fx) > 1:
            ax.step([x for x, _ in fx], [y for _, y in fx], where="post", color="tab:green", lw=1.4, ls="--",
                    zorder=1)
        labels = []
        markers = []
        for i, (r, x, y) in enumerate(pts):
            color = FAMILY_COLOR[r["family"]]
            if errs[i] is not None:  # the interval of the mean (the run's own, over requests)
                lo, hi = errs[i]
                ax.errorbar([x], [y], xerr=[[max(x - lo, 0.0)], [max(hi - x, 0.0)]], fmt="none", ecolor=color,
                            elinewidth=1.0, capsize=3, alpha=0.8, zorder=2)
            base = r["family"] == "baseline"
            markers.append((x, y, 8.0 if base or i in front else 4.0))
            marker = "*" if base else "s" if r["vz_scope"] == "image" else "^" if r["sere_protect"] else "o"
            ax.scatter([x], [y], s=260 if base else 55, marker=marker,
                       facecolors="none" if r["latency_partial"] else color, edgecolors=color,
                       linewidths=1.6 if base else 1.0, zorder=4 if base else 3)
            if i in front:
                ax.scatter([x], [y], s=170 if not base else 420, facecolors="none", edgecolors="tab:green",
                           linewidths=1.2, zorder=2.5)
            if len(pts) <= 40 or i in front or base:
                # baseline and front first: they get the nearest free spots
                labels.append((0 if base else 1 if i in front else 2, x, y, r["label"]))
        to_label.append((ax, [(x, y, lab) for _, x, y, lab in sorted(labels, key=lambda t: t[0])], markers))
        ax.set_xlabel(f"{name} {stat} (ms)" + (" — bars: interval of the mean (within each run)"
                                                if stat == "mean" else ""))
        ax.set_ylabel(f"{label} [{unit}]")
        note = _random_note(panel.rows, panel.metric)
        ax.set_title(wrap_title(panel.title + (f"\n{panel.platform}" if several_platforms else "")
                                + (f"\n{note}" if note else ""), width / ncols, 10),
                     fontsize=10, color="firebrick" if note else "black")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.15, y=0.12)
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
    suptitle = f"{title}\nquality vs {name} ({long})"
    if any(r.get(f"{short}_comparison") == "across runs" for p in usable for r in p.rows):
        suptitle += ("\nlatency of runs measured at different times: drift between them is not in the bars, "
                     "so no difference here is significant on its own")
    if any_random:
        suptitle += "\n⚠ random-init weights in some runs: their quality numbers are meaningless (latency only)"
    if any_random_scorer:
        suptitle += "\n⚠ random-init scorers in some runs: their CLIP / alignment / comprehensive scores are meaningless"
    fig.suptitle(wrap_title(suptitle, width, 12), fontsize=12,
                 color="firebrick" if any_random or any_random_scorer else "black")
    fig.canvas.draw()  # the layout is final before labels are placed against it
    for ax, pts, markers in to_label:
        place_labels(ax, pts, markers=markers)
    return fig


def latency_points(rows: Sequence[dict[str, Any]], short: str
                   ) -> tuple[str, list[tuple[dict[str, Any], float]], list[tuple[float, float] | None]]:
    """(statistic, [(row, x)], [interval or None]) of one panel: the mean with its interval when every run has one
    (the measurement protocol, ``latency.repeats``), else the p50 without bars — never a p50→p90 whisker drawn where
    an interval belongs."""
    with_ci = [r for r in rows if r.get(f"{short}_mean") is not None and r.get(f"{short}_ci_lo") is not None]
    timed = [r for r in rows if r.get(f"{short}_p50") is not None]
    if timed and len(with_ci) == len(timed):
        return "mean", [(r, r[f"{short}_mean"]) for r in with_ci], [(r[f"{short}_ci_lo"], r[f"{short}_ci_hi"])
                                                                    for r in with_ci]
    return "p50", [(r, r[f"{short}_p50"]) for r in timed], [None] * len(timed)


def save(fig: Any, out: Path) -> Path:
    """``out`` (PNG, 150 dpi) and the same figure as SVG beside it (vector, for papers)."""
    fig.savefig(out, dpi=150)
    fig.savefig(out.with_suffix(".svg"))
    _pyplot().close(fig)
    return out


def plot_quality_vs_latency(all_panels: Sequence[Any], short: str, out: Path, *, title: str) -> Path | None:
    """One figure, one subplot per panel: quality against ``short`` latency (mean ± interval, or p50); + SVG."""
    fig = quality_figure(all_panels, short, title=title)
    if fig is None:
        return None
    return save(fig, out)


def keep_rate_runs(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs the per-source keep plot shows: those whose images came from at least two sources."""
    return [r for r in rows if len(r["vz_by_source"]) >= 2]


def keep_rate_figure(rows: Sequence[dict[str, Any]], *, title: str):
    """The figure of :func:`plot_keep_rate_by_source` (not saved), or None when no run mixed sources."""
    runs = keep_rate_runs(rows)
    if not runs:
        return None
    plt = _pyplot()
    sources = sorted({s for r in runs for s in r["vz_by_source"]})
    width = 0.8 / len(sources)
    fig_w = max(7.0, 0.9 * len(runs) * len(sources) / 2 + 2)
    fig, ax = plt.subplots(figsize=(fig_w, 5.0), layout="constrained")
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
    ax.set_title(wrap_title(f"VisionZip keep rate per image source\n{title}", fig_w, 10), fontsize=10)
    return fig


def plot_keep_rate_by_source(rows: Sequence[dict[str, Any]], out: Path, *, title: str) -> Path | None:
    """Grouped bars: achieved keep rate per image source for every VisionZip run that mixed sources."""
    fig = keep_rate_figure(rows, title=title)
    if fig is None:
        return None
    return save(fig, out)


METHOD_STYLE = {"visionzip": ("tab:blue", "o"), "random": ("tab:gray", "x"), "pool": ("tab:cyan", "s"),
                "first": ("tab:olive", "v"), "sere": ("tab:orange", "o"), "random re-route": ("tab:gray", "x"),
                "top_p": ("tab:green", "D")}


def _budget_points(group: Sequence[dict[str, Any]], metric: str) -> tuple[str, dict[str, list[tuple]]]:
    """(x-axis name, {method: [(x, Δ, lo, hi, label)]}) of one setup: VisionZip and its baselines against the keep
    rate, SERE and the routing baselines against the expert union per layer and step (where top-p lands); Δ the
    quality change against the baseline, ``lo``/``hi`` its paired interval (None without one), on the metric's
    display scale."""
    scale = QUALITY[metric][2]
    routing = any(r["family"] in ("sere", "routing-baseline") for r in group)
    series: dict[str, list[tuple]] = {}
    for r in group:
        if r.get(metric) is None:
            continue
        if routing:
            if r["family"] == "sere":
                name, x = "sere", r.get("sere_experts_after")
            elif r["family"] == "routing-baseline":
                name = "random re-route" if r.get("moe_routing") == "random_p" else "top_p"
                x = r.get("moe_union_after")
            else:
                continue
        else:
            if r["family"] == "visionzip":
                name = "visionzip"
            elif r["family"] == "vz-baseline":
                name = str(r.get("vz_method"))
            else:
                continue
            x = r["vz_keep"]
        if x is None or r.get(f"{metric}_delta") is None:
            continue
        y = r[f"{metric}_delta"] * scale
        ci = r.get(f"{metric}_delta_ci")
        lo, hi = (ci[0] * scale, ci[1] * scale) if ci else (None, None)
        series.setdefault(name, []).append((x, y, lo, hi, r["label"]))
    return ("experts per layer per decode step (union after routing)" if routing else "visual tokens kept (keep)",
            {k: sorted(v) for k, v in series.items()})


def frontier_figure(rows: Sequence[dict[str, Any]], *, title: str):
    """Quality change against budget, one subplot per (setup, metric) that has a technique and a trivial baseline:
    every method a line, the trivial baselines beside the technique on the same axes (shifted a little apart so
    their bars stay readable), the baseline the dashed zero, the paired interval over samples as error bars. None
    when no setup has both."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    panels_ = []
    for group in groups.values():
        metric = next(iter(group[0].get("quality_metrics") or ()), None)
        families = {r["family"] for r in group}
        if metric and families & {"visionzip", "sere"} and families & {"vz-baseline", "routing-baseline"}:
            for part in ([r for r in group if r["family"] in ("baseline", "visionzip", "vz-baseline")],
                         [r for r in group if r["family"] in ("baseline", "sere", "routing-baseline")]):
                if len({r["family"] for r in part} - {"baseline"}) >= 2:
                    panels_.append((part, metric))
    if not panels_:
        return None
    plt = _pyplot()
    ncols = min(2, len(panels_))
    nrows = math.ceil(len(panels_) / ncols)
    width = 7.2 * ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 5.0 * nrows), squeeze=False, layout="constrained")
    for ax, (group, metric) in zip(axes.flat, panels_):
        label, unit, scale, _ = QUALITY[metric]
        xname, series = _budget_points(group, metric)
        xs_all = [p[0] for pts in series.values() for p in pts]
        step = 0.012 * ((max(xs_all) - min(xs_all)) or 1.0)  # methods side by side at one budget, bars apart
        for k, (name, pts) in enumerate(series.items()):
            color, marker = METHOD_STYLE.get(name, ("black", "o"))
            shift = (k - (len(series) - 1) / 2) * step
            pts = [(x + shift, *rest) for x, *rest in pts]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker=marker, color=color, lw=1.2, ms=7, label=name)
            for x, y, lo, hi, _ in pts:
                if lo is not None:
                    ax.errorbar([x], [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="none", ecolor=color,
                                capsize=3, alpha=0.7)
        base = [r[metric] * scale for r in group if r["family"] == "baseline" and r.get(metric) is not None]
        ax.axhline(0.0, color="black", ls="--", lw=1,
                   label="baseline" + (f" ({sum(base) / len(base):.3g})" if base else ""))
        ax.set_xlabel(xname)
        ax.set_ylabel(f"Δ {label} vs baseline [{unit}]")
        ax.set_title(wrap_title(f"{label} · {group[0]['dataset']}"
                                + (f" ({group[0]['dataset_variant']})" if group[0]["dataset_variant"] else ""),
                                width / ncols, 10), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels_):]:
        ax.set_visible(False)
    fig.suptitle(wrap_title(f"{title}\nquality at equal budget: each technique beside its trivial baselines "
                            "(bars: paired interval against the baseline)", width, 12), fontsize=12)
    return fig


def plot_frontier(rows: Sequence[dict[str, Any]], out: Path, *, title: str) -> Path | None:
    """``frontier.png`` (+ SVG): :func:`frontier_figure`; None when nothing to draw."""
    fig = frontier_figure(rows, title=title)
    return None if fig is None else save(fig, out)

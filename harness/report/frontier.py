"""The frontier table (issue 31 item 4): every technique against the baseline *and* against each trivial baseline at
the same budget, with a verdict a reader can quote.

Why: a speed-up or a quality retention means little until it is set against what a trivial method gets with the
same budget (pruning studies find random and pooled tokens match many published methods). The runs table answers
"how far from the baseline"; this one answers "better than doing the obvious thing?".

Matching (within one setup: model, engine, device, dtype, batch size, dataset selection, generation length):

* VisionZip (``visionzip.method=attention``) against ``random`` / ``pool`` / ``first`` at the same
  ``visionzip.keep`` and scope — the baselines keep the same number of tokens by construction;
* SERE at K against ``moe.routing=random_p`` with ``moe.k_primary`` = K — the same primary union per step;
* ``moe.routing=top_p`` is not matched to any budget: it is listed apart, where it lands.

Each cell says what it rests on: quality deltas are paired over the samples both runs scored
(:mod:`harness.metrics.paired`, bootstrap interval, ``n.s.`` when it holds 0); a speed-up against a trivial
baseline is paired when the technique's run timed it in the same process (``latency.paired_with``:
``summary.json`` ``comparisons``), else ``across runs`` and never significant. The verdict
"beats <baseline> at equal budget" is ``yes`` when the paired quality interval is above 0, ``no`` when below, and
``n.s.`` otherwise (quality only: speed is equal by construction of the budget, up to the technique's own cost,
which the speed-up column shows). Reads result files only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.metrics.paired import read_samples, stratified_paired_metrics
from harness.report.deltas import paired_on
from harness.report.rows import QUALITY

log = logging.getLogger("harness.report")

TECHNIQUES = ("visionzip", "sere")  # the families a trivial baseline is matched to


def budget(row: Mapping[str, Any]) -> str:
    """The budget a row spends, as the table shows it: ``keep 0.75``, ``K=1``, ``p=0.25``."""
    parts = []
    if row.get("vz_method"):
        parts.append(f"keep {row['vz_keep']:g}" + (" ·img" if row.get("vz_scope") == "image" else ""))
    if row.get("sere_k") is not None:
        parts.append(f"K={row['sere_k']}")
    if row.get("moe_routing") == "random_p":
        parts.append(f"K={row.get('moe_k_primary')}")
    if row.get("moe_routing") == "top_p":
        parts.append(f"p={row.get('moe_p'):g}" if row.get("moe_p") is not None else "p=?")
    return " + ".join(parts) or "–"


def trivial_matches(row: Mapping[str, Any], group: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(name, trivial run)`` for every trivial baseline of ``row``'s technique at ``row``'s budget in ``group``."""
    out = []
    if row["family"] == "visionzip":
        for r in group:
            if r["family"] == "vz-baseline" and r["vz_keep"] == row["vz_keep"] and r["vz_scope"] == row["vz_scope"]:
                out.append((str(r["vz_method"]), r))
    elif row["family"] == "sere":
        for r in group:
            if r["family"] == "routing-baseline" and r.get("moe_routing") == "random_p" \
                    and r.get("moe_k_primary") == row["sere_k"]:
                out.append(("random re-route", r))
    return sorted(out, key=lambda x: x[0])


def quality_against(row: Mapping[str, Any], other: Mapping[str, Any], metric: str) -> dict[str, Any] | None:
    """The paired quality delta ``row − other`` on ``metric`` over the samples both scored (None without both
    ``samples.jsonl`` files or shared samples)."""
    a, b = Path(row.get("_samples") or ""), Path(other.get("_samples") or "")
    if not a.is_file() or not b.is_file():
        return None
    try:
        records_a, records_b = read_samples(a), read_samples(b)
        if metric == "opencompass_average":  # a macro average over datasets: items resampled within each dataset
            res = stratified_paired_metrics(records_a, records_b, "correct", scale=100.0)
            res = {**res, "metrics": {metric: {k: res.get(k) for k in ("n", "delta", "low", "high", "confidence")}}}
        else:
            res = paired_on(records_a, records_b, [metric])
    except Exception as e:  # noqa: BLE001 - a cell without an interval, never a report without a table
        log.warning("%s vs %s: no paired quality interval (%s: %s)", row["run_dir"], other["run_dir"],
                    type(e).__name__, e)
        return None
    d = res["metrics"].get(metric) or {}
    if d.get("delta") is None or not d.get("n"):
        return None
    return {**d, "invalid_a": res["invalid_a"], "invalid_b": res["invalid_b"]}


def speed_against(row: Mapping[str, Any], other: Mapping[str, Any], name: str, short: str) -> dict[str, Any]:
    """``other``'s latency over ``row``'s (> 1: the technique is faster): paired when ``row`` timed ``name`` in its
    own process (``comparisons`` ``against`` starting with the baseline's method), else the runs' p50s."""
    for c in row.get("_comparisons_all") or []:
        if c.get("metric") == f"{short}_ms" and c.get("kind") == "ratio" \
                and str(c.get("against", "")).split(" ")[0] == name and isinstance(c.get("ci"), list):
            lo, hi = c["ci"]
            return {"speedup": c["estimate"], "ci": (lo, hi), "kind": "paired", "significant": not lo <= 1.0 <= hi}
    a, b = row.get(f"{short}_p50"), other.get(f"{short}_p50")
    return {"speedup": b / a if a and b else None, "ci": None, "kind": "across runs", "significant": None}


def verdict(q: Mapping[str, Any] | None) -> str:
    """``yes`` / ``no`` / ``n.s.`` from a paired quality delta (``n/a`` without one)."""
    if q is None or q.get("low") is None:
        return "n/a"
    if q["low"] > 0:
        return "yes"
    if q["high"] < 0:
        return "no"
    return "n.s."


def frontier_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (technique run, trivial baseline at its budget), and one per technique run without any, for
    every setup with a baseline; each with its quality metric, the deltas, speed-ups and the verdict."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    out = []
    for group in groups.values():
        if not any(r["family"] == "baseline" for r in group):
            continue
        for r in group:
            if r["family"] not in TECHNIQUES and not (r["family"] == "routing-baseline"
                                                      and r.get("moe_routing") == "top_p"):
                continue
            metric = next(iter(r.get("quality_metrics") or ()), None)
            if metric is None:
                continue
            base = {"run": r, "metric": metric, "budget": budget(r), "matched": r["family"] in TECHNIQUES,
                    "quality_vs_baseline": {"delta": r.get(f"{metric}_delta"), "ci": r.get(f"{metric}_delta_ci"),
                                            "significant": r.get(f"{metric}_delta_significant")},
                    "ttft_vs_baseline": {"speedup": r.get("ttft_speedup"), "ci": r.get("ttft_speedup_ci"),
                                         "kind": r.get("ttft_comparison"), "significant": r.get("ttft_significant")}}
            matches = trivial_matches(r, group) if base["matched"] else []
            if not matches:
                out.append({**base, "trivial": None})
            for name, t in matches:
                q = quality_against(r, t, metric)
                out.append({**base, "trivial": name, "trivial_run": t, "quality_vs_trivial": q,
                            "ttft_vs_trivial": speed_against(r, t, name, "ttft"), "verdict": verdict(q)})
    return out


def _signed(x: Any, spec: str = "{:+.3f}") -> str:
    return "n/a" if x is None else spec.format(x)


def _quality_cell(q: Mapping[str, Any] | None, scale: float, spec: str) -> str:
    if not q or q.get("delta") is None:
        return "n/a"
    signed = spec.replace("{:", "{:+")
    text = signed.format(q["delta"] * scale)
    ci = q.get("ci") or ((q["low"], q["high"]) if q.get("low") is not None else None)
    if ci and ci[0] is not None:
        text += f" [{signed.format(ci[0] * scale)}, {signed.format(ci[1] * scale)}]"
        if ci[0] <= 0 <= ci[1]:
            text += " n.s."
    return text


def _speed_cell(c: Mapping[str, Any] | None) -> str:
    if not c or c.get("speedup") is None:
        return "n/a"
    text = f"{c['speedup']:.2f}×"
    if c.get("ci"):
        text += f" [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]" + (" n.s." if c.get("significant") is False else "")
    elif c.get("kind") == "across runs":
        text += " across runs"
    return text


def frontier_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """``frontier.md``: the table per setup and metric, the unmatched runs (top-p) apart, and how to read it."""
    entries = frontier_rows(rows)
    lines = ["# Frontier: each technique against the baseline and its trivial baselines at equal budget", ""]
    if not any(r["family"] in ("vz-baseline", "routing-baseline") for r in rows):
        return "\n".join(lines + ["No trivial baseline run (`visionzip.method=random|pool|first`, `moe.routing="
                                   "random_p|top_p`) among these runs: `python -m harness -m --config-name "
                                   "baselines_equal_budget` runs them.", ""])
    if not entries:
        return "\n".join(lines + ["No technique run with a baseline of the same setup among these runs.", ""])
    head = ["dataset", "technique", "budget", "metric", "Δ quality vs baseline", "TTFT × vs baseline",
            "trivial baseline", "Δ quality vs it", "TTFT × vs it", "invalid (technique / it)",
            "beats it at equal budget"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in (e for e in entries if e["matched"]):
        r = e["run"]
        _, _, scale, spec = QUALITY[e["metric"]]
        q = e.get("quality_vs_trivial")
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in [
            r["dataset"], r["label"], e["budget"], e["metric"],
            _quality_cell(e["quality_vs_baseline"], scale, spec), _speed_cell(e["ttft_vs_baseline"]),
            e["trivial"] or "– (none at this budget)", _quality_cell(q, scale, spec) if e["trivial"] else "–",
            _speed_cell(e.get("ttft_vs_trivial")) if e["trivial"] else "–",
            f"{q['invalid_a']} / {q['invalid_b']}" if q else "–",
            f"**{e['verdict']}**" if e["trivial"] else "–"]) + " |")
    apart = [e for e in entries if not e["matched"]]
    if apart:
        lines += ["", "Not matched to a budget (reported where they land):", "",
                  "| dataset | run | budget | metric | Δ quality vs baseline | TTFT × vs baseline "
                  "| expert union after |",
                  "|---|---|---|---|---|---|---|"]
        for e in apart:
            r = e["run"]
            _, _, scale, spec = QUALITY[e["metric"]]
            union = r.get("moe_union_after") if r.get("moe_union_after") is not None else r.get("sere_experts_after")
            lines.append(f"| {r['dataset']} | {r['label']} | {e['budget']} | {e['metric']} | "
                         f"{_quality_cell(e['quality_vs_baseline'], scale, spec)} | "
                         f"{_speed_cell(e['ttft_vs_baseline'])} | {'n/a' if union is None else f'{union:.2f}'} |")
    lines += ["", "Δ quality: paired over the samples both runs scored (bootstrap 95 % interval; **n.s.** when it "
              "holds 0; unparsable answers score 0 and are counted in *invalid*). TTFT ×: the other run's latency "
              "over the technique's (> 1: the technique is faster); with an interval when timed in one process "
              "(`latency.paired`, `latency.paired_with`), else `across runs` (drift between runs unseen: never "
              "significant). *Beats it at equal budget*: **yes** when the paired quality interval against the "
              "trivial baseline is above 0, **no** when below, **n.s.** otherwise.", ""]
    return "\n".join(lines)

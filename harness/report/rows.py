"""The rows of a report: ``summary.json`` files found and read back into flat rows, the quality metrics and
latency axes per benchmark, each run's family and label, the setup it is compared within and the report's order
(``shared/notes/layout.md``: ``report/rows``). What the report's writers (``report`` — CSV and the entry point —,
``report_markdown``, ``report_plots``, ``report_wandb``) share lives below them, so none of them imports another to
get it: here, in the baseline comparisons (harness/report/deltas.py) and in the panels with their Pareto fronts
(harness/report/panels.py), both split from this module; ``harness.report.build`` re-exports every name of the
three.

Reads result files only: the standard library, the results schema (harness/results/schema.py), the OpenCompass
rows (harness/report/opencompass_rows.py), :func:`harness.report.values.finite` and the baseline comparisons are
all it imports — the last because :func:`load_row` reads a run's own ``comparisons`` and :func:`load_rows` hands
back every row with its deltas, so deltas sits below rows and imports nothing of it; panels sits above both, and
rows never imports it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.report.deltas import _add_baseline_deltas, within_run_comparisons
from harness.report.opencompass_rows import opencompass_columns
from harness.report.values import finite as _num
from harness.results.schema import MalformedSummary, read_summary  # noqa: F401 (MalformedSummary: re-exported)

log = logging.getLogger("harness.report")  # the report's logger


# Quality metrics, per benchmark: (summary key, display name, unit, scale for display, format); which of them a
# set of runs is judged on: harness/report/deltas.py ``quality_metrics_for`` (RAG-IGBench's in ``RAG_METRICS`` order)
QUALITY = {
    "comprehensive": ("RAG-IGBench comprehensive", "score (0-1)", 1.0, "{:.3f}"),
    "rouge1": ("RAG-IGBench Rouge-1", "F1 (0-1)", 1.0, "{:.3f}"),
    "edit_score": ("RAG-IGBench edit score", "score (0-1)", 1.0, "{:.3f}"),
    "kendall": ("RAG-IGBench Kendall", "score (0-1)", 1.0, "{:.3f}"),
    "clip_score": ("RAG-IGBench CLIP score", "score", 1.0, "{:.3f}"),
    "alignment": ("RAG-IGBench alignment", "score (0-1)", 1.0, "{:.3f}"),
    "ocrbench_score": ("OCRBench score", "score (0-1000)", 1.0, "{:.0f}"),
    "mcq_accuracy": ("CCBench accuracy (circular)", "accuracy (%)", 100.0, "{:.1f}"),
    "opencompass_average": ("OpenCompass average", "score (0-100)", 1.0, "{:.2f}"),  # python -m harness.opencompass
}
# A run's family names the techniques it has on, in this order (``visionzip+top-k+sere``); top-K truncation
# (``moe.top_k``) is the baseline SERE is judged against, so it must never be mistaken for the baseline itself.
FAMILY_ORDER = ("baseline", "visionzip", "sere", "visionzip+sere", "top-k", "top-k+sere", "visionzip+top-k",
                "visionzip+top-k+sere", "vz-baseline", "vz-baseline+sere", "vz-baseline+top-k", "vz-baseline+top-k+sere",
                "routing-baseline", "visionzip+routing-baseline", "vz-baseline+routing-baseline")  # issue 31's baselines
FAMILY_COLOR = {"baseline": "black", "visionzip": "tab:blue", "sere": "tab:orange", "visionzip+sere": "tab:purple",
                "top-k": "tab:red", "top-k+sere": "tab:brown", "visionzip+top-k": "tab:pink",
                "visionzip+top-k+sere": "tab:olive", "vz-baseline": "tab:cyan", "vz-baseline+sere": "tab:gray",
                "vz-baseline+top-k": "tab:gray", "vz-baseline+top-k+sere": "tab:gray", "routing-baseline": "tab:green",
                "visionzip+routing-baseline": "tab:gray", "vz-baseline+routing-baseline": "tab:gray"}
#: ``load.server_phases`` means a vllm serve run records (ms), in the report's order
PHASE_KEYS = ("client_ttft", "front_end", "queue", "prefill", "decode")
LATENCY_AXES = (("ttft", "TTFT", "time to first token"), ("tpot", "TPOT", "time per output token"))


# --------------------------------------------------------------------------------------------- loading


def _get(d: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return default
        d = d[key]
    return d


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
    moe = cfg.get("moe") or {}
    keep = _num(vz.get("keep"))
    vz_on = keep is not None and keep < 1.0
    sere_on = sere.get("k") is not None
    topk_on = moe.get("top_k") is not None
    method = str(vz.get("method") or "attention")  # issue 31: a trivial baseline is its own family
    routing = moe.get("routing")
    family = "+".join(name for name, on in (("visionzip" if method == "attention" else "vz-baseline", vz_on),
                                            ("top-k", topk_on), ("sere", sere_on), ("routing-baseline", bool(routing)))
                      if on) or "baseline"
    parts = []
    if vz_on:
        parts.append(("" if method == "attention" else f"{method} ") + f"keep {keep:g}" + ("·img" if vz.get("scope") == "image" else "")
                     + (f" ctx{_num(vz.get('contextual')):g}" if _num(vz.get("contextual")) else ""))
    if topk_on:
        parts.append(f"top-{moe['top_k']}" + ("·all" if moe.get("scope") == "all" else ""))
    if routing:
        parts.append(f"{routing} K{moe.get('k_primary')}" if routing == "random_p" else f"{routing} p{moe.get('p')}")
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
        "moe_top_k": moe.get("top_k") if topk_on else None,
        "moe_scope": moe.get("scope") if topk_on else None,
        # the frontier table (harness/report/frontier.py) matches a technique with its trivial baselines on these
        "vz_method": method if vz_on else None,
        "moe_routing": routing or None,
        "moe_k_primary": moe.get("k_primary") if routing else None,
        "moe_p": _num(moe.get("p")) if routing == "top_p" else None,
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


# the quality metrics a random-init scorer makes meaningless (comprehensive is their mean with the others)
RANDOM_SCORER_METRICS = {"clip": ("clip_score", "comprehensive"), "embed": ("alignment", "comprehensive")}


def random_scorers(scoring: Any) -> list[str]:
    """Which scorer encoders of a run had random weights (``summary.json`` ``run.scoring``: ``clip_weights``,
    ``embed_weights``), as random model weights are flagged."""
    if not isinstance(scoring, Mapping):
        return []
    return [k for k in ("clip", "embed") if scoring.get(f"{k}_weights") == "random-init"]


def load_row(path: Path, root: Path | None = None) -> dict[str, Any]:
    """One flat row from one ``summary.json`` (:class:`MalformedSummary` when it cannot be one), read through the
    results schema (harness/results/schema.py: checked, older versions upgraded)."""
    s = read_summary(path)
    run, cfg, metrics, lat = (s.get(k) or {} for k in ("run", "config", "metrics", "latency"))
    run_dir = path.parent
    sweep, job = _sweep_of(s, run_dir)
    vz = s.get("visionzip") or {}
    sere = s.get("sere") or {}
    model = run.get("model") or {}
    weights = run.get("weights") or model.get("weights") or _get(cfg, "model", "weights")
    # scorers with random weights, counted only where the run has a metric they feed (OCRBench / CCBench: none)
    scorers = [k for k in random_scorers(run.get("scoring"))
               if any(_num(metrics.get(m)) is not None for m in RANDOM_SCORER_METRICS[k])]
    row: dict[str, Any] = {
        "run_dir": str(run_dir.relative_to(root)) if root and run_dir.is_relative_to(root) else str(run_dir),
        "sweep": sweep,
        "job": job,
        "dataset": _get(cfg, "dataset", "name") or "?",
        "model": model.get("name") or _get(cfg, "model", "name") or "?",
        "weights": weights or "?",
        "random_init": weights == "random-init",
        "random_scorers": scorers,  # "clip" / "embed": scorer encoders with random weights (run.scoring)
        "random_scorer_metrics": sorted({m for k in scorers for m in RANDOM_SCORER_METRICS[k]}),
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
        "schema_version": run.get("schema_version"),
        **_technique(s),
    }
    for key in QUALITY:
        row[key] = _num(metrics.get(key))
    row["opencompass_average"] = _num(_get(metrics, "opencompass", "average"))  # docs/opencompass.md
    row.update(opencompass_columns(metrics))  # per dataset (harness/report/opencompass_rows.py)
    if "opencompass" in metrics:  # the Hydra dataset group is not what an OpenCompass run evaluated
        row["dataset"] = f"opencompass:{_get(run, 'opencompass', 'suite', default='?')}"
    for short, _, _ in LATENCY_AXES:
        for p in ("p50", "p90", "p99", "mean"):
            row[f"{short}_{p}"] = _num(_get(lat, f"{short}_ms", p))
        row[f"{short}_n"] = _get(lat, f"{short}_ms", "n")
    row.update(latency_protocol_columns(lat))
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
    row["moe_union_after"] = _num(_get(s, "moe", "expert_union_after"))  # routing baselines: where they land
    phases = _get(s, "load", "server_phases") or {}  # vllm serve runs: where the TTFT went (engines/vllm/server_phases)
    for key in PHASE_KEYS:
        row[f"phase_{key}"] = _num(phases.get(f"{key}_ms")) if isinstance(phases, Mapping) else None
    row["comparisons"] = within_run_comparisons(s.get("comparisons"))
    row["_comparisons_all"] = [c for c in s.get("comparisons") or [] if isinstance(c, Mapping)]  # vs trivial ones too
    row["_samples"] = str(run_dir / "samples.jsonl")  # for paired quality intervals against the baseline
    row["platform"] = " · ".join(str(x) for x in (row["model"], row["engine"], row["device"], row["dtype"],
                                                  f"bs{row['batch_size']}") if x is not None)
    # what else must match for two runs to be compared: the dataset selection and the generation length
    row["_setup"] = {**{k: v for k, v in (cfg.get("dataset") or {}).items() if k != "name"},
                     "max_new_tokens": row["max_new_tokens"]}
    row["dataset_variant"] = ""
    row["setup"] = ""
    return row


def latency_protocol_columns(lat: Mapping[str, Any]) -> dict[str, Any]:
    """The measurement protocol's columns (harness/latency/): per TTFT/TPOT the interval of the mean and the
    pass-to-pass CV; repeats, noisy metrics, excluded batches, concurrent measurement. Runs written before the
    protocol have none: their significance is unknown (n/a), never assumed."""
    out: dict[str, Any] = {}
    for short, _, _ in LATENCY_AXES:
        ci = _get(lat, f"{short}_ms", "ci")
        ok = isinstance(ci, Sequence) and len(ci) == 2 and all(_num(x) is not None for x in ci)
        out[f"{short}_ci_lo"], out[f"{short}_ci_hi"] = (_num(ci[0]), _num(ci[1])) if ok else (None, None)
        out[f"{short}_cv"] = _num(_get(lat, f"{short}_ms", "cv"))
    protocol = lat.get("protocol") if isinstance(lat.get("protocol"), Mapping) else {}
    noisy = lat.get("noisy") if isinstance(lat.get("noisy"), list) else []
    out["latency_repeats"] = int(_num(lat.get("repeats")) or 1)
    out["latency_noisy"] = ",".join(str(m).removesuffix("_ms") for m in noisy)
    out["latency_excluded_batches"] = int(_num(protocol.get("batches_excluded")) or 0)
    out["latency_concurrent"] = bool(_get(protocol, "device", "concurrent"))
    return out


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
            r["vz_scope"] or "", r["moe_top_k"] or 0, r["sere_k"] or 0, r["sere_rho"] or 0.0, r["sere_protect"] or 0, r["run_dir"])


def load_rows(paths: Sequence[str | os.PathLike], skipped: list[tuple[Path, str]] | None = None,
              metrics: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Rows of every readable ``summary.json`` below ``paths``; a malformed one is skipped with a warning naming
    it (and appended to ``skipped`` as (path, reason)), never the whole report."""
    summaries = find_summaries(paths)
    if not summaries:
        raise FileNotFoundError(f"no summary.json below {', '.join(map(str, paths))}")
    roots = [Path(p).resolve() for p in paths]
    root = Path(os.path.commonpath(roots)) if roots else None
    if root and root.is_file():
        root = root.parent
    rows = []
    for p in summaries:
        try:
            rows.append(load_row(p, root))
        except Exception as e:  # noqa: BLE001 - one bad file costs its row, never the report
            reason = str(e) if isinstance(e, MalformedSummary) else f"{type(e).__name__}: {e}"
            log.warning("skipped %s: %s", p, reason)
            if skipped is not None:
                skipped.append((p, reason))
    if not rows:
        raise ValueError(f"no readable summary.json below {', '.join(map(str, paths))} "
                         f"({len(summaries)} malformed)")
    _label_setups(rows)
    rows.sort(key=_sort_key)
    _add_baseline_deltas(rows, metrics)
    return rows


# --------------------------------------------------------------------------------------------- plots


def _fmt(x: Any, spec: str = "{:.1f}") -> str:
    return "n/a" if x is None else spec.format(x)

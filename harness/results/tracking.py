"""Weights & Biases logging of a run: opened at its start (config, live progress per batch), finished with the
summary metrics, a samples table and the result files.

``wandb.mode`` is ``offline`` by default (no network; ``wandb sync results/.../wandb/offline-run-*`` uploads
later) and ``disabled`` in tests. wandb is imported only when a run logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.results.schema import TECHNIQUE_BLOCKS, Summary

# the samples table: what was asked, what was expected, what came back, how long it took; the scorer's values
# follow as ``score/<name>`` columns (a scorer's own ``error`` is ``score/error``, never a second ``error``)
SAMPLE_COLUMNS = ("uid", "prompt", "reference", "answer", "parsed_answer", "error", "prompt_tokens",
                  "visual_tokens", "output_tokens", "ttft_ms", "tpot_ms", "cached", "prompt_sha256")
_USER_DATA_DIR = os.environ.get("WANDB_DATA_DIR")  # set by the user: theirs; else each run stages in its directory


def _flatten(prefix: str, data: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    for key, value in data.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(name, value, out)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
    return out


def summary_values(summary: Summary) -> dict[str, Any]:
    """The W&B run summary of a ``summary.json`` (harness/results/schema.py): every number of ``metrics``,
    ``latency`` (each interval as ``ci_lo`` / ``ci_hi``) and the technique blocks, the ``run`` metadata
    (``run/*``: versions, device, dtype, weights, scorers, schema version), and the ``warnings`` (one text, one
    line each, and ``warnings_count``)."""
    out: dict[str, Any] = {}
    for key in ("metrics", "latency", *TECHNIQUE_BLOCKS, "run"):
        block = summary.get(key)  # type: ignore[misc]
        if isinstance(block, Mapping):
            _flatten(key, _with_intervals(block), out)
    for c in summary.get("comparisons") or []:  # within-run paired comparisons (schema Comparison)
        if isinstance(c, Mapping) and c.get("metric"):
            _flatten(f"comparisons/{c.get('against', 'baseline')}/{c['metric']}",
                     _with_intervals({k: v for k, v in c.items() if k not in {"metric", "against"}}), out)
    warnings = [str(w) for w in summary.get("warnings") or []]
    out["warnings"] = "\n".join(warnings)
    out["warnings_count"] = len(warnings)
    return out


def _with_intervals(block: Mapping[str, Any]) -> dict[str, Any]:
    """``ci: [lo, hi]`` → ``ci_lo`` / ``ci_hi`` at every depth (W&B summaries plot numbers, not lists)."""
    out: dict[str, Any] = {}
    for key, value in block.items():
        if isinstance(value, Mapping):
            out[key] = _with_intervals(value)
        elif key == "ci" and isinstance(value, (list, tuple)) and len(value) == 2:
            out["ci_lo"], out["ci_hi"] = value
        else:
            out[key] = value
    return out


def sweep_info() -> dict[str, Any] | None:
    """The Hydra multirun this job belongs to, for ``summary.json`` ``run.sweep`` and the W&B group; None for a
    single run. ``id`` is the sweep directory below ``multirun/`` (``visionzip_keep/2026-05-01_12-00-00``),
    the same in every job of the sweep, whichever launcher (basic, submitit local or Slurm) ran it."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # not under @hydra.main (tests calling run_experiment)
        return None
    if hc.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(str(hc.sweep.dir))
    parts = sweep_dir.parts
    rel = parts[len(parts) - 1 - parts[::-1].index("multirun") + 1:] if "multirun" in parts else parts[-2:]
    return {"id": "/".join(rel), "dir": str(sweep_dir), "name": hc.job.config_name, "job_num": hc.job.num,
            "overrides": list(hc.overrides.task)}


def technique_label(config: dict[str, Any]) -> str:
    """baseline, or the techniques on in the order visionzip, top-k, sere (``visionzip+top-k+sere``), from the
    settings (the W&B job type of sweep runs; the report's run family)."""
    on = (("visionzip", float((config.get("visionzip") or {}).get("keep", 1.0)) < 1.0),
          ("top-k", (config.get("moe") or {}).get("top_k") is not None),
          ("sere", (config.get("sere") or {}).get("k") is not None))
    return "+".join(name for name, is_on in on if is_on) or "baseline"


def technique_tags(config: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """W&B tags: dataset, engine, weights, technique settings (``keep=0.6``, ``scope=image``, ``sere.k=2``, …),
    and ``latency-partial`` when some generations were replayed from the cache."""
    vz, sere = config.get("visionzip") or {}, config.get("sere") or {}
    tags = [f"dataset={(config.get('dataset') or {}).get('name')}", f"engine={summary['run'].get('engine')}",
            f"weights={summary['run'].get('weights')}", technique_label(config)]
    if float(vz.get("keep", 1.0)) < 1.0:
        tags += [f"keep={float(vz['keep']):g}", f"scope={vz.get('scope')}"]
        if vz.get("contextual"):
            tags.append(f"contextual={float(vz['contextual']):g}")
    moe = config.get("moe") or {}
    if moe.get("top_k") is not None:
        tags += [f"moe.top_k={moe['top_k']}", f"moe.scope={moe.get('scope')}"]
    if sere.get("k") is not None:
        tags += [f"sere.k={sere['k']}", f"sere.rho={float(sere.get('rho') or 0):g}",
                 f"sere.protect={int(sere.get('protect') or 0)}"]
    if (summary.get("latency") or {}).get("partial"):
        tags.append("latency-partial")
    return [t[:64] for t in tags]  # W&B's tag length limit


def run_name(config: dict[str, Any], run_dir: Path, sweep: dict[str, Any] | None) -> str:
    """``visionzip_keep#3 rag_igbench keep=0.6 scope=image`` in a sweep (job directories are only numbers);
    the run directory's name otherwise."""
    if not sweep:
        return run_dir.name
    settings = [t for t in technique_tags(config, {"run": {}}) if t.split("=")[0] in
                {"keep", "scope", "contextual", "moe.top_k", "sere.k", "sere.rho", "sere.protect"}]
    dataset = (config.get("dataset") or {}).get("name")
    return " ".join([f"{sweep['name']}#{sweep['job_num']}", str(dataset), *settings] or [run_dir.name])


class LiveRun:
    """A W&B run opened when the run starts and logged as it goes (``progress/*`` per batch), so a crashed or
    killed run still leaves its config and progress in W&B; :meth:`finish` adds the final summary, the samples
    table and the result files. Every attempt of one run directory with one configuration uses the same W&B run id
    (``resume="allow"``; :func:`config_run_id`: a changed configuration gets another), so an online rerun continues
    the same W&B run; offline, each attempt writes its own
    ``wandb/offline-run-*-<id>`` directory under that id (sync the last one)."""

    def __init__(self, run: Any):
        self.run = run
        self.step = 0

    def log(self, values: dict[str, Any]) -> None:
        """Live values (e.g. ``progress/samples_done``); never fails the run."""
        try:
            self.run.log(values)
        except Exception:  # noqa: BLE001 - W&B trouble must not cost the measurement
            pass

    def finish(self, config: dict[str, Any], summary: dict[str, Any], records: list[dict[str, Any]],
               run_dir: Path) -> str | None:
        """Log the finished run's summary metrics, samples table, SERE per-layer table and result files, then
        close the W&B run. Returns the W&B run directory."""
        import wandb

        run = self.run
        try:
            tags = technique_tags(config, summary)
            if hasattr(run, "tags"):  # tags known only at the end (latency-partial)
                run.tags = tuple(dict.fromkeys([*(run.tags or ()), *tags]))
            run.summary.update(summary_values(summary))
            score_keys = sorted({k for r in records for k in r.get("scores", {})})
            table = wandb.Table(columns=[*SAMPLE_COLUMNS, "images", *(f"score/{k}" for k in score_keys)])
            for i, r in enumerate(records):
                table.add_data(*[_cell(r.get(c)) for c in SAMPLE_COLUMNS],
                               thumbnails(wandb, r.get("images")) if i < THUMBNAIL_ROWS else None,
                               *[_cell(r.get("scores", {}).get(k)) for k in score_keys])
            run.log({"samples": table})
            per_layer = (summary.get("sere") or {}).get("per_layer")
            if per_layer:  # the per-layer expert union, as a table and a bar chart
                cols = ["layer", "expert_union_before", "expert_union_after", "moved_fraction", "critical_fraction"]
                layers = wandb.Table(columns=cols, data=[[p.get(c) for c in cols] for p in per_layer])
                run.log({"sere/per_layer": layers,
                         "sere/union_after_by_layer": wandb.plot.bar(layers, "layer", "expert_union_after",
                                                                     title="Distinct experts per decode step (SERE)")})
            artifact = wandb.Artifact(name=f"results-{run.id}", type="results")
            for fname in ("summary.json", "samples.jsonl", "config.yaml", "timings.jsonl"):  # timings: latency.*
                if (run_dir / fname).exists():
                    artifact.add_file(str(run_dir / fname))
            run.log_artifact(artifact)
            return run.dir
        finally:
            run.finish()

    def fail(self) -> None:
        """Close the W&B run of a run that raised (marked failed in W&B)."""
        try:
            self.run.finish(exit_code=1)
        except Exception:  # noqa: BLE001
            pass


THUMBNAIL_ROWS, THUMBNAILS_PER_ROW, THUMBNAIL_PX = 200, 4, 128


def thumbnail_strip(paths: Any) -> Any:
    """A sample's first :data:`THUMBNAILS_PER_ROW` image files side by side, each at most :data:`THUMBNAIL_PX`
    pixels a side, as one PIL image; None when it has no readable image file (bytes in the data file, gone)."""
    if not isinstance(paths, list):
        return None
    from PIL import Image

    thumbs = []
    for p in paths[:THUMBNAILS_PER_ROW]:
        try:
            with Image.open(p) as img:
                img = img.convert("RGB")
                img.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                thumbs.append(img)
        except Exception:  # noqa: BLE001 - no thumbnail for this one
            continue
    if not thumbs:
        return None
    strip = Image.new("RGB", (sum(t.width for t in thumbs) + 4 * (len(thumbs) - 1), max(t.height for t in thumbs)),
                      "white")
    x = 0
    for t in thumbs:
        strip.paste(t, (x, 0))
        x += t.width + 4
    return strip


def thumbnails(wandb: Any, paths: Any) -> Any:
    """One W&B table cell: :func:`thumbnail_strip` as a ``wandb.Image`` (None without images)."""
    strip = thumbnail_strip(paths)
    return wandb.Image(strip) if strip is not None else None


def _cell(value: Any) -> Any:
    """A W&B table cell: lists and mappings as JSON text (a column must keep one type)."""
    if isinstance(value, (dict, list, tuple)):
        import json

        return json.dumps(value, ensure_ascii=False, default=str)
    return value


FLUSH_INTERVAL_S = 2.0


def _live_settings(wandb: Any) -> Any:
    """W&B settings of a live run: the run's ``.wandb`` file is flushed every ``FLUSH_INTERVAL_S`` seconds
    (wandb's default, 15 s, left nothing of a run killed in its first seconds). None where this wandb lacks
    the setting."""
    try:
        return wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL_S)
    except Exception:  # noqa: BLE001 - an older wandb (or a test double): its defaults
        return None


def start_run(wandb_cfg: Any, config: dict[str, Any], run_dir: Path, name: str, *, run_id: str | None = None,
              sweep: dict[str, Any] | None = None, summary: dict[str, Any] | None = None) -> LiveRun | None:
    """Open the W&B run of one run (None when ``wandb.mode=disabled``).

    Group: ``wandb.group`` when set, else the sweep id (``summary.json`` ``run.sweep.id``), so every job of a
    sweep lands in one W&B group. Job type: ``wandb.job_type``, or the technique (``technique_label``) when it
    is ``auto`` (the sweep configs set that). Tags: ``wandb.tags`` + :func:`technique_tags` (from ``summary``
    when known, else from the config)."""
    if wandb_cfg.mode == "disabled":
        return None
    _quiet_and_local(run_dir)
    import wandb

    summary = summary or {"run": {"engine": (config.get("engine") or {}).get("name"),
                                  "weights": (config.get("model") or {}).get("weights")}}
    kwargs: dict[str, Any] = {"id": config_run_id(run_id, config), "resume": "allow"} if run_id else {}
    settings = _live_settings(wandb)
    if settings is not None:
        kwargs["settings"] = settings
    run = wandb.init(
        mode=wandb_cfg.mode,
        project=wandb_cfg.project,
        entity=wandb_cfg.entity,
        group=wandb_cfg.group or (sweep or {}).get("id"),
        job_type=technique_label(config) if wandb_cfg.job_type in (None, "auto") else wandb_cfg.job_type,
        tags=[*wandb_cfg.tags, *technique_tags(config, summary)],
        name=run_name(config, run_dir, sweep) if sweep else name,
        dir=str(run_dir),
        config={**config, "sweep": sweep} if sweep else config,
        **kwargs,
    )
    return LiveRun(run)


def config_run_id(run_id: str, config: dict[str, Any]) -> str:
    """The W&B run id of a run directory's attempt: its ``run_state.json`` id + a digest of the configuration
    (W&B settings aside). Every attempt of one experiment continues one W&B run; a rerun of the directory with a
    changed configuration is another experiment and gets another W&B run, never mixed into the first."""
    import hashlib
    import json

    body = json.dumps({k: v for k, v in config.items() if k != "wandb"}, sort_keys=True, default=str)
    return f"{run_id}-{hashlib.sha256(body.encode('utf-8')).hexdigest()[:8]}"


def _quiet_and_local(run_dir: Path) -> None:
    """W&B's own lines go nowhere near the console (``WANDB_SILENT``; its log stays in ``<run_dir>/wandb/``), and
    its artifact staging (default ``~/.local/share/wandb``, outside the run) is ``<run_dir>/wandb/staging``, so a
    copied ``results/`` keeps the offline artifacts. A value the user exported wins."""
    os.environ.setdefault("WANDB_SILENT", "true")
    if _USER_DATA_DIR is None:
        os.environ["WANDB_DATA_DIR"] = str(Path(run_dir) / "wandb" / "staging")


def log_run(wandb_cfg: Any, config: dict[str, Any], summary: dict[str, Any], records: list[dict[str, Any]],
            run_dir: Path, name: str, *, run_id: str | None = None) -> str | None:
    """Log one finished run in one go (a rerun redoing the W&B logging a killed attempt did not complete);
    returns the W&B run directory (None when disabled). Naming as :func:`start_run`."""
    live = start_run(wandb_cfg, config, run_dir, name, run_id=run_id, sweep=summary["run"].get("sweep"),
                     summary=summary)
    return live.finish(config, summary, records, run_dir) if live is not None else None

"""Weights & Biases logging of a finished run: config, summary metrics, a samples table, result files.

``wandb.mode`` is ``offline`` by default (no network; ``wandb sync results/.../wandb/offline-run-*`` uploads
later) and ``disabled`` in tests. wandb is imported only when a run logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SAMPLE_COLUMNS = ("uid", "prompt_tokens", "visual_tokens", "output_tokens", "ttft_ms", "tpot_ms", "answer",
                  "error")


def _flatten(prefix: str, data: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    for key, value in data.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(name, value, out)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
    return out


def log_run(wandb_cfg: Any, config: dict[str, Any], summary: dict[str, Any], records: list[dict[str, Any]],
            run_dir: Path, name: str) -> str | None:
    """Log one finished run; returns the W&B run directory (None when disabled)."""
    if wandb_cfg.mode == "disabled":
        return None
    import wandb

    run = wandb.init(
        mode=wandb_cfg.mode,
        project=wandb_cfg.project,
        entity=wandb_cfg.entity,
        group=wandb_cfg.group,
        job_type=wandb_cfg.job_type,
        tags=list(wandb_cfg.tags),
        name=name,
        dir=str(run_dir),
        config=config,
    )
    try:
        blocks = {k: summary[k] for k in ("metrics", "latency", "visionzip", "sere") if summary.get(k)}
        run.summary.update(_flatten("", blocks, {}))
        score_keys = sorted({k for r in records for k in r.get("scores", {})})
        table = wandb.Table(columns=[*SAMPLE_COLUMNS, *score_keys])
        for r in records:
            table.add_data(*[r.get(c) if c != "answer" else r.get("answer", "") for c in SAMPLE_COLUMNS],
                           *[r.get("scores", {}).get(k) for k in score_keys])
        run.log({"samples": table})
        per_layer = (summary.get("sere") or {}).get("per_layer")
        if per_layer:  # the per-layer expert union, as a table and a bar chart
            cols = ["layer", "expert_union_before", "expert_union_after", "moved_fraction", "critical_fraction"]
            layers = wandb.Table(columns=cols, data=[[p.get(c) for c in cols] for p in per_layer])
            run.log({"sere/per_layer": layers,
                     "sere/union_after_by_layer": wandb.plot.bar(layers, "layer", "expert_union_after",
                                                                 title="Distinct experts per decode step (SERE)")})
        artifact = wandb.Artifact(name=f"results-{run.id}", type="results")
        for fname in ("summary.json", "samples.jsonl", "config.yaml"):
            if (run_dir / fname).exists():
                artifact.add_file(str(run_dir / fname))
        run.log_artifact(artifact)
        return run.dir
    finally:
        run.finish()

"""A run directory reused with another configuration: the earlier run is kept, moved aside, and the console says so.

Why archive rather than refuse or overwrite: a researcher who reruns ``hydra.run.dir=results/exp1`` with
``visionzip.keep=0.7`` after ``0.5`` either meant to replace the experiment or made a slip. Overwriting
(what happened before) loses the first result without a word; refusing makes the intended replacement take a
second command. Moving the earlier run's files to ``<run_dir>/previous/<N>/`` loses nothing, and the warning
names the keys that changed, so a slip is seen at once. A rerun with the *same* configuration is untouched: it
resumes an interrupted attempt or reports the finished one (:mod:`harness.run.state`); so is a sweep resumed
in its own directory. W&B settings are not part of the experiment (as :func:`harness.results.tracking.config_run_id`).

Only the standard library and PyYAML (Hydra's dependency, for ``config.yaml``) are imported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: what an earlier attempt leaves in its run directory (``.hydra/`` is Hydra's, rewritten by every launch)
# the log files (``cli.log``, ``run.log``) stay: Hydra holds ``cli.log`` open, and a log tells every attempt's story
RUN_FILES = ("summary.json", "config.yaml", "samples.jsonl", "run_state.json", "timings.jsonl",
             "paired_timings.jsonl")
RUN_GLOBS = ("samples.jsonl.interrupted-*", "samples.jsonl.old-*")
IGNORED = ("wandb",)  # not the experiment: a changed W&B mode or project is the same run
ARCHIVE = "previous"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf that differs (a key on one side only: ``None`` /
    ``"<absent>"`` on the other), W&B settings aside, sorted by key."""
    a = _flatten({k: v for k, v in old.items() if k not in IGNORED})
    b = _flatten({k: v for k, v in new.items() if k not in IGNORED})
    absent = "<absent>"
    return [(k, a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b))
            if json.dumps(a.get(k, absent), sort_keys=True, default=str)
            != json.dumps(b.get(k, absent), sort_keys=True, default=str)]


def earlier_config(run_dir: Path) -> dict[str, Any] | None:
    """The configuration of the earlier attempt in ``run_dir``: ``summary.json`` ``config``, else its
    ``config.yaml`` (an interrupted attempt); None when the directory holds no earlier run (or an unreadable one)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        if isinstance(summary, Mapping) and isinstance(summary.get("config"), Mapping):
            return dict(summary["config"])
    except (OSError, ValueError):
        pass
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return dict(cfg) if isinstance(cfg, Mapping) else None
    except (OSError, ValueError, ImportError):
        return None
    except Exception:  # noqa: BLE001 - yaml.YAMLError: a torn config.yaml is no earlier run to protect
        return None


def _fmt(v: Any) -> str:
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


def describe_changes(changes: list[tuple[str, Any, Any]], limit: int = 6) -> str:
    """``visionzip.keep 0.5 → 0.7, sere.k null → 2 (+3 more)``."""
    parts = [f"{k} {_fmt(a)} → {_fmt(b)}" for k, a, b in changes[:limit]]
    more = len(changes) - limit
    return ", ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def archive_if_changed(run_dir: Path, config: Mapping[str, Any]) -> Path | None:
    """Move the earlier run of ``run_dir`` to ``previous/<N>/`` when its configuration differs from ``config``
    (call with the run directory's lock held). Returns the archive folder, None when nothing was moved. The
    warning it logs (console and log file) names the changed keys and the folder."""
    run_dir = Path(run_dir)
    old = earlier_config(run_dir)
    if old is None:
        return None
    changes = changed_keys(old, json.loads(json.dumps(dict(config), default=str)))
    if not changes:
        return None
    root = run_dir / ARCHIVE
    n = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0) if root.is_dir() else 1
    dest = root / str(n)
    dest.mkdir(parents=True)
    moved = []
    for path in [run_dir / f for f in RUN_FILES] + [p for g in RUN_GLOBS for p in sorted(run_dir.glob(g))]:
        if path.exists():
            path.rename(dest / path.name)
            moved.append(path.name)
    (dest / "changed.json").write_text(json.dumps(
        {"changed": [{"key": k, "earlier": a, "now": b} for k, a, b in changes], "moved": moved},
        indent=1, default=str) + "\n", encoding="utf-8")
    log.warning("%s held a run of another configuration (%s): kept in %s; this run starts afresh",
                run_dir, describe_changes(changes), dest)
    return dest

"""How far result directories are: ``python -m harness.report --status SWEEP_DIR`` and the report's warnings about
unfinished sweeps and runs (a report over a running sweep covers its finished jobs only and must say so).

A job has *started* once its directory holds ``config.yaml`` or ``run_state.json`` (written first by every
attempt, harness/run/state.py) or ``samples.jsonl``; it has *finished* with ``summary.json``; it *failed* when
its ``.progress/<job>.json`` marker (harness/run/progress.py) says so.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def sweep_status(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """How far a sweep is: jobs expected (from Hydra's ``multirun.yaml``: sweeper params + command line, basic
    sweeper semantics), finished (``summary.json``), interrupted or running (``samples.jsonl`` only), failed
    (a ``.progress/<job>.json`` marker saying so, harness.run.progress), not started."""
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
    # a job that started writes config.yaml and run_state.json first, samples.jsonl as it goes
    started = [p.name for p in jobs if p.name not in finished and any(
        (p / f).is_file() for f in ("config.yaml", "run_state.json", "samples.jsonl"))]
    failed: dict[str, str] = {}  # job → reason
    for m in (d / ".progress").glob("*.json") if (d / ".progress").is_dir() else []:
        try:
            marker = json.loads(m.read_text())
            if marker["status"] != "completed" and m.stem not in finished:
                failed[m.stem] = str(marker.get("reason") or "failed")
        except (ValueError, KeyError):
            pass
    for p in jobs:  # run_state.json failed (harness/run/progress.py record_failure), whatever the launcher
        if p.name not in finished and p.name not in failed and (p / "run_state.json").is_file():
            try:
                state = json.loads((p / "run_state.json").read_text())
            except ValueError:
                continue
            if isinstance(state, dict) and state.get("status") == "failed":
                failed[p.name] = str(state.get("reason") or "failed")
    seen = len(set(finished) | set(started) | set(failed))
    return {"sweep": str(d), "expected": expected, "finished": len(finished), "failed": sorted(failed, key=int),
            "failed_reasons": {j: failed[j] for j in sorted(failed, key=int)},
            "running_or_interrupted": [j for j in started if j not in failed],
            "not_started": (expected - seen) if expected is not None else None}


_SKIP_PARTS = {".hydra", "wandb", ".submitit", "report"}


def unfinished(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """What below ``paths`` has not finished: ``sweeps`` — :func:`sweep_status` of every sweep directory (Hydra's
    ``multirun.yaml``) with jobs not finished; ``runs`` — other run directories with ``config.yaml`` but no
    ``summary.json`` (running or interrupted). A report over them covers the finished part only, and says so."""
    sweeps: dict[Path, dict[str, Any]] = {}
    runs: set[Path] = set()
    for p in map(Path, paths):
        if not p.is_dir():
            continue
        for mr in p.rglob("multirun.yaml"):
            if _SKIP_PARTS.isdisjoint(mr.relative_to(p).parts[:-1]) and mr.parent not in sweeps:
                try:
                    sweeps[mr.parent] = sweep_status(mr.parent)
                except Exception as e:  # noqa: BLE001 - an unreadable multirun.yaml: count nothing
                    log.warning("%s: cannot read the sweep's state: %s", mr.parent, e)
        for cfg in p.rglob("config.yaml"):
            if _SKIP_PARTS.isdisjoint(cfg.relative_to(p).parts[:-1]) and not (cfg.parent / "summary.json").exists():
                runs.add(cfg.parent.resolve())
    sweep_dirs = [d.resolve() for d in sweeps]
    loose = sorted(r for r in runs if not any(r.is_relative_to(d) for d in sweep_dirs))
    open_sweeps = [st for st in sweeps.values()
                   if st["failed"] or st["running_or_interrupted"] or st["not_started"]
                   or (st["expected"] is not None and st["finished"] < st["expected"])]
    return {"sweeps": open_sweeps, "runs": [str(r) for r in loose]}


def unfinished_lines(state: Mapping[str, Any]) -> list[str]:
    """One sentence per unfinished sweep, and one for other unfinished runs."""
    out = []
    for st in state.get("sweeps") or []:
        expected = st["expected"] if st["expected"] is not None else "?"
        out.append(f"sweep `{st['sweep']}`: {st['finished']} of {expected} jobs finished — "
                   f"{len(st['running_or_interrupted'])} running or interrupted, {len(st['failed'])} failed, "
                   f"{st['not_started'] if st['not_started'] is not None else '?'} not started"
                   + "".join(f"; job {j} failed: {why[:160]}" for j, why in
                             list((st.get("failed_reasons") or {}).items())[:5]))
    if state.get("runs"):
        out.append(f"{len(state['runs'])} run directories without summary.json (running or interrupted): "
                   + ", ".join(f"`{r}`" for r in state["runs"][:10]) + (" …" if len(state["runs"]) > 10 else ""))
    return out



"""The results schema: ``config.yaml``, ``samples.jsonl`` and ``summary.json`` in the run directory.

One schema for every engine and dataset (the lm-evaluation-harness lesson), so reports and sweeps read
any run the same way. ``samples.jsonl`` is appended and flushed as each sample finishes, so a killed run
keeps what it finished. ``summary.json`` keys are stable (documented in the README):
``run``, ``config``, ``metrics``, ``latency``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _jsonable(value: Any) -> Any:
    """Floats that JSON cannot hold (NaN, inf) become None rather than invalid JSON."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class SamplesLog:
    """Append-only JSON Lines writer, one line per finished sample, flushed to disk at each line."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        # default=str: a value JSON cannot hold (a Path in a reference) is written as text, never a crash mid-run
        self._f.write(json.dumps(_jsonable(record), ensure_ascii=False, default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (temporary file + rename): a reader never sees half a summary."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def run_block(engine_info: dict[str, Any], model: dict[str, Any], seed: int, started: str) -> dict[str, Any]:
    """``summary.json`` ``run``: what produced the numbers (versions, hardware, dtype, weights)."""
    from harness.results.envinfo import collect_environment

    env = collect_environment(engine_info.get("device"))
    return {
        "schema_version": SCHEMA_VERSION,
        "harness_version": env["harness_version"],
        "git_commit": env["git_commit"],
        "engine": engine_info.get("engine"),
        "engine_version": engine_info.get("engine_version"),
        "engine_settings": {k: v for k, v in engine_info.items() if k not in {"engine", "engine_version"}},
        "python": env["python"],
        "torch_version": env["torch_version"],
        "transformers_version": env["transformers_version"],
        "triton_version": env["triton_version"],
        "device_name": engine_info.get("device_name", env["device_name"]),
        "dtype": engine_info.get("dtype"),
        "model": model,
        "weights": model.get("weights"),
        "seed": seed,
        "hostname": env["hostname"],
        "start_time": started,
        "end_time": None,
    }

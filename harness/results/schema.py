"""The results schema: ``config.yaml``, ``samples.jsonl`` and ``summary.json`` in the run directory.

One schema for every engine and dataset (lm-evaluation-harness's ``result_schema``), so the run, the OpenCompass
runner, the report and W&B read and write a run the same way. ``samples.jsonl`` is appended and flushed as each
sample finishes, so a killed run keeps what it finished. ``summary.json`` is :class:`Summary` below: its blocks
``run``, ``config``, ``metrics``, ``latency`` (always), ``warnings`` and the techniques' statistics (when
they apply), each a TypedDict that names every key a writer may put there.

Versions. ``run.schema_version`` is :data:`SCHEMA_VERSION`. It is bumped only when a key changes (renamed,
removed, or its meaning or unit changes); a new optional key is not a change (a reader of the same version
treats a missing key as absent). :func:`read_summary` loads every version it knows (:data:`READABLE_VERSIONS`),
upgrading an older one to today's shape with :func:`upgrade`, and refuses a newer one by name rather than
misreading it. tests/results/test_schema.py loads a committed ``summary.json`` of today's version
(tests/fixtures/results/summary_v1.json, written by the run) and guards the key sets.

Writers: :func:`write_summary` (the run, harness/run/experiment.py; the OpenCompass runner,
harness/opencompass/runner.py). Readers: :func:`read_summary` (the report, harness/report/rows.py) and the
block names below (W&B, harness/results/tracking.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypedDict

from harness.results.envinfo import collect_environment

log = logging.getLogger("harness.results")

SCHEMA_VERSION = 1
READABLE_VERSIONS = (0, 1)  # 0: a summary without run.schema_version (written before the field existed)


# --------------------------------------------------------------------------------------------- the schema


class Distribution(TypedDict, total=False):
    """One latency distribution (ms) over the timed requests (harness/metrics/latency.py ``summarize``); with
    the measurement protocol (``latency.repeats``, harness/latency/stats.py) also the interval of the mean
    over requests *within this run* (``ci``), the pass-to-pass spread (``cv``) and ``noisy``."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    n: int
    ci: list[float] | None  # [lo, hi] of the mean: bootstrap over requests, within one run
    confidence: float
    cv: float | None  # coefficient of variation between passes
    noisy: bool
    n_requests: int
    passes: list[Any]
    pass_means: list[float]
    n_excluded: int


class Latency(TypedDict, total=False):
    """``summary.json`` ``latency`` (harness/run/summary_blocks.py ``run_latency``; OpenCompass: the trace or the
    vLLM server's histograms)."""

    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    output_tokens_per_s: float | None
    output_tokens_per_s_basis: str | None
    total_output_tokens: int | None
    n_requests: int
    completed: int
    failed: int
    tpot_undefined: int
    partial: bool  # some generations replayed from the generation cache: the distributions cover the rest
    n_measured: int
    n_cached: int
    repeats: int
    max_cv: float | None
    noisy: list[str]  # the distributions whose pass-to-pass spread exceeds max_cv
    protocol: dict[str, Any]  # how the times were taken (warm-up, excluded batches, device lock)
    source: str  # where the times came from when not the harness's own timer (OpenCompass via vllm serve: /metrics)
    # latency.paired=true: the technique, the baseline (and trivial baselines) timed alternating in this process on
    # the same batches, with paired intervals on the speed-ups (harness/latency/paired.py); also in ``comparisons``
    paired: dict[str, Any]


class Run(TypedDict, total=False):
    """``summary.json`` ``run``: what produced the numbers (:func:`run_block` + the writer's additions)."""

    schema_version: int
    harness_version: str
    git_commit: str | None
    engine: str | None
    engine_version: str | None
    engine_settings: dict[str, Any]
    python: str
    torch_version: str | None
    transformers_version: str | None
    triton_version: str | None
    device_name: str | None
    dtype: str | None
    model: dict[str, Any]
    weights: str | None  # real | random-init | trained-synthetic
    seed: int
    hostname: str
    start_time: str
    end_time: str | None
    wall_time_s: float
    run_dir: str
    sweep: dict[str, Any] | None  # harness/results/tracking.py sweep_info: id, dir, name, job_num, overrides
    attempt: int
    scoring: dict[str, Any]  # which scorer encoders ran and whether their weights were random (clip_weights, …)
    phase_s: dict[str, float]
    wandb_dir: str
    opencompass_version: str  # the OpenCompass runner
    opencompass: dict[str, Any]


class Comparison(TypedDict, total=False):
    """One comparison measured *within* a run (``summary.json`` ``comparisons``): the variant of this run against
    a reference timed or scored in the same process on the same requests (A/B interleaved, paired over
    requests). This is what lets the report call a difference significant: intervals of two runs taken at
    different times cannot see the drift between them (issue 25). Written by the paired A/B timing and the
    paired quality intervals of issue 31; the report reads it (harness/report/deltas.py ``within_run_comparisons``)."""

    metric: str  # a latency distribution (``ttft_ms``, ``tpot_ms``) or a quality metric (``comprehensive``, …)
    against: str  # the reference: ``baseline`` or a technique label
    kind: Literal["ratio", "difference"]  # ratio: reference / this (latency speed-up); difference: this − reference
    estimate: float
    ci: list[float]  # [lo, hi] at ``confidence``
    confidence: float
    n: int  # pairs (requests, or samples for quality)
    method: str  # e.g. "paired bootstrap over requests, A/B interleaved"
    variant: str  # what was measured against ``against`` (the run's technique, e.g. "visionzip keep=0.5 ...")


class Summary(TypedDict, total=False):
    """``summary.json``. ``run``, ``config``, ``metrics``, ``latency`` are always written; the rest when they apply."""

    run: Run
    config: dict[str, Any]  # the resolved Hydra config (config.yaml)
    metrics: dict[str, Any]  # the dataset's metrics (harness/metrics/*) + n_samples, errors; OpenCompass: opencompass
    latency: Latency
    warnings: list[str]  # the caveats of the numbers, one sentence each (harness/run/outcome.py run_warnings)
    visionzip: dict[str, Any]  # tokens in/kept, keep rate per image source
    sere: dict[str, Any]  # expert union before/after, per layer, engagement
    moe: dict[str, Any]  # top-K truncation statistics
    offload: dict[str, Any]
    cache: dict[str, Any]  # generation cache hits/replays
    load: dict[str, Any]  # synthetic load / serving settings
    opencompass_crosscheck: dict[str, Any]
    technique_stats_by_process: list[dict[str, Any]]  # OpenCompass with several inference processes
    comparisons: list[Comparison]


REQUIRED_BLOCKS = ("run", "config", "metrics", "latency")
TECHNIQUE_BLOCKS = ("visionzip", "sere", "moe", "offload", "cache", "load")


def declared_keys(td: type) -> frozenset[str]:
    return frozenset(td.__annotations__)


def undeclared_keys(summary: Mapping[str, Any]) -> list[str]:
    """Keys a writer put in ``summary`` that the schema does not declare (``run.*`` ones prefixed ``run.``)."""
    out = [k for k in summary if k not in declared_keys(Summary)]
    run = summary.get("run")
    if isinstance(run, Mapping):
        out += [f"run.{k}" for k in run if k not in declared_keys(Run)]
    return out


# --------------------------------------------------------------------------------------------- reading


class MalformedSummary(ValueError):
    """A ``summary.json`` that is not a JSON object of the results schema."""


class UnsupportedSummary(MalformedSummary):
    """A ``summary.json`` of a schema version this harness cannot read (written by a newer one)."""


def schema_version(summary: Mapping[str, Any]) -> int:
    run = summary.get("run")
    version = run.get("schema_version") if isinstance(run, Mapping) else None
    return int(version) if isinstance(version, (int, float)) and not isinstance(version, bool) else 0


def upgrade(summary: dict[str, Any]) -> Summary:
    """``summary`` in today's shape. Version 0 (no ``run.schema_version``) has today's keys, every one optional:
    it only gains the version it was read as. Add one step here for each bump."""
    version = schema_version(summary)
    if version not in READABLE_VERSIONS:
        raise UnsupportedSummary(f"schema_version {version}: written by a newer harness (this one reads "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}); update the harness to read it")
    if version == 0 and isinstance(summary.get("run"), dict):
        summary["run"].setdefault("schema_version", 0)
    return summary  # type: ignore[return-value]


def parse_summary(data: Any) -> Summary:
    """Check the shape of a decoded ``summary.json`` (:class:`MalformedSummary` naming what is wrong) and upgrade it."""
    if not isinstance(data, dict):
        raise MalformedSummary(f"a JSON {type(data).__name__}, not an object")
    bad = [k for k in ("run", "config", "metrics", "latency", *TECHNIQUE_BLOCKS)
           if data.get(k) is not None and not isinstance(data[k], dict)]
    bad += [k for k in ("warnings", "comparisons") if data.get(k) is not None and not isinstance(data[k], list)]
    if bad:
        raise MalformedSummary(f"{', '.join(bad)} not an object" if all(b not in ("warnings", "comparisons")
                                                                       for b in bad)
                               else f"{', '.join(bad)} of the wrong type")
    return upgrade(data)


def read_summary(path: str | os.PathLike) -> Summary:
    """One ``summary.json``, checked and upgraded to today's version (:class:`MalformedSummary` when it cannot be)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise MalformedSummary(f"not readable JSON ({type(e).__name__}: {e})") from None
    return parse_summary(data)


# --------------------------------------------------------------------------------------------- writing


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


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    """Write ``summary.json`` (atomically), stamped with :data:`SCHEMA_VERSION`; a key the schema does not declare
    is logged (declare it in :class:`Summary` / :class:`Run` — a new optional key needs no version bump)."""
    run = summary.get("run")
    if isinstance(run, dict):
        run.setdefault("schema_version", SCHEMA_VERSION)
    extra = undeclared_keys(summary)
    if extra:
        log.warning("summary.json keys not in the results schema (harness/results/schema.py): %s", ", ".join(extra))
    write_json(path, dict(summary))


def run_block(engine_info: dict[str, Any], model: dict[str, Any], seed: int, started: str) -> dict[str, Any]:
    """``summary.json`` ``run``: what produced the numbers (versions, hardware, dtype, weights)."""
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

"""One OpenCompass experiment: Hydra config → OpenCompass config → ``opencompass`` CLI → its results →
``summary.json``.

OpenCompass's own runner, partitioner, inferencer, evaluators and summariser do the work (its CLI, started
as a subprocess, so its process model — a subprocess per task — is the one users get); the harness only
writes the config, checks that the data is staged, and reads OpenCompass's result files back. Everything
OpenCompass writes stays under ``<run_dir>/opencompass/work``; its console output is kept in
``<run_dir>/opencompass/opencompass.log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.config.checks import _select, at_least, number, one_of, optional, Check, NONEMPTY, Rule, _MISSING
from harness.config.paths import write_atomic
from harness.engines.base import TechniqueNotAvailable
from harness.metrics.latency import latency_summary
from harness.models.load import resolve_model
from harness.opencompass import vllm_route
from harness.opencompass.config_gen import write_config
from harness.opencompass.crosscheck import mcq_crosscheck, read_rows
from harness.opencompass.results import item_records, read_result_json, read_results, read_trace, OpenCompassFailed
from harness.opencompass.suites import (
    check_evaluators, check_staged, OpenCompassDependencyMissing, SUITES, SUMMARY_GROUPS)
from harness.results.schema import run_block, utc_now, write_summary
from harness.results.tracking import log_run, sweep_info
from harness.run.rules_files import validate_files, validate_model_files
from harness.run.validate import refusal, validate_config, validate_model

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def check_engine(cfg: Any) -> None:
    """The HF route (the project's model class) and the vLLM route (``vllm serve`` + ``OpenAISDK``,
    :mod:`harness.opencompass.vllm_route`)."""
    if cfg.engine.name not in ("hf", "vllm"):
        raise TechniqueNotAvailable(
            f"engine={cfg.engine.name}: python -m harness.opencompass runs engine=hf or engine=vllm")
    if cfg.visionzip.keep < 1.0:
        raise TechniqueNotAvailable("visionzip.keep < 1: the OpenCompass suites are text-only, VisionZip would "
                                    "have nothing to prune. Use visionzip.keep=1.0.")


def _opencompass_rules() -> tuple[Any, ...]:
    """``opencompass.*`` in the vocabulary of harness/run/validate.py (checked before any OpenCompass import:
    a bad value used to surface as mmengine's ``ModuleNotFoundError`` in the main venv, or deep in OpenCompass)."""
    def is_dir(v: Any) -> bool:
        return isinstance(v, str) and Path(v).expanduser().is_dir()

    return (
        Rule("opencompass.suite", one_of(*sorted(SUITES))),
        Rule("opencompass.limit", optional(at_least(1, "rows per dataset"), "every row")),
        Rule("opencompass.ci_items", at_least(1, "rows per generated dataset")),
        Rule("opencompass.max_out_len", optional(at_least(1, "tokens"), "generation.max_new_tokens")),
        Rule("opencompass.max_seq_len", at_least(1, "tokens")),
        Rule("opencompass.num_gpus", optional(at_least(0), "1 when CUDA is visible, else 0")),
        Rule("opencompass.model_abbr", optional(NONEMPTY, "model.name")),
        Rule("opencompass.max_num_workers", at_least(1, "parallel OpenCompass tasks")),
        Rule("opencompass.timeout_s", optional(number(0, lo_open=True, note="seconds"), "no limit")),
        Rule("opencompass.data_cache", optional(Check(is_dir, "an existing directory (OpenCompass's data/ "
                                                              "lives under it)"), "$COMPASS_DATA_CACHE")),
    )


#: the one line for a Python without OpenCompass (docs/opencompass.md, docs/validation.md)
MISSING_OPENCOMPASS = ("{what} is not installed in this Python ({python}): python -m harness.opencompass runs in "
                       ".venv-opencompass (OpenCompass's pins clash with the main venv's); build it with "
                       "bash .ci/opencompass_lane.sh venv, then run .venv-opencompass/bin/python -m harness.opencompass")


def check_opencompass(cfg: Any) -> None:
    """Every ``opencompass.*`` value, then whether OpenCompass (and mmengine, which reads its configs) can be
    imported at all — both before any OpenCompass import and before the run directory is written."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    for rule in _opencompass_rules():
        value = _select(cfg, rule.key)
        if value is not _MISSING and not rule.check.ok(value):
            raise refusal(rule.key, value, rule.check.text())
    try:
        version("opencompass")  # the distribution: a folder called opencompass on sys.path is not OpenCompass
    except PackageNotFoundError:
        raise OpenCompassDependencyMissing(MISSING_OPENCOMPASS.format(what="OpenCompass", python=sys.executable)) \
            from None
    if find_spec("mmengine") is None:
        raise OpenCompassDependencyMissing(MISSING_OPENCOMPASS.format(what="mmengine (OpenCompass's config reader)",
                                                                      python=sys.executable))


def _data_cache(cfg: Any) -> str | None:
    return cfg.opencompass.data_cache or os.environ.get("COMPASS_DATA_CACHE") or None


def top_level_entries(oc_cfg: Any, suite: str) -> list[str]:
    """The suite's average's terms: its summary groups (once each), then every dataset in no such group."""
    groups = {g["name"]: {x if isinstance(x, str) else x[0] for x in g["subsets"]}
              for g in oc_cfg.get("summarizer", {}).get("summary_groups", [])}
    top = [name for _, _, name in SUMMARY_GROUPS[suite]]
    grouped = set().union(*(groups[name] for name in top)) if top else set()
    abbrs = [d.get("abbr") or Path(str(d["path"])).stem for d in oc_cfg["datasets"]]
    return top + [a for a in dict.fromkeys(abbrs) if a not in grouped]


def preflight(config_path: Path, cfg: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Read the generated config as OpenCompass will (mmengine), refuse unstaged real datasets, and return
    the datasets and the suite's top-level entries (:func:`top_level_entries`)."""
    from mmengine.config import Config

    oc_cfg = Config.fromfile(str(config_path))
    datasets = [dict(d) for d in oc_cfg["datasets"]]
    if cfg.opencompass.suite != "ci_sample":
        check_staged(datasets, _data_cache(cfg))
        check_evaluators(datasets)
    return datasets, top_level_entries(oc_cfg, cfg.opencompass.suite)


def launch(config_path: Path, work_dir: Path, cfg: Any, log_path: Path) -> float:
    """Run the ``opencompass`` CLI on the config; return its wall time. Raises :class:`OpenCompassFailed`."""
    cmd = [sys.executable, "-m", "opencompass.cli.main", str(config_path), "-w", str(work_dir),
           "--max-num-workers", str(cfg.opencompass.max_num_workers), "--dump-eval-details", "True"]
    if cfg.opencompass.debug:
        cmd.append("--debug")
    env = dict(os.environ)
    # OpenCompass's task processes import the model class: they must see this checkout's harness
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if _data_cache(cfg):
        env["COMPASS_DATA_CACHE"] = _data_cache(cfg)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["TRITON_INTERPRET"] = env.get("TRITON_INTERPRET", "0")
    t0 = time.perf_counter()
    with log_path.open("w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work_dir.parent),
                                  timeout=cfg.opencompass.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise OpenCompassFailed(f"OpenCompass ran past opencompass.timeout_s={cfg.opencompass.timeout_s}; "
                                    f"its log: {log_path}") from e
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise OpenCompassFailed(f"OpenCompass exited with {proc.returncode}; log {log_path}; its end:\n{tail}")
    return time.perf_counter() - t0


def custom_mcq_crosscheck(out_dir: Path, model_abbr: str, datasets: list[dict[str, Any]]) -> dict[str, Any]:
    """For each custom multiple-choice dataset (a JSONL file whose rows have options A, B, ...): OpenCompass's
    accuracy beside the harness's MCQ scoring on the same predictions (:mod:`harness.opencompass.crosscheck`)."""
    out: dict[str, Any] = {}
    for ds in datasets:
        path = str(ds.get("path", ""))
        if ds.get("type") is not None and "CustomDataset" not in str(ds.get("type")) or not path.endswith(".jsonl"):
            continue
        rows = read_rows(path)
        if not rows or "A" not in rows[0] or "B" not in rows[0]:
            continue
        res = read_result_json(out_dir, model_abbr, ds["abbr"])
        if res and res.get("details") is not None:
            out[ds["abbr"]] = mcq_crosscheck(res["details"], rows)
    return out


def run_opencompass(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """The whole experiment; writes ``config.yaml`` and ``summary.json`` in ``run_dir`` and returns the summary."""
    from importlib.metadata import version

    from omegaconf import OmegaConf

    check_engine(cfg)
    validate_config(cfg)  # the same rules as python -m harness, before anything runs

    validate_files(cfg)  # the SERE artifacts the engine will read (harness/run/rules_files.py)
    check_opencompass(cfg)  # opencompass.* values, then OpenCompass itself: before any OpenCompass import
    run_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    config = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config), encoding="utf-8")
    model_path, model_info = resolve_model(cfg.model)

    validate_model_files(cfg, validate_model(cfg, model_path))  # sere.k, moe.top_k, artifacts vs the checkpoint
    server = None
    if cfg.engine.name == "vllm":  # vllm serve with the run's techniques; OpenCompass's OpenAISDK points at it
        server = vllm_route.start_server(cfg, model_path, model_info["name"], run_dir / "opencompass")
    try:
        model = vllm_route.model_entry(cfg, server, model_path, model_info["name"]) if server else None
        config_path = write_config(cfg, run_dir, model_path, model_info["name"], model=model)
        oc_dir = config_path.parent
        trace_path = oc_dir / "harness_trace.jsonl"
        for old in [trace_path, *oc_dir.glob(f"{trace_path.stem}.stats.*.json")]:  # a rerun in the same directory
            old.unlink(missing_ok=True)
        datasets, top_level = preflight(config_path, cfg)
        work_dir = oc_dir / "work"
        wall_s = launch(config_path, work_dir, cfg, oc_dir / "opencompass.log")
        if server is not None:  # before it stops: its latency histograms and the techniques' statistics
            server_latency, server_stats = vllm_route.server_latency(server), vllm_route.server_stats(server)
    finally:
        if server is not None:
            server.stop()  # its log stays: <run_dir>/opencompass/vllm_serve.log

    model_abbr = cfg.opencompass.model_abbr or model_info["name"]
    metrics, out_dir = read_results(work_dir, model_abbr, top_level)
    records, stats = read_trace(trace_path)
    crosscheck = custom_mcq_crosscheck(out_dir, model_abbr, datasets)
    engine_info = stats.pop("engine", {"engine": "hf"})
    if server is not None:
        engine_info, stats = vllm_route.engine_block(server), server_stats
    summary = {
        "run": {**run_block(engine_info, model_info, cfg.seed, started), "end_time": utc_now(),
                "wall_time_s": round(wall_s, 3), "run_dir": str(run_dir), "sweep": sweep_info(),
                "opencompass_version": version("opencompass"),
                "opencompass": {"suite": cfg.opencompass.suite, "config": str(config_path), "model_abbr": model_abbr,
                                "work_dir": str(work_dir), "output_dir": str(out_dir),
                                "datasets": [d.get("abbr") for d in datasets],
                                "data_cache": _data_cache(cfg),
                                # generations the engine failed on: OpenCompass scored them as empty answers
                                "engine_errors": sum(1 for r in records if r.get("error"))}},
        "config": config,
        "metrics": {"opencompass": metrics},
        "latency": ({**latency_summary(records), "n_measured": sum(1 for r in records if not r.get("error")),
                     "n_cached": 0, "partial": False} if server is None else server_latency),
        **stats,
    }
    if crosscheck:
        summary["opencompass_crosscheck"] = crosscheck
    items = item_records(out_dir, model_abbr, [str(d.get("abbr")) for d in datasets])
    # per item, for paired comparisons between runs (issue 31); atomic and never through a link, as summary.json
    write_atomic(run_dir / "samples.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items).encode())
    summary["run"]["opencompass"]["items"] = {"n": len(items), "errors": sum(1 for r in items if r.get("error"))}
    write_summary(run_dir / "summary.json", summary)
    wandb_dir = log_run(cfg.wandb, config, summary, records, run_dir, name=run_dir.name)
    if wandb_dir:
        summary["run"]["wandb_dir"] = wandb_dir
        write_summary(run_dir / "summary.json", summary)
    return summary

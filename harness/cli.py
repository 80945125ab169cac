"""``python -m harness [overrides]``: compose the Hydra config and run one experiment (or a sweep with -m).

Exit codes: 0 done; 2 the configuration or the data was refused before any model loaded (one line on stderr
naming the key, the value and what is allowed: :mod:`harness.run.validate`), including Hydra's own composition
errors (a misspelt key, a wrong type, an unknown option), which Hydra would print over several lines with
exit code 1, and what the engine needs but this environment lacks (its package, a readable checkpoint:
``EngineUnavailable``); anything else is a crash (traceback, exit code 1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from harness.config.schema import register_configs
from harness.config.paths import CONF_DIR  # noqa: F401 (also importable as harness.cli.CONF_DIR)
from harness.config.paths import PACKAGE_DIR
from harness.datasets.base import DatasetError
from harness.engines.base import EngineUnavailable, TechniqueNotAvailable
from harness.latency.device_lock import UnsafeLockDir
from harness.run.experiment import run_experiment
from harness.run.outcome import console_summary
from harness.run.progress import JobRefused
from harness.run.state import RunDirLocked
from harness.run.validate import hydra_error_line, ConfigError
from harness.techniques.sere.errors import SereNotEngaged

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run_experiment(cfg, run_dir)
    except (TechniqueNotAvailable, EngineUnavailable, DatasetError, ConfigError, RunDirLocked, SereNotEngaged,
            UnsafeLockDir) as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # Hydra records the job failed and runs the next one
            raise JobRefused(str(e)) from e
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # a short summary (key metrics, latency, warnings) rather than a JSON dump: the numbers are in summary.json
    print(console_summary(summary, str(run_dir)), flush=True)


def entry() -> None:
    """``python -m harness`` / ``moe-vlm-harness``: :func:`main`, with Hydra's composition errors as one line and
    exit code 2 like every other refused configuration.

    Hydra catches every exception itself unless ``HYDRA_FULL_ERROR`` is set, so it is set here (unless the user
    chose a value) and the exceptions Hydra raises while composing come back to this function; any other
    exception propagates with its full traceback."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except Exception as e:  # noqa: BLE001 - only composition errors are turned into a line; the rest re-raised
        if isinstance(e, JobRefused):  # a sweep whose valid jobs all ran: each failed one was named as it ended
            print(f"error: a sweep job was refused: {e} (the other jobs ran; python -m harness.report --status "
                  "SWEEP_DIR lists every failed job and why)", file=sys.stderr)
            sys.exit(2)
        line = hydra_error_line(e) or _run_dir_error_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)


def _run_dir_error_line(exc: BaseException) -> str | None:
    """One line when Hydra itself could not create the run directory (``hydra.run.dir`` under a read-only or
    missing mount: it creates the directory before :func:`main` runs), else None (a crash keeps its traceback)."""
    import traceback

    if not isinstance(exc, OSError) or not exc.filename:
        return None

    if any(f.filename.startswith(str(PACKAGE_DIR)) and not f.filename.endswith("cli.py")
           for f in traceback.extract_tb(exc.__traceback__)):
        return None  # raised by the run, not by Hydra's set-up
    return (f"{exc.filename}: {exc.strerror or exc} (hydra.run.dir / hydra.sweep.dir): the run directory cannot be "
            "created; set hydra.run.dir to a directory you can write and rerun")

"""Where the harness's log goes: the run's log file.

Under ``python -m harness`` Hydra's job logging writes the root logger to ``<run_dir>/<job>.log`` (``cli.log``)
and, for this project, only warnings to the console (``hydra.job_logging.handlers.console.level`` in
``conf/config.yaml``: the console shows progress bars and the end-of-run summary). The harness logs through
``logging.getLogger("harness.…")`` and Python warnings are routed into logging during a run, so the log file
holds the run's story (attempt, cache replay, per-sample failures, warnings). When ``run_experiment`` is called
without Hydra (tests, notebooks) there is no file handler: :func:`run_logging` adds ``<run_dir>/run.log``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _has_file_handler() -> bool:
    return any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers)


@contextmanager
def run_logging(run_dir: Path) -> Iterator[None]:
    """During a run: warnings into logging, and a ``run.log`` in ``run_dir`` when nothing writes a log file."""
    logging.captureWarnings(True)
    added: list[tuple[logging.Logger, logging.Handler, int]] = []
    if not _has_file_handler():
        handler = logging.FileHandler(Path(run_dir) / "run.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter(FORMAT))
        for name in ("harness", "py.warnings"):
            logger = logging.getLogger(name)
            added.append((logger, handler, logger.level))
            logger.addHandler(handler)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for logger, handler, level in added:
            logger.removeHandler(handler)
            logger.setLevel(level)
        for handler in {h for _, h, _ in added}:
            handler.close()

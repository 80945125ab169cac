"""Where the harness's log goes: the run's log file.

Under ``python -m harness`` Hydra's job logging writes the root logger to ``<run_dir>/<job>.log`` (``cli.log``)
and, for this project, only warnings to the console (``hydra.job_logging.handlers.console.level`` in
``conf/config.yaml``: the console shows progress bars and the end-of-run summary). The harness logs through
``logging.getLogger("harness.…")`` and Python warnings are routed into logging during a run, so the log file
holds the run's story (attempt, cache replay, per-sample failures, warnings). When ``run_experiment`` is called
without Hydra (tests, notebooks) there is no file handler: :func:`run_logging` adds ``<run_dir>/run.log``.

Third-party chatter (transformers, vLLM, W&B, huggingface_hub, Python warnings from libraries) goes to the log
file only (:data:`THIRD_PARTY`: not propagated to the console handler during a run), and the weight-loading
bars of transformers / huggingface_hub are off (``HF_HUB_DISABLE_PROGRESS_BARS``), so the console shows the
run's phases, its summary and the warnings that apply to the run (issue 25).
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
THIRD_PARTY = ("transformers", "vllm", "wandb", "huggingface_hub", "accelerate", "torch", "urllib3", "filelock",
               "PIL", "matplotlib", "py.warnings")


def _quiet_progress_bars() -> None:
    """No weight-loading bars (transformers and huggingface_hub read this when they load; a user's value wins)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's own stdout handler: its lines reach the log file
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] not in {"0", "false"}:
        try:
            sys.modules["transformers"].utils.logging.disable_progress_bar()
        except AttributeError:
            pass


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
    _quiet_progress_bars()
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)] or \
        sorted({h for _, h, _ in added}, key=id)
    rerouted: list[tuple[logging.Logger, bool, list[logging.Handler]]] = []
    for name in THIRD_PARTY:  # to the log file, never the console
        logger = logging.getLogger(name)
        new = [h for h in files if h not in logger.handlers]
        rerouted.append((logger, logger.propagate, new))
        logger.propagate = False
        for h in new:
            logger.addHandler(h)
    try:
        yield
    finally:
        for logger, propagate, new in rerouted:
            logger.propagate = propagate
            for h in new:
                logger.removeHandler(h)
        logging.captureWarnings(False)
        for logger, handler, level in added:
            logger.removeHandler(handler)
            logger.setLevel(level)
        for handler in {h for _, h, _ in added}:
            handler.close()

"""Before a sweep starts: does its launcher run jobs side by side on one device?

``hydra/launcher=local`` (submitit's local executor) starts every job of a sweep at once, as processes of this
machine, all given the same GPUs (``gpus_per_node`` of them, counted from 0) or none; a joblib launcher runs
``n_jobs`` at once. Their latency figures then measure each other (on the CPU machine, TPOT p50 moved 52-574 ms
between jobs of one sweep). Hydra's basic launcher runs jobs one after the other in its own process; Slurm
gives each array task its own allocation. :class:`ConcurrencyCheck` (a Hydra callback, ``hydra.callbacks`` in
``conf/config.yaml``) warns at the start of a multirun when more than one job may run at once on this host and
``latency.sequential`` is false, and says how the jobs will take turns when it is true.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: launcher ``_target_`` substrings → how they place jobs
SIDE_BY_SIDE = {"submitit_launcher.LocalLauncher": "hydra/launcher=local (submitit's local executor)",
                "joblib_launcher.JoblibLauncher": "hydra/launcher=joblib",
                "ray_launcher.RayLauncher": "hydra/launcher=ray"}


def _count_jobs(config: Any) -> int | None:
    """Jobs of the sweep Hydra is about to launch (basic sweeper semantics: sweeper params, then overrides)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - another sweeper (optuna, …): no total, the bar still counts
        return None


def jobs_at_once(launcher: Any, n_jobs: int | None) -> tuple[int, str | None]:
    """(how many jobs may run at once on this host, the launcher's name) for a launcher config."""
    target = str(_sel(launcher, "_target_") or "")
    name = next((v for k, v in SIDE_BY_SIDE.items() if k in target), None)
    if name is None:
        return 1, None
    if "Joblib" in target:
        want = _sel(launcher, "n_jobs")
        want = os.cpu_count() or 1 if want in (None, -1) else int(want)
        return max(1, min(want, n_jobs or want)), name
    return max(1, n_jobs or 2), name


def _sel(node: Any, key: str) -> Any:
    try:
        return node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve here
        return None


def concurrency_warning(config: Any, n_jobs: int | None) -> str | None:
    """The sentence printed before such a sweep (None when jobs run one at a time)."""
    at_once, name = jobs_at_once(_sel(_sel(config, "hydra"), "launcher"), n_jobs)
    if at_once <= 1:
        return None
    sequential = bool(_sel(_sel(config, "latency"), "sequential"))
    jobs = f"the {n_jobs} jobs" if n_jobs else "the jobs"
    if sequential:
        return (f"{name} starts {jobs} of this sweep together; latency.sequential=true makes them take turns on this "
                "host's device lock (harness/latency/device_lock.py), so waiting jobs count against the launcher's "
                "timeout_min")
    return (f"{name} runs up to {at_once} of {jobs} of this sweep at once on this machine: they share its device, "
            "so their latency figures disturb each other. Add latency.sequential=true (jobs take turns on the "
            "device) or use the basic launcher; each job's summary.json records whether another was measuring")


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    Callback = object  # type: ignore[misc,assignment]


class ConcurrencyCheck(Callback):
    """Hydra callback: :func:`concurrency_warning` at the start of a multirun (stderr and the log)."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            text = concurrency_warning(config, _count_jobs(config))
        except Exception as e:  # noqa: BLE001 - a check that cannot run must never stop a sweep
            log.debug("concurrency check skipped: %s", e)
            return
        if text:  # Hydra's console handler shows it (once) before the jobs start
            log.warning(text)

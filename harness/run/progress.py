"""Progress bars: one run (overall bar over its phases + one bar per phase) and a sweep (one bar over its jobs).

* :class:`RunProgress` — ``run_experiment`` wraps each phase (``data``, ``model``, ``images``, ``cache``,
  ``warmup``, ``generate``, ``finish``) in ``with progress.phase(name, total) as bar``; the overall bar shows
  the phase being run, the phase bar its items. The seconds spent per phase go to ``summary.json``
  ``run.phase_s`` (model load vs generation vs scoring at a glance).
* :class:`SweepProgress` — a Hydra callback (``hydra.callbacks.progress`` in ``conf/config.yaml``): with the
  basic launcher (jobs in this process) a bar over the sweep's jobs sits above the run bars; with any launcher
  each finished job drops ``<sweep dir>/.progress/<job>.json`` (status, seconds, and a failed job's reason), which
  ``python -m harness.report SWEEP_DIR --status`` counts while a Slurm array runs. A job that fails — refused
  (:class:`JobRefused`: the CLI raises it in a sweep instead of exiting, so Hydra runs the next job) or crashed —
  is recorded where ``--status`` and a rerun look: its ``run_state.json`` says ``failed`` with the reason (a
  crashed job that has generations to resume keeps ``running`` and gets ``last_error``), and one line on the
  console names it.

Bars go to stderr through tqdm. Where stderr is not a terminal (a log file, Slurm), a run prints one plain line per
finished phase instead of bars (no escape codes in a log), and the sweep bar refreshes at most once a minute. ``HARNESS_PROGRESS=0`` turns them off.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from harness.latency.launcher import _count_jobs
from harness.run.state import mark_failed, read_state, write_state
from harness.run.validate import validate_config, ConfigError

POSITION_ENV = "HARNESS_PROGRESS_POSITION"  # set by SweepProgress so run bars sit below the sweep bar


def _enabled() -> bool:
    return os.environ.get("HARNESS_PROGRESS", "1") not in {"0", "false", "no"}


def _tqdm(**kw: Any):
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(disable=not _enabled(), mininterval=0.1 if interactive else 60.0, dynamic_ncols=True, **kw)


class _Count:
    """A phase's counter where no bar is drawn (stderr not a terminal): the bar's interface, counting only."""

    def __init__(self, total: int | None = None) -> None:
        self.n, self.total = 0, total

    def update(self, k: int = 1) -> None:
        self.n += k

    def set_postfix_str(self, *a: Any, **k: Any) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class RunProgress:
    """The overall bar of one run and its phase bars; where stderr is not a terminal (a log file, Slurm), one
    plain line per finished phase instead (no cursor movement, no escape codes)."""

    # repeats: latency.repeats > 1; paired: latency.paired (harness/latency/paired.py)
    PHASES = ("data", "model", "images", "cache", "warmup", "generate", "repeats", "paired", "finish")

    def __init__(self, title: str):
        self.base = int(os.environ.get(POSITION_ENV, "0"))
        self.times: dict[str, float] = {}
        self.title = title
        self.lines = _enabled() and not sys.stderr.isatty()  # plain lines, not bars
        self.overall = _Count(len(self.PHASES)) if self.lines else _tqdm(total=len(self.PHASES), desc=title, unit="phase", position=self.base, leave=True,
                             bar_format="{desc}: {n_fmt}/{total_fmt} phases |{bar}| {elapsed} {postfix}")

    @contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "sample") -> Iterator[Any]:
        self.overall.set_postfix_str(name)
        t0 = time.perf_counter()
        bar = _Count(total) if self.lines else _tqdm(total=total, desc=f"  {name}", unit=unit,
                                                      position=self.base + 1, leave=False)
        ok = False
        try:
            yield bar
            ok = True
        finally:
            bar.close()
            seconds = time.perf_counter() - t0
            self.times[name] = round(self.times.get(name, 0.0) + seconds, 3)
            self.overall.update(1)
            if self.lines and ok:  # a failing phase says nothing here: the error line comes last
                done = f", {bar.n} {unit}{'s' if bar.n != 1 else ''}" if bar.n else ""
                print(f"{self.title}: {name} {seconds:.1f} s{done}", file=sys.stderr, flush=True)

    def skip(self, name: str) -> None:
        """A phase that has nothing to do in this run (e.g. ``cache`` when not reading)."""
        self.overall.update(1)

    def close(self) -> None:
        self.overall.set_postfix_str("done")
        self.overall.close()
        if self.lines and "finish" in self.times:
            print(f"{self.title}: done in {sum(self.times.values()):.1f} s", file=sys.stderr, flush=True)


class JobRefused(Exception):
    """A sweep job refused before it ran (its configuration, data or technique): raised in a sweep instead of
    exiting with code 2, so Hydra records the job as failed and goes on with the next one."""


def failure_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "failed"
    if isinstance(exc, JobRefused):
        return f"refused: {exc}"
    return f"{type(exc).__name__}: {exc}".strip()[:500]


def record_failure(run_dir: Path, reason: str) -> None:
    """``run_state.json`` of a failed job: ``failed`` with ``reason`` (a job refused before its first attempt gets
    one); a job whose interrupted generations a rerun resumes keeps ``running`` and records ``last_error``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    state = read_state(run_dir)
    if state is None:
        write_state(run_dir, {"status": "failed", "reason": reason, "attempt": 0, "attempts": []})
    elif state.get("status") == "running" and (run_dir / "samples.jsonl").is_file():
        state["last_error"] = reason
        write_state(run_dir, state)
    elif state.get("status") == "running":
        mark_failed(run_dir, state, reason)


def precheck_jobs(config: Any) -> list[tuple[int, list[str], str]]:
    """Every job of a sweep composed (basic sweeper semantics) and validated (harness/run/validate.py) before any
    runs: (job number, overrides, reason) of each refused one. Empty where the jobs cannot be composed here
    (another sweeper): then each job is still validated when it starts."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import open_dict, read_write

        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        jobs = [list(o) for batch in BasicSweeper.split_arguments(parsed, None) for o in batch]
        loader = GlobalHydra.instance().config_loader()
    except Exception:  # noqa: BLE001 - nothing to check up front
        return []
    refused = []
    for num, overrides in enumerate(jobs):
        try:
            job_cfg = loader.load_sweep_config(config, overrides)
            with read_write(job_cfg), open_dict(job_cfg):
                del job_cfg["hydra"]
            validate_config(job_cfg)
        except ConfigError as e:
            refused.append((num, overrides, str(e)))
        except Exception:  # noqa: BLE001 - anything else: the job itself reports it when it runs
            pass
    return refused


def _job_num(config: Any) -> int:
    """The job's number in a sweep; 0 for a single run, where Hydra leaves ``hydra.job.num`` unset (``???``:
    reading it directly raises MissingMandatoryValue, which Hydra printed as a warning on every plain run)."""
    from omegaconf import OmegaConf

    num = OmegaConf.select(config, "hydra.job.num", default=None)
    return int(num) if num is not None else 0


def _is_multirun(config: Any) -> bool:
    from omegaconf import OmegaConf

    mode = OmegaConf.select(config, "hydra.mode", default=None)
    return mode is not None and str(mode).endswith("MULTIRUN")


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    Callback = object  # type: ignore[misc,assignment]


class SweepProgress(Callback):
    """Hydra callback: a bar over the sweep's jobs and a ``.progress/<job>.json`` marker per finished job."""

    def __init__(self) -> None:
        self.bar = None
        self.t0: dict[int, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Launchers such as submitit pickle the callbacks into each job: the terminal bar stays behind (a
        # pickled tqdm wrapper recurses forever on load); jobs still write their .progress markers.
        return {**self.__dict__, "bar": None}

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        total = _count_jobs(config)
        refused = precheck_jobs(config)
        if refused:  # the valid jobs still run; each refused one fails fast when its turn comes
            print(f"sweep: {len(refused)} of {total if total is not None else '?'} jobs refused before any ran "
                  "(the others run):", file=sys.stderr)
            for num, overrides, why in refused:
                print(f"  job {num} ({' '.join(overrides)}): {why}", file=sys.stderr)
            sys.stderr.flush()
        name = config.hydra.job.config_name
        self.bar = _tqdm(total=total, desc=f"sweep {name}", unit="job", position=0, leave=True)
        os.environ[POSITION_ENV] = "1"

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        self.t0[_job_num(config)] = time.perf_counter()

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        num = _job_num(config)
        status = "completed" if job_return.status == JobStatus.COMPLETED else "failed"
        reason = None
        if status == "failed":
            reason = failure_reason(getattr(job_return, "_return_value", None))
            try:
                record_failure(Path(str(config.hydra.runtime.output_dir)), reason)
            except Exception:  # noqa: BLE001 - bookkeeping must not hide the job's own error
                pass
            line = f"sweep job {num} failed ({' '.join(config.hydra.overrides.task)}): {reason}"
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        if _is_multirun(config):
            marker = Path(str(config.hydra.sweep.dir)) / ".progress" / f"{num}.json"
            marker.parent.mkdir(parents=True, exist_ok=True)
            seconds = time.perf_counter() - self.t0.get(num, time.perf_counter())
            marker.write_text(json.dumps({"job": num, "status": status, "seconds": round(seconds, 1),
                                          "overrides": list(config.hydra.overrides.task),
                                          **({"reason": reason} if reason else {})}) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            if status == "failed":
                self.bar.set_postfix_str(f"job {num} failed")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        os.environ.pop(POSITION_ENV, None)

"""Crash windows of a run directory (issue 12, item 5): every test kills or interrupts a run at one point and checks
what the next attempt does. In-process tests interrupt with a BaseException (as a kill would: nothing after the
point runs); the subprocess tests SIGKILL a real ``python -m harness`` at the named function.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.engines import ENGINES
from harness.engines.base import Generation

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures"


class Killed(BaseException):
    """Stands for a kill: not an Exception, so no handler of the harness swallows it."""


class FlakyEngine:
    """Deterministic answers; dies (``Killed``) in ``__init__`` (model load) or after ``die_after`` requests."""

    calls: list[str] = []
    die_in_init = False
    die_after: int | None = None
    stats: dict | None = None

    def __init__(self, *args, **kwargs):
        if FlakyEngine.die_in_init:
            raise Killed("killed during start-up")

    def generate_batch(self, requests):
        out = []
        for r in requests:
            if FlakyEngine.die_after is not None and len(FlakyEngine.calls) >= FlakyEngine.die_after:
                raise Killed("killed during generation")
            FlakyEngine.calls.append(r.uid)
            out.append(Generation(uid=r.uid, text=json.dumps({"answer": f"答 {r.uid}"}, ensure_ascii=False),
                                  prompt_tokens=10, output_tokens=3, ttft_ms=1.0, tpot_ms=0.5, e2e_ms=2.0))
        return out

    def technique_stats(self):
        return {"sere": dict(FlakyEngine.stats)} if FlakyEngine.stats else {}

    def describe(self):
        return {"engine": "flaky", "engine_version": "0", "device": "cpu", "dtype": "float32", "batch_size": 1}

    def close(self):
        pass


@pytest.fixture
def flaky(monkeypatch, tmp_path):
    monkeypatch.setitem(ENGINES, "flaky", f"{__name__}:FlakyEngine")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "hcache"))
    FlakyEngine.calls, FlakyEngine.die_in_init, FlakyEngine.die_after, FlakyEngine.stats = [], False, None, None
    return FlakyEngine


def config(*overrides: str):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "engine.name=flaky", "engine.batch_size=1", "engine.warmup=0", "wandb.mode=disabled",
            "model.embedded=false", "model.path=unused", "scoring.clip_model=null", "scoring.embed_model=null",
            *overrides])
    GlobalHydra.instance().clear()
    return cfg


def lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines()]


def test_a_resume_killed_during_start_up_still_resumes(tmp_path, flaky):
    """Old code: the killed resume had renamed samples.jsonl away, so attempt 3 saw a fresh directory and
    regenerated all 12 samples."""
    from harness.run.experiment import run_experiment

    run = tmp_path / "run"
    flaky.die_after = 4
    with pytest.raises(Killed):
        run_experiment(config(), run)  # attempt 1: killed after 4 samples
    assert len(lines(run / "samples.jsonl")) == 4
    flaky.die_after, flaky.die_in_init = None, True
    with pytest.raises(Killed):
        run_experiment(config(), run)  # attempt 2 (the resume): killed while loading the model
    assert not (run / "samples.jsonl").exists()
    flaky.die_in_init = False
    flaky.calls = []
    summary = run_experiment(config(), run)  # attempt 3
    assert len(flaky.calls) == 8  # only the unfinished samples reach the model
    assert summary["latency"]["n_cached"] == 4 and summary["run"]["attempt"] == 3
    assert len(lines(run / "samples.jsonl")) == 12
    state = json.loads((run / "run_state.json").read_text())
    assert state["status"] == "finished" and [a["resumed"] for a in state["attempts"]] == [False, True, True]


def test_a_rerun_from_another_directory_replays(tmp_path, flaky, monkeypatch):
    """The default cache path is under $HARNESS_CACHE, not the working directory: a resume typed elsewhere replays."""
    from harness.run.experiment import run_experiment

    run = tmp_path / "run"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    flaky.die_after = 5
    with pytest.raises(Killed):
        run_experiment(config(), run)
    monkeypatch.chdir(tmp_path / "b")
    flaky.die_after, flaky.calls = None, []
    summary = run_experiment(config(), run)
    assert len(flaky.calls) == 7 and summary["cache"]["hits"] == 5
    assert summary["cache"]["path"] == str(tmp_path / "hcache" / "generations")


def test_cache_path_resolves_like_dataset_paths(tmp_path, monkeypatch):
    from harness.run.cache import GenerationCache

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert GenerationCache("~/gens").path == tmp_path / "home" / "gens"  # old code: a directory named "~"
    assert (tmp_path / "home" / "gens").is_dir() and not (tmp_path / "~").exists()
    assert GenerationCache("rel/gens").path == tmp_path / "rel" / "gens"  # absolute in summary.json cache.path


def test_technique_statistics_of_a_resumed_run_are_marked_partial(tmp_path, flaky):
    """Old code: summary.sere of a resumed run covered only the resumed requests and did not say so. (The engine
    reports SERE statistics whatever the config: the engine-side statistics are what is under test.)"""
    from harness.run.experiment import run_experiment

    run = tmp_path / "run"
    flaky.stats = {"steps": 10, "expert_union_before": 5.0, "expert_union_after": 3.0}
    flaky.die_after = 3
    with pytest.raises(Killed):
        run_experiment(config(), run)
    flaky.die_after = None
    summary = run_experiment(config(), run)
    sere = summary["sere"]
    assert (sere["partial"], sere["requests_covered"], sere["requests_replayed"]) == (True, 9, 3)
    assert any("sere statistics cover the 9 requests" in w for w in summary["warnings"])
    fresh = run_experiment(config(), tmp_path / "fresh")  # a fresh directory: all covered
    assert (fresh["sere"]["partial"], fresh["sere"]["requests_covered"]) == (False, 12)


def test_a_second_process_on_a_run_directory_is_refused_and_a_dead_holder_s_lock_is_taken_over(tmp_path, flaky):
    from harness.run.experiment import run_experiment
    from harness.run.state import RunDirLocked, RunLock

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from harness.run.state import RunLock; "
        f"RunLock(Path({str(run)!r})).acquire(); print('locked', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=f"in use by pid {holder.pid} on"):
            run_experiment(config(), run)
        assert flaky.calls == [] and not (run / "samples.jsonl").exists()  # nothing of the first process touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / ".lock").exists()  # the dead holder's file stays; its flock went with it
    summary = run_experiment(config(), run)
    assert summary["metrics"]["n_samples"] == 12
    with RunLock(run):  # released at the end of the run
        pass


# ------------------------------------------------------------------------------------------------ subprocesses

# KILL_AT=module:function or module:Class.method replaces that callable by a SIGKILL of the process
BOOT = ("import os, signal, sys; sys.path.insert(0, {fixtures!r}); from harness.engines import ENGINES; "
        "ENGINES['counting'] = 'counting_engine:CountingEngine'\n"
        "kill_at = os.environ.get('KILL_AT')\n"
        "if kill_at:\n"
        "    import importlib; mod, _, path = kill_at.partition(':'); *owners, name = path.split('.')\n"
        "    target = importlib.import_module(mod)\n"
        "    for owner in owners: target = getattr(target, owner)\n"
        "    setattr(target, name, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))\n"
        "from harness.cli import main; main()")


def harness(tmp_path, run_dir, *overrides, kill_at=None, **env):
    cmd = [sys.executable, "-c", BOOT.format(fixtures=str(FIXTURES)), "engine.name=counting", "engine.batch_size=1",
           "engine.warmup=0", "model.embedded=false", "model.path=unused", "scoring.clip_model=null",
           "scoring.embed_model=null", f"hydra.run.dir={run_dir}", *overrides]
    full_env = {**os.environ, "WANDB_SILENT": "true", "HARNESS_CACHE": str(tmp_path / "hcache"),
                "COUNTING_ENGINE_LOG": str(tmp_path / "calls.log"), **env}
    full_env.pop("KILL_AT", None)
    if kill_at:
        full_env["KILL_AT"] = kill_at
    return subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_w_and_b_starts_with_the_run_and_a_kill_while_logging_is_redone_by_the_rerun(tmp_path):
    """Old code: W&B started only after summary.json, and a rerun of a run killed while logging returned early."""
    run = tmp_path / "run"
    # killed in the middle of generation: the W&B run exists already, with live progress
    # (the first answer takes 3 s, beyond W&B's flush interval harness.results.tracking.FLUSH_INTERVAL_S)
    killed = harness(tmp_path, run, "wandb.mode=offline", kill_at="harness.metrics.scoring:Scorer.__call__",
                     COUNTING_ENGINE_DELAY="3")
    assert killed.returncode == -signal.SIGKILL
    (first,) = (run / "wandb").glob("offline-run-*")
    assert b"progress/samples_total" in b"".join(p.read_bytes() for p in first.glob("*.wandb"))
    # rerun, killed while W&B logs the finished run (after summary.json)
    killed = harness(tmp_path, run, "wandb.mode=offline", kill_at="harness.results.tracking:LiveRun.finish")
    assert killed.returncode == -signal.SIGKILL and (run / "summary.json").exists()
    state = json.loads((run / "run_state.json").read_text())
    assert state["status"] == "finished" and state["wandb"]["logged"] is False
    calls = (tmp_path / "calls.log").read_text().split()
    # the next rerun generates nothing and logs W&B (same W&B run id)
    done = harness(tmp_path, run, "wandb.mode=offline")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "calls.log").read_text().split() == calls
    state = json.loads((run / "run_state.json").read_text())
    assert state["wandb"]["logged"] is True
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run"]["wandb_dir"] and state["wandb"]["id"] in summary["run"]["wandb_dir"]
    offline = sorted((run / "wandb").glob(f"offline-run-*-{state['wandb']['id']}*"))
    assert len(offline) == 3  # one per attempt, all under the one W&B run id
    assert b"results-" in b"".join(p.read_bytes() for p in offline[-1].glob("*.wandb"))  # the artifact
    # and a fourth run has nothing left to do
    again = harness(tmp_path, run, "wandb.mode=offline")
    assert again.returncode == 0 and len(list((run / "wandb").glob("offline-run-*"))) == 3


@pytest.mark.slow
def test_a_second_harness_process_exits_2_with_a_clear_error(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-c", BOOT.format(fixtures=str(FIXTURES)), "engine.name=counting", "engine.batch_size=1",
         "engine.warmup=0", "model.embedded=false", "model.path=unused", "scoring.clip_model=null",
         "scoring.embed_model=null", "wandb.mode=disabled", f"hydra.run.dir={run}"],
        # 60 s per request: the first run still holds the directory when the second has started, however loaded
        # the machine (at 0.5 s it could finish first under pytest-xdist); it is killed below
        cwd=tmp_path, env={**os.environ, "HARNESS_CACHE": str(tmp_path / "hcache"),
                           "COUNTING_ENGINE_DELAY": "60"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "samples.jsonl").exists() and time.time() < deadline:
            time.sleep(0.1)
        second = harness(tmp_path, run, "wandb.mode=disabled")
        assert second.returncode == 2
        assert "error: run directory" in second.stderr and f"in use by pid {first.pid}" in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch, caplog):
    """Lustre without ``-o flock`` answers flock with ENOSYS: the run must go on (unprotected), not crash."""
    import errno
    import fcntl

    from harness.run import state as run_state

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level("WARNING", logger="harness.run.state"):
        with run_state.RunLock(tmp_path):
            pass
    assert "does not support locks" in caplog.text

"""Sweep definitions (sweeps/*.yaml) and launcher configs (conf/hydra/launcher/): they compose, expand into the
intended jobs, every job validates against the schemas, and the submitit launcher runs a real two-job sweep."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

from harness.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = ROOT / "harness/sweeps"
CONF = ROOT / "harness/conf"
SEARCHPATH = f"hydra.searchpath=[file://{ROOT / 'harness/conf'}]"
EXPECTED_JOBS = {"visionzip_keep": 16, "sere_grid": 24, "joint": 16, "baseline": 2, "baselines_equal_budget": 13}
SLURM_ENV = ("HARNESS_SLURM_PARTITION", "HARNESS_SLURM_ACCOUNT", "HARNESS_SLURM_QOS", "HARNESS_SLURM_CONSTRAINT",
             "HARNESS_SLURM_EXCLUDE", "HARNESS_SLURM_GRES", "HARNESS_SLURM_GPUS", "HARNESS_SLURM_CPUS",
             "HARNESS_SLURM_MEM_GB", "HARNESS_SLURM_TIME_MIN", "HARNESS_SLURM_ARRAY_PARALLELISM",
             "HARNESS_SLURM_MAX_REQUEUE", "HARNESS_SLURM_SETUP", "HARNESS_SLURM_EXTRA", "WANDB_MODE")


def _compose(config_name: str, overrides: list[str] = (), old_form: bool = False):
    """Compose like ``python -m harness --config-name NAME [overrides]`` (the sweep found by name in the package's
    config directory, from anywhere), or with ``old_form`` like ``--config-dir sweeps --config-name NAME``
    (hydra node kept)."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(SWEEPS if old_form else CONF), version_base="1.3"):
            extra = [SEARCHPATH] if old_form else []
            return compose(config_name=config_name, overrides=[*extra, *overrides], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def without_hydra(cfg):
    """The job's config as the task function sees it (Hydra removes its own node)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def expand(config_name: str, overrides: list[str] = ()) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper makes: swept params, then the command line (which wins)."""
    cfg = _compose(config_name, [o for o in overrides if "," not in o])
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    parsed = OverridesParser.create().parse_overrides([*params, *overrides])
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return batch


def job_configs(config_name: str, overrides: list[str] = ()):
    return [_compose(config_name, job) for job in expand(config_name, overrides)]


def sweep_names() -> list[str]:
    return sorted(p.stem for p in SWEEPS.glob("*.yaml"))


def test_every_sweep_file_is_known():
    assert sweep_names() == sorted(EXPECTED_JOBS)


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_every_sweep_is_found_by_name_in_the_package_config_dir(name):
    """``--config-name NAME`` works from any directory (an installed wheel included) because the package's config
    directory links every sweep; the link must point at the one definition in harness/sweeps."""
    link = CONF / f"{name}.yaml"
    assert link.is_symlink() and link.resolve() == (SWEEPS / f"{name}.yaml").resolve()


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_old_config_dir_form_composes_the_same_jobs(name):
    new = [OmegaConf.to_container(without_hydra(_compose(name, job)), resolve=True) for job in expand(name)]
    old = [OmegaConf.to_container(without_hydra(_compose(name, job, old_form=True)), resolve=True)
           for job in expand(name)]
    assert new == old


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_sweep_composes_with_a_stable_sweep_dir(name):
    cfg = _compose(name)
    assert cfg.hydra.sweep.dir.startswith(f"results/multirun/{name}/")
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert cfg.wandb.job_type == "auto"
    assert len(expand(name)) == EXPECTED_JOBS[name]


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_every_job_of_every_sweep_validates_against_the_schemas(name):
    from harness.run.validate import validate_config

    for cfg in job_configs(name):
        OmegaConf.to_container(cfg, resolve=False)  # composed against the dataclass schemas
        validate_config(without_hydra(cfg))  # and every value passes the rules checked before a model loads
        assert 0 < cfg.visionzip.keep <= 1.0 and cfg.visionzip.scope in {"request", "image"}
        assert cfg.sere.k is None or cfg.sere.k in {1, 2, 4}


def settings(cfgs, *keys):
    return {tuple(OmegaConf.select(c, k) for k in keys) for c in cfgs}


def test_visionzip_keep_grid():
    cfgs = job_configs("visionzip_keep")
    assert settings(cfgs, "dataset.name", "visionzip.keep", "visionzip.scope") == {
        (d, k, s) for d in ("rag_igbench", "ocr_cc_mix") for k in (1.0, 0.7, 0.6, 0.5) for s in ("request", "image")}
    assert all(c.sere.k is None for c in cfgs)
    mix = [c for c in cfgs if c.dataset.name == "ocr_cc_mix"]
    assert mix and all(c.dataset.n_per_source == 1000 for c in mix)  # the full mix, not the bundled sample


def test_sere_grid():
    cfgs = job_configs("sere_grid")
    assert settings(cfgs, "sere.k", "sere.rho", "sere.protect") == {
        (k, r, p) for k in (1, 2, 4) for r in (0.0, 0.1, 0.3, 0.5) for p in (0, 16)}
    assert all(c.visionzip.keep == 1.0 and c.dataset.name == "rag_igbench" for c in cfgs)


def test_joint_grid():
    cfgs = job_configs("joint")
    assert settings(cfgs, "dataset.name", "visionzip.keep", "sere.k") == {
        (d, k, s) for d in ("rag_igbench", "ocr_cc_mix") for k in (1.0, 0.7, 0.6, 0.5) for s in (None, 2)}
    assert all(c.sere.rho == 0.1 and c.sere.protect == 16 for c in cfgs)


def test_command_line_replaces_a_swept_value():
    jobs = expand("visionzip_keep", ["dataset=rag_igbench_sample,ocr_cc_mix_sample", "visionzip.keep=0.6"])
    assert len(jobs) == 4  # 2 datasets x 1 keep x 2 scopes
    cfgs = [_compose("visionzip_keep", j) for j in jobs]
    assert any(str(p).endswith("harness/datasets/bundled/rag_igbench_sample/data.jsonl") for (p,) in settings(cfgs, "dataset.path"))
    assert {c.visionzip.keep for c in cfgs} == {0.6}


# ------------------------------------------------------------------------------------------ launchers


@pytest.fixture
def clean_env(monkeypatch):
    for var in SLURM_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def slurm_launcher(overrides=()):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose("visionzip_keep", ["hydra/launcher=slurm", *overrides])
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_slurm_launcher_defaults(clean_env):
    p = slurm_launcher()
    assert p["_target_"].endswith("SlurmLauncher")
    assert p["partition"] is None and p["account"] is None and p["gres"] is None
    assert (p["gpus_per_node"], p["cpus_per_task"], p["mem_gb"], p["timeout_min"]) == (1, 16, 128, 240)
    assert p["array_parallelism"] == 8 and p["max_num_timeout"] == 2
    assert p["setup"] == ["true", "export WANDB_MODE=offline"] and p["additional_parameters"] == {}
    assert p["submitit_folder"].endswith("/.submitit/%j") and p["submitit_folder"].startswith("results/multirun/")


def test_slurm_launcher_takes_its_settings_from_the_environment(clean_env, tmp_path):
    env = {"HARNESS_SLURM_PARTITION": "h200", "HARNESS_SLURM_ACCOUNT": "proj42", "HARNESS_SLURM_GPUS": "2",
           "HARNESS_SLURM_CPUS": "24", "HARNESS_SLURM_MEM_GB": "200", "HARNESS_SLURM_TIME_MIN": "90",
           "HARNESS_SLURM_ARRAY_PARALLELISM": "4", "HARNESS_SLURM_SETUP": "module load cuda/12.4; echo ready",
           "HARNESS_SLURM_EXTRA": "{mail-type: END, mail-user: me@example.org}", "WANDB_MODE": "online"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    p = slurm_launcher()
    assert (p["partition"], p["account"], p["gpus_per_node"], p["cpus_per_task"]) == ("h200", "proj42", 2, 24)
    assert (p["mem_gb"], p["timeout_min"], p["array_parallelism"]) == (200, 90, 4)
    assert p["setup"] == ["module load cuda/12.4; echo ready", "export WANDB_MODE=online"]
    assert p["additional_parameters"] == {"mail-type": "END", "mail-user": "me@example.org"}
    # command-line overrides still win over the environment
    assert slurm_launcher(["hydra.launcher.partition=debug"])["partition"] == "debug"

    # what submitit makes of it: the sbatch script of a 16-task array, built the way the launcher builds its
    # executor (hydra_submitit_launcher.submitit_launcher.BaseSubmititLauncher.launch), without submitting
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm.slurm import SlurmExecutor, _make_sbatch_string

    clean_env.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun on this machine
    executor = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path / "%j"),
                                     slurm_max_num_timeout=p["max_num_timeout"])
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in p.items()
                                  if k not in {"_target_", "submitit_folder", "max_num_timeout"}})
    script = _make_sbatch_string(command="python -m submitit.core._submit /tmp", folder=str(tmp_path / "%j"),
                                 map_count=16, **executor._executor.parameters)
    for line in ("#SBATCH --partition=h200", "#SBATCH --account=proj42", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --cpus-per-task=24", "#SBATCH --mem=200GB", "#SBATCH --time=90", "#SBATCH --array=0-15%4",
                 "#SBATCH --mail-type=END", "module load cuda/12.4; echo ready", "export WANDB_MODE=online"):
        assert line in script, line


def test_local_launcher_composes(clean_env):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose("baseline", ["hydra/launcher=local"])
    p = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert p["_target_"].endswith("LocalLauncher") and p["gpus_per_node"] == 0 and p["timeout_min"] == 240


@pytest.mark.slow
def test_submitit_local_runs_a_two_job_sweep(tmp_path, clean_env):
    """The Slurm code path without Slurm: one process per job, both jobs land in one stable sweep directory."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "-m", "--config-name", "baseline",  # found by name, from tmp_path
         "hydra/launcher=local", "dataset=rag_igbench_sample,ocr_cc_mix_sample", "dataset.limit=2",
         "generation.max_new_tokens=4", "engine.warmup=0", "wandb.mode=disabled"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "results/multirun/baseline").iterdir()
    assert (sweep_dir / "multirun.yaml").is_file() and (sweep_dir / ".submitit").is_dir()
    summaries = {int(p.parent.name): json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")}
    assert sorted(summaries) == [0, 1]
    assert {s["config"]["dataset"]["name"] for s in summaries.values()} == {"rag_igbench", "ocr_cc_mix"}
    for s in summaries.values():
        run_dir = tmp_path / s["run"]["run_dir"]
        assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 2 and s["latency"]["ttft_ms"]["n"] == 2
        assert run_dir.resolve().parent == sweep_dir.resolve()
        if "sweep" in s["run"]:  # tracking.sweep_info (the W&B group): one id for the jobs of both processes
            assert s["run"]["sweep"]["id"] == f"baseline/{sweep_dir.name}"

    # and the report reads the sweep as it was left
    from harness.report.build import build_report

    out = build_report([sweep_dir], tmp_path / "report")
    assert len(out.rows) == 2 and (tmp_path / "report/report.md").is_file()


# ------------------------------------------------------------------------------------------ W&B naming


def test_wandb_group_job_type_and_tags(monkeypatch, tmp_path):
    """tracking.log_run: group = sweep id, job type from the technique (wandb.job_type=auto), setting tags."""
    from harness.results import tracking

    import types

    seen = {}

    class FakeRun:
        id, dir, summary = "abc", str(tmp_path), {}

        def log(self, *a, **k): pass
        def log_artifact(self, *a, **k): pass
        def finish(self): pass

    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or FakeRun(),
                                 Table=lambda **kw: types.SimpleNamespace(add_data=lambda *a: None),
                                 Artifact=lambda **kw: types.SimpleNamespace(add_file=lambda *a: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _compose("joint", ["visionzip.keep=0.6", "sere.k=2"])
    config = OmegaConf.to_container(cfg, resolve=False)
    config.pop("hydra", None)
    sweep = {"id": "joint/2026-05-01_12-00-00", "name": "joint", "job_num": 5}
    summary = {"run": {"engine": "hf", "weights": "real", "sweep": sweep}, "metrics": {}, "latency": {"partial": True}}
    tracking.log_run(OmegaConf.create(config["wandb"] | {"mode": "offline"}), config, summary, [], tmp_path, "5")
    assert seen["group"] == "joint/2026-05-01_12-00-00" and seen["job_type"] == "visionzip+sere"
    assert {"keep=0.6", "scope=request", "sere.k=2", "sere.rho=0.1", "sere.protect=16", "dataset=rag_igbench",
            "weights=real", "latency-partial"} <= set(seen["tags"])
    assert seen["name"].startswith("joint#5 rag_igbench keep=0.6")
    # an explicit wandb.group / job_type wins
    tracking.log_run(OmegaConf.create(config["wandb"] | {"mode": "offline", "group": "mine", "job_type": "eval"}),
                     config, summary, [], tmp_path, "5")
    assert (seen["group"], seen["job_type"]) == ("mine", "eval")


@pytest.mark.slow
def test_a_refused_job_does_not_stop_the_sweep_and_is_recorded_failed(tmp_path):
    """Issue 25: `-m visionzip.keep=1.5,0.9` refused job 0 and never ran job 1; the refused job's run_state.json
    stayed `running`, so --status called it "running or interrupted"."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_SILENT": "true", "HARNESS_PROGRESS": "0"}
    proc = subprocess.run([sys.executable, "-m", "harness", "-m", "visionzip.keep=1.5,0.9",
                           f"hydra.sweep.dir={sweep}", "wandb.mode=disabled", "dataset.limit=1",
                           "generation.max_new_tokens=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (sweep / "1" / "summary.json").is_file(), proc.stderr[-3000:]  # the valid job ran
    state = json.loads((sweep / "0" / "run_state.json").read_text())
    assert state["status"] == "failed" and "visionzip.keep" in state["reason"]
    assert "sweep: 1 of 2 jobs refused before any ran" in proc.stderr  # every job validated up front
    assert "sweep job 0 failed (visionzip.keep=1.5 " in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr  # transformers' bars: off during a run (harness/run/logs.py)
    from harness.report.status import sweep_status

    st = sweep_status(sweep)
    assert (st["finished"], st["failed"], st["running_or_interrupted"]) == (1, ["0"], [])
    assert "visionzip.keep" in st["failed_reasons"]["0"]

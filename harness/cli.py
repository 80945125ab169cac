"""``python -m harness [overrides]``: compose the Hydra config and run one experiment (or a sweep with -m)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.config import register_configs

register_configs()

# Absolute, so the configs are found whatever the working directory and however the module is started.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from harness.datasets.base import DatasetError
    from harness.outcome import console_summary
    from harness.run import TechniqueNotAvailable, run_experiment
    from harness.run_state import RunDirLocked

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run_experiment(cfg, run_dir)
    except (TechniqueNotAvailable, DatasetError, RunDirLocked) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # a short summary (key metrics, latency, warnings) rather than a JSON dump: the numbers are in summary.json
    print(console_summary(summary, str(run_dir)), flush=True)

"""``python -m harness.opencompass [overrides]`` (in ``.venv-opencompass``): one OpenCompass evaluation of the
configured model with the run's techniques, or a sweep with ``-m``. Same Hydra config tree as
``python -m harness`` (``sere.*``, ``moe.*``, ``engine.*``, ``model=...``) plus the ``opencompass.*`` block."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.config.schema import register_configs
from harness.engines.base import TechniqueNotAvailable
from harness.opencompass.runner import run_opencompass, OpenCompassFailed
from harness.opencompass.suites import OpenCompassDataMissing, OpenCompassDependencyMissing
from harness.run.validate import hydra_error_line, ConfigError

register_configs()
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run_opencompass(cfg, run_dir)
    except (TechniqueNotAvailable, ConfigError, OpenCompassDataMissing, OpenCompassDependencyMissing,
            OpenCompassFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({"run_dir": str(run_dir), "opencompass": summary["metrics"]["opencompass"],
                      "tpot_ms": summary["latency"].get("tpot_ms")}, ensure_ascii=False, indent=2))


def entry() -> None:
    """:func:`main`, with Hydra's composition errors (a misspelt key, a wrong type) as one line and exit code 2,
    as ``python -m harness`` (harness.cli.entry)."""
    import os

    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except Exception as e:  # noqa: BLE001 - only composition errors become a line; the rest re-raised
        line = hydra_error_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()

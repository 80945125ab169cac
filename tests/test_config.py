"""The Hydra configuration composes for every group option and rejects bad keys and types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from harness.config import GROUP_SCHEMAS, register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture
def compose_cfg():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides=(): compose(config_name="config", overrides=list(overrides))
    GlobalHydra.instance().clear()


def group_options() -> list[tuple[str, str]]:
    return [(g, f.stem) for g in GROUP_SCHEMAS for f in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_a_yaml_and_a_schema():
    for group in GROUP_SCHEMAS:
        assert list((CONF / group).glob("*.yaml")), f"no options for group {group}"


@pytest.mark.parametrize("group,option", group_options())
def test_every_option_composes(compose_cfg, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    node = OmegaConf.to_object(cfg[group])  # instantiates the dataclass: types checked
    assert isinstance(node, GROUP_SCHEMAS[group])


def test_defaults_are_the_embedded_path(compose_cfg):
    cfg = compose_cfg()
    assert cfg.model.embedded and cfg.model.weights == "trained-synthetic"  # model=tiny: the committed checkpoint
    assert cfg.dataset.name == "rag_igbench"
    assert cfg.engine.name == "hf"
    assert cfg.visionzip.keep == 1.0 and cfg.sere.k is None
    assert cfg.wandb.mode == "offline"


def test_technique_knobs_are_plain_overrides(compose_cfg):
    cfg = compose_cfg(["sere.k=2", "visionzip.keep=0.6"])
    assert cfg.sere.k == 2 and cfg.visionzip.keep == 0.6


def test_misspelt_key_is_rejected(compose_cfg):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["sere.kk=2"])
    assert "kk" in str(e.value.__cause__ or e.value)


def test_wrong_type_is_rejected(compose_cfg):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_cfg(["engine.batch_size=two"])
    assert "batch_size" in str(e.value.__cause__ or e.value)


def test_unknown_key_in_struct_config_cannot_be_added_later(compose_cfg):
    cfg = compose_cfg()
    with pytest.raises(ConfigAttributeError):
        cfg.sere.nonexistent = 1


def test_help_lists_the_groups():
    out = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for group in ("model", "dataset", "engine", "visionzip", "sere", "wandb"):
        assert f"{group}:" in out

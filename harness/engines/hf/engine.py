"""Hugging Face transformers engine: batched greedy generation with per-request TTFT/TPOT.

Why it exists beside vLLM: it runs anywhere (CPU CI included) and it is the reference against which every
other engine's tokens are checked. Decoding: on CUDA (``engine.cuda_graphs``, on by default) a static-cache
greedy decoder replays each decode step as a captured CUDA graph (``hf_graphs.py``, gpt-fast style) and
timestamps every step with CUDA events; elsewhere ``model.generate`` runs with a stopping criterion that never
stops and records a timestamp after every generated token. Either way, for each request of a batch

- TTFT = time from the batch's start (chat template and image pre-processing included) to its first token,
- E2E  = time to its last token (its end-of-sequence token, or the last allowed one),
- TPOT = (E2E − TTFT) / (output tokens − 1), undefined for one-token outputs,

exactly the serving definitions, applied to a static batch: every request of a batch shares the batch's
prefill, so TTFT includes the whole batch's prefill (state the batch size next to any TTFT).
Padding is on the left, as generation requires; the processor expands each ``<|image_pad|>``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from harness.engines.base import EngineUnavailable, Generation, Request, TechniqueNotAvailable, generate_splitting
from harness.engines.hf.decode_path import (capture_reason, random_routing_reason, resolve_decode_path,
                                            resolve_experts_implementation, split_reason)

# resolve_device / resolve_dtype live in harness.models.load (a technique or tool needs them without the engine)
from harness.models.load import _DTYPES, resolve_device, resolve_dtype  # noqa: F401
from harness.models.families import family_of
from harness.models.load import load_processor, model_class_for
from harness.models.real_shapes import family_settings, shapes_hf_config, shapes_model_for_engine
from harness.results.envinfo import device_name, package_version
from harness.techniques.moe_routing import routing_settings
from harness.techniques.moe_topk import moe_settings
from harness.techniques.offload.timing import offload_summary


class _StepClock:
    """A ``StoppingCriteria`` that only records when each generation step finished (``now``: the engine's
    clock, injectable so tests can script the timings)."""

    def __init__(self, device: str, now=time.perf_counter):
        import torch

        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.now = now
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.sync()
        self.times.append(self.now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _visionzip_generation(model, ctx):
    """The VisionZip generation context, or a no-op one when VisionZip is off."""
    if ctx is None:
        return contextlib.nullcontext()
    from harness.engines.hf.visionzip import visionzip_generation

    return visionzip_generation(model, ctx)


class HFEngine:
    """Generate with a ``transformers`` image-text-to-text model loaded from a local path or hub id."""

    name = "hf"

    def __init__(self, model_path: str, engine_cfg: Any, generation_cfg: Any, trust_remote_code: bool = False,
                 sere_cfg: Any = None, visionzip_cfg: Any = None, model_id: str | None = None,
                 moe_cfg: Any = None, offload_cfg: Any = None, shapes_cfg: Any = None, seed: int = 0):
        import torch

        moe = moe_settings(moe_cfg, sere_cfg)  # a bad moe.* value fails before the model loads
        routing_settings(moe_cfg)  # moe.routing too
        self.cfg = engine_cfg
        self.gen_cfg = generation_cfg
        self.device = resolve_device(engine_cfg.device)
        self.dtype = resolve_dtype(engine_cfg.dtype, self.device)
        self.experts_impl = resolve_experts_implementation(engine_cfg.experts_implementation, self.device)
        self.shapes_info = None
        self.attn_implementation = engine_cfg.attn_implementation
        self.device_map = getattr(engine_cfg, "device_map", None)
        if shapes_cfg is not None and getattr(shapes_cfg, "arch", None):  # random weights, built on the device
            # the family's refusals before a (possibly 57 GiB) build, as for a checkpoint
            self._family_checks(shapes_hf_config(shapes_cfg), visionzip_cfg, offload_cfg)
            self.model, self.processor, self.shapes_info = shapes_model_for_engine(
                shapes_cfg, self.device, self.dtype, self.experts_impl, seed=seed,
                attn_implementation=engine_cfg.attn_implementation)
            # what the build used (a family without the fused experts kernel falls back): describe() says so
            self.experts_impl = family_settings(shapes_cfg.arch, self.experts_impl,
                                                engine_cfg.attn_implementation)[0]
        else:
            from transformers import AutoConfig

            try:
                hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            except (OSError, ValueError) as e:  # a hub id not cached and no network; a config.json it cannot read
                hint = (" (this machine may have no network: download the checkpoint where there is one and point "
                        "model.path at it)") if isinstance(e, OSError) else ""
                raise EngineUnavailable(f"model.path={model_path}: {str(e).strip().splitlines()[0]}{hint}") from e
            model_cls = model_class_for(hf_config)  # the family's auto class (text-only families: causal LM)
            self.family = self._family_checks(hf_config, visionzip_cfg, offload_cfg)
            if self.experts_impl == "harness_fused_moe" and self.family is not None \
                    and self.family.refusal("harness_fused_moe"):
                if engine_cfg.experts_implementation == "auto":  # auto: transformers' own experts instead
                    self.experts_impl = None
                else:
                    raise TechniqueNotAvailable(self.family.refusal("harness_fused_moe"))
            self.processor = load_processor(model_path, hf_config, trust_remote_code)
            self.processor.tokenizer.padding_side = "left"
            if self.family is not None and self.family.attention and engine_cfg.attn_implementation == "sdpa":
                self.attn_implementation = self.family.attention  # transformers has no SDPA path for it
            kwargs: dict[str, Any] = {"dtype": self.dtype, "attn_implementation": self.attn_implementation}
            if self.experts_impl:
                kwargs["experts_implementation"] = self.experts_impl
            if self.device_map:  # accelerate places the weights (docs/real_shapes.md): no .to(device) after it
                kwargs["device_map"] = self.device_map
                max_memory = dict(getattr(engine_cfg, "max_memory", None) or {})
                if max_memory:
                    kwargs["max_memory"] = {int(k) if str(k).isdigit() else str(k): str(v)
                                            for k, v in max_memory.items()}
                self.model = model_cls.from_pretrained(
                    model_path, trust_remote_code=trust_remote_code, **kwargs).eval()
            else:
                self.model = model_cls.from_pretrained(
                    model_path, trust_remote_code=trust_remote_code, **kwargs
                ).to(self.device).eval()
        self.tokenizer_free = bool(getattr(self.processor, "tokenizer_free", False))
        # engine.decode_attention: decode steps' attention through the Triton kernel (hf_attention_decode)
        self.decode_attention, self.decode_attention_reason = self._install_decode_attention(engine_cfg)
        self.router_kernel_layers = self._install_decode_router(engine_cfg)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.processor.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        # generation.ignore_eos: every request decodes max_new_tokens tokens (synthetic load: TPOT over a known count)
        self.ignore_eos = bool(getattr(generation_cfg, "ignore_eos", False))
        self.stop_ids = set() if self.ignore_eos else self.eos_ids
        self.pad_id = self.processor.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_ids))
        self.image_token_id = getattr(self.model.config, "image_token_id", None)
        # engine.decode_path (engine.cuda_graphs on CUDA): compiled regions + manual CUDA graph (hf_compile),
        # the manual graph of the eager step (hf_graphs), or model.generate
        self.cuda_graphs = bool(getattr(engine_cfg, "cuda_graphs", False)) and self.device.startswith("cuda")
        self.decode_path_requested = str(getattr(engine_cfg, "decode_path", "auto") or "auto")
        routing = routing_settings(moe_cfg)
        self.decode_path, self.decode_path_reason = resolve_decode_path(
            self.decode_path_requested, self.device, bool(getattr(engine_cfg, "cuda_graphs", False)),
            split_reason(self.model) or capture_reason(self.model) or random_routing_reason(routing))
        self.compile_info: dict[str, Any] | None = None
        self._graph_decoder = None
        self._make_decoder()
        self._torch = torch
        self.vz_cfg = visionzip_cfg if visionzip_cfg is not None and visionzip_cfg.keep < 1.0 else None
        if self.vz_cfg is not None:
            from harness.engines.hf.visionzip import supports_visionzip

            if not supports_visionzip(self.model):
                raise ValueError(f"VisionZip needs a Qwen3-VL(-MoE) model (deepstack vision tower), got "
                                 f"{type(self.model).__name__}")
        self.sere = self.moe = None
        self._decode_tokens, self._sere_partial = 0, False  # the SERE canary's count (sere_graphs)
        sere_artifacts = None
        if sere_cfg is not None and sere_cfg.k is not None:  # computed on the stock model, before any hook
            from harness.techniques.sere.setup import sere_artifacts_from_config

            sere_artifacts = sere_artifacts_from_config(self.model, self.processor.tokenizer, sere_cfg,
                                                        model_id or model_path)
        if moe is not None:  # moe.top_k: plain top-K truncation (hf_topk); before SERE, which re-routes its output
            from harness.engines.hf.topk import install_topk

            self.moe = install_topk(self.model, moe[0], moe[1], eos_token_ids=sorted(self.stop_ids))
        if routing is not None:  # moe.routing: SERE's trivial baselines (issue 31), alone (validate refuses a mix)
            from harness.engines.hf.routing_baselines import install_routing_baseline

            self.moe = install_routing_baseline(self.model, routing, eos_token_ids=sorted(self.stop_ids))
        if sere_artifacts is not None:
            from harness.engines.hf.sere import install_sere

            similarity, protected = sere_artifacts
            self.sere = install_sere(self.model, similarity, int(sere_cfg.k), float(sere_cfg.rho), protected,
                                     eos_token_ids=sorted(self.stop_ids))
        self.offload = None
        if offload_cfg is not None and offload_cfg.get("policy") is not None:
            self._install_offload(offload_cfg)

    family = None  # the model's family (harness.models.families), None for the shapes path or an unknown type

    @staticmethod
    def _family_checks(hf_config: Any, visionzip_cfg: Any, offload_cfg: Any):
        """The checkpoint's family; refuses, before the weights load, what the family cannot do (one line,
        ``TechniqueNotAvailable``: the CLI prints it and exits 2)."""
        family = family_of(hf_config)
        name = family.name if family is not None else getattr(hf_config, "model_type", "?")
        if visionzip_cfg is not None and getattr(visionzip_cfg, "keep", 1.0) < 1.0:
            if not hasattr(hf_config, "vision_config"):
                raise TechniqueNotAvailable(f"visionzip.keep={visionzip_cfg.keep}: {name} is a text-only model (no "
                                            "vision tower): VisionZip does not apply")
            if family is not None and family.refusal("visionzip"):
                raise TechniqueNotAvailable(family.refusal("visionzip"))
        if offload_cfg is not None and offload_cfg.get("policy") is not None and family is not None \
                and family.refusal("offload"):
            raise TechniqueNotAvailable(family.refusal("offload"))
        return family

    def _make_decoder(self) -> None:
        """The static decoder of ``self.decode_path`` (None for eager); compiled: the regions wrapped first."""
        self._graph_decoder = None
        if self.decode_path == "eager":
            return
        from harness.engines.hf.graphs import StaticGreedyDecoder

        self._graph_decoder = StaticGreedyDecoder(self.model, self.stop_ids, self.pad_id,
                                                  max_states=int(getattr(self.cfg, "graph_states", 3)))
        if self.decode_path == "compiled":
            from harness.engines.hf.compiled import compile_regions, decoding

            self.compile_info = dict(compile_regions(self.model, getattr(self.cfg, "compile_mode", "default"),
                                                     getattr(self.cfg, "compile_backend", "inductor")))
            self._graph_decoder.step_context = decoding

    def _fall_back_to_graph(self, exc: BaseException) -> None:
        """A compiled path that failed at its first decode step: the manual graph of the eager step instead."""
        from harness.engines.hf.compiled import uncompile

        uncompile(self.model)
        self.decode_path = "graph"
        self.decode_path_reason = f"compiled path failed ({type(exc).__name__}: {str(exc)[:300]}): fell back to graph"
        import logging

        logging.getLogger(__name__).warning("%s", self.decode_path_reason)
        self._make_decoder()

    def _install_offload(self, offload_cfg: Any) -> None:
        """Expert offload (harness/techniques/offload, docs/offload.md), installed last: SERE's calibration ran on the
        resident model. The experts move into the host store and leave the device (a model loaded on the host,
        e.g. with a device_map, has its other weights moved to the device here); the host decides per layer,
        so no CUDA graph replays the decode step."""
        from harness.engines.hf.offload import NAME, install_offload

        self.offload = install_offload(self.model, offload_cfg, self.device, max(1, self.cfg.batch_size))
        self.experts_impl = NAME
        self.cuda_graphs = False
        self._graph_decoder = None
        self.decode_path, self.decode_path_reason = "eager", "expert offload: the host decides per layer (no graph)"

    def _install_decode_attention(self, engine_cfg: Any) -> tuple[str, str | None]:
        from harness.engines.hf import attention_decode as decode_attn

        self.packed_qkv_layers = 0
        if not decode_attn.resolve(getattr(engine_cfg, "decode_attention", "auto"), self.device):
            return "sdpa", None
        why_not, self.packed_qkv_layers = decode_attn.install_decode_path(self.model)
        return ("sdpa", why_not) if why_not else ("triton", None)

    def _install_decode_router(self, engine_cfg: Any) -> int:
        from harness.engines.hf import router as hf_router

        if not hf_router.resolve(getattr(engine_cfg, "decode_router", "auto"), self.device):
            return 0
        return hf_router.install(self.model)

    # -- public API -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "engine_version": package_version("transformers"),
            "device": self.device,
            "device_name": device_name(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attn_implementation": self.attn_implementation,
            "decode_attention": self.decode_attention,
            "decode_attention_reason": self.decode_attention_reason,
            "packed_qkv_layers": self.packed_qkv_layers,
            "decode_router": "triton" if self.router_kernel_layers else "torch",
            "router_kernel_layers": self.router_kernel_layers,
            "experts_implementation": self.experts_impl or "transformers-default",
            "cuda_graphs": self.cuda_graphs,
            "batch_size": self.cfg.batch_size,
            "decode_path_requested": self.decode_path_requested,
            "decode_path": self.decode_path,
            "decode_path_reason": self.decode_path_reason,
            "compile": self._compile_block(),
            "device_map": self.device_map,
            "placement": sorted({str(p.device) for p in self.model.parameters()}) if self.model is not None else None,
            "ignore_eos": self.ignore_eos,
            "tokenizer_free": self.tokenizer_free,
            **({"shapes": {k: v for k, v in self.shapes_info.items() if k != "config"}} if self.shapes_info else {}),
            **({"offload": self.offload.policy.name} if self.offload is not None else {}),
        }

    def _compile_block(self) -> dict[str, Any] | None:
        if self.decode_path != "compiled" or self.compile_info is None:
            return None
        from harness.engines.hf.compiled import dynamo_counters

        return {**self.compile_info, **dynamo_counters()}

    def warmup(self, batch: list[Request]) -> list[Generation]:
        """One short untimed generation: first-call allocations and lazy initialisation stay out of TTFT (and,
        on the compiled path, the compilation of the decode regions; a failure there falls back to ``graph``).
        Returns its generations: the latency protocol (harness/latency/) reads the shape it ran."""
        try:
            gens = self._generate_batch(batch, max_new_tokens=2)
        except Exception as exc:  # noqa: BLE001 - only the compiled path has a fallback
            if self.decode_path != "compiled":
                raise
            self._fall_back_to_graph(exc)
            gens = self._generate_batch(batch, max_new_tokens=2)
        for handle in (self.sere, self.moe, self.offload):
            if handle is not None:
                handle.reset_stats()
        self._decode_tokens, self._sere_partial = 0, False
        return gens

    # -- latency protocol hooks (harness/latency/runner.py) ---------------------------------------------
    clock = staticmethod(time.perf_counter)  # every timestamp of a generation (tests script it)

    def prompt_length(self, batch: list[Request]) -> int:
        """The padded prompt length (tokens, images expanded, before VisionZip) the processor gives ``batch``:
        the warm-up planner's shape key."""
        from harness.engines.hf.direct import build_inputs, has_direct_parts

        if self.tokenizer_free or has_direct_parts(batch):  # the same ids the timed batch will get, on the host
            inputs = build_inputs(batch, self.model.config, self.processor.tokenizer, self.pad_id, "cpu", self.dtype)
        else:
            inputs = self.processor(text=[self._prompt(r) for r in batch],
                                    images=[img for r in batch for img in r.images] or None, return_tensors="pt",
                                    padding=True)
        return int(inputs["input_ids"].shape[1])

    def graph_states(self) -> int | None:
        """How many (batch, cache length) decoder states, each with its CUDA graph, stay captured (None: this
        engine decodes without graphs here). The latency protocol warns when a run needs more."""
        if self._graph_decoder is None or not self.device.startswith("cuda"):
            return None
        return self._graph_decoder.max_states

    def compile_counters(self) -> dict[str, int]:
        """Counts a timed batch must not move: CUDA graphs captured by the static decoder (the compiled path's
        recompilations show in torch.compile's own counters, which the latency protocol reads as well)."""
        return {"cuda_graph_captures": int(getattr(self._graph_decoder, "captures", 0) or 0)}

    def technique_stats(self) -> dict[str, Any]:
        """Statistics of the installed techniques, for ``summary.json`` (``sere``, ``moe``)."""
        out: dict[str, Any] = {}
        if self.sere is not None:
            out["sere"] = self.sere.stats()
            if out["sere"]["mode"] == "decode":  # the canary: every fed decode token re-routed (sere_graphs)
                from harness.techniques.sere.graphs import engagement

                layers = [{"layer": p["layer"], "calls": p["steps"], "rows": p["tokens"]}
                          for p in out["sere"]["per_layer"]]
                out["sere"]["engagement"] = engagement(layers, self._decode_tokens, recomputed=self._sere_partial)
        if self.moe is not None:
            out["moe"] = self.moe.stats()
        if self.offload is not None:
            out["offload"] = offload_summary(self.offload)
        return out

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Generate in batches of ``engine.batch_size``; a failing batch is retried request by request so
        one bad request costs only itself."""
        out: list[Generation] = []
        bs = max(1, self.cfg.batch_size)
        for i in range(0, len(requests), bs):
            out.extend(self.generate_batch(requests[i : i + bs]))
        return out

    def generate_batch(self, batch: list[Request]) -> list[Generation]:
        return generate_splitting(batch, lambda b: self._generate_batch(b, self.gen_cfg.max_new_tokens),
                                  self._mark_sere_partial)

    def _mark_sere_partial(self) -> None:
        self._sere_partial = True  # a failed batch's decode steps may have been counted without its tokens

    def close(self) -> None:
        for name in ("sere", "moe", "offload"):  # SERE first: the reverse of installation
            handle = getattr(self, name, None)
            if handle is not None:
                handle.remove()
                setattr(self, name, None)
        self._graph_decoder = None
        self.model = None
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()

    # -- internals --------------------------------------------------------------------------------
    def _input_device(self) -> str:
        """Where the inputs go: ``engine.device``, or the embedding's device under ``engine.device_map``."""
        if self.device_map:
            return str(self.model.get_input_embeddings().weight.device)
        return self.device

    def _prompt(self, request: Request) -> str:
        parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                 for p in request.content]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )

    def _generate_batch(self, batch: list[Request], max_new_tokens: int) -> list[Generation]:
        torch = self._torch
        clock = _StepClock(self.device, self.clock)
        clock.sync()
        t0 = self.clock()
        from harness.engines.hf.direct import build_inputs, has_direct_parts

        if self.tokenizer_free or has_direct_parts(batch):  # hf_direct: ids and patches without a processor
            inputs = build_inputs(batch, self.model.config, self.processor.tokenizer, self.pad_id, self._input_device(),
                                  self.dtype)
        else:
            texts = [self._prompt(r) for r in batch]
            images = [img for r in batch for img in r.images]
            inputs = self.processor(text=texts, images=images or None, return_tensors="pt", padding=True)
            inputs = inputs.to(self._input_device())
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        vz_ctx = None
        with torch.inference_mode():
            if self.vz_cfg is not None:  # inside the timed region: importance and selection count in TTFT
                from harness.engines.hf.visionzip import prepare_visionzip_inputs

                inputs, vz_ctx = prepare_visionzip_inputs(self.model, inputs, self.vz_cfg, pad_token_id=self.pad_id)
            with _visionzip_generation(self.model, vz_ctx):
                if self._graph_decoder is not None:  # static cache, decode step replayed from a CUDA graph
                    decoded = self._graph_decoder.generate(inputs, max_new_tokens,
                                                           reserve_new_tokens=self.gen_cfg.max_new_tokens)
                    new_tokens, clock.times = decoded.tokens, decoded.times
                else:
                    if self.ignore_eos:  # no stop id: generate runs max_new_tokens steps (the clock never stops)
                        import copy

                        gen_cfg = copy.deepcopy(self.model.generation_config)
                        gen_cfg.eos_token_id = []  # not None: transformers 5 fills a None back in from the model
                        gen_cfg.update(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id)
                        out = self.model.generate(**inputs, generation_config=gen_cfg, stopping_criteria=[clock])
                    else:
                        out = self.model.generate(
                            **inputs,
                            max_new_tokens=max_new_tokens,
                            do_sample=False,
                            stopping_criteria=[clock],
                            pad_token_id=self.pad_id,
                        )
                    new_tokens = out[:, inputs["input_ids"].shape[1]:].tolist()
        mask = inputs["attention_mask"]
        if self.offload is not None and clock.times:
            self.offload.timing.add_batch(t0, clock.times, len(batch))
        results = []
        for row, req in enumerate(batch):
            ids = new_tokens[row]
            n = next((j + 1 for j, t in enumerate(ids) if t in self.stop_ids), len(ids))
            ids = ids[:n]
            self._decode_tokens += max(n - 1, 0)  # tokens fed back: every one a re-routed decode row
            ttft = (clock.times[0] - t0) * 1e3 if clock.times else None
            e2e = (clock.times[n - 1] - t0) * 1e3 if n and len(clock.times) >= n else None
            tpot = (e2e - ttft) / (n - 1) if n > 1 and ttft is not None and e2e is not None else None
            n_visual = 0
            if self.image_token_id is not None:
                n_visual = int((inputs["input_ids"][row][mask[row].bool()] == self.image_token_id).sum())
            results.append(Generation(
                uid=req.uid,
                text=self.processor.tokenizer.decode(ids, skip_special_tokens=True),
                prompt_tokens=int(mask[row].sum()),
                visual_tokens=n_visual,
                output_tokens=n,
                ttft_ms=ttft,
                tpot_ms=tpot,
                e2e_ms=e2e,
                extra={"batch_size": len(batch),
                       **({"visionzip": {**vz_ctx.requests[row].as_dict(),
                                         "importance_ms": vz_ctx.importance_ms / len(batch),  # share of the batch's
                                         "lse_reused": vz_ctx.lse_reused}}
                          if vz_ctx else {})},
            ))
        return results

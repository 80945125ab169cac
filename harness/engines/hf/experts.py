"""The project's fused MoE kernel as a transformers experts implementation: ``"harness_fused_moe"``.

transformers (≥ 5.16; checked on 5.17 and 5.24) dispatches every ``@use_experts_implementation`` experts
module (``Qwen3MoeExperts``, ``Qwen3VLMoeTextExperts``, …) through the registry
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` keyed by ``config._experts_implementation``; a
registered function is called as ``fn(experts_module, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``. :func:`register` adds ours class-wide (``ExpertsInterface.register``,
so every instance of the interface sees it); it is idempotent. After it, both

    from_pretrained(path, experts_implementation="harness_fused_moe")     # validated against the registry
    model.set_experts_implementation("harness_fused_moe")                 # switch a loaded model

work in 5.17 and 5.24 (both check the name against ``ALL_EXPERTS_FUNCTIONS.keys()``): register *before*
either call.

Backends: CUDA tensors → the Triton kernel (``harness.kernels.fused_moe.fused_moe``: the custom op
``torch.ops.harness.fused_moe`` under ``torch.compile``, the launch wrapper in eager mode). CPU tensors →
the float32 reference by default (exact, fast enough for the tiny model); set ``CPU_BACKEND = "triton"``
to run the real kernels through Triton's interpreter (``TRITON_INTERPRET=1``; slow, for tests).

The kernel is built for decode-sized batches. A pass with more than ``MAX_FUSED_TOKENS`` tokens (a
prefill) is handed to transformers' ``grouped_mm`` implementation instead, on any device, so TTFT stays
the stock one; the choice depends on the token count only (a static shape), so it is fixed inside a CUDA
graph or a compiled region. Set ``MAX_FUSED_TOKENS = None`` to use the kernel for every pass.

Only the layout the kernel implements is accepted: fused ``[gate; up]`` weights (``is_concatenated``),
not transposed, no biases, no post-expert norm, no expert parallelism, SiLU gate with the default
``_apply_gate``. Another experts class raises ``NotImplementedError`` naming the attribute, rather than
silently running something else.
"""

from __future__ import annotations

import torch

from harness.kernels.fused_moe import fused_moe
from harness.kernels.fused_moe_reference import fused_moe_reference

__all__ = ["NAME", "CPU_BACKEND", "MAX_FUSED_TOKENS", "experts_forward", "register", "is_registered",
           "unsupported_reason"]

NAME = "harness_fused_moe"
CPU_BACKEND = "reference"   # or "triton" (interpreter)
MAX_FUSED_TOKENS: int | None = 1024   # larger passes (prefill) go to transformers' grouped_mm


def unsupported_reason(experts: torch.nn.Module) -> str | None:
    """Why ``experts`` cannot run on the fused kernel, or None when it can."""
    flags = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for attr, want in flags.items():
        if getattr(experts, attr, want) != want:
            return f"{type(experts).__name__}.{attr}={getattr(experts, attr)!r} (the kernel needs {want!r})"
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(experts, attr, None), torch.Tensor):
            return f"{type(experts).__name__} has no tensor {attr}"
    act = getattr(experts, "act_fn", None)
    is_silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if not is_silu:
        return f"{type(experts).__name__}.act_fn is {type(act).__name__} (the kernel fuses SiLU only)"
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"{type(experts).__name__} overrides _apply_gate"
    return None


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered experts function (signature fixed by transformers)."""
    reason = unsupported_reason(self)
    if reason is not None:
        raise NotImplementedError(f"experts_implementation={NAME!r} cannot run this module: {reason}")
    if MAX_FUSED_TOKENS is not None and hidden_states.shape[0] > MAX_FUSED_TOKENS:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if hidden_states.is_cuda or CPU_BACKEND == "triton":
        return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)
    return fused_moe_reference(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)


def is_registered() -> bool:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS.get(NAME) is experts_forward


def register() -> str:
    """Add ``"harness_fused_moe"`` to transformers' experts registry (idempotent); returns the name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if not is_registered():
        type(ALL_EXPERTS_FUNCTIONS).register(NAME, experts_forward)
    return NAME

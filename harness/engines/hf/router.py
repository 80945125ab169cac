"""HF engine: decode passes' MoE routers through the project's Triton router (``engine.decode_router``).

Why: transformers' router is a GEMV plus ``torch.topk``'s gather and sort kernels, ~17 µs per layer at B=1 on the
H200 where the bytes need ~0.1 µs (``harness.kernels.router``'s doc). The kernel computes the same outputs —
``(logits, top-k weights, top-k ids)`` — in two launches.

Only routers whose family's rule is the kernel's (``harness.models.families``: ``router_kernel``; softmax top-k
with a ``weight [E, H]``, ``top_k``, renormalisation by the family's rule) and only passes of at most
:data:`MAX_TOKENS` tokens (decode steps; the choice depends on the shape only, so it is fixed inside a CUDA
graph) take the kernel; prefill keeps the original forward.
Forward hooks on the router (SERE's, plain top-K's) see the same outputs, so they run unchanged. The router is then
not one of ``hf_compile``'s compiled regions (nothing is left to compile in it).

``engine.decode_router``: ``auto`` = the kernel on CUDA; ``triton`` = wherever Triton runs (CPU only under
``TRITON_INTERPRET=1``: tests); ``torch`` = transformers' forward.
"""

from __future__ import annotations

import torch

from harness.models.moe_blocks import find_moe_blocks

CLASSES = ("Qwen3VLMoeTextTopKRouter", "Qwen3MoeTopKRouter")
CHOICES = ("auto", "triton", "torch")
MAX_TOKENS = 256


def resolve(choice: str | None, device: str) -> bool:
    """Whether ``engine.decode_router=choice`` puts the kernel in on ``device``."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise ValueError(f"engine.decode_router={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "torch":
        return False
    if choice == "auto":
        return str(device).startswith("cuda")
    from harness.kernels.router import triton_available

    if not triton_available(device):
        raise ValueError(f"engine.decode_router=triton: Triton cannot run on {device} (CUDA, or TRITON_INTERPRET=1)")
    return True


def renormalizes(router: torch.nn.Module) -> bool:
    """Qwen3-VL-MoE's router always renormalises its top-k; Qwen3-MoE's follows ``norm_topk_prob``."""
    return bool(getattr(router, "norm_topk_prob", True))


def install(model: torch.nn.Module) -> int:
    """Route decode passes of every supported router of ``model`` through the kernel; returns how many.

    Supported: the routers of a family whose rule the kernel computes (``MoeFamily.router_kernel``: softmax
    top-k, sorted, renormalised by the rule, weights cast to the logits' dtype — Qwen3(-VL)-MoE, Qwen2-MoE, OLMoE,
    Qwen3.5-MoE, Qwen3-Next); for a model type no family claims, the :data:`CLASSES`. Other families (Mixtral's
    float32 weights, DeepSeek, GPT-OSS) keep transformers' router: not an error, ``describe()`` says 0 layers."""
    from harness.kernels.router import moe_router

    n = 0
    for ref in find_moe_blocks(model):
        router = ref.gate
        supported = ref.family.router_kernel if ref.family is not None else type(router).__name__ in CLASSES
        if not supported or not isinstance(getattr(router, "weight", None), torch.Tensor) \
                or not hasattr(router, "top_k"):
            continue
        n += 1
        if getattr(router, "_harness_router_kernel", False):
            continue
        original = router.forward
        renorm = ref.rule.renormalize if ref.rule is not None else renormalizes(router)

        def forward(hidden_states, _router=router, _original=original, _renorm=renorm):
            x = hidden_states.reshape(-1, _router.weight.shape[1])
            if x.shape[0] > MAX_TOKENS or _router.training:
                return _original(hidden_states)
            return moe_router(x, _router.weight, _router.top_k, _renorm)

        router.forward = forward
        router._harness_router_kernel = True
        router._harness_router_original = original
    return n


def uninstall(model: torch.nn.Module) -> None:
    for router in model.modules():
        if getattr(router, "_harness_router_kernel", False):
            router.forward = router._harness_router_original
            del router._harness_router_kernel, router._harness_router_original

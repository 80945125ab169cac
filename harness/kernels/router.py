"""Decode-sized MoE router in Triton: logits, softmax, top-k and renormalisation in two launches.

Why (issue 17, profile in ``results/benchmarks/run_path_breakdown_attn.json``): at B=1 on the H200 a Qwen3 router
(128 experts, hidden 2048) costs ~17 µs per layer as transformers runs it — a cuBLAS GEMV (~5 µs for 0.5 MB of
weights), ``torch.topk``'s gather and sort kernels (~9 µs), softmax and the renormalisation — ~0.8 ms of a 5.8 ms
step over 48 layers. Here:

    x [T, H] ──logits──▶ [T, E] fp32      grid (T, cdiv(E, BLOCK_E)): each program one block of experts' rows
    logits ──select──▶ ids [T, k], weights [T, k], logits out [T, E]     grid (T,): one token per program:
                       round the logits to the model dtype (as F.linear returns them), softmax in fp32, k rounds of
                       "take the largest, mask it" (ties: the lowest expert id), divide by the sum if ``renormalize``,
                       store the weights once in the model dtype

Semantics = :func:`router_reference` = ``Qwen3*TopKRouter.forward`` (transformers 5.17 / 5.24): returns
``(logits in x.dtype, top-k weights in x.dtype, top-k ids int64)``, weights in descending order. Fixed shapes, no
host synchronisation (CUDA-graph capturable); ``torch.ops.harness.moe_router`` is the custom op for
``torch.compile``. No tl.dot (a GEMV), so the interpreter needs no bf16 upcast.
Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs

__all__ = ["router_reference", "router_triton", "moe_router", "triton_available"]


def triton_available(device: torch.device | str) -> bool:
    """True on CUDA, or on CPU under Triton's interpreter (``harness.kernels._triton.triton_runs``)."""
    return triton_runs(device, _logits_kernel)


def router_reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = True):
    """transformers' router: logits = x·Wᵀ (x.dtype), softmax in fp32, top-k, optional renormalisation."""
    logits = torch.nn.functional.linear(x, weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), ids


@triton.jit
def _logits_kernel(x_ptr, w_ptr, out_ptr, H, E, sxt, sxh, swe, swh, sot, soe,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, e-block] = x[t] · W[e-block]ᵀ, fp32 accumulation."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        x = tl.load(x_ptr + t * sxt + h * sxh, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * swe + h[None, :] * swh, mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + t * sot + e * soe, acc, mask=e_ok)


@triton.jit
def _select_kernel(acc_ptr, logits_ptr, ids_ptr, weights_ptr, E, sat, sae, slt, sle, sit, sik, swt, swk,
                   TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """Per token: logits rounded to the output dtype, fp32 softmax, top-k by repeated max, renormalised; the k
    values stay in registers and are stored once, in the output dtype."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logit = tl.load(acc_ptr + t * sat + e * sae, mask=e_ok, other=0.0)
    logit = logit.to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + t * slt + e * sle, logit, mask=e_ok)
    z = tl.where(e_ok, logit.to(tl.float32), float("-inf"))
    z = z - tl.max(z, 0)
    p = tl.exp(z)
    p = p / tl.sum(p, 0)
    remaining = tl.where(e_ok, p, -1.0)
    slot = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(remaining, 0)
        idx = tl.min(tl.where(remaining == best, e, BLOCK_E), 0)     # ties: the lowest expert id
        top = tl.where(slot == j, best, top)
        ids = tl.where(slot == j, idx, ids)
        remaining = tl.where(e == idx, -1.0, remaining)
    if RENORM:
        top = top / tl.sum(top, 0)
    k_ok = slot < TOPK
    tl.store(ids_ptr + t * sit + slot * sik, ids.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + t * swt + slot * swk, top.to(weights_ptr.dtype.element_ty), mask=k_ok)


def router_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = True):
    """The two kernels (module doc): ``(logits [T, E] x.dtype, weights [T, k] x.dtype, ids [T, k] int64)``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, H] and [E, H]")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router: top_k={top_k} with {num_experts} experts")
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    dev = x.device
    cuda = dev.type == "cuda"
    acc = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=dev)
    logits = torch.empty((num_tokens, num_experts), dtype=x.dtype, device=dev)
    weights = torch.empty((num_tokens, top_k), dtype=x.dtype, device=dev)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=dev)
    if num_tokens == 0:
        return logits, weights, ids
    # GPU: 2 experts' rows per program (64 programs per token at 128 experts: the 0.5 MB of weights spread over
    # the SMs; 8 rows per program left 16 programs and ran at ~45 GB/s)
    block_e = 2 if cuda else 16
    block_h = 1024 if cuda else 32
    _logits_kernel[(num_tokens, triton.cdiv(num_experts, block_e))](
        x, weight, acc, hidden, num_experts, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        acc.stride(0), acc.stride(1), BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4)
    _select_kernel[(num_tokens,)](
        acc, logits, ids, weights, num_experts, acc.stride(0), acc.stride(1), logits.stride(0), logits.stride(1),
        ids.stride(0), ids.stride(1), weights.stride(0), weights.stride(1),
        TOPK=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
        RENORM=renormalize, num_warps=4)
    return logits, weights, ids


@torch.library.custom_op("harness::moe_router", mutates_args=())
def _router_op(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if triton_available(x.device):
        return router_triton(x, weight, top_k, renormalize)
    logits, w, ids = router_reference(x, weight, top_k, renormalize)
    return logits, w, ids


@_router_op.register_fake
def _router_fake(x, weight, top_k, renormalize):
    t, e = x.shape[0], weight.shape[0]
    return (x.new_empty((t, e)), x.new_empty((t, top_k)), x.new_empty((t, top_k), dtype=torch.int64))


def moe_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = True):
    """Dispatcher: the custom op under ``torch.compile``, the kernels where Triton runs, else the reference."""
    if torch.compiler.is_compiling():
        return torch.ops.harness.moe_router(x, weight, top_k, renormalize)
    if triton_available(x.device):
        return router_triton(x, weight, top_k, renormalize)
    return router_reference(x, weight, top_k, renormalize)

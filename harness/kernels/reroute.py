"""Fused SERE re-routing: primary union, nearest primary expert, threshold and protection in one launch.

Semantics are those of the reference ``harness.techniques.sere.reroute`` (read its module doc); this op
must equal it id for id, ties included (lowest expert id wins).

Design (one launch per layer, no host sync, fixed shapes, so it can sit in a CUDA graph before the fused
MoE). The [T, k] slots are flattened and split into blocks of ``BLOCK_M``; grid = cdiv(T * k, BLOCK_M).

- Phase 1, primary set, recomputed by every program (no cross-program communication is needed, hence
  one kernel and no scratch buffer to zero): scan the T x k_primary primary ids in tiles of ``BLOCK_N``
  rows and OR each expert's bit into a bitmask of ``BLOCK_W`` int32 words (E <= 32 * BLOCK_W). An id
  touches W words rather than E flags, so the redundant scan costs T * k_primary * W compares per program
  (T=512, k_primary=2, E=256: 8 K compares, ~64 per thread), a 32x saving over a [T, E] one-hot.
- Phase 2, per slot of the block: secondary column, valid id, row masked in, source not in P and not
  protected -> load the source's similarity row restricted to P (masked load: other columns are not
  read), best = max, target = lowest id attaining it, move iff best is finite and best >= rho. Every
  slot, primary or not, is written, so the output needs no initialisation.

Recompilation: K (the top-k width) and the block sizes are ``tl.constexpr``; ``k_primary``, ``T``, ``E``
and ``rho`` (a float32 argument) are runtime values, so changing the threshold never recompiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from harness.techniques.sere import check_reroute_args
from harness.techniques.sere import reroute as reroute_reference

__all__ = ["reroute_op", "reroute_triton"]


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _reroute_kernel(
    ids_ptr, sim_ptr, protected_ptr, row_mask_ptr, out_ptr,
    T, E, k_primary, rho,
    stride_it, stride_ik, stride_se, stride_sp, stride_ot, stride_ok,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_W: tl.constexpr, HAS_PROTECTED: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
):
    offs_w = tl.arange(0, BLOCK_W)

    # ---- Phase 1: bitmask of P = experts in the first k_primary slots of masked-in rows.
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        row_ok = offs_t < T
        if HAS_ROW_MASK:
            row_ok = row_ok & (tl.load(row_mask_ptr + offs_t, mask=row_ok, other=0) != 0)
        for j in range(0, k_primary):
            e = tl.load(ids_ptr + offs_t * stride_it + j * stride_ik, mask=row_ok, other=-1)
            ok = row_ok & (e >= 0) & (e < E)
            e32 = tl.where(ok, e, 0).to(tl.int32)
            bit = tl.where(ok, 1 << (e32 & 31), 0)
            acc = acc | tl.where((e32 >> 5)[:, None] == offs_w[None, :], bit[:, None], 0)
    words = tl.reduce(acc, 0, _bitwise_or)                                  # [BLOCK_W]

    # P as flags over candidate experts (columns of the similarity row).
    offs_e = tl.arange(0, BLOCK_E)
    word_e = tl.sum(tl.where((offs_e >> 5)[:, None] == offs_w[None, :], words[None, :], 0), axis=1)
    cand = (((word_e >> (offs_e & 31)) & 1) != 0) & (offs_e < E)             # [BLOCK_E]

    # ---- Phase 2: this program's slots.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = offs_m < T * K
    t = offs_m // K
    j = offs_m % K
    e_old = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=in_range, other=-1)
    ok = in_range & (j >= k_primary) & (e_old >= 0) & (e_old < E)
    src = tl.where(ok, e_old, 0).to(tl.int32)
    word_src = tl.sum(tl.where((src >> 5)[:, None] == offs_w[None, :], words[None, :], 0), axis=1)
    ok = ok & (((word_src >> (src & 31)) & 1) == 0)                          # source not in P
    if HAS_PROTECTED:
        ok = ok & (tl.load(protected_ptr + src, mask=ok, other=0) == 0)
    if HAS_ROW_MASK:
        ok = ok & (tl.load(row_mask_ptr + t, mask=ok, other=0) != 0)

    sim = tl.load(sim_ptr + src[:, None] * stride_se + offs_e[None, :] * stride_sp,
                  mask=ok[:, None] & cand[None, :], other=float("-inf")).to(tl.float32)
    sim = tl.where(sim == sim, sim, float("-inf"))                          # NaN never attracts
    best = tl.max(sim, axis=1)                                              # [BLOCK_M]
    target = tl.min(tl.where(sim == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
    move = ok & (best > float("-inf")) & (best >= rho)
    new = tl.where(move, target.to(e_old.dtype), e_old)
    tl.store(out_ptr + t * stride_ot + j * stride_ok, new, mask=in_range)


def reroute_triton(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
                   protected: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                   *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SERE re-routing (same semantics as ``harness.techniques.sere.reroute``).

    ``out`` (optional, [T, k], same dtype/device as ``topk_ids``) receives the result, e.g. a static
    buffer under CUDA-graph capture; otherwise a new tensor is returned.
    """
    check_reroute_args(topk_ids, similarity, k_primary, rho, protected, row_mask)
    num_tokens, k = topk_ids.shape
    num_experts = similarity.shape[0]
    if out is None:
        out = torch.empty_like(topk_ids, memory_format=torch.contiguous_format)
    elif out.shape != topk_ids.shape or out.dtype != topk_ids.dtype or out.device != topk_ids.device:
        raise ValueError(f"out must match topk_ids: got {tuple(out.shape)} {out.dtype} {out.device}")
    if num_tokens == 0:
        return out
    if k_primary >= k:                       # nothing is secondary
        return out.copy_(topk_ids)
    if protected is not None:
        protected = protected.contiguous()
    if row_mask is not None:
        row_mask = row_mask.contiguous()

    block_e = max(16, triton.next_power_of_2(num_experts))
    block_w = max(2, triton.next_power_of_2(triton.cdiv(num_experts, 32)))
    block_m = max(16, min(64, 4096 // block_e))
    block_n = 64
    grid = (triton.cdiv(num_tokens * k, block_m),)
    _reroute_kernel[grid](
        topk_ids, similarity,
        protected if protected is not None else topk_ids,   # dummies, never read (constexpr flags)
        row_mask if row_mask is not None else topk_ids,
        out,
        num_tokens, num_experts, k_primary, float(rho),
        topk_ids.stride(0), topk_ids.stride(1), similarity.stride(0), similarity.stride(1),
        out.stride(0), out.stride(1),
        K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_W=block_w,
        HAS_PROTECTED=protected is not None, HAS_ROW_MASK=row_mask is not None,
    )
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def reroute_op(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
               protected: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The fused op on CUDA tensors (or under ``TRITON_INTERPRET=1``), the torch reference otherwise."""
    if topk_ids.is_cuda or _interpreting():
        return reroute_triton(topk_ids, similarity, k_primary, rho, protected, row_mask)
    return reroute_reference(topk_ids, similarity, k_primary, rho, protected, row_mask)

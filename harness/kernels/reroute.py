"""Fused SERE re-routing: primary union, nearest primary expert, threshold and protection.

Semantics are those of the reference ``harness.kernels.reroute_reference.reroute`` (the algorithm:
``harness.techniques.sere.reroute``'s module doc); this op must equal it id for id, ties included (lowest expert id
wins).

Why two kernels. The primary set P (experts in the first ``k_primary`` slots of the masked-in rows) is a
reduction over the whole step, and each slot's re-routing needs all of it. The first version rebuilt P
inside every program of the per-slot kernel (no scratch, one launch), so its cost grew as T²: on an H200
~55 µs per call up to T=4096, 190 µs at 8192, 706 µs at 16384 (``benchmarks/bench_reroute.py``). Now P is
built **once per step**:

- ``_primary_kernel`` (grid ``G <= MAX_G``): program g ORs the expert bits of rows [g·R, (g+1)·R) into a
  bitmask of ``BLOCK_W`` int32 words (E <= 32·BLOCK_W; an id touches W words, not E flags) and writes it
  to ``partial[g]``. Every program writes its whole row, so the scratch needs no zeroing and no atomics.
- ``_reroute_kernel`` (grid = cdiv(T·k, BLOCK_M)): each program ORs the G <= MAX_G partial words (a
  [MAX_G, W] load: 256 ints for E = 128) into P, then handles its slots: secondary column, valid id, row
  masked in, source not in P and not protected -> the source's similarity row restricted to P (masked
  load), best = max, target = lowest id attaining it, move iff best is finite and best >= rho. Every
  slot is written, so the output needs no initialisation.

For small steps (T <= ``FUSE_MAX_TOKENS``, i.e. decode batches, where the redundant scan is a few hundred
ids) the per-slot kernel still builds P itself (``FUSED_P``): one launch instead of two. ``primary=``
forces either path (the benchmark compares them at every T).

A step without decode rows needs no re-routing at all: callers that know it on the host skip the op
(``harness.techniques.sere.graphs``); under a CUDA graph, where nothing is known on the host, such a step
gives P = {} and the similarity is never read (masked loads), so only the ids are copied.

No host sync, fixed shapes: it can sit in a CUDA graph before the fused MoE (the scratch comes from the
caching allocator, i.e. from the graph's pool under capture). Recompilation: K, the block sizes and the
flags are ``tl.constexpr``; ``k_primary``, ``T``, ``E``, ``G``, the rows per program and ``rho`` (a float32
argument) are runtime values, so neither T nor the threshold recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs
from harness.kernels.reroute_reference import check_reroute_args, reroute as reference

__all__ = ["FUSE_MAX_TOKENS", "MAX_G", "primary_words", "reroute_op", "reroute_triton", "words_to_mask"]

MAX_G = 64               # programs of the primary pass (the per-slot kernel reduces MAX_G x W words)
BLOCK_N = 64             # rows per tile of the primary scan
FUSE_MAX_TOKENS = 128    # up to this many rows the per-slot kernel builds P itself (one launch)
PRIMARY_MODES = ("auto", "fused", "separate")


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _or_rows(ids_ptr, row_mask_ptr, row_lo, row_hi, E, k_primary, stride_it, stride_ik,
             BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_ROW_MASK: tl.constexpr):
    """Bitmask words [BLOCK_W] of the experts in the first k_primary slots of rows [row_lo, row_hi)."""
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for t0 in range(row_lo, row_hi, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        row_ok = offs_t < row_hi
        if HAS_ROW_MASK:
            row_ok = row_ok & (tl.load(row_mask_ptr + offs_t, mask=row_ok, other=0) != 0)
        for j in range(0, k_primary):
            e = tl.load(ids_ptr + offs_t * stride_it + j * stride_ik, mask=row_ok, other=-1)
            ok = row_ok & (e >= 0) & (e < E)
            e32 = tl.where(ok, e, 0).to(tl.int32)
            bit = tl.where(ok, 1 << (e32 & 31), 0)
            acc = acc | tl.where((e32 >> 5)[:, None] == offs_w[None, :], bit[:, None], 0)
    return tl.reduce(acc, 0, _bitwise_or)


@triton.jit
def _primary_kernel(ids_ptr, row_mask_ptr, partial_ptr, T, E, k_primary, rows_per_prog, stride_it, stride_ik,
                    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_ROW_MASK: tl.constexpr):
    g = tl.program_id(0)
    lo = g * rows_per_prog
    hi = tl.minimum(lo + rows_per_prog, T)
    words = _or_rows(ids_ptr, row_mask_ptr, lo, hi, E, k_primary, stride_it, stride_ik,
                     BLOCK_N, BLOCK_W, HAS_ROW_MASK)
    tl.store(partial_ptr + g * BLOCK_W + tl.arange(0, BLOCK_W), words)


@triton.jit
def _reroute_kernel(
    ids_ptr, sim_ptr, protected_ptr, row_mask_ptr, partial_ptr, out_ptr,
    T, E, k_primary, rho, G,
    stride_it, stride_ik, stride_se, stride_sp, stride_ot, stride_ok,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_W: tl.constexpr, MAX_G: tl.constexpr, FUSED_P: tl.constexpr,
    HAS_PROTECTED: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
):
    offs_w = tl.arange(0, BLOCK_W)

    # ---- P = experts in the first k_primary slots of masked-in rows, as bitmask words.
    if FUSED_P:
        words = _or_rows(ids_ptr, row_mask_ptr, 0, T, E, k_primary, stride_it, stride_ik,
                         BLOCK_N, BLOCK_W, HAS_ROW_MASK)
    else:
        offs_g = tl.arange(0, MAX_G)
        part = tl.load(partial_ptr + offs_g[:, None] * BLOCK_W + offs_w[None, :],
                       mask=offs_g[:, None] < G, other=0)
        words = tl.reduce(part, 0, _bitwise_or)                              # [BLOCK_W]

    # P as flags over candidate experts (columns of the similarity row).
    offs_e = tl.arange(0, BLOCK_E)
    word_e = tl.sum(tl.where((offs_e >> 5)[:, None] == offs_w[None, :], words[None, :], 0), axis=1)
    cand = (((word_e >> (offs_e & 31)) & 1) != 0) & (offs_e < E)             # [BLOCK_E]

    # ---- This program's slots.
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


def _block_w(num_experts: int) -> int:
    return max(2, triton.next_power_of_2(triton.cdiv(num_experts, 32)))


def _primary_grid(num_tokens: int) -> tuple[int, int]:
    """(G programs, rows per program) of the primary pass: at most MAX_G programs of whole BLOCK_N tiles."""
    tiles = triton.cdiv(num_tokens, BLOCK_N)
    rows = BLOCK_N * triton.cdiv(tiles, MAX_G)
    return triton.cdiv(num_tokens, rows), rows


def _launch_primary(topk_ids: torch.Tensor, num_experts: int, k_primary: int,
                    row_mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    num_tokens = topk_ids.shape[0]
    block_w = _block_w(num_experts)
    groups, rows = _primary_grid(num_tokens)
    partial = torch.empty(groups, block_w, dtype=torch.int32, device=topk_ids.device)
    _primary_kernel[(groups,)](
        topk_ids, row_mask if row_mask is not None else topk_ids, partial,
        num_tokens, num_experts, k_primary, rows, topk_ids.stride(0), topk_ids.stride(1),
        BLOCK_N=BLOCK_N, BLOCK_W=block_w, HAS_ROW_MASK=row_mask is not None,
    )
    return partial, groups


def primary_words(topk_ids: torch.Tensor, num_experts: int, k_primary: int,
                  row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """P of the step as int32 bitmask words [W] (the primary pass plus the OR of its partials; for tests
    and inspection — the re-routing kernel does the OR itself). ``words_to_mask`` turns it into bool [E]."""
    if topk_ids.shape[0] == 0:
        return torch.zeros(_block_w(num_experts), dtype=torch.int32, device=topk_ids.device)
    partial, _ = _launch_primary(topk_ids, num_experts, k_primary,
                                 row_mask.contiguous() if row_mask is not None else None)
    out = partial[0].clone()
    for g in range(1, partial.shape[0]):
        out |= partial[g]
    return out


def words_to_mask(words: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Bool [E] from bitmask words (expert e is bit e % 32 of word e // 32)."""
    e = torch.arange(num_experts, device=words.device)
    return ((words.long()[e // 32] >> (e % 32)) & 1).bool()


def reroute_triton(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
                   protected: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                   *, out: torch.Tensor | None = None, primary: str = "auto") -> torch.Tensor:
    """Fused SERE re-routing (same semantics as ``harness.techniques.sere.reroute``).

    ``out`` (optional, [T, k], same dtype/device as ``topk_ids``) receives the result, e.g. a static
    buffer under CUDA-graph capture; otherwise a new tensor is returned. ``primary``: ``"separate"`` (P
    built once by its own pass), ``"fused"`` (rebuilt in every program: the first version, O(T²)) or
    ``"auto"`` (fused up to ``FUSE_MAX_TOKENS`` rows, separate beyond).
    """
    check_reroute_args(topk_ids, similarity, k_primary, rho, protected, row_mask)
    if primary not in PRIMARY_MODES:
        raise ValueError(f"primary must be one of {PRIMARY_MODES}, got {primary!r}")
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

    fused = primary == "fused" or (primary == "auto" and num_tokens <= FUSE_MAX_TOKENS)
    if fused:
        partial, groups = topk_ids, 0          # dummy pointer, never read (FUSED_P)
    else:
        partial, groups = _launch_primary(topk_ids, num_experts, k_primary, row_mask)
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_m = max(16, min(64, 4096 // block_e))
    grid = (triton.cdiv(num_tokens * k, block_m),)
    _reroute_kernel[grid](
        topk_ids, similarity,
        protected if protected is not None else topk_ids,   # dummies, never read (constexpr flags)
        row_mask if row_mask is not None else topk_ids,
        partial, out,
        num_tokens, num_experts, k_primary, float(rho), groups,
        topk_ids.stride(0), topk_ids.stride(1), similarity.stride(0), similarity.stride(1),
        out.stride(0), out.stride(1),
        K=k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_E=block_e, BLOCK_W=_block_w(num_experts), MAX_G=MAX_G,
        FUSED_P=fused, HAS_PROTECTED=protected is not None, HAS_ROW_MASK=row_mask is not None,
    )
    return out


def reroute_op(topk_ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
               protected: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The fused op on CUDA tensors (or under ``TRITON_INTERPRET=1``), the torch reference otherwise."""
    if triton_runs(topk_ids.device):
        return reroute_triton(topk_ids, similarity, k_primary, rho, protected, row_mask)
    return reference(topk_ids, similarity, k_primary, rho, protected, row_mask)

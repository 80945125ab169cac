"""Attention received per token (VisionZip importance) without the N×N attention matrix.

For a packed batch of images (``cu_seqlens`` segments, full attention inside each), the importance of
token j is ``c_j = 1/H · Σ_h Σ_i P^h_ij`` with ``P^h_ij = exp(scale·q_i·k_j − lse^h_i)`` — the reference is
:func:`harness.kernels.importance_reference.attention_received` (same convention: each segment averages 1).

Two Triton passes, each O(N) in memory (fp32 [heads, N] buffers), inputs in fp32/bf16/fp16, dot products
accumulated in fp32 (fp32 inputs use IEEE fp32 dots, not TF32):

    pass 1  _lse_kernel     grid (query block, segment, head): online max / sum over the segment's key
                            blocks → row log-sum-exp (stored in base 2: lse₂ = lse · log2 e)
    pass 2  _colsum_kernel  grid (key block, segment, head): loops over the segment's query blocks,
                            accumulates Σ_i exp2(scale·log2e·q_i·k_j − lse₂_i) → per-head column sums
    wrapper                 mean over heads (a [H, N] → [N] torch reduction; deterministic, no atomics)

Each pass costs one QKᵀ over the segment (2·n²·d FLOPs per head), so both together cost about what an
attention forward does (QKᵀ + PV) and the P·V product is never needed. If the engine's attention already
returns its log-sum-exp (flash attention does), pass ``lse=`` and only pass 2 runs: both engines do
(``harness.kernels.attention_lse`` runs the scoring block's attention with the op that returns it); pass 1
remains the fallback where no such op exists (fp32 on CUDA). head_dim need not be a
power of two: it is padded to one (72 → 128 for Qwen3-VL) with masked loads.

Tiles are fixed per device (``GPU_CONFIG``, or the small ``INTERPRETER_CONFIG`` on CPU) rather than
autotuned, so tests under the interpreter run one configuration; ``benchmarks/bench_importance.py`` sweeps a
few on the GPU. Under the interpreter, bf16 tiles are upcast to fp32 before ``tl.dot`` (the interpreter
multiplies the raw bf16 bits, triton-lang/triton#11584); bf16·bf16 products are exact in fp32, so the
numbers match a tensor-core bf16 dot with fp32 accumulation.

Imports: torch and triton only (plus the reference, lazily, in :func:`compute_importance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs
from harness.kernels.importance_reference import attention_received

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class ImportanceConfig:
    """Tile sizes: BLOCK_M = query rows, BLOCK_N = key rows, for each pass (powers of two, ≥ 16)."""

    lse_block_m: int = 64
    lse_block_n: int = 64
    col_block_m: int = 64
    col_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


# The 64×64 tiles verified on the H200. The benchmark's sweep timed larger tiles faster (0.91 ms against
# 1.27 ms at 30 images) but (128, 64, 64, 128) failed the GPU correctness tests on short odd segments:
# not adopted until the sweep also checks correctness per configuration.
GPU_CONFIG = ImportanceConfig()
# The interpreter runs one program at a time in numpy: small tiles keep the masked work small.
INTERPRETER_CONFIG = ImportanceConfig(16, 16, 16, 16, num_warps=1, num_stages=1)


@triton.jit
def _lse_kernel(
    Q, K, CU, LSE2,
    qk_scale,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(CU + seg)
    seqlen = tl.load(CU + seg + 1) - start
    if pid_m * BLOCK_M >= seqlen:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + (start + offs_m).to(tl.int64)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, seqlen, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seqlen
        k_ptrs = K + (start + offs_n).to(tl.int64)[:, None] * stride_kn + head * stride_kh + offs_d[None, :] * stride_kd
        k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Column 0 of the first block is always valid, so m_new is finite from the first iteration on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE2 + head * stride_lh + start + offs_m, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit
def _colsum_kernel(
    Q, K, CU, LSE2, OUT,
    qk_scale,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_lh, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    seg = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(CU + seg)
    seqlen = tl.load(CU + seg + 1) - start
    if pid_n * BLOCK_N >= seqlen:
        return

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < seqlen
    mask_d = offs_d < HEAD_DIM
    k_ptrs = K + (start + offs_n).to(tl.int64)[:, None] * stride_kn + head * stride_kh + offs_d[None, :] * stride_kd
    k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)

    # Work on the transposed tile sᵀ = k·qᵀ [BLOCK_N, BLOCK_M]: the sum over queries is then a row
    # reduction (within a warp in the MMA layout), as for dV in a flash-attention backward pass.
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(0, seqlen, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seqlen
        q_ptrs = Q + (start + offs_m).to(tl.int64)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # Rows past the segment: q = 0 gives s = 0, and lse = +inf makes their p exactly 0.
        lse2 = tl.load(LSE2 + head * stride_lh + start + offs_m, mask=mask_m, other=float("inf"))
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        acc += tl.sum(tl.exp2(s_t - lse2[None, :]), 1)
    tl.store(OUT + head * stride_oh + start + offs_n, acc, mask=mask_n)


# ---------------------------------------------------------------------------------------- wrappers


def _prepare(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None, max_seqlen: int | None,
             config: ImportanceConfig | None):
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [N, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q and k must share a dtype among fp32/bf16/fp16, got {q.dtype}, {k.dtype}")
    if q.device != k.device:
        raise ValueError("q and k must be on the same device")
    head_dim = q.shape[-1]
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D with at least one element")
    if max_seqlen is None:  # one host sync; pass max_seqlen to avoid it
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if config is None:
        config = GPU_CONFIG if q.is_cuda else INTERPRETER_CONFIG
    # The interpreter multiplies the raw uint16 bits of bf16 dot operands (triton-lang/triton#11584):
    # there, bf16 tiles go through an exact fp32 dot (bf16·bf16 products are exact in fp32).
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    meta = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return cu, max_seqlen, scale * LOG2E, config, meta


def _check_out(out: torch.Tensor, heads: int, n: int, device: torch.device) -> torch.Tensor:
    if out.shape != (heads, n) or out.dtype != torch.float32 or out.device != device or (n and out.stride(1) != 1):
        raise ValueError(f"out must be a float32 [heads, N] = {(heads, n)} tensor with unit stride along N")
    return out


def _run_lse2(q, k, cu, max_seqlen, qk_scale, config, meta, out=None) -> torch.Tensor:
    n, heads, _ = q.shape
    if out is None:
        lse2 = torch.empty((heads, n), dtype=torch.float32, device=q.device)
    else:
        lse2 = _check_out(out, heads, n, q.device)
    n_seg = cu.numel() - 1
    if n and n_seg and max_seqlen:
        grid = (triton.cdiv(max_seqlen, config.lse_block_m), n_seg, heads)
        _lse_kernel[grid](
            q, k, cu, lse2, qk_scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            lse2.stride(0),
            BLOCK_M=config.lse_block_m, BLOCK_N=config.lse_block_n, **meta,
        )
    return lse2


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
    max_seqlen: int | None = None, config: ImportanceConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row log-sum-exp (natural log) of ``scale·QKᵀ`` within each segment: [heads, N] float32 (pass 1)."""
    cu, max_seqlen, qk_scale, config, meta = _prepare(q, k, cu_seqlens, scale, max_seqlen, config)
    lse2 = _run_lse2(q, k, cu, max_seqlen, qk_scale, config, meta, out=out)
    return lse2.mul_(LN2)


def attention_colsums(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
    lse: torch.Tensor | None = None, max_seqlen: int | None = None, config: ImportanceConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head column sums of softmax(scale·QKᵀ) within each segment: [heads, N] float32.

    ``lse``: optional [heads, N] natural-log row log-sum-exp (e.g. from flash attention); without it pass 1
    computes it. ``out``: optional [heads, N] float32 destination.
    """
    cu, max_seqlen, qk_scale, config, meta = _prepare(q, k, cu_seqlens, scale, max_seqlen, config)
    n, heads, _ = q.shape
    if lse is None:
        lse2 = _run_lse2(q, k, cu, max_seqlen, qk_scale, config, meta)
    else:
        if lse.shape != (heads, n):
            raise ValueError(f"lse must be [heads, N] = {(heads, n)}, got {tuple(lse.shape)}")
        lse2 = lse.to(torch.float32) * LOG2E
    if out is None:
        out = torch.empty((heads, n), dtype=torch.float32, device=q.device)
    else:
        _check_out(out, heads, n, q.device)
    n_seg = cu.numel() - 1
    if n and n_seg and max_seqlen:
        grid = (triton.cdiv(max_seqlen, config.col_block_n), n_seg, heads)
        _colsum_kernel[grid](
            q, k, cu, lse2, out, qk_scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            lse2.stride(0), out.stride(0),
            BLOCK_M=config.col_block_m, BLOCK_N=config.col_block_n, **meta,
        )
    return out


def attention_importance(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
    lse: torch.Tensor | None = None, max_seqlen: int | None = None, config: ImportanceConfig | None = None,
) -> torch.Tensor:
    """Triton importance: column sums over queries, mean over heads, [N] float32 (each segment averages 1)."""
    return attention_colsums(q, k, cu_seqlens, scale, lse=lse, max_seqlen=max_seqlen, config=config).mean(dim=0)


def triton_available(device: torch.device | str) -> bool:
    """True on CUDA, or on CPU when Triton's interpreter is on (``TRITON_INTERPRET=1``, set before this
    module was imported: the kernels are built as interpreted functions at import)."""
    return triton_runs(device, _lse_kernel)


def reference_colsums_from_lse(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, lse: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """PyTorch reference of pass 2: per-head column sums of ``exp(scale·q_i·k_j − lse_i)``, [heads, N].

    ``lse``: [heads, N] natural-log row log-sum-exp (the attention's own). Materialises one segment's
    [heads, n, n] at a time, in float32 (float64 for float64 inputs). With the true LSE this equals the
    column sums of the softmax; a wrong LSE shows up as segments not summing to their length.
    """
    n, heads, head_dim = q.shape
    if lse.shape != (heads, n):
        raise ValueError(f"lse must be [heads, N] = {(heads, n)}, got {tuple(lse.shape)}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = [int(b) for b in cu_seqlens.reshape(-1).tolist()]
    out = torch.zeros((heads, n), dtype=dtype, device=q.device)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qs, ks = q[s:e].to(dtype).transpose(0, 1), k[s:e].to(dtype).transpose(0, 1)  # [H, n, D]
        logits = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [H, n(q), n(k)]
        out[:, s:e] = torch.exp(logits - lse[:, s:e].to(dtype).unsqueeze(-1)).sum(dim=1)
    return out


def compute_importance(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher: the Triton kernel where it runs (CUDA or interpreter), else the torch reference.

    ``lse``: the scoring attention's own row log-sum-exp [heads, N] (natural log), when the engine has it
    (``harness.kernels.attention_lse``): only pass 2 runs (Triton), or the reference's pass-2 twin
    (:func:`reference_colsums_from_lse`). Without it the kernel computes the LSE itself (the fallback).
    """
    if triton_available(q.device) and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return attention_importance(q, k, cu_seqlens, scale, lse=lse)
    if lse is not None:
        return reference_colsums_from_lse(q, k, cu_seqlens, lse, scale).mean(dim=0).to(torch.float32)

    return attention_received(q, k, cu_seqlens, scale).to(torch.float32)


def importance_flops(seqlens: list[int], heads: int, head_dim: int) -> int:
    """FLOPs of the two passes (two QKᵀ per segment), counted with the true head_dim."""
    return 2 * sum(2 * n * n * head_dim for n in seqlens) * heads


def importance_min_bytes(n: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes a perfect implementation must move: q and k read once, [N] float32 written once."""
    return 2 * n * heads * head_dim * itemsize + 4 * n


__all__ = [
    "ImportanceConfig", "GPU_CONFIG", "INTERPRETER_CONFIG", "attention_lse", "attention_colsums",
    "attention_importance", "compute_importance", "reference_colsums_from_lse", "triton_available",
    "importance_flops", "importance_min_bytes",
]

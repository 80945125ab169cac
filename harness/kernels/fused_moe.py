"""Decode-sized fused MoE in Triton: cost follows the experts a batch activates, no host synchronisation.

Semantics: :func:`harness.kernels.fused_moe_reference.fused_moe_reference` (SiLU-gated experts in the
transformers layout ``gate_up_proj [E, 2I, H]`` = [gate; up], ``down_proj [E, H, I]``; ids outside [0, E)
contribute nothing; repeated ids in a row are separate slots whose outputs add up).

Pipeline (one layer, S = T·k (token, slot) pairs; every shape depends only on T, k, E, H, I)::

    router ids [T, k] ──sort──▶ sorted ids [S], perm [S]         torch.sort (stable: ties keep slot order)
                      ──align──▶ tile_start [MAX_TILES]          1 program: segment each expert's rows into
                                                                 tiles of BLOCK_M sorted rows, -1 = no tile
    x [T, H] ──gate_up──▶ act [S, I]                             grid (MAX_TILES, cdiv(I, BLOCK_N)):
                                                                 act = SiLU(x·gateᵀ) ⊙ (x·upᵀ), fp32 acc
    act ──down──▶ slot_out [S, H] fp32                           grid (MAX_TILES, cdiv(H, BLOCK_N)):
                                                                 (act·downᵀ) · w[slot], stored per slot
    slot_out ──combine──▶ out [T, H]                             grid (T, cdiv(H, BLOCK_H)): Σ_j over the
                                                                 k slots in slot order (deterministic)

``MAX_TILES = (S + min(S, E)·(BLOCK_M − 1)) // BLOCK_M`` bounds Σ_e cdiv(count_e, BLOCK_M) for any
routing, so the grids are fixed for a given T (CUDA-graph capturable, ``torch.compile``-friendly);
programs beyond the real number of tiles read ``tile_start = -1`` and exit at once. Each tile reads its
expert's gate/up/down weights once, so the bytes moved are ≈ (tiles) × 3·H·I·itemsize — at decode sizes
(≤ BLOCK_M tokens per expert) exactly the active experts' weights, the roofline of a decode MoE layer.
No atomics: the weighted sum over a token's k slots is a second, fixed-order reduction.

Entry points:

- :func:`fused_moe_triton` — check → allocate → grid → launch (CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1``). Takes an optional ``out=`` buffer and ``config=``. At S ≤
  ``fused_moe_small.SMALL_PATH_MAX_PAIRS`` pairs it runs the small-batch path instead
  (:mod:`harness.kernels.fused_moe_small`: no sort, no align, two GEMV launches); ``path="sorted"`` /
  ``"small"`` forces one.
- ``torch.ops.harness.fused_moe`` — the same, as a ``torch.library.custom_op`` with a fake (meta)
  implementation, so ``torch.compile(fullgraph=True)`` treats it as one opaque node and CUDA-graph trees
  capture its launches.
- :func:`fused_moe` — dispatcher: the custom op while ``torch.compile`` traces, the wrapper in eager
  (no custom-op dispatch overhead), the float32 reference on CPU without the interpreter.

Tiles are fixed per device and batch size (:func:`default_config`), not autotuned, so one configuration
compiles and tests under the interpreter run small tiles; ``benchmarks/bench_fused_moe.py --sweep`` times
a few on the GPU. Under the interpreter, bf16 tiles are upcast to fp32 before ``tl.dot`` (the interpreter
multiplies raw bf16 bits, triton-lang/triton#11584); fp32 inputs use IEEE fp32 dots (no TF32). Observed
with Triton 3.8's interpreter: fp32 → bf16 stores truncate instead of rounding to nearest, so interpreter
bf16 errors are about twice the GPU's (tests bound them relative to torch's own bf16 error).

Imports: torch and triton only (and the reference module, which imports torch only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs

from harness.kernels.fused_moe_reference import check_fused_moe_args, fused_moe_reference
from harness.kernels.fused_moe_small import SmallMoEConfig, default_small_config, launch_small_moe, use_small_path

__all__ = [
    "FusedMoEConfig", "GPU_CONFIGS", "INTERPRETER_CONFIG", "default_config", "max_tiles", "fused_moe_triton",
    "fused_moe", "fused_moe_reference", "triton_available", "fused_moe_bytes",
]

# Tests may set this (e.g. float("nan")) to poison every scratch buffer after allocation, so a read of an
# element no kernel wrote shows up in the output.
_SCRATCH_FILL: float | None = None


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile sizes. ``block_m``: sorted (token, slot) rows per tile (≥ 16, power of two); ``up_block_n`` /
    ``up_block_k``: intermediate columns / hidden depth per gate_up program; ``down_block_n`` /
    ``down_block_k``: hidden columns / intermediate depth per down program; ``combine_block_h``."""

    block_m: int = 16
    up_block_n: int = 32
    up_block_k: int = 128
    down_block_n: int = 64
    down_block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    combine_block_h: int = 1024


# Decode on an H100/H200-class GPU: few rows per expert, the weights stream once. Keyed by the largest
# number of (token, slot) pairs S the entry is for; see ``default_config``.
GPU_CONFIGS: tuple[tuple[int, FusedMoEConfig], ...] = (
    (64, FusedMoEConfig(block_m=16, up_block_n=32, up_block_k=128, down_block_n=32, down_block_k=128)),
    (2048, FusedMoEConfig(block_m=16, up_block_n=64, up_block_k=128, down_block_n=64, down_block_k=128)),
    (1 << 62, FusedMoEConfig(block_m=64, up_block_n=64, up_block_k=64, down_block_n=64, down_block_k=64)),
)
# The interpreter runs one program at a time in numpy: small tiles keep the masked work small.
INTERPRETER_CONFIG = FusedMoEConfig(16, 16, 16, 16, 16, num_warps=1, num_stages=1, combine_block_h=64)


def default_config(num_pairs: int, device: torch.device) -> FusedMoEConfig:
    """The tile configuration for ``num_pairs`` = T·k (token, slot) pairs on ``device``."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    for limit, cfg in GPU_CONFIGS:
        if num_pairs <= limit:
            return cfg
    return GPU_CONFIGS[-1][1]


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e cdiv(count_e, block_m) over every routing of ``num_pairs`` pairs."""
    return (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_kernel(
    sorted_ids_ptr, tile_start_ptr,
    S, E, n_tiles_max,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: tile_start[p] = first sorted row of tile p (tiles of ≤ BLOCK_M rows inside one
    expert's run of sorted rows, in sorted order); tile_start[p] = -1 for p ≥ number of tiles."""
    seg_carry = tl.full([], -1, tl.int32)       # start of the run that spans the chunk boundary
    n_carry = tl.full([], 0, tl.int32)          # tiles found in earlier chunks
    for c0 in range(0, S, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        in_s = i < S
        cur = tl.load(sorted_ids_ptr + i, mask=in_s, other=-1)
        prev = tl.load(sorted_ids_ptr + i - 1, mask=in_s & (i > 0), other=-1)
        run_start = in_s & ((i == 0) | (cur != prev))
        seg = tl.associative_scan(tl.where(run_start, i, -1), 0, _max_combine)
        seg = tl.maximum(seg, seg_carry)
        valid = in_s & (cur >= 0) & (cur < E)
        is_tile = valid & (((i - seg) % BLOCK_M) == 0)
        flags = is_tile.to(tl.int32)
        idx = n_carry + tl.cumsum(flags, 0) - 1
        tl.store(tile_start_ptr + idx, i, mask=is_tile)
        n_carry += tl.sum(flags, 0)
        seg_carry = tl.max(tl.where(in_s, seg, -1), 0)
    for p0 in range(0, n_tiles_max, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(tile_start_ptr + p, tl.full([CHUNK], -1, tl.int32), mask=(p >= n_carry) & (p < n_tiles_max))


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ids_ptr, perm_ptr, tile_start_ptr,
    S, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_as, stride_ai,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """act[r, n] = SiLU(x_tok(r) · gate_e[n]) · (x_tok(r) · up_e[n]) for the rows r of one tile."""
    row0 = tl.load(tile_start_ptr + tl.program_id(0))
    if row0 < 0:
        return
    expert = tl.load(sorted_ids_ptr + row0)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = (rows < S) & (tl.load(sorted_ids_ptr + rows, mask=rows < S, other=-1) == expert)
    slot = tl.load(perm_ptr + rows, mask=row_ok, other=0)
    tok = (slot // TOPK).to(tl.int64)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + offs_n[:, None] * stride_wn
    up_ptrs = w_base + (offs_n + I)[:, None] * stride_wn
    x_ptrs = x_ptr + tok[:, None] * stride_xt

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_ptrs + offs_k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(gate_ptrs + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(up_ptrs + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate = tl.dot(x, tl.trans(wg), acc_gate, input_precision=INPUT_PRECISION)
        acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=INPUT_PRECISION)

    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_as + offs_n[None, :] * stride_ai
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, slot_out_ptr, topk_w_ptr, sorted_ids_ptr, perm_ptr, tile_start_ptr,
    S, H, I,
    stride_as, stride_ai, stride_we, stride_wn, stride_wk, stride_os, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """slot_out[slot(r), n] = w[slot(r)] · (act[r] · down_e[n]) for the rows r of one tile (fp32)."""
    row0 = tl.load(tile_start_ptr + tl.program_id(0))
    if row0 < 0:
        return
    expert = tl.load(sorted_ids_ptr + row0)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = (rows < S) & (tl.load(sorted_ids_ptr + rows, mask=rows < S, other=-1) == expert)
    slot = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_as

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(a_ptrs + offs_k[None, :] * stride_ai, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=INPUT_PRECISION)

    gate_w = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * gate_w[:, None]
    out_ptrs = slot_out_ptr + slot[:, None] * stride_os + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    slot_out_ptr, ids_ptr, out_ptr,
    H, E,
    stride_os, stride_oh, stride_it, stride_ik, stride_ot, stride_oh2,
    TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = Σ_j slot_out[t·k + j] over the valid slots j = 0..k-1, in that order."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
        valid = (e >= 0) & (e < E)
        slot = (t * TOPK + j).to(tl.int64)
        acc += tl.load(slot_out_ptr + slot * stride_os + offs_h * stride_oh, mask=h_ok & valid, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_h * stride_oh2, acc.to(out_ptr.dtype.element_ty),
             mask=h_ok)


# ---------------------------------------------------------------------------------------------- wrappers



def triton_available(device: torch.device | str) -> bool:
    """True on CUDA, or on CPU when Triton's interpreter is on (``TRITON_INTERPRET=1`` set before triton
    was first imported: the kernels are then built as interpreted functions)."""
    return triton_runs(device, _gate_up_kernel)


def _scratch(shape, dtype, device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    if _SCRATCH_FILL is not None:
        buf.fill_(_SCRATCH_FILL if dtype.is_floating_point else -7777)
    return buf


def fused_moe_triton(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                     out: torch.Tensor | None = None, config: FusedMoEConfig | None = None,
                     path: str = "auto", small_config: SmallMoEConfig | None = None) -> torch.Tensor:
    """Fused SiLU-gated MoE (see module doc): [T, H] in ``hidden.dtype`` (or into ``out``).

    ``path``: "auto" (the small-batch path at S = T·k ≤ ``SMALL_PATH_MAX_PAIRS``, else the sorted one),
    "sorted" or "small"; ``config`` tiles the sorted path, ``small_config`` the small one (under "auto", passing
    only one of them picks its path: a tile sweep times what it asked for). The choice depends on shapes
    only, so a captured graph or a compiled op always replays the same path.

    ``hidden`` is cast to the weights' dtype if they differ (as transformers does under autocast). Supported
    dtypes: float32, bfloat16, float16. No host synchronisation, fixed shapes: CUDA-graph capturable.
    """
    num_tokens, hidden_size, num_experts, inter, topk = check_fused_moe_args(
        hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    dtype = gate_up_proj.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or down_proj.dtype != dtype:
        raise ValueError(f"weights must share a dtype among fp32/bf16/fp16, got {gate_up_proj.dtype}, "
                         f"{down_proj.dtype}")
    device = hidden.device
    if not triton_available(device):
        raise RuntimeError(f"Triton cannot run on {device} (use CUDA, or TRITON_INTERPRET=1 before importing "
                           "triton); fused_moe() falls back to the reference instead")
    out_dtype = hidden.dtype
    if out is None:
        out = torch.empty((num_tokens, hidden_size), dtype=out_dtype, device=device)
    elif out.shape != (num_tokens, hidden_size) or out.dtype != out_dtype or out.device != device:
        raise ValueError(f"out must be a {out_dtype} [{num_tokens}, {hidden_size}] tensor on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if num_tokens == 0 or topk == 0:
        return out.zero_()

    x = hidden if hidden.dtype == dtype else hidden.to(dtype)
    num_pairs = num_tokens * topk
    if path == "auto" and (config is None) != (small_config is None):
        path = "sorted" if config is not None else "small"
    if use_small_path(num_pairs, path):
        act = _scratch((num_pairs, inter), dtype, device)
        return launch_small_moe(x, gate_up_proj, down_proj, topk_ids, topk_weights, act, out,
                                small_config or default_small_config(device))
    if config is None:
        config = default_config(num_pairs, device)
        if dtype == torch.float32 and device.type == "cuda":   # fp32 tiles: half the pipeline depth fits smem
            config = replace(config, num_stages=min(config.num_stages, 2))
    upcast = dtype != torch.float32 and device.type != "cuda"
    meta = dict(UPCAST=upcast, INPUT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages)

    # 1. group the (token, slot) pairs by expert: a stable sort on device (slot order kept within an expert).
    sorted_ids, perm = torch.sort(topk_ids.reshape(-1), stable=True)
    weights_flat = topk_weights.contiguous().view(-1)   # slot-major [S], unit stride (no copy when contiguous)
    n_tiles = max_tiles(num_pairs, num_experts, config.block_m)
    tile_start = _scratch((n_tiles,), torch.int32, device)
    _align_kernel[(1,)](sorted_ids, tile_start, num_pairs, num_experts, n_tiles,
                        BLOCK_M=config.block_m, CHUNK=1024 if device.type == "cuda" else 64, num_warps=4)

    # 2. gate/up projection + SiLU·up, rows in sorted order.
    act = _scratch((num_pairs, inter), dtype, device)
    grid = (n_tiles, triton.cdiv(inter, config.up_block_n))
    _gate_up_kernel[grid](
        x, gate_up_proj, act, sorted_ids, perm, tile_start,
        num_pairs, hidden_size, inter,
        x.stride(0), x.stride(1), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        act.stride(0), act.stride(1),
        TOPK=topk, BLOCK_M=config.block_m, BLOCK_N=config.up_block_n, BLOCK_K=config.up_block_k, **meta,
    )

    # 3. down projection × routing weight, one fp32 row per (token, slot).
    slot_out = _scratch((num_pairs, hidden_size), torch.float32, device)
    grid = (n_tiles, triton.cdiv(hidden_size, config.down_block_n))
    _down_kernel[grid](
        act, down_proj, slot_out, weights_flat, sorted_ids, perm, tile_start,
        num_pairs, hidden_size, inter,
        act.stride(0), act.stride(1), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        slot_out.stride(0), slot_out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k, **meta,
    )

    # 4. deterministic sum over each token's k slots.
    block_h = min(config.combine_block_h, triton.next_power_of_2(hidden_size))
    grid = (num_tokens, triton.cdiv(hidden_size, block_h))
    _combine_kernel[grid](
        slot_out, topk_ids, out, hidden_size, num_experts,
        slot_out.stride(0), slot_out.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        out.stride(0), out.stride(1),
        TOPK=topk, BLOCK_H=block_h, num_warps=4,
    )
    return out


# ------------------------------------------------------------------------------------ torch custom op


@torch.library.custom_op("harness::fused_moe", mutates_args=())
def _fused_moe_op(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    if triton_available(hidden.device):
        return fused_moe_triton(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    return fused_moe_reference(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)


@_fused_moe_op.register_fake
def _fused_moe_fake(hidden, gate_up_proj, down_proj, topk_ids, topk_weights):
    check_fused_moe_args(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    return hidden.new_empty(hidden.shape)


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Dispatcher: ``torch.ops.harness.fused_moe`` under ``torch.compile`` (one opaque node, no graph
    break), the Triton wrapper in eager mode where Triton runs, the float32 reference otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.harness.fused_moe(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    if triton_available(hidden.device):
        return fused_moe_triton(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    return fused_moe_reference(hidden, gate_up_proj, down_proj, topk_ids, topk_weights)


def fused_moe_bytes(active_experts: int, hidden_size: int, inter: int, itemsize: int) -> int:
    """Weight bytes a decode MoE layer must read: active experts × 3 × H × I × itemsize (the roofline;
    activations are negligible at decode sizes)."""
    return active_experts * 3 * hidden_size * inter * itemsize

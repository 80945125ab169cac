"""Small-batch path of the fused MoE: no sort, no align — two GEMV-style Triton launches per layer.

Same semantics as :func:`harness.kernels.fused_moe_reference.fused_moe_reference` (ids outside [0, E)
contribute nothing; repeated ids in a row are separate slots whose outputs add up).

Why a second path: the sorted path (``harness.kernels.fused_moe``) groups the S = T·k (token, slot) pairs by
expert (torch.sort + a one-program align kernel) so that each expert's weights are read once per tile of
≤ BLOCK_M rows, then runs gate_up, down and a combine kernel. On an H200 at Qwen3-30B-A3B shapes that
pipeline costs a fixed ~35 µs per layer (51 µs at B = 1 against a 17.7 µs byte floor; 38 µs with a single
active expert, floor 2.2 µs): launches and serial latency, not bytes. At decode sizes the pairs rarely
share an expert, so grouping buys nothing; this path skips it::

    x [T, H] ──gate_up_small──▶ act [S, I]      grid (S, cdiv(I, BLOCK_N)): program = one pair p
                                                (expert ids.flat[p], token p // k); act = SiLU(x·gateᵀ) ⊙
                                                (x·upᵀ), broadcast-multiply + tl.sum over BLOCK_K chunks
                                                (a GEMV: tl.dot needs M ≥ 16), fp32 accumulation
    act ──down_small──▶ out [T, H]               grid (T, cdiv(H, BLOCK_N)): program = one token, its k
                                                slots in slot order (deterministic, no atomics):
                                                out[t] = Σ_j w[t, j] · (act[t·k + j] · downᵀ)

Two launches instead of five (sort, align, gate_up, down, combine), no fp32 ``slot_out`` round trip. The
price: every pair reads its expert's weights itself, so pairs that share an expert read them again (from
L2 if they run close together — axis 0 of the gate_up grid is the pair, so pairs of one column block
are scheduled side by side). Above a few dozen pairs sharing becomes common and the sorted path, which
reads each active expert once per tile, wins: :data:`SMALL_PATH_MAX_PAIRS` is the crossover
(``fused_moe_triton`` picks the path; ``benchmarks/bench_fused_moe.py`` times both).

All products are computed in fp32 on every device (loads are upcast before the multiply): the kernels are
memory-bound, so the conversion is free on the GPU, and it gives the interpreter the same treatment as the
sorted path's ``UPCAST`` (the interpreter mishandles raw bf16 arithmetic, triton-lang/triton#11584). ``act``
is stored in the weights' dtype, as in the sorted path. Fixed shapes, no host synchronisation: CUDA-graph
capturable and usable inside ``torch.ops.harness.fused_moe``.

Imports: torch and triton only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SMALL_PATH_MAX_PAIRS", "SmallMoEConfig", "SMALL_GPU_CONFIG", "SMALL_INTERPRETER_CONFIG",
           "default_small_config", "use_small_path", "launch_gate_up_small", "launch_down_small",
           "launch_small_moe"]

# Largest S = T·k (token, slot) pairs the automatic dispatch sends down the small path; 32 = B ≤ 4 at top-8.
# Each pair reads its expert's 3·H·I weights itself (9.4 MB in bf16 at Qwen3-30B-A3B shapes), so the small
# path moves S × 9.4 MB from L2 to the SMs against the sorted path's (distinct experts) × 9.4 MB. Pairs
# that share an expert run side by side (same column block), so their re-reads mostly hit L2 rather than
# HBM, but L2 bandwidth and issue slots still grow with S while the sorted path's ~35 µs fixed cost stays.
# At B = 1 (8 pairs, 8 experts) there is nothing to share: the small path is strictly less work. At B = 4
# (32 pairs, ≈ 19 experts under Zipf-like routing) the 13 extra reads are 122 MB, ≤ 29 µs even if every
# one went to HBM — less than the ~35 µs the sorted path spends on sort/align/launches: a win whatever L2
# does. At B = 16 (128 pairs, ≈ 39 experts) the 89 extra reads are 0.84 GB, up to 196 µs from HBM against
# a 127 µs sorted layer: the outcome rests on the L2 hit rate. 32 is the largest S the worst-case bound
# guarantees; the benchmark times both paths at B = 1..16. Measured (H200, results/benchmarks/fused_moe_small.md,
# graph replay µs, sorted vs small): B=1 top-8 50.7 vs 46.8 (37.2 with the tiles below), B=2 62.6 vs 51.5, B=4
# top-8 83.1 vs 79.7 but SERE K=2 48.1 vs 67.7 (6 experts shared by 32 pairs: the re-reads the sorted path
# avoids), B=8 99.3 vs 130.3. So the small path is taken up to S = 16 (B = 2 at top-8), where it wins for every
# routing measured.
SMALL_PATH_MAX_PAIRS = 16


@dataclass(frozen=True)
class SmallMoEConfig:
    """Tile sizes of the small path. ``up_block_n`` / ``up_block_k``: intermediate columns / hidden depth
    per gate_up program; ``down_block_n`` / ``down_block_k``: hidden columns / intermediate depth per down
    program (powers of two); ``up_warps`` / ``down_warps``: warps per program of each kernel; ``unroll``:
    unroll factor of the depth loops (more loads in flight per program: a GEMV is latency-bound when few
    programs share an SM); ``down_all_slots``: the down kernel loads all k slots' tiles per depth step
    (see ``_down_small_kernel``)."""

    up_block_n: int = 16
    up_block_k: int = 256
    down_block_n: int = 8
    down_block_k: int = 128
    up_warps: int = 4
    down_warps: int = 4
    num_stages: int = 3
    unroll: int = 4
    down_all_slots: bool = True


# H200, Qwen3-30B-A3B at B = 1: gate_up grid 8 × 48 = 384 programs, down grid 1 × 256 (≥ 132 SMs busy),
# each down program with 8 slots × [8, 128] weights in flight per step; 128/256-wide depth chunks are
# 256/512 B contiguous per weight row (16-byte vector loads). The sweep of ``benchmarks/bench_fused_moe.py`` at
# B = 1 (15 configurations): unroll 4 was the fastest measured row, 37.2 µs against 46.8 for unroll 2.
SMALL_GPU_CONFIG = SmallMoEConfig()
# The interpreter runs one program at a time in numpy: small tiles keep the masked work small, and tiles
# narrower than the test shapes exercise the column / depth masks.
SMALL_INTERPRETER_CONFIG = SmallMoEConfig(16, 16, 16, 16, up_warps=1, down_warps=1, num_stages=1, unroll=1)


def default_small_config(device: torch.device) -> SmallMoEConfig:
    return SMALL_GPU_CONFIG if device.type == "cuda" else SMALL_INTERPRETER_CONFIG


def use_small_path(num_pairs: int, path: str = "auto") -> bool:
    """``path``: "auto" (small iff ``num_pairs`` ≤ :data:`SMALL_PATH_MAX_PAIRS`), "small" or "sorted"."""
    if path == "auto":
        return num_pairs <= SMALL_PATH_MAX_PAIRS
    if path in ("small", "sorted"):
        return path == "small"
    raise ValueError(f"path must be 'auto', 'small' or 'sorted', got {path!r}")


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _gate_up_small_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr,
    H, I, E,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_as, stride_ai, stride_it, stride_ik,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
):
    """act[p, n] = SiLU(x_t · gate_e[n]) · (x_t · up_e[n]) for pair p = (t, j), e = ids[t, j]; an invalid
    e writes nothing (the down kernel does not read that row)."""
    pair = tl.program_id(0)
    tok = pair // TOPK
    expert = tl.load(ids_ptr + tok * stride_it + (pair % TOPK) * stride_ik)
    if (expert < 0) | (expert >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + offs_n[:, None] * stride_wn
    up_ptrs = w_base + (offs_n + I)[:, None] * stride_wn
    x_ptrs = x_ptr + tok.to(tl.int64) * stride_xt

    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, loop_unroll_factor=UNROLL):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_ptrs + offs_k * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_ptrs + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32)
        wu = tl.load(up_ptrs + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(wg * x[None, :], axis=1)
        acc_up += tl.sum(wu * x[None, :], axis=1)

    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pair.to(tl.int64) * stride_as + offs_n * stride_ai, act.to(act_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def _down_small_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, topk_w_ptr,
    H, I, E,
    stride_as, stride_ai, stride_we, stride_wn, stride_wk, stride_ot, stride_oh,
    stride_it, stride_ik, stride_wt, stride_wj,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr, ALL_SLOTS: tl.constexpr,
):
    """out[t, n] = Σ_j w[t, j] · (act[t·k + j] · down_e[n]) over the valid slots j = 0..k-1 (invalid slots
    neither read their act row nor add anything).

    ``ALL_SLOTS``: each depth step loads a [k, BLOCK_N, BLOCK_K] tile of all k slots' weights at once (k
    independent loads in flight: at B = 1 there are only cdiv(H, BLOCK_N) programs, so each must keep many
    bytes in flight), then reduces over the slots; otherwise the slots run one after another (smaller tiles,
    fewer registers). Both are fixed-order reductions: deterministic, no atomics."""
    tok = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if ALL_SLOTS:
        js = tl.arange(0, TOPK_P2)
        experts = tl.load(ids_ptr + tok * stride_it + js * stride_ik, mask=js < TOPK, other=-1)
        valid = (js < TOPK) & (experts >= 0) & (experts < E)
        e_safe = tl.where(valid, experts, 0).to(tl.int64)
        gate_w = tl.load(topk_w_ptr + tok * stride_wt + js * stride_wj, mask=valid, other=0.0).to(tl.float32)
        w_ptrs = w_ptr + e_safe[:, None, None] * stride_we + offs_n[None, :, None] * stride_wn
        a_ptrs = act_ptr + (tok * TOPK + js).to(tl.int64)[:, None] * stride_as
        wn_ok = valid[:, None, None] & n_ok[None, :, None]
        acc = tl.zeros([TOPK_P2, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, loop_unroll_factor=UNROLL):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(a_ptrs + offs_k[None, :] * stride_ai, mask=valid[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + offs_k[None, None, :] * stride_wk, mask=wn_ok & k_ok[None, None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[:, None, :], axis=2)
        out = tl.sum(acc * gate_w[:, None], axis=0)
    else:
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            expert = tl.load(ids_ptr + tok * stride_it + j * stride_ik)
            valid = (expert >= 0) & (expert < E)
            e_safe = tl.where(valid, expert, 0).to(tl.int64)
            w_ptrs = w_ptr + e_safe * stride_we + offs_n[:, None] * stride_wn
            a_ptrs = act_ptr + (tok * TOPK + j).to(tl.int64) * stride_as
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in tl.range(0, I, BLOCK_K, loop_unroll_factor=UNROLL):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = (offs_k < I) & valid
                a = tl.load(a_ptrs + offs_k * stride_ai, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptrs + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                acc += tl.sum(w * a[None, :], axis=1)
            gate_w = tl.load(topk_w_ptr + tok * stride_wt + j * stride_wj, mask=valid, other=0.0).to(tl.float32)
            out += acc * gate_w
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + offs_n * stride_oh, out.to(out_ptr.dtype.element_ty),
             mask=n_ok)


# ---------------------------------------------------------------------------------------------- launcher


def launch_gate_up_small(x: torch.Tensor, gate_up_proj: torch.Tensor, topk_ids: torch.Tensor,
                         act: torch.Tensor, config: SmallMoEConfig) -> torch.Tensor:
    """Kernel 1 into ``act`` [T·k, I] (rows of invalid slots left unwritten)."""
    num_experts, two_i, hidden = gate_up_proj.shape
    inter, topk = two_i // 2, topk_ids.shape[1]
    _gate_up_small_kernel[(topk_ids.shape[0] * topk, triton.cdiv(inter, config.up_block_n))](
        x, gate_up_proj, act, topk_ids,
        hidden, inter, num_experts,
        x.stride(0), x.stride(1), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        act.stride(0), act.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        TOPK=topk, BLOCK_N=config.up_block_n, BLOCK_K=config.up_block_k, UNROLL=config.unroll,
        num_warps=config.up_warps, num_stages=config.num_stages,
    )
    return act


def launch_down_small(act: torch.Tensor, down_proj: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, out: torch.Tensor, config: SmallMoEConfig) -> torch.Tensor:
    """Kernel 2 into ``out`` [T, H] (every element written)."""
    num_experts, hidden, inter = down_proj.shape
    num_tokens, topk = topk_ids.shape
    _down_small_kernel[(num_tokens, triton.cdiv(hidden, config.down_block_n))](
        act, down_proj, out, topk_ids, topk_weights,
        hidden, inter, num_experts,
        act.stride(0), act.stride(1), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        out.stride(0), out.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, UNROLL=config.unroll, ALL_SLOTS=config.down_all_slots,
        num_warps=config.down_warps, num_stages=config.num_stages,
    )
    return out


def launch_small_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: torch.Tensor, out: torch.Tensor,
                     config: SmallMoEConfig) -> torch.Tensor:
    """Run the two kernels; arguments already checked by ``fused_moe_triton`` (``x`` in the weights' dtype,
    ``act`` a [T·k, I] scratch buffer in that dtype, ``out`` [T, H]). Returns ``out``."""
    launch_gate_up_small(x, gate_up_proj, topk_ids, act, config)
    return launch_down_small(act, down_proj, topk_ids, topk_weights, out, config)

"""SERE's per-layer decode statistics in one Triton launch (``hf_routing.RoutingHandle._record``,
which SERE's and ``moe.top_k``'s handles share).

Why: the statistics behind ``summary.json["sere"]`` (distinct experts before / after re-routing, |P|, moved,
outside-P, critical and protected slots, live rows, the by-live-rows histogram) were computed with ~44 small
torch ops per layer and step (``torch.cat``, comparisons, two ``index_fill_`` scatters, seven sums, the
accumulator updates). Captured in the engine's decode CUDA graph that is ~2,000 kernels per step for a
48-layer model, each a few µs of mostly idle GPU: at Qwen3-30B-A3B shapes on an H200 the engine's SERE step
was ~3.5 ms slower than the same step without statistics (``benchmarks/run_path_gaps.py``; docs/latency.md
"Run path vs benchmark scripts"). This kernel does the same counting in one program per layer and step and
adds the result into the same int64 device counters in place, so ``hf_graphs`` (which captures, restores and
re-attaches those tensors by identity) is unchanged.

Semantics: exactly ``RoutingHandle._record_torch`` (tested value for value): rows outside ``live`` name no
expert; an id outside ``[0, E)`` is no expert; P = the valid ids of the first ``kp`` columns of live rows.
One program (grid 1): decode steps have T·k of a few hundred slots. ``hf_sere`` sends passes of more than
``FUSED_MAX_TOKENS`` rows (a prefill under ``mode="all"``) to the torch ops instead. No host synchronisation, fixed shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.reroute import _block_w, _or_rows

__all__ = ["FUSED_MAX_TOKENS", "record_stats"]

BLOCK_N = 64     # rows per tile of the union scans
#: ``stats_impl="auto"`` uses the kernel up to this many rows per pass (decode batches). One program loops over a
#: pass's rows, so a long prefill re-routed under ``mode="all"`` keeps the torch ops, which spread over the GPU.
FUSED_MAX_TOKENS = 1024
BLOCK_M = 128    # slots per tile of the per-slot pass


@triton.jit
def _count_bits(words, E, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr):
    """Experts set in the bitmask ``words`` [BLOCK_W] (expert e = bit e % 32 of word e // 32), as int64."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_w = tl.arange(0, BLOCK_W)
    word_e = tl.sum(tl.where((offs_e >> 5)[:, None] == offs_w[None, :], words[None, :], 0), axis=1)
    flags = (((word_e >> (offs_e & 31)) & 1) != 0) & (offs_e < E)
    return tl.sum(flags.to(tl.int64), axis=0)


@triton.jit
def _add(ptr, value):
    tl.store(ptr, tl.load(ptr) + value.to(tl.int64))


@triton.jit
def _stats_kernel(old_ptr, new_ptr, live_ptr, prot_ptr, acc_ptr, hist_ptr, T, E, kp,
                  s_ot, s_ok, s_nt, s_nk,
                  K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_E: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_PROT: tl.constexpr):
    # distinct experts of old, new and old's primary columns (live rows, valid ids)
    w_old = _or_rows(old_ptr, live_ptr, 0, T, E, K, s_ot, s_ok, BLOCK_N, BLOCK_W, HAS_LIVE)
    w_new = _or_rows(new_ptr, live_ptr, 0, T, E, K, s_nt, s_nk, BLOCK_N, BLOCK_W, HAS_LIVE)
    w_prim = _or_rows(old_ptr, live_ptr, 0, T, E, kp, s_ot, s_ok, BLOCK_N, BLOCK_W, HAS_LIVE)
    before = _count_bits(w_old, E, BLOCK_E, BLOCK_W)
    after = _count_bits(w_new, E, BLOCK_E, BLOCK_W)
    prim = _count_bits(w_prim, E, BLOCK_E, BLOCK_W)

    offs_w = tl.arange(0, BLOCK_W)
    moved = tl.zeros([BLOCK_M], dtype=tl.int64)
    outside_n = tl.zeros([BLOCK_M], dtype=tl.int64)
    critical_n = tl.zeros([BLOCK_M], dtype=tl.int64)
    prot_n = tl.zeros([BLOCK_M], dtype=tl.int64)
    live_n = tl.zeros([BLOCK_M], dtype=tl.int64)
    for m0 in range(0, T * K, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_range = offs_m < T * K
        t = offs_m // K
        j = offs_m % K
        live = in_range
        if HAS_LIVE:
            live = live & (tl.load(live_ptr + t, mask=in_range, other=0) != 0)
        e_old = tl.load(old_ptr + t * s_ot + j * s_ok, mask=live, other=-1)   # finished rows: -1 (no expert)
        e_new = tl.load(new_ptr + t * s_nt + j * s_nk, mask=live, other=-1)
        moved += (in_range & (e_old != e_new)).to(tl.int64)
        valid = live & (j >= kp) & (e_old >= 0) & (e_old < E)
        src = tl.where(valid, e_old, 0).to(tl.int32)
        word_src = tl.sum(tl.where((src >> 5)[:, None] == offs_w[None, :], w_prim[None, :], 0), axis=1)
        outside = valid & (((word_src >> (src & 31)) & 1) == 0)
        stayed = outside & (e_old == e_new)
        if HAS_PROT:
            prot = stayed & (tl.load(prot_ptr + src, mask=stayed, other=0) != 0)
        else:
            prot = stayed & (src < 0)   # all false
        outside_n += outside.to(tl.int64)
        critical_n += (stayed & (prot == 0)).to(tl.int64)
        prot_n += prot.to(tl.int64)
        live_n += (live & (j == 0)).to(tl.int64)
    n_live = tl.sum(live_n, axis=0)

    _add(acc_ptr + 0, before)
    _add(acc_ptr + 1, after)
    _add(acc_ptr + 2, prim)
    _add(acc_ptr + 3, tl.sum(moved, axis=0))
    _add(acc_ptr + 4, tl.sum(outside_n, axis=0))
    _add(acc_ptr + 5, tl.sum(critical_n, axis=0))
    _add(acc_ptr + 6, tl.sum(prot_n, axis=0))
    _add(acc_ptr + 7, n_live)
    row = hist_ptr + n_live * 3       # the histogram row of this step's live-row count: (steps, before, after)
    _add(row + 0, n_live * 0 + 1)
    _add(row + 1, before)
    _add(row + 2, after)


def record_stats(old: torch.Tensor, new: torch.Tensor, num_experts: int, k_primary: int,
                 live: torch.Tensor | None, protected: torch.Tensor | None, acc: torch.Tensor,
                 hist: torch.Tensor) -> None:
    """Add one pass's counters into ``acc`` (int64 [8], ``hf_routing.COUNTERS`` order) and ``hist`` (int64
    [T + 1, 3], row = live rows: steps, before, after), in place, in one launch. ``old`` / ``new``: [T, k]
    ids before / after re-routing; ``live``: bool [T] or None (all rows); ``protected``: bool [E] or None."""
    t, k = old.shape
    if t == 0:
        return
    if acc.dtype != torch.long or acc.numel() != 8 or hist.dtype != torch.long or tuple(hist.shape) != (t + 1, 3):
        raise ValueError(f"acc int64 [8], hist int64 [{t + 1}, 3] expected, got {acc.dtype} {tuple(acc.shape)}, "
                         f"{hist.dtype} {tuple(hist.shape)}")
    if not (acc.is_contiguous() and hist.is_contiguous()):
        raise ValueError("acc and hist must be contiguous (they are updated in place)")
    kp = min(int(k_primary), k)
    _stats_kernel[(1,)](
        old, new, live if live is not None else old, protected if protected is not None else old, acc, hist,
        t, int(num_experts), kp, old.stride(0), old.stride(1), new.stride(0), new.stride(1),
        K=k, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, BLOCK_W=_block_w(num_experts),
        BLOCK_E=max(16, triton.next_power_of_2(int(num_experts))),
        HAS_LIVE=live is not None, HAS_PROT=protected is not None,
    )

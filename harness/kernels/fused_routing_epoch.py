"""SERE's multi-program routing plan without arrivals: the step's expert sets as epoch-tagged words
(``harness.kernels.fused_routing``'s plan for SERE steps beyond the one-program kernel, when chosen).

Why (issue 23, session 25). The multi-program plan's first SERE launch 2 (``fused_routing_multi`` until session
25) ended in a chain of dependent memory round trips: the step scratch's expert-set words (written as atomic
ORs), the tile's ids, the similarity rows, the store, then an acq_rel arrival (a fence that waits for the store
and the statistics' atomics) and, in the last program, the exchanges that read and zeroed the scratch and the
counters' update: 5.2–6.0 µs per layer for SERE K=2 without statistics and 6.2–7.8 with them, against 2.3–2.6
for the stock routing (H100 and H200). Fusing the two launches with a grid-wide wait was slower still (the fence
and the poll cost more than a kernel boundary inside a CUDA graph; built and timed in session 25, commit
8ccfe87). The arrivals existed only to zero the scratch for the next call and to find the program that adds the
counters. Here nothing is zeroed:

    words: int64, per expert, the epoch of the last step that put it in P (and, with statistics, in SERE's
           before-set, its kept set, and top-K's before- and after-sets); C1 = the epoch of the last finished
           step, C2 = this step's; sums (decode rows, counted rows, moved slots) zeroed by whoever reads them
    launch 1, one program per tile: epoch = C1 + 1; pass 1 (``_topk_tile``); plain stores of ``epoch`` into
           the words of the tile's experts (several programs may store the same value: no atomics); the sums
           added (statistics only); program 0 stores C2 = epoch
    launch 2, one program per tile: P = {e : word[e] == C2}; re-route the tile's decode rows (the same
           ``_reroute_tile_with`` as the two-launch plan), store the ids; without statistics program 0 stores
           C1 = C2 and the step is done
    launch 3 (statistics only, one program): read the sets (word == C2) and the sums, zero the sums, add the
           counters, store C1 = C2 — the issue's "one cheap launch when it does" need them

Each launch reads only what an earlier launch wrote (a kernel boundary orders it), and writes C1 only where no
program of the same launch reads it, so no program waits for another and no atomics order anything; Triton's
interpreter runs the same code. Older epochs in the words never match C2 (int64: no wrap). A launch that fails
leaves C2's words behind: the scratch is zeroed then (C1 = 0 again, every word older). Timed on the H200 against
the arrival plan (session 25, results/benchmarks/routing_op_h200_s25.json, ``epoch_*`` / ``two_*`` rows): SERE K=2
without counters 4.50–5.05 µs per layer from 8 to 256 rows against 5.35–5.99; with them 5.88–6.55 against
6.46–6.68 up to 70 rows, 7.06 / 6.98 at 128 and 7.99 / 7.78 at 256. Semantics: equal ids, weights and counters
to :func:`harness.kernels.fused_routing_reference.fused_routing_reference` (tests/kernels/test_fused_routing_epoch.py).
Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.fused_routing_reference import RoutingSpec
from harness.kernels.fused_routing_tiles import _add_counters, _reroute_tile_with, _tile_has_decode, _topk_tile

__all__ = ["EPOCH_KERNELS", "epoch_scratch", "fused_routing_epoch"]

#: word sets of the scratch, each [BLOCK_E] int64, in this order; then C1, C2 and the three sums
SETS = ("primary", "sere_before", "kept", "topk_before", "topk_after")
C1, C2, N_DEC, N_TR, MOVED = range(5)


@triton.jit
def _mark(words_ptr, which: tl.constexpr, flags, epoch, BLOCK_E: tl.constexpr):
    """Store ``epoch`` into the words of set ``which`` of the experts ``flags`` names (plain stores)."""
    e = tl.arange(0, BLOCK_E)
    tl.store(words_ptr + which * BLOCK_E + e, tl.zeros([BLOCK_E], dtype=tl.int64) + epoch, mask=flags > 0)


@triton.jit
def _members(words_ptr, which: tl.constexpr, epoch, BLOCK_E: tl.constexpr):
    """[BLOCK_E] int32: 1 for the experts set ``which`` holds in the step of ``epoch``."""
    e = tl.arange(0, BLOCK_E)
    return (tl.load(words_ptr + which * BLOCK_E + e) == epoch).to(tl.int32)


@triton.jit(do_not_specialize=["T"])  # one compilation per tiling, not per step length
def _epoch_topk_kernel(
    logits_ptr, dec_ptr, real_ptr, w_ptr, ids_ptr, bias_ptr, words_ptr,
    T, E, scale, s_lt, s_le, s_wt, s_wk, s_it, s_ik,
    TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr, TRUNC: tl.constexpr, TRUNC_ALL: tl.constexpr, HAS_REAL: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NG: tl.constexpr, GSIZE: tl.constexpr, TG: tl.constexpr,
    SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr,
):
    """Launch 1 (module doc): pass 1 on tile ``program_id``, ids and weights stored, the tile's sets marked with
    this step's epoch."""
    tile = tl.program_id(0)
    head = words_ptr + 5 * BLOCK_E
    epoch = tl.load(head + 0) + 1
    ids, dec, prim, s_before, k_before, k_after, need, n_dec, n_tr = _topk_tile(
        logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, tile * BLOCK_T, T, E, scale, s_lt, s_le, s_wt, s_wk,
        TOPK, KT, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, RENORM, TRUNC, TRUNC_ALL, True, True, HAS_REAL,
        SIGMOID, HAS_BIAS, NG, GSIZE, TG)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik, ids,
             mask=(rows[:, None] < T) & (slots[None, :] < TOPK))
    _mark(words_ptr, 0, prim, epoch, BLOCK_E)
    if SERE_STATS:
        _mark(words_ptr, 1, s_before, epoch, BLOCK_E)
        tl.atomic_add(head + 2, n_dec, mask=n_dec > 0, sem="relaxed")
    if TOPK_STATS:
        _mark(words_ptr, 3, k_before, epoch, BLOCK_E)
        _mark(words_ptr, 4, k_after, epoch, BLOCK_E)
        tl.atomic_add(head + 3, n_tr, mask=n_tr > 0, sem="relaxed")
    if tile == 0:
        tl.store(head + 1, epoch)


@triton.jit(do_not_specialize=["T"])
def _epoch_reroute_kernel(
    dec_ptr, sim_ptr, prot_ptr, ids_ptr, words_ptr, T, E, rho, s_se, s_sp, s_it, s_ik,
    TOPK: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC_CELLS: tl.constexpr, HAS_PROT: tl.constexpr, SERE_STATS: tl.constexpr, LAST: tl.constexpr,
    LANES: tl.constexpr,
):
    """Launch 2 (module doc): program ``pid`` re-routes its tile against the step's P; ``LAST`` (no statistics
    launch follows): program 0 closes the step (C1 = C2)."""
    pid = tl.program_id(0)
    head = words_ptr + 5 * BLOCK_E
    epoch = tl.load(head + 1)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    if _tile_has_decode(dec_ptr, pid, T, BLOCK_T, LANES):
        dec = row_ok & (tl.load(dec_ptr + rows, mask=row_ok, other=0) != 0)
        slots = tl.arange(0, BLOCK_K)
        ptrs = ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik
        ok = row_ok[:, None] & (slots[None, :] < TOPK)
        ids = tl.load(ptrs, mask=ok, other=0)
        prim = _members(words_ptr, 0, epoch, BLOCK_E)
        ids, moved, kept = _reroute_tile_with(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp, KP, WIDTH,
                                              BLOCK_T, BLOCK_E, BLOCK_K, VEC_CELLS, HAS_PROT)
        tl.store(ptrs, ids, mask=ok)
        if SERE_STATS:
            _mark(words_ptr, 2, kept, epoch, BLOCK_E)
            tl.atomic_add(head + 4, moved, mask=moved > 0, sem="relaxed")
    if LAST:
        if pid == 0:
            tl.store(head + 0, epoch)


@triton.jit
def _epoch_stats_kernel(words_ptr, sere_cnt_ptr, topk_cnt_ptr, TOPK: tl.constexpr, KT: tl.constexpr,
                        KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_E: tl.constexpr,
                        SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr):
    """Launch 3 (statistics only, one program): the step's sets and sums into the counters; the sums zeroed, the
    step closed (C1 = C2)."""
    head = words_ptr + 5 * BLOCK_E
    epoch = tl.load(head + 1)
    three = tl.arange(0, 4)
    sums = tl.load(head + 2 + three, mask=three < 3, other=0)
    tl.store(head + 2 + three, tl.zeros([4], dtype=tl.int64), mask=three < 3)
    n_dec = tl.sum(tl.where(three == 0, sums, 0), axis=0)
    n_tr = tl.sum(tl.where(three == 1, sums, 0), axis=0)
    moved = tl.sum(tl.where(three == 2, sums, 0), axis=0)
    if SERE_STATS:
        prim = _members(words_ptr, 0, epoch, BLOCK_E)
        kept = _members(words_ptr, 2, epoch, BLOCK_E)
        _add_counters(sere_cnt_ptr, n_dec, _members(words_ptr, 1, epoch, BLOCK_E), tl.maximum(prim, kept), prim,
                      moved, WIDTH - KP)
    if TOPK_STATS:
        k_after = _members(words_ptr, 4, epoch, BLOCK_E)
        _add_counters(topk_cnt_ptr, n_tr, _members(words_ptr, 3, epoch, BLOCK_E), k_after, k_after,
                      n_tr * (TOPK - KT), TOPK - KT)
    tl.store(head + 0, epoch)


#: the plan's kernels in launch order (``fused_routing.kernel_sources`` hashes their sources)
EPOCH_KERNELS = (_epoch_topk_kernel, _epoch_reroute_kernel, _epoch_stats_kernel)

_EPOCH_SCRATCH: dict[tuple, torch.Tensor] = {}


def epoch_scratch(device: torch.device, block_e: int) -> torch.Tensor:
    """The int64 words of the plan (module doc), allocated zeroed once per device and experts block (no memset
    node in a CUDA graph; the same reasons and the same one-call-at-a-time assumption as
    ``fused_routing_multi.step_scratch``)."""
    key = (device.type, device.index, block_e)
    buf = _EPOCH_SCRATCH.get(key)
    if buf is None:
        buf = _EPOCH_SCRATCH[key] = torch.zeros(len(SETS) * block_e + 8, dtype=torch.int64, device=device)
    return buf


def fused_routing_epoch(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor,
                        real_rows: torch.Tensor | None, sere_counters: torch.Tensor | None,
                        topk_counters: torch.Tensor | None, sim: torch.Tensor, prot: torch.Tensor | None,
                        bias: torch.Tensor | None, weights: torch.Tensor, ids: torch.Tensor, *, vec_cells: int,
                        block_t: int, num_warps: int, reroute_warps: int) -> None:
    """Launch the plan (module doc) for a SERE step (``decode_rows`` given) into ``weights`` / ``ids``, on the
    multi-program plan's tiling (``fused_routing_multi`` passes its own, so pass 1 reduces in the same order as
    the stock routing's and SERE on and off give identical weights)."""
    t, num_experts = logits.shape
    block_e = max(16, triton.next_power_of_2(num_experts))
    n_tiles = triton.cdiv(t, block_t)
    sere_stats = sere_counters is not None
    topk_stats = spec.trunc_k is not None and topk_counters is not None
    words = epoch_scratch(logits.device, block_e)
    dummy = ids
    meta = dict(TOPK=spec.top_k, KP=spec.k_primary, WIDTH=spec.width, BLOCK_T=block_t, BLOCK_E=block_e,
                BLOCK_K=triton.next_power_of_2(spec.top_k))
    kt = spec.trunc_k or spec.top_k
    try:
        _epoch_topk_kernel[(n_tiles,)](
            logits, decode_rows, real_rows if real_rows is not None else dummy, weights, ids,
            bias if bias is not None else weights, words, t, num_experts, float(spec.scaling),
            logits.stride(0), logits.stride(1), weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
            KT=kt, RENORM=spec.renormalize, TRUNC=spec.trunc_k is not None, TRUNC_ALL=spec.trunc_all,
            HAS_REAL=real_rows is not None, SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NG=spec.groups,
            GSIZE=num_experts // spec.groups, TG=spec.topk_groups, SERE_STATS=sere_stats, TOPK_STATS=topk_stats,
            num_warps=num_warps, **meta)
        _epoch_reroute_kernel[(n_tiles,)](
            decode_rows, sim, prot if prot is not None else dummy, ids, words, t, num_experts, float(spec.rho),
            sim.stride(0), sim.stride(1), ids.stride(0), ids.stride(1), VEC_CELLS=vec_cells,
            HAS_PROT=prot is not None, SERE_STATS=sere_stats, LAST=not (sere_stats or topk_stats),
            LANES=max(block_e, block_t, 32), num_warps=reroute_warps, **meta)
        if sere_stats or topk_stats:
            _epoch_stats_kernel[(1,)](
                words, sere_counters if sere_stats else dummy, topk_counters if topk_stats else dummy,
                TOPK=spec.top_k, KT=kt, KP=spec.k_primary, WIDTH=spec.width, BLOCK_E=block_e,
                SERE_STATS=sere_stats, TOPK_STATS=topk_stats, num_warps=1 if block_e <= 256 else 4)
    except BaseException:
        words.zero_()   # a step left half-marked: every word older than the next step's epoch again
        raise

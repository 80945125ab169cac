"""MoE routing for an engine's ``custom_routing_function`` in one launch: softmax (or DeepSeek-V3's sigmoid +
selection bias + group-limited top-k + scaling), top-k, renormalisation, ``moe.top_k`` truncation, SERE's
re-route and the statistics counters.

Why (issue 23). Inside vLLM the harness's routing function ran a chain of ~25 small torch ops per MoE layer
(the stock top-k, the truncation, the decode-row mask, the re-route kernel, ~15 counter ops, a concat, a
cast). Under vLLM's CUDA graphs no Python runs, but every one of those kernels still runs: ~70 µs per layer,
~3.5 ms per step on Qwen3-30B-A3B shapes — SERE made single-request decode 1.86× slower and plain top-2 was
slower than stock top-8. vLLM's own softmax top-k is one kernel. This op is one kernel too, for decode-sized
steps (T <= :data:`FUSED_MAX_TOKENS`, which covers every step vLLM captures in a graph by default):

    one program (grid 1), row tiles of BLOCK_T tokens × BLOCK_E experts
    pass 1, per tile: logits → fp32 softmax → top-k by k rounds of "largest, lowest id on ties" →
             renormalise → (TRUNC) the first K' slots renormalised, slots K'.. = (row's first expert,
             weight 0) → weights stored; P |= experts of the first k_primary slots of decode rows;
             statistics' expert sets accumulated as [BLOCK_E] flags
    SERE, one tile: for each secondary slot j in [k_primary, width) of a decode row whose source is not
             in P and not protected → the source's similarity row restricted to P (masked gather), best,
             lowest id attaining it, move iff best is finite and >= rho → ids stored
    SERE, several tiles: the same decision once per source expert (one masked [E, E] load: a table
             source → target | stay), then pass 2 per tile looks each secondary slot up → ids stored
    end:     (STATS) the counters [calls, rows, before, after, primary, moved, secondary] += this call,
             in place (grid 1: no atomics)

P is a reduction over the whole step and pass 2 needs all of it, hence one program; a step that fits one tile
keeps everything in registers (no store/reload between the passes). Longer steps (prefill: eager, never in a
graph at vLLM's default capture sizes) go to the torch reference, whose ops spread over the GPU
(:func:`fused_routing`).

Semantics: :func:`fused_routing_reference` (plain torch, beside the kernel), which equals the composition of
the engine's stock top-k, ``harness.techniques.moe_topk.truncate_routing`` + ``pad_routing`` and
``harness.techniques.sere.reroute`` (tested in tests/kernels/test_fused_routing.py). Weights are rounded to
the logits' dtype (as transformers' router returns them) and returned as float32, ids as int32 (what vLLM's
fused-MoE kernels take). Fixed shapes, no host synchronisation: capturable in a CUDA graph; registered as
``torch.ops.harness.fused_moe_routing`` for ``torch.compile``.

Counter layout (int64 [7], one vector per layer and statistic): :data:`COUNTERS`. SERE's counters count the
decode rows' re-routing (before = distinct experts of the re-routed columns, after = after re-routing,
primary = |P|); ``moe.top_k``'s count the truncated rows (before = the stock top-k's experts, after = the
truncated routing's, primary = the experts of its first K' columns, moved = slots changed).
Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs
from harness.kernels.fused_routing_reference import COUNTERS, RoutingSpec, fused_routing_reference

__all__ = ["COUNTERS", "FUSED_MAX_TOKENS", "RoutingSpec", "fused_routing", "fused_routing_reference",
           "fused_routing_triton"]

#: steps up to this many tokens run the one-launch kernel; longer ones the torch reference. One program walks
#: the step's tiles, so its cost grows with T: on the H200 SERE K=2 costs 79 µs per layer at T=256 against 84 for
#: the op chain it replaced (results/benchmarks/routing_op_h200.json); beyond that the chain's ops, which spread
#: over the GPU, are the better bet (unmeasured above 256; vLLM captures graphs up to 512 tokens by default)
FUSED_MAX_TOKENS = 256
#: rows x slots x experts up to which SERE's secondary slots are re-routed all at once (:func:`_reroute_slots`):
#: 4 rows at top-8 of 128 experts; beyond, the per-slot loop keeps registers in bounds
VEC_CELLS = 4096


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _column(tile, slots, j):
    """Column ``j`` of an int [BLOCK_T, BLOCK_K] tile."""
    return tl.sum(tl.where(slots[None, :] == j, tile, 0), axis=1)


@triton.jit
def _flags(hit, rows):
    """[BLOCK_E] int32: experts hit on any of ``rows`` (hit [BLOCK_T, BLOCK_E] bool, rows [BLOCK_T] bool)."""
    return tl.max(tl.where(hit & rows[:, None], 1, 0), axis=0)


@triton.jit
def _sigmoid_key(x, e, e_ok, bias_ptr, GSIZE: tl.constexpr, NG: tl.constexpr, TG: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """DeepSeek-V3's rule on a tile of logits ``x``: (scores s = sigmoid(x), rank key c = s + bias with the
    experts of all but the ``TG`` best of ``NG`` groups at -inf; a group's score is the sum of its two best c,
    ties to the lower id / group)."""
    s = 1.0 / (1.0 + tl.exp(-x))
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    c = tl.where(e_ok[None, :], c, float("-inf"))
    if NG > 1:
        grp = e // GSIZE
        g_ids = tl.arange(0, NG)
        g_score = tl.zeros([BLOCK_T, NG], dtype=tl.float32)
        for g in tl.static_range(NG):
            in_g = (grp == g) & e_ok
            m1 = tl.max(tl.where(in_g[None, :], c, float("-inf")), axis=1)
            i1 = tl.min(tl.where(in_g[None, :] & (c == m1[:, None]), e[None, :], BLOCK_E), axis=1)
            m2 = tl.max(tl.where(in_g[None, :] & (e[None, :] != i1[:, None]), c, float("-inf")), axis=1)
            g_score = tl.where(g_ids[None, :] == g, (m1 + m2)[:, None], g_score)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for r in tl.static_range(TG):
            best = tl.max(g_score, axis=1)
            gi = tl.min(tl.where(g_score == best[:, None], g_ids[None, :], NG), axis=1)
            keep = tl.where(grp[None, :] == gi[:, None], 1, keep)
            g_score = tl.where(g_ids[None, :] == gi[:, None], float("-inf"), g_score)
        c = tl.where(keep > 0, c, float("-inf"))
    return s, c


@triton.jit
def _topk_tile(logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, t0, T, E, scale, s_lt, s_le, s_wt, s_wk,
               TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
               RENORM: tl.constexpr, TRUNC: tl.constexpr, TRUNC_ALL: tl.constexpr, SERE: tl.constexpr,
               HAS_DEC: tl.constexpr, HAS_REAL: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
               NG: tl.constexpr, GSIZE: tl.constexpr, TG: tl.constexpr):
    """Pass 1 on rows [t0, t0 + BLOCK_T): ids [BLOCK_T, BLOCK_K] int32 (returned), weights stored, and the
    [BLOCK_E] flag vectors the counters and pass 2 need. ``SIGMOID``: DeepSeek-V3's rule (:func:`_sigmoid_key`;
    weights = s, renormalised with + 1e-20, times ``scale``, kept float32), else the softmax rule."""
    rows = t0 + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    slots = tl.arange(0, BLOCK_K)
    if HAS_DEC:
        dec = row_ok & (tl.load(dec_ptr + rows, mask=row_ok, other=0) != 0)
    else:
        dec = rows < 0
    if HAS_REAL:
        real = row_ok & (tl.load(real_ptr + rows, mask=row_ok, other=0) != 0)
    else:
        real = row_ok
    if TRUNC_ALL:
        tr = row_ok
    else:
        tr = dec
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * s_lt + e[None, :] * s_le,
                mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        p, key = _sigmoid_key(x, e, e_ok, bias_ptr, GSIZE, NG, TG, HAS_BIAS, BLOCK_T, BLOCK_E)
        rem = key
        gone = float("-inf")
    else:
        x = tl.where(e_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        rem = tl.where(e_ok[None, :], p, -1.0)
        gone = -1.0
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    rank = tl.full([BLOCK_T, BLOCK_E], BLOCK_K, dtype=tl.int32)   # slot an expert was selected in (BLOCK_K: none)
    counted = real & tr
    for j in tl.static_range(TOPK):
        best = tl.max(rem, axis=1)
        if SIGMOID:  # ranked on c (which -inf fills: never pick a taken or padding expert), weighed by s
            free = (rank == BLOCK_K) & e_ok[None, :]
            idx = tl.min(tl.where((rem == best[:, None]) & free, e[None, :], BLOCK_E), axis=1)
            hit = e[None, :] == idx[:, None]
            best = tl.sum(tl.where(hit, p, 0.0), axis=1)
        else:
            idx = tl.min(tl.where(rem == best[:, None], e[None, :], BLOCK_E), axis=1)
            hit = e[None, :] == idx[:, None]
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)
        vals = tl.where(slots[None, :] == j, best[:, None], vals)
        rem = tl.where(hit, gone, rem)
        rank = tl.where(hit, j, rank)
    # the expert sets, one cross-row reduction each (not one per slot: those cost ~0.3 µs apiece)
    prim = _flags(rank < KP, dec)            # P: first KP slots of decode rows
    s_before = _flags(rank < WIDTH, dec)     # SERE: the re-routed columns of decode rows
    k_before = _flags(rank < TOPK, counted)  # top-K: all slots of the counted truncated rows
    k_after = _flags(rank < KT, counted)     # top-K: its first KT slots (= after and primary)
    need = _flags((rank >= KP) & (rank < WIDTH), dec)   # experts some decode row has in a secondary slot
    k_ok = slots < TOPK
    eps = 1e-20 if SIGMOID else 0.0
    if RENORM:
        w = vals / (tl.sum(tl.where(k_ok[None, :], vals, 0.0), axis=1)[:, None] + eps)
    else:
        w = vals
    if TRUNC:
        head = slots < KT
        hv = tl.where(head[None, :], vals, 0.0)
        if RENORM:
            tw = hv / (tl.sum(hv, axis=1)[:, None] + eps)
        else:
            tw = hv
        w = tl.where(tr[:, None], tw, w)
        first = _column(ids, slots, 0)
        ids = tl.where(tr[:, None] & (slots[None, :] >= KT), first[:, None], ids)
    if SIGMOID:
        w = w * scale
    else:
        w = w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(w_ptr + rows[:, None].to(tl.int64) * s_wt + slots[None, :] * s_wk, w,
             mask=row_ok[:, None] & k_ok[None, :])
    n_dec = tl.sum(dec.to(tl.int64), axis=0)
    n_tr = tl.sum(counted.to(tl.int64), axis=0)
    return ids, dec, prim, s_before, k_before, k_after, need, n_dec, n_tr


@triton.jit
def _nearest_in_p(sim_ptr, src, ok, cand, rho, s_se, s_sp, BLOCK_E: tl.constexpr):
    """SERE's decision for source experts ``src`` [N] (``ok``: eligible): the lowest-id expert of P (``cand``)
    with the highest similarity (NaN never attracts), and whether the slot moves (finite and >= rho). Shared by
    the per-slot gather and the per-expert table, so both decide exactly alike."""
    e = tl.arange(0, BLOCK_E)
    sim = tl.load(sim_ptr + src[:, None].to(tl.int64) * s_se + e[None, :] * s_sp,
                  mask=ok[:, None] & cand[None, :], other=float("-inf")).to(tl.float32)
    sim = tl.where(sim == sim, sim, float("-inf"))
    best = tl.max(sim, axis=1)
    target = tl.min(tl.where(sim == best[:, None], e[None, :], BLOCK_E), axis=1)
    return target, ok & (best > float("-inf")) & (best >= rho)


@triton.jit
def _reroute_tile(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                  KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_PROT: tl.constexpr):
    """Pass 2 of a one-tile step: SERE's re-route of the secondary slots [KP, WIDTH) of the decode rows
    ``dec``, one similarity-row gather per slot (masked to P). Returns the new ids, the moved-slot count and
    the flags of the unmoved sources (for ``after``). At <= 32 rows this beats :func:`_route_table`'s
    [E, E] pass (H200: 7.4 vs 10.4 µs per layer at T=1, results/benchmarks/routing_op_h200.json)."""
    e = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    cand = prim > 0
    moved = tl.zeros([BLOCK_T], dtype=tl.int64)
    kept_rows = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(KP, WIDTH):
        src = _column(ids, slots, j)
        hit = e[None, :] == src[:, None]
        in_p = tl.max(tl.where(hit & cand[None, :], 1, 0), axis=1) > 0
        ok = dec & (in_p == 0)
        if HAS_PROT:
            ok = ok & (tl.load(prot_ptr + src, mask=ok, other=0) == 0)
        target, move = _nearest_in_p(sim_ptr, src, ok, cand, rho, s_se, s_sp, BLOCK_E)
        ids = tl.where((slots[None, :] == j) & move[:, None], target[:, None], ids)
        moved += move.to(tl.int64)
        kept_rows = tl.where(hit & (move == 0)[:, None], 1, kept_rows)
    return ids, tl.sum(moved, axis=0), _flags(kept_rows > 0, dec)


@triton.jit
def _reroute_slots(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                   KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_PROT: tl.constexpr):
    """Pass 2 of a small one-tile step, every secondary slot at once: :func:`_reroute_tile`'s decisions with
    the [rows x slots] grid flattened, so the similarity-row gathers of all slots are one masked load.

    Why: in :func:`_reroute_tile` slot j+1's source is read from the ids slot j may have rewritten, so its
    gathers form a dependent chain of WIDTH - KP global loads (H200, T=1: 7.4 µs per layer against 3.4 for the
    stock routing alone). P is fixed for the step, so no slot's decision depends on another's: loading them
    together gives the same ids. Chosen while the [rows x slots x experts] grid stays small (registers)."""
    e = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    cand = prim > 0
    sec_rows = dec[:, None] & (slots[None, :] >= KP) & (slots[None, :] < WIDTH)
    src = tl.reshape(ids, (BLOCK_T * BLOCK_K,))
    sec = tl.reshape(tl.broadcast_to(sec_rows, (BLOCK_T, BLOCK_K)), (BLOCK_T * BLOCK_K,))
    hit = src[:, None] == e[None, :]
    in_p = tl.max(tl.where(hit & cand[None, :], 1, 0), axis=1) > 0
    ok = sec & (in_p == 0)
    if HAS_PROT:
        ok = ok & (tl.load(prot_ptr + src, mask=ok, other=0) == 0)
    target, move = _nearest_in_p(sim_ptr, src, ok, cand, rho, s_se, s_sp, BLOCK_E)
    new = tl.reshape(tl.where(move, target, src), (BLOCK_T, BLOCK_K))
    moved = tl.sum(move.to(tl.int64), axis=0)
    kept = tl.max(tl.where(hit & (sec & (move == 0))[:, None], 1, 0), axis=0)
    return new, moved, kept


@triton.jit
def _route_table(prim, need, sim_ptr, prot_ptr, E, rho, s_se, s_sp, BLOCK_E: tl.constexpr, HAS_PROT: tl.constexpr):
    """Where each expert's secondary slots go, once per step: ``[BLOCK_E]`` int32, the target for a source
    expert that moves (not in P, not protected, some decode row names it as secondary, best similarity over P
    finite and >= rho; target = lowest id attaining it), -1 for one that stays. A row's slot outcome depends
    only on its source expert (P is the step's), so one [E, E] masked load replaces a similarity-row gather
    per slot and row; masked lanes fetch nothing, so a B=1 step reads only its few sources' P-columns."""
    src = tl.arange(0, BLOCK_E)
    cand = prim > 0
    ok = (need > 0) & (cand == 0) & (src < E)
    if HAS_PROT:
        ok = ok & (tl.load(prot_ptr + src, mask=ok, other=0) == 0)
    target, move = _nearest_in_p(sim_ptr, src, ok, cand, rho, s_se, s_sp, BLOCK_E)
    return tl.where(move, target, -1)


@triton.jit
def _apply_tile(ids, dec, table, KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pass 2 on one tile: the secondary slots [KP, WIDTH) of the decode rows ``dec`` take their source's
    entry of :func:`_route_table`. Returns the new ids, the moved-slot count and the flags of the unmoved
    sources (for ``after``)."""
    e = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    moved = tl.zeros([BLOCK_T], dtype=tl.int64)
    kept_rows = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(KP, WIDTH):
        src = _column(ids, slots, j)
        hit = e[None, :] == src[:, None]
        target = tl.max(tl.where(hit, table[None, :], -1), axis=1)
        move = dec & (target >= 0)
        ids = tl.where((slots[None, :] == j) & move[:, None], target[:, None], ids)
        moved += move.to(tl.int64)
        kept_rows = tl.where(hit & (move == 0)[:, None], 1, kept_rows)
    return ids, tl.sum(moved, axis=0), _flags(kept_rows > 0, dec)


@triton.jit
def _add_counters(ptr, rows, before, after, primary, moved, secondary_per_row):
    o = tl.arange(0, 8)
    vals = tl.where(o == 0, (rows > 0).to(tl.int64), 0)
    vals = tl.where(o == 1, rows, vals)
    vals = tl.where(o == 2, tl.sum(before.to(tl.int64), axis=0), vals)
    vals = tl.where(o == 3, tl.sum(after.to(tl.int64), axis=0), vals)
    vals = tl.where(o == 4, tl.sum(primary.to(tl.int64), axis=0), vals)
    vals = tl.where(o == 5, moved, vals)
    vals = tl.where(o == 6, rows * secondary_per_row, vals)
    old = tl.load(ptr + o, mask=o < 7, other=0)
    tl.store(ptr + o, old + vals, mask=o < 7)


@triton.jit(do_not_specialize=["T", "n_tiles"])  # one compilation per tile size, not per step length
def _fused_routing_kernel(
    logits_ptr, dec_ptr, real_ptr, sim_ptr, prot_ptr, w_ptr, ids_ptr, sere_cnt_ptr, topk_cnt_ptr, bias_ptr,
    T, n_tiles, E, rho, scale, s_lt, s_le, s_se, s_sp, s_wt, s_wk, s_it, s_ik,
    TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
    RENORM: tl.constexpr, TRUNC: tl.constexpr, TRUNC_ALL: tl.constexpr, SERE: tl.constexpr,
    HAS_DEC: tl.constexpr, HAS_REAL: tl.constexpr, HAS_PROT: tl.constexpr,
    SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr, VEC_CELLS: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NG: tl.constexpr, GSIZE: tl.constexpr, TG: tl.constexpr,
):
    slots = tl.arange(0, BLOCK_K)
    k_ok = slots < TOPK
    zero_e = tl.zeros([BLOCK_E], dtype=tl.int32)
    n_dec = tl.sum(tl.zeros([1], dtype=tl.int64), axis=0)
    n_tr = n_dec
    moved = n_dec
    if SINGLE:
        ids, dec, prim, s_before, k_before, k_after, need, n_dec, n_tr = _topk_tile(
            logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, 0, T, E, scale, s_lt, s_le, s_wt, s_wk,
            TOPK, KT, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, RENORM, TRUNC, TRUNC_ALL, SERE, HAS_DEC, HAS_REAL,
            SIGMOID, HAS_BIAS, NG, GSIZE, TG)
        kept = zero_e
        if SERE:
            if BLOCK_T * BLOCK_K * BLOCK_E <= VEC_CELLS:
                ids, moved, kept = _reroute_slots(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                                                  KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, HAS_PROT)
            else:
                ids, moved, kept = _reroute_tile(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                                                 KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, HAS_PROT)
        rows = tl.arange(0, BLOCK_T)
        tl.store(ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik, ids,
                 mask=(rows[:, None] < T) & k_ok[None, :])
    else:
        prim = zero_e
        s_before = zero_e
        k_before = zero_e
        k_after = zero_e
        need = zero_e
        kept = zero_e
        for tile in range(0, n_tiles):
            t0 = tile * BLOCK_T
            ids, dec, p_t, sb_t, kb_t, ka_t, nn_t, nd_t, nt_t = _topk_tile(
                logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, t0, T, E, scale, s_lt, s_le, s_wt, s_wk,
                TOPK, KT, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, RENORM, TRUNC, TRUNC_ALL, SERE, HAS_DEC, HAS_REAL,
                SIGMOID, HAS_BIAS, NG, GSIZE, TG)
            prim = tl.maximum(prim, p_t)
            s_before = tl.maximum(s_before, sb_t)
            k_before = tl.maximum(k_before, kb_t)
            k_after = tl.maximum(k_after, ka_t)
            need = tl.maximum(need, nn_t)
            n_dec += nd_t
            n_tr += nt_t
            rows = t0 + tl.arange(0, BLOCK_T)
            tl.store(ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik, ids,
                     mask=(rows[:, None] < T) & k_ok[None, :])
        if SERE:
            table = _route_table(prim, need, sim_ptr, prot_ptr, E, rho, s_se, s_sp, BLOCK_E, HAS_PROT)
            tl.debug_barrier()  # pass 1's stores are visible to every thread of the program
            for tile in range(0, n_tiles):
                rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
                row_ok = rows < T
                ptrs = ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik
                ids = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
                if HAS_DEC:
                    dec = row_ok & (tl.load(dec_ptr + rows, mask=row_ok, other=0) != 0)
                else:
                    dec = rows < 0
                ids, m_t, kept_t = _apply_tile(ids, dec, table, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K)
                moved += m_t
                kept = tl.maximum(kept, kept_t)
                tl.store(ptrs, ids, mask=row_ok[:, None] & k_ok[None, :])
    if SERE_STATS:
        _add_counters(sere_cnt_ptr, n_dec, s_before, tl.maximum(prim, kept), prim, moved, WIDTH - KP)
    if TOPK_STATS:
        _add_counters(topk_cnt_ptr, n_tr, k_before, k_after, k_after, n_tr * (TOPK - KT), TOPK - KT)


def _tile_rows(num_tokens: int, block_e: int) -> int:
    """Rows per tile: the whole step when it is small (no store/reload between the passes), else tiles of
    ~4K logits (registers of one program)."""
    cap = max(1, 4096 // block_e)
    return max(1, min(triton.next_power_of_2(max(num_tokens, 1)), cap))


def fused_routing_triton(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None = None,
                         real_rows: torch.Tensor | None = None, sere_counters: torch.Tensor | None = None,
                         topk_counters: torch.Tensor | None = None, *, block_t: int | None = None,
                         num_warps: int | None = None, vec_cells: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch kernel (module doc); arguments as :func:`fused_routing_reference`. ``block_t`` /
    ``num_warps`` override the tiling and ``vec_cells`` the all-slots-at-once re-route's limit (0: never;
    the benchmark and the tests compare both re-routes)."""
    if logits.dim() != 2:
        raise ValueError(f"routing: logits must be [T, E], got {tuple(logits.shape)}")
    t, num_experts = logits.shape
    if spec.top_k > num_experts:
        raise ValueError(f"routing: top_k={spec.top_k} with {num_experts} experts")
    dev = logits.device
    weights = torch.empty((t, spec.top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, spec.top_k), dtype=torch.int32, device=dev)
    if t == 0:
        return weights, ids
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_t = block_t or _tile_rows(t, block_e)
    sere = spec.k_primary is not None
    trunc = spec.trunc_k is not None
    sim = spec.similarity if sere else None
    if sim is not None and (sim.device != dev or sim.dtype != torch.float32):
        sim = sim.to(device=dev, dtype=torch.float32)
    if sere and tuple(sim.shape) != (num_experts, num_experts):
        raise ValueError(f"routing: similarity {tuple(sim.shape)} for {num_experts} experts")
    prot = spec.protected if sere else None
    bias = spec.bias if spec.sigmoid else None
    if bias is not None and (bias.device != dev or bias.dtype != torch.float32):
        bias = bias.to(device=dev, dtype=torch.float32)
    if spec.groups > 1 and (num_experts % spec.groups or spec.groups & (spec.groups - 1)
                            or spec.top_k > spec.topk_groups * (num_experts // spec.groups)):
        raise ValueError(f"routing: top-{spec.top_k} of {num_experts} experts in {spec.topk_groups} of "
                         f"{spec.groups} groups (the kernel needs equal groups, a power-of-two count, enough experts)")
    dummy = ids
    n_tiles = triton.cdiv(t, block_t)
    _fused_routing_kernel[(1,)](
        logits, decode_rows if decode_rows is not None else dummy, real_rows if real_rows is not None else dummy,
        sim if sim is not None else dummy, prot if prot is not None else dummy, weights, ids,
        sere_counters if sere_counters is not None else dummy, topk_counters if topk_counters is not None else dummy,
        bias if bias is not None else weights,
        t, n_tiles, num_experts, float(spec.rho), float(spec.scaling), logits.stride(0), logits.stride(1),
        sim.stride(0) if sim is not None else 0, sim.stride(1) if sim is not None else 0,
        weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
        TOPK=spec.top_k, KT=spec.trunc_k or spec.top_k, KP=spec.k_primary or 0, WIDTH=spec.width,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(spec.top_k),
        SINGLE=n_tiles == 1, RENORM=spec.renormalize, TRUNC=trunc, TRUNC_ALL=spec.trunc_all,
        SERE=sere, HAS_DEC=decode_rows is not None, HAS_REAL=real_rows is not None, HAS_PROT=prot is not None,
        SERE_STATS=sere and sere_counters is not None, TOPK_STATS=trunc and topk_counters is not None,
        VEC_CELLS=VEC_CELLS if vec_cells is None else vec_cells,
        SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NG=spec.groups, GSIZE=num_experts // spec.groups,
        TG=spec.topk_groups,
        # 4 warps up to 8 rows x 128 experts, 8 beyond (H200 sweep: SERE K=2 at T=16 9.9 µs with 8 warps vs 11.7
        # with 4; at T=1 7.4 with 4 vs 8.9 with 8); never chosen by technique, so every technique's stock part
        # reduces in the same order (identical weights with SERE on and off)
        num_warps=num_warps or (4 if block_t * block_e <= 1024 else 8),
    )
    return weights, ids


# -------------------------------------------------------------------------------------------- dispatch


@torch.library.custom_op("harness::fused_moe_routing", mutates_args=("sere_counters", "topk_counters"))
def _routing_op(logits: torch.Tensor, top_k: int, renormalize: bool, trunc_k: int, trunc_all: bool,
                k_primary: int, rho: float, similarity: torch.Tensor | None, protected: torch.Tensor | None,
                decode_rows: torch.Tensor | None, real_rows: torch.Tensor | None,
                sere_counters: torch.Tensor | None, topk_counters: torch.Tensor | None, scoring: str,
                bias: torch.Tensor | None, groups: int, topk_groups: int, scaling: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    spec = RoutingSpec(top_k, renormalize, trunc_k=trunc_k or None, trunc_all=trunc_all,
                       k_primary=k_primary or None, rho=rho, similarity=similarity, protected=protected,
                       scoring=scoring, bias=bias, groups=groups, topk_groups=topk_groups, scaling=scaling)
    return _eager(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)


@_routing_op.register_fake
def _routing_fake(logits, top_k, renormalize, trunc_k, trunc_all, k_primary, rho, similarity, protected,
                  decode_rows, real_rows, sere_counters, topk_counters, scoring, bias, groups, topk_groups, scaling):
    t = logits.shape[0]
    return (logits.new_empty((t, top_k), dtype=torch.float32), logits.new_empty((t, top_k), dtype=torch.int32))


def _eager(logits, spec, decode_rows, real_rows, sere_counters, topk_counters):
    if logits.shape[0] <= FUSED_MAX_TOKENS and triton_runs(logits.device, _fused_routing_kernel):
        return fused_routing_triton(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)
    return fused_routing_reference(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)


def fused_routing(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None = None,
                  real_rows: torch.Tensor | None = None, sere_counters: torch.Tensor | None = None,
                  topk_counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the custom op under ``torch.compile``; the one-launch kernel where Triton runs and the step
    is decode-sized; the torch reference otherwise (CPU engines, long prefill steps — eager, never in a graph
    at vLLM's default capture sizes)."""
    if torch.compiler.is_compiling():
        return torch.ops.harness.fused_moe_routing(
            logits, spec.top_k, spec.renormalize, spec.trunc_k or 0, spec.trunc_all, spec.k_primary or 0,
            spec.rho, spec.similarity, spec.protected, decode_rows, real_rows, sere_counters, topk_counters,
            spec.scoring, spec.bias, spec.groups, spec.topk_groups, spec.scaling)
    return _eager(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)

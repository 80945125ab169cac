"""The tile functions of the routing op (``harness.kernels.fused_routing``), shared by its two launch plans.

Why a module of its own: the one-program kernel (``fused_routing``: one program walks every tile) and the
multi-program kernels (``fused_routing_multi``: one program per tile, a second launch as the grid barrier) run
the same pass 1 (softmax or DeepSeek-V3 top-k, renormalisation, truncation, the step's expert sets) and make
the same SERE decision per source expert; written once here, the two plans cannot drift apart, and neither
kernel module imports the other. Imports: triton only.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    [BLOCK_E] flag vectors the counters and pass 2 need (``need``: a count per expert, see below). ``SIGMOID``:
    DeepSeek-V3's rule (:func:`_sigmoid_key`; weights = s, renormalised with + 1e-20, times ``scale``, kept
    float32), else the softmax rule."""
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
    # per expert, how many decode rows have it in a secondary slot (> 0: it needs a decision; the multi-program
    # plan's counter program sums these into the moved-slot count)
    need = tl.sum(tl.where((rank >= KP) & (rank < WIDTH) & dec[:, None], 1, 0), axis=0)
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
def _reroute_slots(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                   KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_PROT: tl.constexpr):
    """Pass 2 of a small tile (a one-tile step of the one-program kernel, or one program's tile of the
    multi-program plan; ``prim``: the step's P), every secondary slot at once: ``fused_routing._reroute_tile``'s
    decisions with the [rows x slots] grid flattened, so the similarity-row gathers of all slots are one load.

    Why: in ``_reroute_tile`` slot j+1's source is read from the ids slot j may have rewritten, so its
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
def _secondary_sources(ids, dec, KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_E] int32: experts some decode row of the tile names in a secondary slot (those need a decision)."""
    e = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    need = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(KP, WIDTH):
        src = _column(ids, slots, j)
        need = tl.maximum(need, _flags(e[None, :] == src[:, None], dec))
    return need


@triton.jit
def _tile_has_decode(dec_ptr, pid, T, BLOCK_T: tl.constexpr, LANES: tl.constexpr):
    """Whether tile ``pid`` has a decode row, reduced over a [LANES >= 32] vector: a reduction that wide is one
    REDUX into a uniform register, so the compiler knows a branch on it is taken by the whole warp (a 2-row
    reduction is shuffles; the branch then counts as divergent and every shuffle inside it runs in a collective
    block)."""
    lanes = tl.arange(0, LANES)
    lane = pid * BLOCK_T + lanes
    lane_ok = (lanes < BLOCK_T) & (lane < T)
    return tl.max(tl.where(lane_ok & (tl.load(dec_ptr + lane, mask=lane_ok, other=0) != 0), 1, 0), axis=0) > 0


@triton.jit
def _reroute_tile_with(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp, KP: tl.constexpr, WIDTH: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, VEC_CELLS: tl.constexpr,
                       HAS_PROT: tl.constexpr):
    """Pass 2 of one program's tile of a multi-program plan against the step's P (``prim``): every secondary slot
    in one gather on small tiles (:func:`_reroute_slots`), else once per source expert of the tile
    (:func:`_route_table`). Returns the new ids, the moved-slot count and the kept sources' flags."""
    if BLOCK_T * BLOCK_K * BLOCK_E <= VEC_CELLS:   # small tile: every slot's gather in one load
        ids, moved, kept = _reroute_slots(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                                          KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, HAS_PROT)
    else:                                          # else once per source expert of the tile
        need = _secondary_sources(ids, dec, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K)
        table = _route_table(prim, need, sim_ptr, prot_ptr, E, rho, s_se, s_sp, BLOCK_E, HAS_PROT)
        ids, moved, kept = _apply_tile(ids, dec, table, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K)
    return ids, moved, kept


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

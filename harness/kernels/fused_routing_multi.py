"""The routing op (``harness.kernels.fused_routing``) for steps of many rows: one program per row tile, one
launch, or two with SERE.

Why (issue 23). The one-program kernel walks every tile of a step in one program, so its cost grows with the
rows: on the H200 SERE K=2 cost 9.9 µs per layer at T=16, 23 µs at 64 and 79 µs at 256, against 3.7–3.9 µs for
vLLM's ``topk_softmax`` at every T. Under serving load vLLM's steps mix a prefill chunk with the running
decodes (~70 rows), where that cost ate SERE's gain (QPS 16: 0.94×, results/benchmarks/vllm_serve_h200_session8.json).
SERE's set P (the primary experts of the decode rows) is a reduction over the whole step, and the re-route
needs all of it; a second launch is the grid-wide barrier:

    launch 1, one program per tile of BLOCK_T rows: pass 1 (``fused_routing_tiles._topk_tile``: softmax or
             DeepSeek-V3 top-k, renormalisation, truncation, weights stored), ids stored; the tile's expert
             sets OR-ed into the step scratch, one int32 word per expert (bit 0 in P, bit 1 in SERE's
             before-set, bit 2 in top-K's before-set, bit 3 in its after-set), its decode and counted rows
             added to the scratch's sums
    launch 2, one program per tile (SERE only): a tile with no decode row stops at once; the others read P
             (one [BLOCK_E] load) and make the one-program kernel's decision (``_nearest_in_p``): every
             secondary slot in one gather on small tiles (``_reroute_slots``), else once per source expert
             of the tile (``_route_table``); then rewrite their ids in place and add the slots they moved and
             the sources they kept (bit 4) to the scratch
    the last program to finish (of launch 2, or of launch 1 when no launch 2 follows: top-K's counters,
             or SERE's on a step without decode rows) reads the scratch, zeroes it and adds the counters

The scratch (:func:`step_scratch`) is allocated zeroed once per device and experts block and left zeroed
by every call (the last program exchanges each word with 0), so the op stays one or two kernel nodes in a CUDA
graph — no memset node, no host synchronisation. Arrival is CUTLASS's semaphore pattern (``_arrive``: a CTA
barrier, then one thread's acq_rel atomic). Any number of rows.

One launch for SERE (session 25): every step pays a launch's fixed cost (~2.4 µs per kernel node in a CUDA graph
on the H100: vLLM's own ``topk_softmax`` costs 2.4–2.9 µs), so two launches cannot meet the issue's 5 µs per
layer (SERE K=2 5.6–5.8 µs at 16–64 rows without the counters, H100, session 24). Where every program of the grid
can be resident at once (:func:`grid_wait_programs`: a program per SM), launch 1 does launch 2's work itself:
each program OR-s its sets, waits until the whole grid has (:func:`_wait_for_all`, one thread polling the
arrivals), re-routes its tile from registers (no store and reload of the ids) and stores them; the last to
leave adds the counters and zeroes the scratch. Triton's interpreter runs a grid's programs one after another,
so there the wait is allowed over one program only (CI runs it that way; the wait across programs is tested
on CUDA). Larger grids (more programs than SMs: beyond 132 rows on an H100) keep two launches. Measured on the
H100 it does not pay (:data:`ONE_LAUNCH_SERE`): the dispatch keeps two launches; ``grid_wait=True`` and
bench_routing_op.py's ``grid_*`` rows keep the plan timeable on other cards.

What does pay (session 25): no arrivals at all. ``harness.kernels.fused_routing_epoch`` tags the step's expert
sets with an epoch instead of zeroing them, so launch 2 ends at its store and the counters take a third,
one-program launch only when a run keeps them (:data:`EPOCH_SERE`, on). This module's two launches remain for
SERE where that plan is switched off, and its launch 1 is every non-SERE step's plan (stock, top-K and its
counters in one launch).

Before (session 9's plan, timed on the H200): launch 1 wrote one word per (tile, expert) with plain stores;
every program of launch 2 OR-ed the whole step's words (T/BLOCK_T per expert) and one extra program, at the 4
warps its [E, E] table needed, re-derived the counters: launch 2 cost ~10–13 µs with the counters (~6.5–11
without), 15.5 µs per layer for SERE K=2 at 64 rows against 2.7 for launch 1 alone (results/benchmarks/
routing_op_h200.json; sm_90 SASS: launch 2 3,894 instructions per thread for the statistics program, 812 of them
OR-ing the words, results/benchmarks/routing_op_sass_sm90.md). Now launch 2 runs at one warp on
small tiles (sm_90: 1,056 instructions per thread with the counters up to 64 rows; both launches 2,478 against
4,943), and top-K's counters need no second launch. Timed (H100, session 23, µs per layer, one row per
program): SERE K=2 8.26 against the old plan's 16.22 at 64 rows and 9.35 against 16.44 at 256; top-2 in one
launch 6.77 against the old two launches' 6.60 at 64 rows (the counters' arrival costs what the second launch
did) and 7.48 against 9.71 at 256 (results/benchmarks/routing_op_h100_s23.json, docs/vllm.md). With the last
program's exchanges relaxed (``_finish_step``; H100, session 24, same rounds as the acq_rel version): top-2 4.06
against 6.86 at 64 rows (stock 2.57), SERE K=2 6.83 against 8.21 (results/benchmarks/routing_op_h100_s24.json).
Semantics: :func:`harness.kernels.fused_routing_reference.fused_routing_reference`, equal
ids, weights and counters (tests/kernels/test_fused_routing.py). Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels._triton import interpreting
from harness.kernels.fused_routing_epoch import fused_routing_epoch
from harness.kernels.fused_routing_reference import RoutingSpec
from harness.kernels.fused_routing_tiles import _add_counters, _reroute_tile_with, _tile_has_decode, _topk_tile

__all__ = ["EPOCH_SERE", "KERNELS", "ONE_LAUNCH_SERE", "fused_routing_multi", "grid_wait_programs", "multi_tile",
           "one_launch_sere", "step_scratch"]

@triton.jit
def _arrive(scratch_ptr, n_programs, BLOCK_E: tl.constexpr):
    """This program is done with the step scratch; True in the program that arrives last. CUTLASS's
    semaphore pattern: a CTA barrier, then one thread's acq_rel atomic, so every thread's atomics of this
    program are ordered before the arrival and the last program sees them all."""
    tl.debug_barrier()
    return tl.atomic_add(scratch_ptr + BLOCK_E + 3, 1, sem="acq_rel") == n_programs - 1


@triton.jit
def _finish_step(scratch_ptr, sere_cnt_ptr, topk_cnt_ptr,
                 TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
                 BLOCK_E: tl.constexpr, SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr):
    """The last program of the step: read the step scratch and zero it in the same atomics (the next call
    starts from zeros without a memset), then add the counters (one program: no atomics on them). The exchanges
    are relaxed: :func:`_arrive`'s acq_rel atomic and the CTA barrier after it already order every other
    program's atomics before them (CUTLASS reads after its semaphore with plain loads), and each acq_rel element
    cost a ``MEMBAR.ALL.GPU`` + ``CCTL.IVALL`` pair in the sm_90 SASS — five of the last program's six fences."""
    e = tl.arange(0, BLOCK_E)
    flags = tl.atomic_xchg(scratch_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int32), sem="relaxed")
    four = tl.arange(0, 4)
    sums = tl.atomic_xchg(scratch_ptr + BLOCK_E + four, tl.zeros([4], dtype=tl.int32), sem="relaxed")
    n_dec = tl.sum(tl.where(four == 0, sums, 0), axis=0).to(tl.int64)
    n_tr = tl.sum(tl.where(four == 1, sums, 0), axis=0).to(tl.int64)
    moved = tl.sum(tl.where(four == 2, sums, 0), axis=0).to(tl.int64)
    if SERE_STATS:
        prim = flags & 1
        _add_counters(sere_cnt_ptr, n_dec, (flags >> 1) & 1, tl.maximum(prim, (flags >> 4) & 1), prim, moved,
                      WIDTH - KP)
    if TOPK_STATS:
        k_after = (flags >> 3) & 1
        _add_counters(topk_cnt_ptr, n_tr, (flags >> 2) & 1, k_after, k_after, n_tr * (TOPK - KT), TOPK - KT)


@triton.jit
def _wait_for_all(count_ptr, n_programs):
    """The one-launch plan's grid-wide barrier: arrive (CUTLASS's semaphore pattern, as :func:`_arrive`), then
    one thread polls the arrivals with acquire atomics until every program of the grid has arrived, and a CTA
    barrier holds the rest of the program until it has. Safe only while every program of the grid is resident
    at once (:func:`grid_wait_programs`); never in Triton's interpreter, which runs programs one after another."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="acq_rel") + 1
    while seen < n_programs:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["T", "n_tiles"])  # one compilation per tiling, not per step length
def _multi_topk_kernel(
    logits_ptr, dec_ptr, real_ptr, w_ptr, ids_ptr, bias_ptr, scratch_ptr, sere_cnt_ptr, topk_cnt_ptr,
    sim_ptr, prot_ptr, T, n_tiles, E, scale, rho, s_lt, s_le, s_wt, s_wk, s_it, s_ik, s_se, s_sp,
    TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr, TRUNC: tl.constexpr, TRUNC_ALL: tl.constexpr, SERE: tl.constexpr,
    HAS_DEC: tl.constexpr, HAS_REAL: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    NG: tl.constexpr, GSIZE: tl.constexpr, TG: tl.constexpr,
    FLAGS: tl.constexpr, FINISH: tl.constexpr, SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr,
    GRID_WAIT: tl.constexpr, VEC_CELLS: tl.constexpr, HAS_PROT: tl.constexpr, LANES: tl.constexpr,
):
    """Launch 1: pass 1 on tile ``program_id``, ids and weights stored; with ``FLAGS`` the tile's expert
    sets are OR-ed into the step scratch and its row counts added; with ``FINISH`` (no launch 2 follows) the
    last program adds the counters. ``GRID_WAIT`` (SERE, the one-launch plan): after OR-ing its sets each
    program waits for the whole grid's (:func:`_wait_for_all`), re-routes its tile from registers and stores
    the ids — launch 2's work without a second launch."""
    tile = tl.program_id(0)
    t0 = tile * BLOCK_T
    ids, dec, prim, s_before, k_before, k_after, need, n_dec, n_tr = _topk_tile(
        logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, t0, T, E, scale, s_lt, s_le, s_wt, s_wk,
        TOPK, KT, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, RENORM, TRUNC, TRUNC_ALL, SERE, HAS_DEC, HAS_REAL,
        SIGMOID, HAS_BIAS, NG, GSIZE, TG)
    rows = t0 + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, BLOCK_K)
    ptrs = ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik
    ok = (rows[:, None] < T) & (slots[None, :] < TOPK)
    if not GRID_WAIT:
        tl.store(ptrs, ids, mask=ok)
    if FLAGS:
        e = tl.arange(0, BLOCK_E)
        word = prim
        if SERE_STATS:
            word = word | (s_before << 1)
        if TOPK_STATS:
            word = word | (k_before << 2) | (k_after << 3)
        tl.atomic_or(scratch_ptr + e, word, mask=word != 0, sem="relaxed")
        tl.atomic_add(scratch_ptr + BLOCK_E, n_dec.to(tl.int32), mask=n_dec > 0, sem="relaxed")
        tl.atomic_add(scratch_ptr + BLOCK_E + 1, n_tr.to(tl.int32), mask=n_tr > 0, sem="relaxed")
    if GRID_WAIT:
        _wait_for_all(scratch_ptr + BLOCK_E + 4, n_tiles)
        if _tile_has_decode(dec_ptr, tile, T, BLOCK_T, LANES):
            ids = _reroute_against_step(ids, dec, scratch_ptr, sim_ptr, prot_ptr, E, rho, s_se, s_sp, KP, WIDTH,
                                        BLOCK_T, BLOCK_E, BLOCK_K, VEC_CELLS, HAS_PROT, SERE_STATS)
        tl.store(ptrs, ids, mask=ok)
    if FINISH:
        if _arrive(scratch_ptr, n_tiles, BLOCK_E):
            _finish_step(scratch_ptr, sere_cnt_ptr, topk_cnt_ptr, TOPK, KT, KP, WIDTH, BLOCK_E, SERE_STATS,
                         TOPK_STATS)
            if GRID_WAIT:   # every program is past the wait: its arrivals can go back to zero for the next call
                tl.atomic_xchg(scratch_ptr + BLOCK_E + 4, 0, sem="relaxed")


@triton.jit
def _reroute_against_step(ids, dec, scratch_ptr, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                          KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, VEC_CELLS: tl.constexpr, HAS_PROT: tl.constexpr,
                          SERE_STATS: tl.constexpr):
    """Pass 2 on one tile against the step's P (one [BLOCK_E] read of the scratch, at L2: ``.cg``, never a line
    an earlier call left in this SM's L1), every secondary slot in one gather on small tiles
    (``_reroute_slots``), else once per source expert of the tile (``_route_table``); adds what it moved and
    kept to the scratch. Written once for launch 2 and the one-launch plan."""
    e = tl.arange(0, BLOCK_E)
    prim = tl.load(scratch_ptr + e, cache_modifier=".cg") & 1
    ids, moved, kept = _reroute_tile_with(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp, KP, WIDTH,
                                          BLOCK_T, BLOCK_E, BLOCK_K, VEC_CELLS, HAS_PROT)
    if SERE_STATS:
        tl.atomic_or(scratch_ptr + e, kept << 4, mask=kept > 0, sem="relaxed")
        tl.atomic_add(scratch_ptr + BLOCK_E + 2, moved.to(tl.int32), mask=moved > 0, sem="relaxed")
    return ids


@triton.jit(do_not_specialize=["T", "n_tiles"])
def _multi_reroute_kernel(
    dec_ptr, sim_ptr, prot_ptr, ids_ptr, scratch_ptr, sere_cnt_ptr, topk_cnt_ptr,
    T, n_tiles, E, rho, s_se, s_sp, s_it, s_ik,
    TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC_CELLS: tl.constexpr, HAS_PROT: tl.constexpr, SERE_STATS: tl.constexpr, TOPK_STATS: tl.constexpr,
    LANES: tl.constexpr,
):
    """Launch 2 (SERE): program ``pid`` re-routes its tile against the step's P, adds what it moved and kept,
    and the last program to finish adds the counters (module doc)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    if _tile_has_decode(dec_ptr, pid, T, BLOCK_T, LANES):
        dec = row_ok & (tl.load(dec_ptr + rows, mask=row_ok, other=0) != 0)
        slots = tl.arange(0, BLOCK_K)
        ptrs = ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik
        ok = row_ok[:, None] & (slots[None, :] < TOPK)
        ids = tl.load(ptrs, mask=ok, other=0)
        ids = _reroute_against_step(ids, dec, scratch_ptr, sim_ptr, prot_ptr, E, rho, s_se, s_sp, KP, WIDTH,
                                    BLOCK_T, BLOCK_E, BLOCK_K, VEC_CELLS, HAS_PROT, SERE_STATS)
        tl.store(ptrs, ids, mask=ok)
    if _arrive(scratch_ptr, n_tiles, BLOCK_E):
        _finish_step(scratch_ptr, sere_cnt_ptr, topk_cnt_ptr, TOPK, KT, KP, WIDTH, BLOCK_E, SERE_STATS, TOPK_STATS)


#: the plan's kernels in launch order (``fused_routing.kernel_sources`` hashes their sources)
KERNELS = (_multi_topk_kernel, _multi_reroute_kernel)


def multi_tile(num_tokens: int, block_e: int) -> tuple[int, int, int]:
    """(rows per program, warps of launch 1, warps of launch 2 on small tiles) of the multi-program plan: one
    row per program up to 256 rows, then tiles that keep the grid at ~256 programs (2–16 rows). Why: the rebuilt
    plan reads one word per expert whatever the step, so more programs cost no more reading, and a one-row
    program is one warp with no cross-row reduction. Timed on the H100 (session 23, µs per layer,
    results/benchmarks/routing_op_h100_s23.json), one row / one warp / launch 2 at 2 warps against the previous
    rule's ~32 programs: SERE K=2 8.26 vs 11.17 at 64 rows, 9.35 vs 18.37 at 256, 8.09 vs 10.46 at 16; stock 2.57
    vs 2.79 and 2.61 vs 3.77; top-2 6.77 vs 7.08 and 7.48 vs 7.94; 2 rows / 2 warps in between (SERE 8.99 / 9.79).
    Beyond 256 rows (prefill chunks) not timed on this plan: tiles grow there so the arrivals on the step
    scratch's counter stay ~256 per launch, with the previous rule's warps (launch 2 at least 2)."""
    block_t = max(1, min(16, triton.next_power_of_2(triton.cdiv(max(num_tokens, 1), 256))))
    if block_t == 1:
        return 1, 1, 2
    warps = 1 if block_t * block_e <= 512 else 2 if block_t * block_e <= 1024 else 4
    return block_t, warps, max(warps, 2)


#: SERE's plan beyond the one-program kernel's steps: one launch whose programs wait for each other
#: (:func:`_wait_for_all`) where the grid fits (:func:`grid_wait_programs`), else two launches. Off: timed on the
#: H100 (session 25, µs per layer, results/benchmarks/routing_op_h100_s25.json), one launch is slower than two at
#: every step length, even of one program, where nobody waits: SERE K=2 6.23 / 6.19 at 1 row, 6.51 / 6.29 at 4,
#: 6.98 / 6.73 at 16, 6.99 / 6.87 at 64, 7.24 / 7.19 at 128; without the counters 6.32 / 5.61 at 16. A kernel
#: boundary inside a CUDA graph costs less than the release fence, the arrival and the poll's round trips.
ONE_LAUNCH_SERE = False


def grid_wait_programs(device: torch.device) -> int:
    """How many programs a grid-wide wait may span on ``device``: one per SM on CUDA (a program of this plan
    is one to four warps with few registers, so an SM always has room for one: every program of such a grid
    is resident at once, and no program can wait on one that never starts; kernels of other streams only delay
    the start). One in Triton's interpreter, which runs a grid's programs one after another (a second program
    would wait forever); none elsewhere. An MPS or green-context share of the SMs is not seen here."""
    if device.type == "cuda" and not interpreting() and torch.cuda.is_available():
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1 if interpreting() else 0


def one_launch_sere(n_tiles: int, device: torch.device) -> bool:
    """The dispatch's choice for SERE on a multi-program step: one launch (:data:`ONE_LAUNCH_SERE`) where its
    grid of ``n_tiles`` programs can wait for itself on ``device``."""
    return ONE_LAUNCH_SERE and n_tiles <= grid_wait_programs(device)


#: SERE's two launches without arrivals (``fused_routing_epoch``: epoch-tagged expert sets, a third one-program
#: launch for the statistics) instead of this module's arrival-and-zero scratch, where SERE takes two launches.
#: On: H200, session 25, µs per layer, epoch / arrival plan on the same tiling (results/benchmarks/
#: routing_op_h200_s25.json): SERE K=2 without counters 4.50 / 5.35 at 8 rows, 4.71 / 5.42 at 16, 4.78 / 5.53 at 64,
#: 4.96 / 5.69 at 128, 5.05 / 5.99 at 256; with counters 5.88 / 6.46, 6.12 / 6.54, 6.50 / 6.68 (64), 7.06 / 6.98
#: (128), 7.99 / 7.78 (256); a serving-like step (6 decodes, the rest prefill) 5.89–6.11 / 6.44–6.53
EPOCH_SERE = True

_SM_COUNT: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


#: the step scratch of each (device, experts block): [BLOCK_E] expert-set words, then (decode rows, counted rows,
#: moved slots, arrivals, the one-launch plan's arrivals at its wait) and 3 spare words; zero between calls (the
#: last program of each call zeroes it)
_STEP_SCRATCH: dict[tuple, torch.Tensor] = {}


def step_scratch(device: torch.device, block_e: int) -> torch.Tensor:
    """The zeroed int32 scratch the launches share (module doc), allocated once per device and experts block: a
    buffer made per call would need a memset node in vLLM's CUDA graphs. One per device, not per stream: a
    captured graph replays on whatever stream runs it, and the first call (an eager warm-up: vLLM's profile run,
    the engines' and benchmarks' warm-ups) allocates it outside any graph's pool. It assumes a device's routing
    calls run one after another, as a model's layers do; vLLM's micro-batch overlap, which would run two at
    once, is refused by the plugin (``harness.engines.vllm.plugin.refuse_micro_batching``)."""
    key = (device.type, device.index, block_e)
    buf = _STEP_SCRATCH.get(key)
    if buf is None:
        buf = _STEP_SCRATCH[key] = torch.zeros(block_e + 8, dtype=torch.int32, device=device)
    return buf


def fused_routing_multi(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None,
                        real_rows: torch.Tensor | None, sere_counters: torch.Tensor | None,
                        topk_counters: torch.Tensor | None, sim: torch.Tensor | None, prot: torch.Tensor | None,
                        bias: torch.Tensor | None, weights: torch.Tensor, ids: torch.Tensor, *, vec_cells: int,
                        block_t: int | None = None, num_warps: int | None = None,
                        reroute_warps: int | None = None, grid_wait: bool | None = None,
                        epoch: bool | None = None) -> None:
    """Launch the kernels (module doc) into ``weights`` / ``ids``; the arguments are those
    ``fused_routing.fused_routing_triton`` has checked and moved to the device. ``vec_cells``: up to this many
    rows x slots x experts a tile re-routes every secondary slot in one gather (``_reroute_slots``), beyond it
    decides once per source expert (``_route_table``, an [E, E] masked load, given at least 4 warps: its
    registers). ``block_t`` / ``num_warps`` override :func:`multi_tile` (the benchmark's tiling rows),
    ``reroute_warps`` launch 2's warps (default on small tiles: :func:`multi_tile`'s with its tiling, launch 1's
    with a caller's; at least 4 on the table path). ``grid_wait``: SERE in one launch whose programs wait for
    each other (:func:`_wait_for_all`; launch 1's warps) or in two; None: one launch where
    :data:`ONE_LAUNCH_SERE` and the grid is small enough (:func:`grid_wait_programs`). ``epoch``: SERE's two
    launches without arrivals (``fused_routing_epoch``; where no one launch is chosen); None: :data:`EPOCH_SERE`."""
    t, num_experts = logits.shape
    block_e = max(16, triton.next_power_of_2(num_experts))
    auto_t, auto_w, auto_w2 = multi_tile(t, block_e)
    small_w2 = auto_w2 if block_t is None and num_warps is None else None   # multi_tile's tiling: its launch 2 too
    block_t = block_t or auto_t
    num_warps = num_warps or auto_w
    n_tiles = triton.cdiv(t, block_t)
    sere_run = spec.k_primary is not None and decode_rows is not None   # else nothing can move
    sere_stats = spec.k_primary is not None and sere_counters is not None
    topk_stats = spec.trunc_k is not None and topk_counters is not None
    flags = sere_run or sere_stats or topk_stats
    fits = n_tiles <= grid_wait_programs(logits.device)
    if grid_wait and not fits:
        raise ValueError(f"routing: a grid-wide wait over {n_tiles} programs on {logits.device} (at most "
                         f"{grid_wait_programs(logits.device)} can be resident at once here)")
    one_launch = sere_run and (grid_wait if grid_wait is not None else one_launch_sere(n_tiles, logits.device))
    small = block_t * triton.next_power_of_2(spec.top_k) * block_e <= vec_cells
    warps_2 = reroute_warps or ((small_w2 or num_warps) if small else max(num_warps, 4))
    if sere_run and not one_launch and (epoch if epoch is not None else EPOCH_SERE):
        fused_routing_epoch(logits, spec, decode_rows, real_rows, sere_counters, topk_counters, sim, prot, bias,
                            weights, ids, vec_cells=vec_cells, block_t=block_t, num_warps=num_warps,
                            reroute_warps=warps_2)
        return
    scratch = step_scratch(logits.device, block_e) if flags else ids
    dummy = ids
    meta = dict(TOPK=spec.top_k, KT=spec.trunc_k or spec.top_k, KP=spec.k_primary or 0, WIDTH=spec.width,
                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(spec.top_k),
                SERE_STATS=sere_stats, TOPK_STATS=topk_stats)
    counters = (sere_counters if sere_counters is not None else dummy,
                topk_counters if topk_counters is not None else dummy)
    sere = dict(VEC_CELLS=vec_cells, HAS_PROT=prot is not None, LANES=max(block_e, block_t, 32))
    sim_strides = (sim.stride(0), sim.stride(1)) if sim is not None else (0, 0)
    try:
        _multi_topk_kernel[(n_tiles,)](
            logits, decode_rows if decode_rows is not None else dummy,
            real_rows if real_rows is not None else dummy, weights, ids, bias if bias is not None else weights,
            scratch, *counters, sim if sim is not None else dummy, prot if prot is not None else dummy,
            t, n_tiles, num_experts, float(spec.scaling), float(spec.rho), logits.stride(0), logits.stride(1),
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), *sim_strides,
            RENORM=spec.renormalize, TRUNC=spec.trunc_k is not None, TRUNC_ALL=spec.trunc_all,
            SERE=spec.k_primary is not None, HAS_DEC=decode_rows is not None, HAS_REAL=real_rows is not None,
            SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NG=spec.groups, GSIZE=num_experts // spec.groups,
            TG=spec.topk_groups, FLAGS=flags, FINISH=flags and (one_launch or not sere_run),
            GRID_WAIT=one_launch, num_warps=num_warps, **sere, **meta)
        if one_launch or not sere_run:
            return
        _multi_reroute_kernel[(n_tiles,)](
            decode_rows, sim, prot if prot is not None else dummy, ids, scratch, *counters,
            t, n_tiles, num_experts, float(spec.rho), *sim_strides, ids.stride(0), ids.stride(1),
            num_warps=warps_2, **sere, **meta)
    except BaseException:
        if flags:       # a launch that did not run would leave the scratch half-written for the next call
            scratch.zero_()
        raise

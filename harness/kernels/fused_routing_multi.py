"""The routing op (``harness.kernels.fused_routing``) for steps of many rows: one program per row tile, in one
launch; SERE's re-route in a second (``harness.kernels.fused_routing_epoch``, on this module's tiling).

Why (issue 23). The one-program kernel walks every tile of a step in one program, so its cost grows with the
rows: on the H200 SERE K=2 cost 9.9 µs per layer at T=16, 23 µs at 64 and 79 µs at 256, against 3.7–3.9 µs for
vLLM's ``topk_softmax`` at every T. Under serving load vLLM's steps mix a prefill chunk with the running
decodes (~70 rows), where that cost ate SERE's gain (QPS 16: 0.94×, results/benchmarks/vllm_serve_h200_session8.json).
Here one program per tile of BLOCK_T rows runs pass 1 (``fused_routing_tiles._topk_tile``: softmax or
DeepSeek-V3 top-k, renormalisation, truncation) and stores weights and ids; that is the whole op for stock
routing and top-K. With top-K's counters to keep, each program OR-s its tile's expert sets into the step scratch
(one int32 word per expert) and adds its counted rows, and the last program to arrive reads the scratch, zeroes
it and adds the counters (SERE's counters on a step without decode rows count nothing: the reference adds zeros).

The scratch (:func:`step_scratch`) is allocated zeroed once per device and experts block and left zeroed by
every call (the last program exchanges each word with 0), so the op stays one kernel node in a CUDA graph — no
memset node, no host synchronisation. Arrival is CUTLASS's semaphore pattern (``_arrive``: a CTA barrier, then
one thread's acq_rel atomic); no program waits for another, so Triton's interpreter runs the same code.

SERE's step-wide set P needs a grid-wide barrier, and a kernel boundary is the cheapest one measured: session 25
built SERE in one launch whose programs wait for each other (commit 8ccfe87) and timed it slower than two
launches at every step length on the H100, even over one program, where no program waits (SERE K=2 6.23 / 6.19 µs
at one row, 6.98 / 6.73 at 16: the release fence, the arrival and the poll cost more than a kernel boundary in a
CUDA graph; results/benchmarks/routing_op_h100_s25.json), and the second launch of this module's earlier SERE
plan, which ended in an arrival that zeroed the scratch, lost 0.7–0.9 µs per layer to the epoch-tagged plan that
replaced it (H200, results/benchmarks/routing_op_h200_s25.json). History of this plan's tiling and exchanges:
:func:`multi_tile`, ``_finish_step``, docs/vllm.md. Semantics:
:func:`harness.kernels.fused_routing_reference.fused_routing_reference`, equal ids, weights and counters
(tests/kernels/test_fused_routing.py). Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.fused_routing_epoch import fused_routing_epoch
from harness.kernels.fused_routing_reference import RoutingSpec
from harness.kernels.fused_routing_tiles import _add_counters, _topk_tile

__all__ = ["KERNELS", "fused_routing_multi", "multi_tile", "step_scratch"]


@triton.jit
def _arrive(scratch_ptr, n_programs, BLOCK_E: tl.constexpr):
    """This program is done with the step scratch; True in the program that arrives last. CUTLASS's
    semaphore pattern: a CTA barrier, then one thread's acq_rel atomic, so every thread's atomics of this
    program are ordered before the arrival and the last program sees them all."""
    tl.debug_barrier()
    return tl.atomic_add(scratch_ptr + BLOCK_E + 1, 1, sem="acq_rel") == n_programs - 1


@triton.jit
def _finish_step(scratch_ptr, topk_cnt_ptr, TOPK: tl.constexpr, KT: tl.constexpr, BLOCK_E: tl.constexpr):
    """The last program of the step: read the step scratch and zero it in the same atomics (the next call
    starts from zeros without a memset), then add top-K's counters (one program: no atomics on them). The
    exchanges are relaxed: :func:`_arrive`'s acq_rel atomic and the CTA barrier after it already order every other
    program's atomics before them (CUTLASS reads after its semaphore with plain loads), and each acq_rel element
    cost a ``MEMBAR.ALL.GPU`` + ``CCTL.IVALL`` pair in the sm_90 SASS (session 24: top-2 4.06 against 6.86 µs per
    layer at 64 rows on the H100 with acq_rel exchanges, results/benchmarks/routing_op_h100_s24.json)."""
    e = tl.arange(0, BLOCK_E)
    flags = tl.atomic_xchg(scratch_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int32), sem="relaxed")
    two = tl.arange(0, 2)
    sums = tl.atomic_xchg(scratch_ptr + BLOCK_E + two, tl.zeros([2], dtype=tl.int32), sem="relaxed")
    n_tr = tl.sum(tl.where(two == 0, sums, 0), axis=0).to(tl.int64)
    k_after = (flags >> 1) & 1
    _add_counters(topk_cnt_ptr, n_tr, flags & 1, k_after, k_after, n_tr * (TOPK - KT), TOPK - KT)


@triton.jit(do_not_specialize=["T", "n_tiles"])  # one compilation per tiling, not per step length
def _multi_topk_kernel(
    logits_ptr, dec_ptr, real_ptr, w_ptr, ids_ptr, bias_ptr, scratch_ptr, topk_cnt_ptr,
    T, n_tiles, E, scale, s_lt, s_le, s_wt, s_wk, s_it, s_ik,
    TOPK: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr, TRUNC: tl.constexpr, TRUNC_ALL: tl.constexpr, SERE: tl.constexpr,
    HAS_DEC: tl.constexpr, HAS_REAL: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    NG: tl.constexpr, GSIZE: tl.constexpr, TG: tl.constexpr, TOPK_STATS: tl.constexpr,
):
    """Pass 1 on tile ``program_id``, ids and weights stored; with top-K's counters (module doc) the tile's
    expert sets OR-ed into the step scratch and its counted rows added, and the last program adds the counters."""
    tile = tl.program_id(0)
    t0 = tile * BLOCK_T
    ids, dec, prim, s_before, k_before, k_after, need, n_dec, n_tr = _topk_tile(
        logits_ptr, dec_ptr, real_ptr, w_ptr, bias_ptr, t0, T, E, scale, s_lt, s_le, s_wt, s_wk,
        TOPK, KT, KP, WIDTH, BLOCK_T, BLOCK_E, BLOCK_K, RENORM, TRUNC, TRUNC_ALL, SERE, HAS_DEC, HAS_REAL,
        SIGMOID, HAS_BIAS, NG, GSIZE, TG)
    rows = t0 + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + rows[:, None].to(tl.int64) * s_it + slots[None, :] * s_ik, ids,
             mask=(rows[:, None] < T) & (slots[None, :] < TOPK))
    if TOPK_STATS:
        e = tl.arange(0, BLOCK_E)
        word = k_before | (k_after << 1)
        tl.atomic_or(scratch_ptr + e, word, mask=word != 0, sem="relaxed")
        tl.atomic_add(scratch_ptr + BLOCK_E, n_tr.to(tl.int32), mask=n_tr > 0, sem="relaxed")
        if _arrive(scratch_ptr, n_tiles, BLOCK_E):
            _finish_step(scratch_ptr, topk_cnt_ptr, TOPK, KT, BLOCK_E)


#: the plan's kernel (``fused_routing.kernel_sources`` hashes its sources with ``fused_routing_epoch``'s)
KERNELS = (_multi_topk_kernel,)


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


#: the step scratch of each (device, experts block): [BLOCK_E] expert-set words (bit 0 top-K's before-set, bit 1
#: its after-set), then (counted rows, arrivals); zero between calls (the last program of each call zeroes it)
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
        buf = _STEP_SCRATCH[key] = torch.zeros(block_e + 2, dtype=torch.int32, device=device)
    return buf


def fused_routing_multi(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None,
                        real_rows: torch.Tensor | None, sere_counters: torch.Tensor | None,
                        topk_counters: torch.Tensor | None, sim: torch.Tensor | None, prot: torch.Tensor | None,
                        bias: torch.Tensor | None, weights: torch.Tensor, ids: torch.Tensor, *, vec_cells: int,
                        block_t: int | None = None, num_warps: int | None = None,
                        reroute_warps: int | None = None) -> None:
    """Launch the plan (module doc) into ``weights`` / ``ids``, or SERE's (``fused_routing_epoch``) on its tiling
    for a step SERE re-routes; the arguments are those ``fused_routing.fused_routing_triton`` has checked and moved
    to the device. ``vec_cells``: up to this many rows x slots x experts a tile re-routes every secondary slot in
    one gather (``_reroute_slots``), beyond it decides once per source expert (``_route_table``, an [E, E] masked
    load, given at least 4 warps: its registers). ``block_t`` / ``num_warps`` override :func:`multi_tile` (the
    benchmark's tiling rows), ``reroute_warps`` SERE's re-route launch's warps (default on small tiles:
    :func:`multi_tile`'s with its tiling, launch 1's with a caller's; at least 4 on the table path)."""
    t, num_experts = logits.shape
    block_e = max(16, triton.next_power_of_2(num_experts))
    auto_t, auto_w, auto_w2 = multi_tile(t, block_e)
    small_w2 = auto_w2 if block_t is None and num_warps is None else None   # multi_tile's tiling: its launch 2 too
    block_t = block_t or auto_t
    num_warps = num_warps or auto_w
    if spec.k_primary is not None and decode_rows is not None:   # a step SERE re-routes
        small = block_t * triton.next_power_of_2(spec.top_k) * block_e <= vec_cells
        fused_routing_epoch(logits, spec, decode_rows, real_rows, sere_counters, topk_counters, sim, prot, bias,
                            weights, ids, vec_cells=vec_cells, block_t=block_t, num_warps=num_warps,
                            reroute_warps=reroute_warps or ((small_w2 or num_warps) if small else max(num_warps, 4)))
        return
    n_tiles = triton.cdiv(t, block_t)
    topk_stats = spec.trunc_k is not None and topk_counters is not None
    dummy = ids
    _multi_topk_kernel[(n_tiles,)](
        logits, decode_rows if decode_rows is not None else dummy,
        real_rows if real_rows is not None else dummy, weights, ids, bias if bias is not None else weights,
        step_scratch(logits.device, block_e) if topk_stats else ids, topk_counters if topk_stats else dummy,
        t, n_tiles, num_experts, float(spec.scaling), logits.stride(0), logits.stride(1),
        weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
        TOPK=spec.top_k, KT=spec.trunc_k or spec.top_k, KP=spec.k_primary or 0, WIDTH=spec.width,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(spec.top_k),
        RENORM=spec.renormalize, TRUNC=spec.trunc_k is not None, TRUNC_ALL=spec.trunc_all,
        SERE=spec.k_primary is not None, HAS_DEC=decode_rows is not None, HAS_REAL=real_rows is not None,
        SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NG=spec.groups, GSIZE=num_experts // spec.groups,
        TG=spec.topk_groups, TOPK_STATS=topk_stats, num_warps=num_warps)

"""MoE routing for an engine's ``custom_routing_function`` in one or two launches: softmax (or DeepSeek-V3's
sigmoid + selection bias + group-limited top-k + scaling), top-k, renormalisation, ``moe.top_k`` truncation,
SERE's re-route and the statistics counters.

Why (issue 23). Inside vLLM the harness's routing function ran a chain of ~25 small torch ops per MoE layer
(the stock top-k, the truncation, the decode-row mask, the re-route kernel, ~15 counter ops, a concat, a
cast). Under vLLM's CUDA graphs no Python runs, but every one of those kernels still runs: ~70 µs per layer,
~3.5 ms per step on Qwen3-30B-A3B shapes — SERE made single-request decode 1.86× slower and plain top-2 was
slower than stock top-8. vLLM's own softmax top-k is one kernel. This op is one kernel too on small steps
(T <= :data:`ONE_PROGRAM_MAX_TOKENS`), and on larger ones one for stock and top-K (``harness.kernels.
fused_routing_multi``: one program per row tile) and two for SERE (``harness.kernels.fused_routing_epoch``: the
second launch as the grid barrier SERE's step-wide set P needs; a third, one program, for its counters when a run
keeps them). One program:

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

P is a reduction over the whole step and pass 2 needs all of it: one program sees all of it, and a step that
fits one tile keeps everything in registers (no store/reload between the passes, one launch). Its cost grows
with T (SERE K=2 on the H200: 5.2 µs per layer at T=4, 23 at 64, 80 at 256), so beyond
:data:`ONE_PROGRAM_MAX_TOKENS` rows the multi-program plans take the step (SERE K=2 on the H200, session 25,
results/benchmarks/routing_op_h200_s25.json: 4.5–5.1 µs per layer from 8 to 256 rows without its counters,
5.9–8.0 with them; stock 2.4–2.5).
The tile functions both plans run are in ``harness.kernels.fused_routing_tiles``. The torch reference runs
only where Triton does not.

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

from harness.kernels._triton import source_text_key, triton_runs
from harness.kernels.fused_routing_epoch import EPOCH_KERNELS
from harness.kernels.fused_routing_multi import KERNELS as MULTI_KERNELS
from harness.kernels.fused_routing_multi import fused_routing_multi
from harness.kernels.fused_routing_reference import COUNTERS, RoutingSpec, fused_routing_reference
from harness.kernels.fused_routing_tiles import (_add_counters, _apply_tile, _column, _flags, _nearest_in_p,
                                                 _reroute_slots, _route_table, _topk_tile)

__all__ = ["COUNTERS", "ONE_PROGRAM_MAX_TOKENS", "RoutingSpec", "fused_routing", "fused_routing_reference",
           "fused_routing_triton", "dispatched_plan", "kernel_sources", "one_program_warps"]

#: steps of at most this many rows run the one-program kernel, longer ones the multi-program plan
#: (``fused_routing_multi``). Chosen by rows only, never by technique, so SERE on and off give identical weights.
#: H100, session 25, µs per layer, one program against the multi-program plan at one row per program
#: (results/benchmarks/routing_op_h100_s25_t4to8.json, the same in routing_op_h100_s25.json): at 4 rows one program
#: wins or ties every technique (SERE K=2 5.20 / 6.23, top-2 3.34 / 3.76, stock 2.43 / 2.46); at 5, 6, 7 and 8 rows
#: the multi-program plan wins every one (SERE 7.67–7.72 / 6.29–6.32, top-2 4.27–4.32 / 3.77–3.78, stock
#: 2.76–2.77 / 2.46–2.48): from 5 rows the one program's tile is 8 rows (a power of two) and costs what 8 rows do.
ONE_PROGRAM_MAX_TOKENS = 4
#: rows x slots x experts up to which a tile re-routes SERE's secondary slots all at once (``_reroute_slots``):
#: 4 rows at top-8 of 128 experts; beyond, the per-slot loop (one program) or the per-expert table (one program
#: per tile) keeps registers in bounds
VEC_CELLS = 4096


@triton.jit
def _reroute_tile(ids, dec, prim, sim_ptr, prot_ptr, E, rho, s_se, s_sp,
                  KP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_PROT: tl.constexpr):
    """Pass 2 of a one-tile step: SERE's re-route of the secondary slots [KP, WIDTH) of the decode rows
    ``dec``, one similarity-row gather per slot (masked to P). Returns the new ids, the moved-slot count and
    the flags of the unmoved sources (for ``after``). At <= 32 rows this beats :func:`_route_table`'s
    [E, E] pass (H200: 7.4 vs 10.4 µs per layer at T=1, results/benchmarks/routing_op_h200_vllm026.json and
    routing_op_h200_table_everywhere.json)."""
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


def one_program_warps(block_t: int, block_e: int) -> int:
    """Warps of the one-program kernel: a warp per row on one- and two-row steps, 4 up to 8 rows x 128 experts,
    8 beyond. Why: routing_op_sass.py found 4 warps on a one-row step put 34–53 barriers on the longest chain
    with no more warps than rows doing work; timed (H100, session 23, µs per layer, 1 / 2 / 4 warps): one row
    SERE K=2 4.19 / 4.50 / 5.21, stock 2.47 / – / 3.55, top-2 2.89 / 3.65 / 3.98; two rows SERE 5.37 / 4.13 /
    5.23, top-2 3.08 / 2.98 / 3.93, stock 2.75 / – / 3.40; four rows 4 warps win every technique (SERE 8.64 /
    6.15 / 5.23), and 8 rows too. 8 warps beyond 8 rows x 128 experts: H200, SERE K=2 at T=16 9.9 µs against
    11.7 with 4. By rows only, never by technique, so every technique's stock part reduces in the same order
    (identical weights with SERE on and off)."""
    if block_t <= 2:
        return block_t
    return 4 if block_t * block_e <= 1024 else 8


def fused_routing_triton(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None = None,
                         real_rows: torch.Tensor | None = None, sere_counters: torch.Tensor | None = None,
                         topk_counters: torch.Tensor | None = None, *, block_t: int | None = None,
                         num_warps: int | None = None, vec_cells: int | None = None, multi: bool | None = None,
                         reroute_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton op; arguments as :func:`fused_routing_reference`. ``multi``: the multi-program plan
    (``harness.kernels.fused_routing_multi``) or the one-program kernel (module doc); None: by
    :data:`ONE_PROGRAM_MAX_TOKENS`. ``block_t`` / ``num_warps`` override the tiling and ``vec_cells`` the one-program
    all-slots-at-once re-route's limit (0: never; the benchmark and the tests compare both plans and re-routes);
    ``reroute_warps`` the warps of SERE's re-route launch on the multi-program plan."""
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
    if multi if multi is not None else dispatched_plan(t) == "multi":
        fused_routing_multi(logits, spec, decode_rows, real_rows, sere_counters, topk_counters, sim, prot, bias,
                            weights, ids, vec_cells=VEC_CELLS if vec_cells is None else vec_cells,
                            block_t=block_t, num_warps=num_warps, reroute_warps=reroute_warps)
        return weights, ids
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_t = block_t or _tile_rows(t, block_e)
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
        num_warps=num_warps or one_program_warps(block_t, block_e),
    )
    return weights, ids


def dispatched_plan(num_tokens: int) -> str:
    """The launch plan the dispatch picks for a step of ``num_tokens`` rows (``one`` or ``multi``): by rows only,
    so SERE on and off reduce alike (the multi-program plan runs SERE's step in ``fused_routing_epoch`` on its own
    tiling). One place for the rule, read by the op and by the benchmark that records which plan each of its
    ``fused_*`` timings ran."""
    return "one" if num_tokens <= ONE_PROGRAM_MAX_TOKENS else "multi"


def kernel_sources() -> dict[str, str]:
    """Which kernel code each launch plan runs (``one``, ``multi``: :func:`harness.kernels._triton.source_text_key`
    of its kernels and the tile functions they share). A timing records it, so an analysis of the compiled code
    (benchmarks/routing_op_sass.py) pairs a figure only with the code it timed."""
    return {"one": source_text_key(_fused_routing_kernel, _topk_tile),
            "multi": source_text_key(*MULTI_KERNELS, *EPOCH_KERNELS, _topk_tile)}


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
    if triton_runs(logits.device, _fused_routing_kernel):
        return fused_routing_triton(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)
    return fused_routing_reference(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)


def fused_routing(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None = None,
                  real_rows: torch.Tensor | None = None, sere_counters: torch.Tensor | None = None,
                  topk_counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the custom op under ``torch.compile``; where Triton runs, the one-program kernel up to
    :data:`ONE_PROGRAM_MAX_TOKENS` rows and the multi-program plan beyond, at any step length; the torch
    reference where Triton does not run (CPU engines)."""
    if torch.compiler.is_compiling():
        return torch.ops.harness.fused_moe_routing(
            logits, spec.top_k, spec.renormalize, spec.trunc_k or 0, spec.trunc_all, spec.k_primary or 0,
            spec.rho, spec.similarity, spec.protected, decode_rows, real_rows, sere_counters, topk_counters,
            spec.scoring, spec.bias, spec.groups, spec.topk_groups, spec.scaling)
    return _eager(logits, spec, decode_rows, real_rows, sere_counters, topk_counters)

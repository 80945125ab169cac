"""Benchmark one decode MoE layer: the fused Triton kernel against transformers' experts implementations.

    python benchmarks/bench_fused_moe.py                       # full run, ~2-3 min on an H200
    python benchmarks/bench_fused_moe.py --quick               # B = 1, 16, 128; top-8 and SERE K=1; no sweep
    python benchmarks/bench_fused_moe.py --batches 1,16 --impls fused,grouped_mm --variants top8 --no-sweep
    python benchmarks/bench_fused_moe.py --batches 1,2,4,8 --impls fused,small --no-sweep   # small-B rows only
    python benchmarks/bench_fused_moe.py --smoke               # CPU: same code path, tiny shapes, interpreter
                                                               # (writes to the temp dir, not results/)

Shapes: Qwen3-30B-A3B's MoE layer (E = 128 experts, H = 2048, I = 768, top-8, bf16, random weights with
std H^-1/2 / I^-1/2), decode batches B ∈ {1, 4, 8, 16, 32, 64, 128}.

Routing (stated, seeded; not a trained router): expert popularity is Zipf-like, p_e ∝ 1 / rank(e)^1.5 over
a fixed random permutation of the experts; each token draws its k experts without replacement with
probability ∝ p (Gumbel-top-k on log p), gate weights = softmax over the k selected scores
(norm_topk_prob). Distinct experts: ≈8 / 19 / 43 / 60 / 78 / 95 at B = 1 / 4 / 16 / 32 / 64 / 128 (the
measured skewed table in environment.md has 50 at B = 16 and 82 at B = 128).
Variants of the same batch: ``top8`` (as routed), ``sere_k2`` and ``sere_k1`` = SERE re-routing
(``harness.techniques.sere.reroute``, k_primary = 2 / 1, rho = 0: every secondary slot whose expert is not
in the primary union moves to its most similar primary expert) with a random similarity
1 − d/max d over random 64-d expert vectors (seeded). Routing weights are unchanged by SERE.

Implementations, called directly on the same inputs, side by side in one process:

- ``fused``       ``harness.kernels.fused_moe.fused_moe_triton(path="sorted")``: sort + align + grouped
                  tiles (default tiles for the batch);
- ``small``       ``fused_moe_triton(path="small")``: the small-batch path (``fused_moe_small``: no sort, no
                  align, two GEMV launches), timed for S = B·k ≤ SMALL_BENCH_MAX_PAIRS only (B ≤ 16 at
                  top-8: past the dispatch threshold too, so the table shows where the crossover lies).
                  ``fused_moe_triton``'s default ``path="auto"`` picks ``small`` at S ≤
                  ``SMALL_PATH_MAX_PAIRS``; the table's ``auto`` column says which one that is;
- ``grouped_mm``  transformers' ``grouped_mm_experts_forward`` on a ``Qwen3MoeExperts`` module;
- ``batched_mm``  transformers' ``batched_mm_experts_forward`` (gathers one weight copy per (token, slot));
- ``eager``       the module's own Python loop over the hit experts (host syncs: no CUDA graph);
- ``prep``        (diagnostic) the fused kernel's sort + tile alignment alone.

Each implementation is first checked against the float32 torch reference (relative Frobenius error;
bf16 bound 2e-2), then timed with ``triton.testing.do_bench`` (median, p10/p90; do_bench flushes L2 before
every call, so each call starts cold as in a model where 47 other layers pass in between) both eagerly
(Python + launches) and as a CUDA-graph replay (the launch cost a compiled decode step pays). Reported:
distinct experts, weight bytes = experts × 3·H·I·2, achieved bandwidth and its fraction of the measured
4.27 TB/s device copy. ``--sweep`` (on by default) times a few tile configurations of the fused kernel at
B = 1, 16, 128 (top8) under graph replay; ``--small-sweep`` (on by default) times a few tile
configurations of the small path at B = 1 and 4 (top8, graph replay).

Writes ``results/benchmarks/fused_moe.json`` and ``fused_moe.md`` (tables: ``fused_moe_bench_report.py``; small-path
sweep: ``fused_moe_small_sweep.py``) after every batch (a crash keeps the
finished rows); every row carries its error instead of aborting the run. Imports torch, triton,
transformers and harness (envinfo, the kernel, SERE) only; the timer, graph capture, error and writer helpers are
``benchmarks/_common.py``'s (shared with ``bench_decode_attention`` and ``bench_router``).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from _common import (Timer, add_device_args, capture_graph, free_memory, random_similarity, rel_err, results_path,
                     short_error, use_cuda, write_result)
from fused_moe_bench_report import markdown, print_row
from fused_moe_small_sweep import best_small_config, small_sweep

SHAPES = {"num_experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}
SMOKE_SHAPES = {"num_experts": 16, "hidden": 64, "inter": 48, "top_k": 4}
BATCHES = [1, 4, 8, 16, 32, 64, 128]
VARIANTS = {"top8": None, "sere_k2": 2, "sere_k1": 1}
IMPLS = ["fused", "small", "grouped_mm", "batched_mm", "eager", "prep"]
SMALL_BENCH_MAX_PAIRS = 128   # the small path is timed up to here (4x the dispatch threshold)
ZIPF_S = 1.5
COPY_BYTES_PER_S = 4.27e12
BF16_TOL = 2e-2


# ------------------------------------------------------------------------------------------------ inputs


def zipf_routing(batch: int, num_experts: int, k: int, seed: int):
    """ids int64 [B, k], weights float32 [B, k] (CPU): Gumbel-top-k on log p_e, p_e ∝ rank^-ZIPF_S."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_experts, generator=g)
    log_p = torch.empty(num_experts)
    log_p[perm] = -ZIPF_S * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    u = torch.rand(batch, num_experts, generator=g).clamp_min(1e-20)
    scores = log_p - torch.log(-torch.log(u))
    top, ids = scores.topk(k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def make_experts(shapes: dict, device: str, dtype: torch.dtype):
    """A transformers ``Qwen3MoeExperts`` with random weights, built directly on the device."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=shapes["hidden"], moe_intermediate_size=shapes["inter"],
                            num_experts=shapes["num_experts"], num_experts_per_tok=shapes["top_k"],
                            hidden_act="silu", num_hidden_layers=1)
    config._experts_implementation = "eager"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            experts = Qwen3MoeExperts(config)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, shapes["hidden"] ** -0.5)
        experts.down_proj.normal_(0.0, shapes["inter"] ** -0.5)
    return experts.requires_grad_(False).eval()


# ------------------------------------------------------------------------------------------- one layer


def implementations(experts, fused_out: torch.Tensor, small_out: torch.Tensor):
    """name -> (fn(x, ids, w) -> [B, H], graph-capturable?)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from harness.kernels import fused_moe as fm

    w1, w2 = experts.gate_up_proj, experts.down_proj

    def prep(x, ids, w):
        sorted_ids, _ = torch.sort(ids.reshape(-1), stable=True)
        cfg = fm.default_config(ids.numel(), x.device)
        n_tiles = fm.max_tiles(ids.numel(), w1.shape[0], cfg.block_m)
        tiles = torch.empty(n_tiles, dtype=torch.int32, device=x.device)
        fm._align_kernel[(1,)](sorted_ids, tiles, ids.numel(), w1.shape[0], n_tiles, BLOCK_M=cfg.block_m,
                               CHUNK=1024 if x.is_cuda else 64, num_warps=4)
        return None

    return {
        "fused": (lambda x, ids, w: fm.fused_moe_triton(x, w1, w2, ids, w, out=fused_out, path="sorted"), True),
        "small": (lambda x, ids, w: fm.fused_moe_triton(x, w1, w2, ids, w, out=small_out, path="small"), True),
        "grouped_mm": (lambda x, ids, w: ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, ids, w), True),
        "batched_mm": (lambda x, ids, w: ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, ids, w), True),
        "eager": (lambda x, ids, w: experts(x, ids, w), False),
        "prep": (prep, True),
    }


def bench_case(experts, impls, x, ids, w, timer: Timer, cuda: bool, graphs: bool) -> dict:
    from harness.kernels.fused_moe_reference import fused_moe_reference

    want = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, ids, w, out_dtype=torch.float32)
    table = implementations(experts, torch.empty_like(x), torch.empty_like(x))
    out: dict = {}
    for name in impls:
        fn, capturable = table[name]
        res: dict = {}
        out[name] = res
        if name == "small" and ids.numel() > SMALL_BENCH_MAX_PAIRS:
            res["skipped"] = f"S = {ids.numel()} > {SMALL_BENCH_MAX_PAIRS} pairs"
            continue
        try:
            call = lambda fn=fn: fn(x, ids, w)  # noqa: E731
            got = call()
            if got is not None:
                res["rel_err"] = rel_err(got, want)
                res["correct"] = bool(res["rel_err"] < BF16_TOL)
            res["eager"] = timer(call, rep_ms=60 if name == "eager" else None)
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not lose the others
            res["error"] = short_error(exc)
            if not isinstance(exc, torch.cuda.OutOfMemoryError):
                res["traceback"] = traceback.format_exc(limit=4)
            free_memory(cuda)
            continue
        if not (graphs and capturable and cuda):
            continue
        try:
            graph = capture_graph(call)
            if name in ("fused", "small"):   # the replay writes the static output buffer: check it again
                got.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                res["graph_rel_err"] = rel_err(got, want)
                res["correct"] = bool(res["correct"] and res["graph_rel_err"] < BF16_TOL)
            res["graph"] = timer(graph.replay)
            del graph
        except Exception as exc:  # noqa: BLE001
            res["graph_error"] = short_error(exc)
            free_memory(cuda)
    return out


def add_roofline(row: dict, shapes: dict, itemsize: int) -> None:
    row["weight_bytes"] = row["experts"] * 3 * shapes["hidden"] * shapes["inter"] * itemsize
    row["floor_us"] = row["weight_bytes"] / COPY_BYTES_PER_S * 1e6
    for res in row["impls"].values():
        for mode in ("eager", "graph"):
            t = res.get(mode, {}).get("p50_us")
            if t:
                res[mode]["bandwidth_TBps"] = row["weight_bytes"] / (t * 1e-6) / 1e12
                res[mode]["frac_copy_bw"] = row["weight_bytes"] / (t * 1e-6) / COPY_BYTES_PER_S


# -------------------------------------------------------------------------------------------- tile sweep


SWEEP = [  # block_m, up_n, up_k, down_n, down_k, warps, stages
    (16, 32, 128, 32, 128, 4, 4),
    (16, 64, 128, 64, 128, 4, 4),
    (16, 32, 256, 64, 256, 4, 3),
    (16, 64, 64, 64, 64, 4, 4),
    (16, 128, 128, 128, 128, 8, 3),
    (16, 32, 128, 32, 128, 2, 6),
    (32, 64, 128, 64, 128, 4, 4),
    (64, 64, 64, 64, 64, 4, 3),
]


def sweep(experts, shapes, batches, timer: Timer, seed: int) -> list[dict]:
    from harness.kernels.fused_moe import FusedMoEConfig, default_config, fused_moe_triton
    from harness.kernels.fused_moe_reference import fused_moe_reference

    rows = []
    w1, w2 = experts.gate_up_proj, experts.down_proj
    for batch in batches:
        ids, w = zipf_routing(batch, shapes["num_experts"], shapes["top_k"], seed + batch)
        ids, w = ids.cuda(), w.to("cuda", w1.dtype)
        x = torch.randn(batch, shapes["hidden"], device="cuda", dtype=w1.dtype)
        want = fused_moe_reference(x, w1, w2, ids, w, out_dtype=torch.float32)
        out = torch.empty_like(x)
        default = default_config(ids.numel(), x.device)
        for bm, un, uk, dn, dk, warps, stages in SWEEP:
            cfg = FusedMoEConfig(block_m=bm, up_block_n=un, up_block_k=uk, down_block_n=dn, down_block_k=dk,
                                 num_warps=warps, num_stages=stages)
            row = {"B": batch, "config": cfg.__dict__, "is_default": cfg == default}
            try:
                call = lambda cfg=cfg: fused_moe_triton(x, w1, w2, ids, w, out=out, config=cfg,  # noqa: E731
                                                        path="sorted")
                row["rel_err"] = rel_err(call(), want)
                row["graph"] = timer(capture_graph(call).replay)
            except Exception as exc:  # noqa: BLE001
                row["error"] = short_error(exc)
                free_memory(True)
            rows.append(row)
            t = row.get("graph", {}).get("p50_us")
            print(f"  sweep B={batch:<4} {str((bm, un, uk, dn, dk, warps, stages)):<34} "
                  f"{'%.1f us' % t if t else row.get('error')}{'  (default)' if row['is_default'] else ''}",
                  flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {list(VARIANTS)}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {IMPLS}")
    parser.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replay timings")
    parser.add_argument("--sweep", dest="sweep", action="store_true", default=True)
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--small-sweep", dest="small_sweep", action="store_true", default=True,
                        help="tile sweep of the small path (gate_up / down / total) at --small-sweep-batches")
    parser.add_argument("--no-small-sweep", dest="small_sweep", action="store_false")
    parser.add_argument("--small-sweep-batches", default="1")
    parser.add_argument("--quick", action="store_true", help="B=1,16,128; top8,sere_k1; fused,grouped_mm; no sweep")
    parser.add_argument("--seed", type=int, default=0)
    add_device_args(parser, "CPU/interpreter run at tiny shapes (tests the script)")
    args = parser.parse_args()

    cuda = use_cuda(args, interpret=True)   # smoke: the interpreter, before triton is first imported
    if cuda is None:
        return 0
    if args.quick:
        args.batches, args.variants, args.impls = "1,16,128", "top8,sere_k1", "fused,small,grouped_mm"
        args.sweep = args.small_sweep = False
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = [v for v in args.variants.split(",") if v]
    impls = [i for i in args.impls.split(",") if i]
    for name, chosen, known in (("variant", variants, VARIANTS), ("impl", impls, IMPLS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"unknown {name}(s) {unknown}; known: {list(known)}")

    import triton

    from harness.results.envinfo import collect_environment
    from harness.kernels.fused_moe_small import SMALL_GPU_CONFIG, SMALL_PATH_MAX_PAIRS, use_small_path
    from harness.techniques.sere.reroute import expert_union, reroute

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    out_path = args.out or results_path("fused_moe_smoke.json" if args.smoke else "fused_moe.json", args.smoke)
    timer = Timer(cuda)
    t_start = time.perf_counter()

    experts = make_experts(shapes, device, dtype)
    sim = random_similarity(shapes["num_experts"], args.seed + 1).to(device)
    result = {
        "benchmark": "fused_moe",
        "environment": collect_environment(device),
        "config": {
            "shapes": shapes, "dtype": "bfloat16", "weights": "random-init (normal, std H^-1/2 and I^-1/2)",
            "routing": f"Zipf-like popularity p ∝ rank^-{ZIPF_S} over a seeded random expert permutation, "
                       "k experts per token by Gumbel-top-k, weights = softmax over the selected scores",
            "sere": "harness.techniques.sere.reroute(k_primary=K, rho=0), random similarity 1-d/max d over "
                    "random 64-d expert vectors; routing weights unchanged",
            "timer": "triton.testing.do_bench median (p10/p90), warmup 25 ms, rep 100 ms, L2 flushed per call"
                     if cuda else "host timer (smoke run: numbers meaningless)",
            "copy_bandwidth_Bps": COPY_BYTES_PER_S, "seed": args.seed, "batches": batches,
            "variants": variants, "impls": impls, "graphs": not args.no_graphs,
            "triton_version": triton.__version__,
            "small_path_max_pairs": SMALL_PATH_MAX_PAIRS, "small_bench_max_pairs": SMALL_BENCH_MAX_PAIRS,
            "small_gpu_config": SMALL_GPU_CONFIG.__dict__,
        },
        "rows": [],
        "sweep": [],
        "small_sweep": [],
    }
    print(f"fused MoE layer bench on {result['environment']['device_name']}: shapes {shapes}, bf16", flush=True)
    for batch in batches:
        ids_cpu, w_cpu = zipf_routing(batch, shapes["num_experts"], shapes["top_k"], args.seed + batch)
        ids0 = ids_cpu.to(device)
        x = torch.randn(batch, shapes["hidden"], generator=torch.Generator().manual_seed(args.seed + 1000 + batch))
        x = x.to(device, dtype)
        w = w_cpu.to(device, dtype)
        for variant in variants:
            kp = VARIANTS[variant]
            ids = ids0 if kp is None else reroute(ids0, sim, kp, 0.0)
            row = {"B": batch, "variant": variant, "experts": expert_union(ids),
                   "experts_top8": expert_union(ids0), "impls": {},
                   "auto_path": "small" if use_small_path(ids.numel()) else "sorted"}
            try:
                row["impls"] = bench_case(experts, impls, x, ids, w, timer, cuda, not args.no_graphs)
            except Exception as exc:  # noqa: BLE001 - e.g. the reference itself failing
                row["error"] = short_error(exc)
                free_memory(cuda)
            add_roofline(row, shapes, 2)
            result["rows"].append(row)
            print_row(row)
            free_memory(cuda)             # graph pools of this case (batched_mm holds GBs)
        result["elapsed_s"] = time.perf_counter() - t_start
        write_result(result, out_path, markdown)
    if args.sweep and cuda:
        print("tile sweep (fused, graph replay, top8):", flush=True)
        try:
            result["sweep"] = sweep(experts, shapes, [b for b in (1, 16, 128) if b in batches] or batches[:1],
                                    timer, args.seed)
        except Exception as exc:  # noqa: BLE001
            result["sweep_error"] = short_error(exc)
        write_result(result, out_path, markdown)
    if args.small_sweep:
        small_batches = [int(b) for b in args.small_sweep_batches.split(",") if b]
        print("tile sweep (small path, top8):", flush=True)
        try:
            result["small_sweep"] = small_sweep(
                experts, shapes, small_batches, seed=args.seed, cuda=cuda, routing=zipf_routing, rel_err=rel_err,
                tol=BF16_TOL, time_call=lambda call: timer(capture_graph(call).replay if cuda else call, rep_ms=60))
            result["best_small_config"] = {b: best_small_config(result["small_sweep"], b) for b in small_batches}
        except Exception as exc:  # noqa: BLE001
            result["small_sweep_error"] = short_error(exc)
            result["small_sweep_traceback"] = traceback.format_exc(limit=4)
    result["elapsed_s"] = time.perf_counter() - t_start
    write_result(result, out_path, markdown)
    print(markdown(result))
    print(f"wrote {out_path} and {out_path.with_suffix('.md')} in {result['elapsed_s']:.0f} s")
    bad = [1 for r in result["rows"] for v in r["impls"].values() if v.get("correct") is False]
    bad += [1 for r in result["small_sweep"] if r.get("correct") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the routing op a vLLM MoE layer runs per decode step (issue 23): the fused one-launch op
(``harness.kernels.fused_routing``) against vLLM's own ``topk_softmax`` and against the chain of torch ops the
plugin ran before (stock top-k, re-route kernel, ~15 counter ops), at Qwen3-30B-A3B router shapes.

    python benchmarks/bench_routing_op.py [--tokens 1,4,16,64,70,256,512 --layers 48 --rounds 9 --variants ...]
    python benchmarks/bench_routing_op.py --compile-jobs 7 ...   # a fresh machine: compile each T in its own process
    TRITON_INTERPRET=1 python benchmarks/bench_routing_op.py --smoke   # CPU: correctness only, no timing

What a decode step does, 48 times (one MoE layer each): logits [T, 128] bf16 → weights/ids [T, 8]. Every
variant is captured in one CUDA graph of ``--layers`` calls (distinct logits and counters per layer, as in a
step), so the figure is device time per layer with launches replayed as vLLM replays them. Variants are
interleaved round-robin in each round (warm-up round discarded); each round times ``--replays`` replays;
the table gives the median over rounds and a 95 % bootstrap interval of it. Before timing, every fused
variant is checked id-for-id against its torch reference on the same inputs.

Variants: ``vllm_topk_softmax`` (stock vLLM: ``vllm._custom_ops.topk_softmax``; torch softmax+topk when vLLM
is absent, named ``torch_topk``), ``old_sere2`` (the plugin's previous SERE path), ``reference_sere2`` (the
torch reference, which steps of more than 256 rows ran before the multi-program plan); through the op's
dispatch ``fused_stock``, ``fused_sere2``, ``fused_sere2_nostats``, ``fused_sere1``, ``fused_top2``; the two
launch plans forced, side by side: ``one_*`` / ``multi_*`` for stock, SERE K=2 and top-2, and for SERE K=2 on
a serving-like step of ``MIXED_DECODES`` decode rows and the rest prefill (``*_sere2_mixed``), and for SERE K=2
without its counters (``*_sere2_nostats``: what the statistics cost in each plan); the one-program kernel with 1
or 2 warps at T <= 16 (``one_{stock,sere2,top2}_w{1,2}``: ``routing_op_sass.py`` found the default 4 warps on a
one- or two-row step put 34–59 barriers on the longest dependency chain, no more warps than rows 0–14); tiling
rows of the one-program kernel (``fused_sere2_w4``, ``fused_sere2_loop`` = slot-by-slot re-route, ``fused_sere2_vec``
= all slots in one gather at every size) and of the multi-program plan (``multi_sere2_t<rows>w<warps>[r<launch 2
warps>]``, ``multi_{stock,top2}_t<rows>w<warps>``); ``--baseline-multi FILE`` adds another version of the
multi-program plan's module (``base_multi_*``), timed in the same rounds (session 25's result files name today's
multi-program SERE plan ``epoch_*`` and the two it was timed against ``two_*`` and ``grid_*``: docs/vllm.md).
``--variants`` times a subset. Writes ``results/benchmarks/routing_op_<card>.json`` (``h200``, ``h100``; or
``--out``). Imports torch, triton, the harness's kernel and technique modules (and vLLM's op when installed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from _common import RESULTS_DIR, capture_graph, card_slug, random_similarity, write_result

#: the ``fused_*`` variants that call the op as vLLM does (the dispatch picks plan and tiling)
DISPATCHED = ("fused_stock", "fused_sere2", "fused_sere1", "fused_top2", "fused_sere2_nostats")


def dispatched_as(name: str, tokens: int) -> str:
    """The forced variant's name (``one_sere2_w1``, ``multi_sere2_t1w1r2``, ...) of the kernels the dispatch
    compiles for ``fused_<variant>`` at ``tokens`` rows: recorded with each ``fused_*`` row, so that
    ``routing_op_sass.py`` can set it beside the compiled code of the same plan and tiling."""
    from harness.kernels.fused_routing import dispatched_plan
    from routing_op_sass import measured_as

    return measured_as(name.removeprefix("fused_"), dispatched_plan(tokens), tokens)


E, K = 128, 8
#: (rows per program, warps, launch 2's warps) of the multi-program plan's tiling sweep for SERE K=2
#: (``multi_sere2_t<rows>w<warps>[r<launch 2 warps>]``); sm_90 SASS (routing_op_sass.py's tool): at 2-row tiles
#: launch 2 issues 1,449 instructions per thread at 1 warp, 1,040 at 2 and 819 at 4, and a warp per row keeps
#: launch 1's top-k reductions inside a warp
MULTI_TILINGS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2), (2, 2, 4), (2, 1, 4), (4, 2, 4), (4, 4, 4), (8, 2, 4), (16, 4, 4)]
#: (rows per program, warps) for the one-launch multi-program plans (stock, top-2): ``multi_{stock,top2}_t<r>w<w>``
ONE_LAUNCH_TILINGS = [(1, 1), (2, 1), (2, 2), (4, 4)]
#: decode rows of the ``*_mixed`` variants (the rest of the step: prefill rows, which SERE leaves alone)
MIXED_DECODES = 6


def bootstrap_ci(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the median."""
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(values), (n, len(values)), generator=g)
    med = v[idx].median(dim=1).values.sort().values
    return float(med[int(0.025 * n)]), float(med[int(0.975 * n) - 1])


def load_baseline(path: Path):
    """Another version of ``harness/kernels/fused_routing_multi.py`` (e.g. the last commit's, from ``git show``)
    as a module of its own, so its plan is timed in the same process, interleaved with today's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_fused_routing_multi", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_variants(tokens: int, layers: int, device: str, baseline=None):
    """name -> (fn(layer) -> None, check) with per-layer inputs / counters; check() asserts correctness.
    ``baseline``: a module from :func:`load_baseline`, whose multi-program plan is added as ``base_multi_*``."""
    from harness.engines.vllm.routing import stock_topk
    from harness.kernels.fused_routing import (COUNTERS, RoutingSpec, fused_routing, fused_routing_reference,
                                               fused_routing_triton)
    from harness.kernels.reroute import reroute_triton
    from harness.techniques.sere.graphs import RoutingCounters, StepRows, route

    g = torch.Generator().manual_seed(tokens)
    logits = [(torch.randn(tokens, E, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
              for _ in range(layers)]
    dec = torch.ones(max(tokens, 1), dtype=torch.bool, device=device)
    sim = random_similarity(E, seed=0).to(device)
    variants = {}

    try:
        from vllm import _custom_ops as ops  # noqa: F401

        def stock(i, _ops=ops):
            w = torch.empty(tokens, K, dtype=torch.float32, device=device)
            ids = torch.empty(tokens, K, dtype=torch.int32, device=device)
            tei = torch.empty(tokens, K, dtype=torch.int32, device=device)
            _ops.topk_softmax(w, ids, tei, logits[i], True)
        variants["vllm_topk_softmax"] = (stock, None)
    except Exception:  # noqa: BLE001 - no vLLM here: the nearest stock path
        def stock(i):
            p = torch.softmax(logits[i], dim=-1, dtype=torch.float32)
            w, ids = torch.topk(p, K, dim=-1)
            (w / w.sum(-1, keepdim=True), ids.to(torch.int32))
        variants["torch_topk"] = (stock, None)

    rows = StepRows(capacity=max(tokens, 1))
    rows.write(device, torch.ones(tokens, dtype=torch.bool))
    old_counters = [RoutingCounters(i, E) for i in range(layers)]
    for c in old_counters:
        c.counter(device)

    def old(i):
        w, ids = stock_topk(logits[i], K, True)
        new = route(ids, sim, 2, 0.0, None, rows, old_counters[i], reroute_triton)
        (w, new.to(torch.int32))
    variants["old_sere2"] = (old, None)

    # a serving step under load: a prefill chunk beside a few running decodes (vLLM puts the decodes first)
    mixed = torch.zeros(max(tokens, 1), dtype=torch.bool, device=device)
    mixed[:MIXED_DECODES] = True

    def fused(spec, stats: bool, topk_stats: bool = False, dec=dec, plan=None, **tiling):
        sc = [torch.zeros(len(COUNTERS), dtype=torch.long, device=device) if stats else None for _ in range(layers)]
        tc = [torch.zeros(len(COUNTERS), dtype=torch.long, device=device) if topk_stats else None
              for _ in range(layers)]

        def fn(i):
            if plan is not None:   # the baseline module's multi-program plan
                plan(logits[i], spec, dec[:tokens], sc[i], tc[i])
            elif tiling:   # a plan or tiling other than the dispatch's (the sweep rows)
                fused_routing_triton(logits[i], spec, dec[:tokens], None, sc[i], tc[i], **tiling)
            else:
                fused_routing(logits[i], spec, dec[:tokens], None, sc[i], tc[i])

        def check():
            # float32 logits: bf16 logits tie often, and torch.topk on CUDA breaks ties in no stated order
            # (the op: lowest expert id; vLLM's topk_softmax: its own order); the variant's own plan and tiling
            x = torch.randn(tokens, E, generator=torch.Generator().manual_seed(7)).to(device) * 2
            got_s, got_k, want_s, want_k = torch.zeros(4, len(COUNTERS), dtype=torch.long, device=device)
            if plan is not None:
                w, ids = plan(x, spec, dec[:tokens], got_s, got_k)
            elif tiling:
                w, ids = fused_routing_triton(x, spec, dec[:tokens], None, got_s, got_k, **tiling)
            else:
                w, ids = fused_routing(x, spec, dec[:tokens], None, got_s, got_k)
            rw, rids = fused_routing_reference(x, spec, dec[:tokens], None, want_s, want_k)
            assert torch.equal(ids, rids), "fused ids differ from the reference"
            torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
            assert got_s.tolist() == want_s.tolist() and got_k.tolist() == want_k.tolist(), "counters differ"
        return fn, check

    variants["fused_stock"] = fused(RoutingSpec(K, True), False)
    variants["fused_sere2"] = fused(RoutingSpec(K, True, k_primary=2, rho=0.0, similarity=sim), True)
    variants["fused_sere2_nostats"] = fused(RoutingSpec(K, True, k_primary=2, rho=0.0, similarity=sim), False)
    variants["fused_sere1"] = fused(RoutingSpec(K, True, k_primary=1, rho=0.0, similarity=sim), True)
    variants["fused_top2"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True)
    sere2 = RoutingSpec(K, True, k_primary=2, rho=0.0, similarity=sim)
    variants["fused_sere2_w4"] = fused(sere2, True, multi=False, num_warps=4)  # one-program sweep (default: 4 warps
    variants["fused_sere2_loop"] = fused(sere2, True, multi=False, vec_cells=0)  # up to 8 rows); slot-by-slot
    variants["fused_sere2_vec"] = fused(sere2, True, multi=False, vec_cells=1 << 16)  # all slots at every size
    if tokens >= 64:
        variants["fused_sere2_t64"] = fused(sere2, True, multi=False, block_t=64, num_warps=8)
        variants["fused_stock_t64"] = fused(RoutingSpec(K, True), False, multi=False, block_t=64, num_warps=8)
    # the two launch plans side by side at every T (the dispatch's ONE_PROGRAM_MAX_TOKENS is read off these)
    variants["one_sere2"] = fused(sere2, True, multi=False)
    variants["multi_sere2"] = fused(sere2, True, multi=True)
    variants["one_stock"] = fused(RoutingSpec(K, True), False, multi=False)
    variants["multi_stock"] = fused(RoutingSpec(K, True), False, multi=True)
    variants["one_top2"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True, multi=False)
    variants["multi_top2"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True, multi=True)
    # the statistics' own cost in each plan (launch 2's extra program and the 4 warps it needs: routing_op_sass.md)
    variants["one_sere2_nostats"] = fused(sere2, False, multi=False)
    variants["multi_sere2_nostats"] = fused(sere2, False, multi=True)
    if tokens <= 16:  # fewer warps than the default (4 up to 8 rows): with no more warps than rows, the top-k's
        for w in (1, 2):  # reductions stay inside a warp (sm_90 SASS, stock at T=1: 1 barrier with 1 warp, 53 with 4)
            variants[f"one_stock_w{w}"] = fused(RoutingSpec(K, True), False, multi=False, num_warps=w)
            variants[f"one_sere2_w{w}"] = fused(sere2, True, multi=False, num_warps=w)
            variants[f"one_top2_w{w}"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True, multi=False,
                                               num_warps=w)
    variants["one_sere2_mixed"] = fused(sere2, True, dec=mixed, multi=False)
    variants["multi_sere2_mixed"] = fused(sere2, True, dec=mixed, multi=True)
    for tile_rows, warps, warps_2 in MULTI_TILINGS:    # the multi-program tiling sweep (default: multi_tile)
        name = f"multi_sere2_t{tile_rows}w{warps}" + (f"r{warps_2}" if warps_2 != warps else "")
        variants[name] = fused(sere2, True, multi=True, block_t=tile_rows, num_warps=warps, reroute_warps=warps_2)
    for tile_rows, warps in ONE_LAUNCH_TILINGS:
        variants[f"multi_stock_t{tile_rows}w{warps}"] = fused(RoutingSpec(K, True), False, multi=True,
                                                              block_t=tile_rows, num_warps=warps)
        variants[f"multi_top2_t{tile_rows}w{warps}"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True,
                                                             multi=True, block_t=tile_rows, num_warps=warps)
    if baseline is not None:
        from harness.kernels.fused_routing import VEC_CELLS

        def base_plan(x, spec, d, s_cnt, k_cnt):
            """What ``fused_routing_triton(..., multi=True)`` does, with the baseline module's plan."""
            w = torch.empty(x.shape[0], spec.top_k, dtype=torch.float32, device=x.device)
            ids = torch.empty(x.shape[0], spec.top_k, dtype=torch.int32, device=x.device)
            baseline.fused_routing_multi(x, spec, d, None, s_cnt, k_cnt, spec.similarity, spec.protected, None,
                                         w, ids, vec_cells=VEC_CELLS)
            return w, ids
        variants["base_multi_stock"] = fused(RoutingSpec(K, True), False, plan=base_plan)
        variants["base_multi_sere2"] = fused(sere2, True, plan=base_plan)
        variants["base_multi_sere2_nostats"] = fused(sere2, False, plan=base_plan)
        variants["base_multi_top2"] = fused(RoutingSpec(K, True, trunc_k=2), False, topk_stats=True, plan=base_plan)
        variants["base_multi_sere2_mixed"] = fused(sere2, True, dec=mixed, plan=base_plan)
    ref_counters = [torch.zeros(len(COUNTERS), dtype=torch.long, device=device) for _ in range(layers)]
    # the torch reference: what steps of more than 256 rows ran before the multi-program plan
    variants["reference_sere2"] = (lambda i: fused_routing_reference(logits[i], sere2, dec[:tokens], None,
                                                                     ref_counters[i]), None)
    return variants


def time_graphs(variants, layers: int, rounds: int, replays: int) -> dict[str, list[float]]:
    """Per-layer µs of each variant's graph of ``layers`` calls, one value per round. Not ``_common``'s timers: the
    variants are interleaved round-robin and each round times ``replays`` replays between two events (one value
    per round, for the bootstrap interval), after a warm-up round. The eager warm-up before each capture stays
    this script's own (every layer once, on the current stream, where the persistent state is allocated)."""
    graphs = {}
    for name, (fn, _) in variants.items():
        for i in range(layers):          # eager warm-up: compiles, allocates persistent state
            fn(i)
        torch.cuda.synchronize()
        graphs[name] = capture_graph(lambda fn=fn: [fn(i) for i in range(layers)], warmup=0)
    per_layer_us: dict[str, list[float]] = {name: [] for name in graphs}
    for r in range(rounds + 1):
        for name, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            if r > 0:                     # round 0 is warm-up
                per_layer_us[name].append(start.elapsed_time(end) * 1000.0 / (replays * layers))
    return per_layer_us


def markdown(doc: dict) -> str:
    """The JSON's rows as one table: a row per T, a column per variant (median µs per layer)."""
    rows = doc["rows"]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    tokens = list(dict.fromkeys(r["tokens"] for r in rows))
    cell = {(r["tokens"], r["variant"]): r["us_per_layer"] for r in rows}
    lines = [f"# Routing op, µs per layer ({doc['env'].get('device')}, {doc['protocol']})", "",
             f"env: {json.dumps(doc['env'])}; dispatch: {json.dumps(doc['dispatch'])}", "",
             *([f"note: {doc['note']}", ""] if doc.get("note") else []),
             "| variant | " + " | ".join(f"T={t}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for n in names:
        vals = (f"{cell[(t, n)]:.2f}" if (t, n) in cell else "–" for t in tokens)
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def warm_argv(argv: list[str]) -> list[str]:
    """The caller's flags for a ``--warm-only`` process, less ``--tokens``, ``--out`` and ``--compile-jobs``
    (as ``--flag value`` or ``--flag=value``): each process gets its own T and writes nothing."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in ("--tokens", "--out", "--compile-jobs"):
            skip = "=" not in a
            continue
        kept.append(a)
    return kept


def compile_in_parallel(tokens: list[int], jobs: int, argv: list[str]) -> None:
    """Fill Triton's disk cache with every variant at every T, ``jobs`` processes at a time (this script with
    ``--warm-only --tokens T`` and the caller's other flags, ``argv``), so the timed run loads kernels instead of compiling
    them one after another. Why: one process compiles serially on one core, minutes of a device call on a fresh
    machine. A process that fails stops the run with its output (a variant that disagrees with its reference
    must not be timed)."""
    argv = warm_argv(argv)

    def warm(t: int) -> tuple[int, int, str]:
        proc = subprocess.run([sys.executable, __file__, *argv, "--warm-only", "--tokens", str(t)],
                              capture_output=True, text=True)
        return t, proc.returncode, (proc.stdout + proc.stderr)[-4000:]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(warm, tokens))
    failed = [(t, out) for t, rc, out in results if rc != 0]
    for t, out in failed:
        print(f"compile T={t} failed:\n{out}", file=sys.stderr)
    if failed:
        raise SystemExit(f"compiling failed at T={[t for t, _ in failed]}")
    print(f"compiled {len(tokens)} step lengths in {jobs} processes: {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,70,256,512")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", default="", help="comma-separated variant names to time (default: all); "
                    "the stock baseline (vllm_topk_softmax / torch_topk) is always kept")
    ap.add_argument("--smoke", action="store_true", help="CPU: correctness of every variant, no timing")
    ap.add_argument("--warm-only", action="store_true", help="check and run every variant once, time nothing: "
                    "fills Triton's cache, e.g. one process per T in parallel before the timed run")
    ap.add_argument("--compile-jobs", type=int, default=0,
                    help="compile in N processes first, one per T (--warm-only each, sharing Triton's disk cache): "
                         "on a fresh machine compiling the variants takes most of a run's minutes, one core each")
    ap.add_argument("--baseline-multi", type=Path, default=None,
                    help="another version of harness/kernels/fused_routing_multi.py: its plan is timed beside "
                         "today's in the same rounds as base_multi_{stock,sere2,sere2_nostats,top2,sere2_mixed}")
    ap.add_argument("--out", type=Path, default=None, help="default results/benchmarks/routing_op_<card>.json")
    args = ap.parse_args()
    args.out = args.out or RESULTS_DIR / f"routing_op_{card_slug()}.json"
    baseline = load_baseline(args.baseline_multi) if args.baseline_multi else None
    tokens = [int(t) for t in args.tokens.split(",")]
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        for t in (1, 5):
            for name, (fn, check) in build_variants(t, 2, device, baseline).items():
                if check is not None:
                    check()
                fn(0)
            print(f"smoke T={t}: every variant ran, fused == reference")
        return
    keep = {v for v in args.variants.split(",") if v} | {"vllm_topk_softmax", "torch_topk"}
    if args.variants and not args.warm_only:   # a misspelt name fails here, before any GPU time (names depend on T: shortest and longest)
        known = {n for t in (min(tokens), max(tokens)) for n in build_variants(t, 1, "cpu", baseline)}
        unknown = keep - known - {"vllm_topk_softmax", "torch_topk"}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(known)}")
    if args.compile_jobs > 0 and not args.warm_only:
        compile_in_parallel(tokens, args.compile_jobs, sys.argv[1:])
    rows = []

    def save() -> None:
        """Write the JSON and its table (after every T: a run stopped early keeps what it measured)."""
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            import triton
            env["triton"] = triton.__version__
            import vllm
            env["vllm"] = vllm.__version__
        except Exception:  # noqa: BLE001
            pass
        from harness.kernels.fused_routing import ONE_PROGRAM_MAX_TOKENS, VEC_CELLS
        from harness.kernels.fused_routing import kernel_sources

        doc = {"benchmark": "routing_op", "env": env, "experts": E, "top_k": K, "layers": args.layers,
               "dtype": "bfloat16", "weights": "n/a (random logits)", "protocol":
               f"CUDA graph of {args.layers} calls; {args.rounds} interleaved rounds x {args.replays} replays "
               "after a warm-up round; median over rounds, 95% bootstrap CI",
               # what the fused_* rows dispatched with (one_* / multi_* force a plan)
               "dispatch": {"one_program_max_tokens": ONE_PROGRAM_MAX_TOKENS, "vec_cells": VEC_CELLS,
                            "mixed_decodes": MIXED_DECODES},
               "baseline_multi": str(args.baseline_multi) if args.baseline_multi else None,
               # which kernel code the one_* / multi_* rows timed (a hash of each plan's kernel sources):
               # routing_op_sass.py sets a figure beside the compiled code only when the hashes agree
               "kernel_sources": kernel_sources(),
               "rows": rows}
        write_result(doc, args.out, markdown, indent=1)
        print("wrote", args.out, "and", args.out.with_suffix(".md"))

    for t in tokens:
        variants = build_variants(t, args.layers, device, baseline)
        if args.variants:
            absent = keep - set(variants) - {"vllm_topk_softmax", "torch_topk"}
            if absent:   # some variants exist only at some T (one_*_w1/_w2: T <= 16)
                print(f"T={t}: not defined at this T: {sorted(absent)}", flush=True)
            variants = {k: v for k, v in variants.items() if k in keep}
        for name, (fn, check) in variants.items():
            if check is not None:
                check()
            if args.warm_only:
                fn(0)
        if args.warm_only:
            torch.cuda.synchronize()
            print(f"warm T={t}: {len(variants)} variants checked against the reference and compiled", flush=True)
            continue
        times = time_graphs(variants, args.layers, args.rounds, args.replays)
        for name, vals in times.items():
            med = float(torch.tensor(vals).median())
            lo, hi = bootstrap_ci(vals)
            row = {"tokens": t, "variant": name, "us_per_layer": med, "ci95": [lo, hi], "rounds": vals}
            if name in DISPATCHED:  # the forced variant of the plan and tiling the dispatch compiled for it
                row["dispatched_as"] = dispatched_as(name, t)
            rows.append(row)
            print(f"T={t:4d} {name:22s} {med:7.2f} µs/layer  [{lo:.2f}, {hi:.2f}]", flush=True)
        save()


if __name__ == "__main__":
    main()

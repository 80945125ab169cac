"""Benchmark the SERE re-routing op (``harness.kernels.reroute``): P rebuilt per program (old) vs P built
once per step (new), against the torch reference, T = 1 ... 16384 tokens.

    python benchmarks/bench_reroute.py [--experts 128 --k 8 --k-primary 2 --rho 0.1 --protect 16]
    python benchmarks/bench_reroute.py --smoke      # CPU: Triton interpreter, tiny T, no timing worth reading

For each T, random routing (distinct top-k of Gaussian logits), a random similarity built as SERE builds it
(1 - d/max d over random "expert outputs"), 16 protected experts and a decode-row mask (all rows decode, as
in a decode step; the op reads the mask in every call): it first checks that every variant equals the
reference id for id (eagerly and, on CUDA, under graph replay with poisoned outputs), then times with
``triton.testing.do_bench`` (median, p10/p90; L2 flushed before every call, so each call starts cold, as
the op would between two MoE layers):

- ``ref``:          the torch reference, eager (many small launches);
- ``old``:          P rebuilt by every program (``primary="fused"``, the first version), eager;
- ``new``:          P built once by its own pass (``primary="separate"``), eager;
- ``auto``:         what the op does by default (fused up to ``FUSE_MAX_TOKENS`` rows, separate beyond);
- ``old_graph`` / ``new_graph``: the op captured in a CUDA graph, one call per replay;
- ``old_op`` / ``new_op``: a graph of 16 calls, replay time / 16 (device time of one op, launch amortised);
- ``new_prefill_graph``: ``new`` in a graph with an all-False mask (a prefill-only step replayed from a
  graph, where the host cannot skip the op: P is empty and the similarity is never read).
  Eager prefill-only steps skip the op on the host (``harness.techniques.sere.graphs``): 0 µs.

Prints a table and writes ``results/benchmarks/reroute_primary.json`` (environment, shapes, dtypes, rows;
each T is measured in its own guarded section, so one failure keeps the rest). ~1-2 min on one H200.
Random routing and similarity say nothing about quality; only times and the correctness check count.

Imports only torch, triton and the harness modules of this op, so it runs on a bare GPU machine (``_common``
puts the repository on ``sys.path`` and holds the timer, the graph capture and the similarity).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import RESULTS_DIR, Timer, capture_graph, short_error, similarity_of, write_result

TOKENS = [2**i for i in range(15)]   # 1 .. 16384
SMOKE_TOKENS = [1, 5, 150]
GRAPH_CALLS = 16
VARIANTS = {"old": "fused", "new": "separate", "auto": "auto"}


def make_inputs(num_tokens, num_experts, k, num_protected, ids_dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randn(num_tokens, num_experts, generator=g).topk(k).indices.to(ids_dtype)
    sim = similarity_of(torch.randn(num_experts, 64, generator=g))   # stand-in for calibrated expert outputs
    protected = torch.zeros(num_experts, dtype=torch.bool)
    protected[torch.randperm(num_experts, generator=g)[:num_protected]] = True
    rows = torch.ones(num_tokens, dtype=torch.bool)
    return ids.to(device), sim.to(device), protected.to(device), rows.to(device)


def guarded(row, key, fn):
    """row[key] = fn(), or {"error": ...}: one failing measurement keeps the others."""
    try:
        row[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded, printed, never hidden
        row[key] = {"error": short_error(exc)}
        traceback.print_exc()


def measure(num_tokens, args, device, timer, failures):
    from harness.kernels.reroute import reroute_triton
    from harness.techniques.sere.reroute import reroute, reroute_stats

    cuda = device == "cuda"
    ids_dtype = getattr(torch, args.ids_dtype)
    kp, rho = args.k_primary, args.rho
    ids, sim, protected, rows = make_inputs(num_tokens, args.experts, args.k, args.protect, ids_dtype, device,
                                            seed=num_tokens)
    no_rows = torch.zeros_like(rows)
    want = reroute(ids, sim, kp, rho, protected, rows)
    row = {"T": num_tokens, **reroute_stats(ids, want, kp)}
    outs = {name: torch.full_like(ids, -7777) for name in VARIANTS}
    calls = {name: (lambda out=outs[name], mode=mode: reroute_triton(ids, sim, kp, rho, protected, rows,
                                                                      out=out, primary=mode))
             for name, mode in VARIANTS.items()}

    for name, fn in calls.items():          # correctness first; the first call also compiles (timed apart)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        row[f"{name}_first_call_ms"] = (time.perf_counter() - t0) * 1e3
        if not torch.equal(outs[name], want):
            failures.append(f"T={num_tokens}: {name} (eager) differs from the reference")

    guarded(row, "ref", lambda: timer(lambda: reroute(ids, sim, kp, rho, protected, rows)))
    for name, fn in calls.items():
        guarded(row, name, lambda fn=fn: timer(fn))
    if not cuda:
        return row

    for name in ("old", "new"):
        def graphs(name=name):
            one = capture_graph(calls[name], 1, warmup=3)
            many = capture_graph(calls[name], GRAPH_CALLS, warmup=3)
            outs[name].fill_(-7777)
            one.replay()
            torch.cuda.synchronize()
            if not torch.equal(outs[name], want):
                failures.append(f"T={num_tokens}: {name} (graph replay) differs from the reference")
            row[f"{name}_graph"] = timer(one.replay)
            per = timer(many.replay)
            return {key: value / GRAPH_CALLS for key, value in per.items()}
        guarded(row, f"{name}_op", graphs)

    def prefill_graph():
        out = torch.full_like(ids, -7777)
        graph = capture_graph(lambda: reroute_triton(ids, sim, kp, rho, protected, no_rows, out=out,
                                                     primary="separate"), warmup=3)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, ids):
            failures.append(f"T={num_tokens}: a step without decode rows changed ids")
        return timer(graph.replay)
    guarded(row, "new_prefill_graph", prefill_graph)
    return row


def p50(row, key):
    value = row.get(key)
    return value.get("p50_us", float("nan")) if isinstance(value, dict) else float("nan")


def print_table(rows, args, device_name):
    cols = ["ref", "old", "new", "auto", "old_graph", "new_graph", "old_op", "new_op", "new_prefill_graph"]
    heads = ["ref", "old", "new", "auto", "old_gr", "new_gr", "old/op", "new/op", "pre_gr"]
    print(f"SERE re-route: E={args.experts} k={args.k} k_primary={args.k_primary} rho={args.rho} "
          f"protected={args.protect} ids={args.ids_dtype} similarity=float32 decode-row mask on {device_name}")
    print(f"{'T':>6} {'experts':>9} " + " ".join(f"{h:>8}" for h in heads) + f" {'old/new':>8}   (us, medians)")
    for r in rows:
        speed = p50(r, "old") / p50(r, "new")
        print(f"{r['T']:>6} {r['experts_before']:>4}->{r['experts_after']:<4} "
              + " ".join(f"{p50(r, c):>8.1f}" for c in cols) + f" {speed:>8.2f}")


def run(args) -> int:
    from harness.results.envinfo import collect_environment

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    timer = Timer(cuda, cpu_calls=1)   # smoke: one call (the interpreter is slow, its times mean nothing)
    rows, failures = [], []
    for num_tokens in tokens:
        try:
            rows.append(measure(num_tokens, args, device, timer, failures))
        except Exception as exc:  # noqa: BLE001 - keep the other sizes
            failures.append(f"T={num_tokens}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
    print_table(rows, args, torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: smoke only)")

    import triton

    from harness.kernels.reroute import FUSE_MAX_TOKENS, MAX_G
    result = {
        "benchmark": "reroute_primary",
        "smoke": bool(args.smoke),
        "environment": collect_environment(device),
        "config": {
            "num_experts": args.experts, "k": args.k, "k_primary": args.k_primary, "rho": args.rho,
            "num_protected": args.protect, "ids_dtype": args.ids_dtype, "similarity_dtype": "float32",
            "row_mask": "all rows decode (bool [T])", "tokens": tokens,
            "routing": "random: distinct top-k of N(0,1) logits (not a trained router)",
            "similarity": "1 - d/max(d), d = pairwise L2 of random N(0,1) 64-d expert vectors",
            "timer": ("triton.testing.do_bench(warmup=25, rep=100), L2 flushed per call; us; p50/p10/p90"
                      if cuda else "one perf_counter call (smoke: not a measurement)"),
            "graph_op_calls": GRAPH_CALLS, "triton_version": triton.__version__,
            "fuse_max_tokens": FUSE_MAX_TOKENS, "max_primary_programs": MAX_G,
            "weights": "none (a routing op; random ids)",
        },
        "correct": not failures,
        "failures": failures,
        "rows": rows,
    }
    path = args.out or RESULTS_DIR / ("reroute_primary_smoke.json" if args.smoke else "reroute_primary.json")
    write_result(result, Path(path))
    print(f"wrote {path}")
    if failures:
        print("CORRECTNESS FAILURES (timings recorded but not to be trusted):\n  " + "\n  ".join(failures),
              file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--k-primary", type=int, default=2)
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--protect", type=int, default=16, help="number of random protected experts")
    parser.add_argument("--ids-dtype", choices=["int32", "int64"], default="int32")
    parser.add_argument("--smoke", action="store_true", help="CPU/interpreter run at T = 1, 5, 150")
    parser.add_argument("--out", default=None, help="JSON path (default results/benchmarks/reroute_primary.json)")
    args = parser.parse_args()

    if args.smoke or not torch.cuda.is_available():
        args.smoke = True
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    sys.exit(run(args))


if __name__ == "__main__":
    main()

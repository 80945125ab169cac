"""Benchmark the fused SERE re-routing op (``harness.kernels.reroute``) against its torch reference.

    python benchmarks/bench_reroute.py [--experts 128 --k 8 --k-primary 2 --rho 0.1 --protect 16]

On a GPU: for T = 1, 2, 4, ..., 512 decode tokens, random routing (distinct top-k of Gaussian logits) and a
random similarity built as SERE builds it (1 - d/max d over random "expert outputs"), it first checks that
the op equals the reference id for id (eagerly and under CUDA-graph replay), then times with
``triton.testing.do_bench`` (median, p10/p90; do_bench flushes L2 before every call, so each call starts
cold, as the op would between two MoE layers):

- ``ref``:        the torch reference, eager (many small launches);
- ``ref_graph``:  the reference captured in a CUDA graph (it has no host sync), one call per replay;
- ``triton``:     the fused op, eager: Python wrapper + one launch (timed twice: the gap is the noise);
- ``graph``:      the fused op in a CUDA graph, one call per replay (launch latency included);
- ``graph_op``:   a graph of 16 calls, replay time / 16 (device time of one op, launch amortised).

Prints a table and writes ``results/benchmarks/reroute.json`` (environment, shapes, dtypes, rows).
Random routing and similarity say nothing about quality; only times and the correctness check count.

On a machine without CUDA it runs a tiny correctness pass in Triton's interpreter instead (no timing, no
JSON: CPU interpreter times would mean nothing) and exits 0.

Imports only torch, triton and the harness modules of this op, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = [2**i for i in range(10)]   # 1 .. 512
GRAPH_CALLS = 16
QUANTILES = [0.5, 0.1, 0.9]


def make_inputs(num_tokens, num_experts, k, num_protected, ids_dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randn(num_tokens, num_experts, generator=g).topk(k).indices.to(ids_dtype)
    outputs = torch.randn(num_experts, 64, generator=g)          # stand-in for calibrated expert outputs
    dist = torch.cdist(outputs, outputs)
    sim = (1.0 - dist / dist.max()).fill_diagonal_(1.0)
    protected = torch.zeros(num_experts, dtype=torch.bool)
    protected[torch.randperm(num_experts, generator=g)[:num_protected]] = True
    return ids.to(device), sim.to(device), protected.to(device)


def capture(fn, calls):
    """A CUDA graph of ``calls`` invocations of ``fn`` (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def bench(fn, do_bench):
    p50, p10, p90 = do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES, return_mode="median")
    return {"p50_us": p50 * 1e3, "p10_us": p10 * 1e3, "p90_us": p90 * 1e3}


def cpu_sanity(args) -> None:
    from harness.kernels.reroute import reroute_triton
    from harness.techniques.sere import reroute

    for num_tokens in (1, 5):
        ids, sim, protected = make_inputs(num_tokens, 16, 8, 4, torch.int32, "cpu", seed=num_tokens)
        for rho in (0.0, args.rho):
            out = torch.full_like(ids, -7777)
            got = reroute_triton(ids, sim, args.k_primary, rho, protected, out=out)
            want = reroute(ids, sim, args.k_primary, rho, protected)
            if not torch.equal(got, want):
                sys.exit(f"MISMATCH in the interpreter sanity pass (T={num_tokens}, rho={rho})")
    print("No CUDA device: ran a tiny interpreter correctness pass (T=1, 5; E=16; k=8): OK. "
          "No timing and no JSON on CPU; run this script on a GPU for numbers.")


def gpu_bench(args) -> None:
    import triton
    from triton.testing import do_bench

    from harness.envinfo import collect_environment
    from harness.kernels.reroute import reroute_triton
    from harness.techniques.sere import reroute, reroute_stats

    ids_dtype = getattr(torch, args.ids_dtype)
    kp, rho = args.k_primary, args.rho
    rows, failures = [], []
    for num_tokens in TOKENS:
        ids, sim, protected = make_inputs(num_tokens, args.experts, args.k, args.protect, ids_dtype, "cuda",
                                          seed=num_tokens)
        want = reroute(ids, sim, kp, rho, protected)

        # Correctness first: poisoned output, eager (the first call also compiles: timed apart).
        out = torch.full_like(ids, -7777)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reroute_triton(ids, sim, kp, rho, protected, out=out)
        torch.cuda.synchronize()
        first_call_ms = (time.perf_counter() - t0) * 1e3
        if not torch.equal(out, want):
            failures.append(f"T={num_tokens}: eager ids differ from the reference")

        graph = capture(lambda: reroute_triton(ids, sim, kp, rho, protected, out=out), 1)
        graph_many = capture(lambda: reroute_triton(ids, sim, kp, rho, protected, out=out), GRAPH_CALLS)
        out.fill_(-7777)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, want):
            failures.append(f"T={num_tokens}: graph-replayed ids differ from the reference")
        try:
            ref_graph = capture(lambda: reroute(ids, sim, kp, rho, protected), 1)
        except RuntimeError as exc:          # record, do not hide, a reference that cannot be captured
            ref_graph, ref_graph_error = None, str(exc).splitlines()[0]
        else:
            ref_graph_error = None

        row = {"T": num_tokens, "first_call_ms": first_call_ms, **reroute_stats(ids, want, kp)}
        row["ref"] = bench(lambda: reroute(ids, sim, kp, rho, protected), do_bench)
        row["ref_graph"] = bench(ref_graph.replay, do_bench) if ref_graph else {"error": ref_graph_error}
        row["triton"] = bench(lambda: reroute_triton(ids, sim, kp, rho, protected, out=out), do_bench)
        row["triton_repeat"] = bench(lambda: reroute_triton(ids, sim, kp, rho, protected, out=out), do_bench)
        row["graph"] = bench(graph.replay, do_bench)
        many = bench(graph_many.replay, do_bench)
        row["graph_op"] = {key: value / GRAPH_CALLS for key, value in many.items()}
        row["speedup_eager"] = row["ref"]["p50_us"] / row["triton"]["p50_us"]
        row["speedup_graph"] = (row["ref_graph"]["p50_us"] / row["graph"]["p50_us"]
                                if ref_graph else None)
        rows.append(row)

    header = (f"{'T':>4} {'experts':>10} {'moved':>6} {'ref':>8} {'ref_gr':>8} {'triton':>8} {'again':>8} "
              f"{'graph':>8} {'gr/op':>8} {'x eager':>8} {'x graph':>8}   (us, medians)")
    print(f"SERE re-route: E={args.experts} k={args.k} k_primary={kp} rho={rho} protected={args.protect} "
          f"ids={args.ids_dtype} similarity=float32 on {torch.cuda.get_device_name()}")
    print(header)
    for r in rows:
        ref_gr = r["ref_graph"].get("p50_us", float("nan"))
        print(f"{r['T']:>4} {r['experts_before']:>4}->{r['experts_after']:<4} {r['moved_fraction']:>6.2f} "
              f"{r['ref']['p50_us']:>8.1f} {ref_gr:>8.1f} {r['triton']['p50_us']:>8.1f} "
              f"{r['triton_repeat']['p50_us']:>8.1f} {r['graph']['p50_us']:>8.1f} "
              f"{r['graph_op']['p50_us']:>8.2f} "
              f"{r['speedup_eager']:>8.2f} {(r['speedup_graph'] or float('nan')):>8.2f}")

    result = {
        "benchmark": "reroute",
        "environment": collect_environment("cuda"),
        "config": {
            "num_experts": args.experts, "k": args.k, "k_primary": kp, "rho": rho,
            "num_protected": args.protect, "ids_dtype": args.ids_dtype, "similarity_dtype": "float32",
            "tokens": TOKENS, "routing": "random: distinct top-k of N(0,1) logits (not a trained router)",
            "similarity": "1 - d/max(d), d = pairwise L2 of random N(0,1) 64-d expert vectors",
            "timer": "triton.testing.do_bench(warmup=25, rep=100), L2 flushed per call; us; p50/p10/p90",
            "graph_op_calls": GRAPH_CALLS, "triton_version": triton.__version__,
        },
        "correct": not failures,
        "failures": failures,
        "rows": rows,
    }
    path = args.out or os.path.join(REPO, "results", "benchmarks", "reroute.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    if failures:
        sys.exit("CORRECTNESS FAILURES (timings recorded but not to be trusted):\n  " + "\n  ".join(failures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--k-primary", type=int, default=2)
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--protect", type=int, default=16, help="number of random protected experts")
    parser.add_argument("--ids-dtype", choices=["int32", "int64"], default="int32")
    parser.add_argument("--out", default=None, help="JSON path (default results/benchmarks/reroute.json)")
    args = parser.parse_args()

    sys.path.insert(0, REPO)                     # the package need not be installed on the GPU machine
    if torch.cuda.is_available():
        gpu_bench(args)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
        cpu_sanity(args)


if __name__ == "__main__":
    main()

"""Host time of each offload policy per decode token, with the MoE kernel replaced by a no-op (CPU, seconds).

    python benchmarks/offload_host_overhead.py            # prints a table; --json PATH writes it

Why: on the GPU every offloaded layer reads its routing on the host, so the host's work between that read and
the kernel launch is on the critical path, and work after the launch is hidden only while it is shorter than
the layer's compute. This script isolates that host work — the cache, the policy, the gate read — on the exact
code path of ``benchmarks/bench_offload.py`` (``run_once``), at the real geometry (12 layers × 128 experts,
top-8, 41 slots per layer, the skewed trace, B = 1) but with tiny expert tensors and no kernel. Interleaved
rounds and bootstrap intervals as in the GPU benchmark (``offload_protocol``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_offload as b  # noqa: E402
from offload_protocol import compare, rounds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="none,lru,lfu,lru+gate,lease,oracle")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from harness.techniques.offload.store import ExpertStore
    from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace

    b.kernel = lambda h, gu, dn, ids, w: h  # the host's work only
    s = b.Shapes(True, 12, 128, 8)
    warmup, steps = 10, 10 + args.tokens
    gu, dn, _ = b.build_weights(s, "cpu", 0)
    store = ExpertStore(s.layers, s.e, s.i, s.h, torch.bfloat16, pin=False)
    for layer in range(s.layers):
        store.put(layer, gu[layer], dn[layer])
    tr = synthetic_trace(SyntheticSpec(num_layers=s.layers, num_experts=s.e, top_k=s.k, requests=1, tokens=steps))
    rows, w = b.skewed_rows(tr, 1, steps)
    src = b.replay_source(rows, w, "cpu")
    src["guesses"] = b.emulated_guesses(rows, s.e, 0.8, 1)
    variants = args.variants.split(",")
    run = lambda v: b.run_once(v, s, src, 41, "cpu", store, (gu, dn), warmup, args.tokens)  # noqa: E731
    for v in variants:
        run(v)
    ms: dict[str, list[float]] = {v: [] for v in variants}
    for order in rounds(variants, args.repeats):
        for v in order:
            ms[v].append(run(v)["ms_per_token"])
    cmp = compare(ms)
    print("| variant | host ms/token | 95 % CI | vs lru (paired) | verdict |\n|---|---|---|---|---|")
    for v, c in cmp.items():
        vs = c.get("vs_lru", {}).get("mean")
        print(f"| {v} | {c['mean']:.3f} | [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] | "
              f"{'—' if vs is None else f'{vs:.2f}'} | {c.get('verdict_vs_lru', '—')} |")
    if args.json:
        from harness.results.envinfo import collect_environment

        with open(args.json, "w") as fh:
            json.dump({"benchmark": "offload host overhead (kernel = no-op)", "environment": collect_environment("cpu"),
                       "geometry": {**s.as_dict(), "capacity": 41, "source": "skewed", "batch": 1},
                       "results": cmp}, fh, indent=1)


if __name__ == "__main__":
    main()

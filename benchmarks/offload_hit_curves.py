"""The seed's curves that need no GPU: hit rates of every policy against budget, batch, lease threshold and grace.

    python benchmarks/offload_hit_curves.py          # CPU, ~1-2 min; results/benchmarks/offload_hit_curves.{json,md,png}

Why a CPU script: a hit rate, a prefetch's precision, the experts a lease holds are decided by the cache's
bookkeeping alone, which is the same code with or without tensors (:func:`harness.techniques.offload.simulate.simulate`
replays a trace through :class:`~harness.techniques.offload.cache.ExpertCache` with no mover). They are exact here;
only time needs the GPU (``benchmarks/bench_offload.py``). Traces: the synthetic skewed one at Qwen3-30B-A3B's
routing shape (12 layers × 128 experts, top-8, 4 requests × 128 tokens) and the embedded trained model's own
RAG / OCR / MCQ routing (4 layers × 16 experts, top-4, ``results/benchmarks/offload_trace_tiny*.pt``). The
next-layer gate of ``lru+gate``/``lease`` is emulated as in the GPU benchmark: the true next-layer experts, each
replaced by a uniformly random expert with probability ``1 - --gate-precision``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RECORDED = {"rag": "offload_trace_tiny.pt", "ocr": "offload_trace_tiny_ocr.pt", "mcq": "offload_trace_tiny_mcq.pt"}
POLICIES = ("lru", "lfu", "lru+gate", "lease", "lease/nopf", "oracle")
EXPERT_BYTES = 3 * 2048 * 768 * 2  # one Qwen3-30B-A3B expert in bf16


def emulated_gate(steps: list, num_experts: int, precision: float, seed: int):
    """``gate(layer, t)`` → host rows of step ``t``'s true ids at ``layer``, each wrong with prob. 1 - precision."""
    import torch

    g = torch.Generator().manual_seed(seed)
    guesses = []
    for ids in steps:
        wrong = torch.rand(ids.shape, generator=g) >= precision
        guesses.append(torch.where(wrong, torch.randint(0, num_experts, ids.shape, generator=g), ids))
    return lambda layer, t: guesses[t][:, layer].tolist()


def params_of(variant: str, threshold: float = 0.5, grace: str = "fixed") -> tuple[str, dict]:
    if variant.startswith("lease"):
        return "lease", {"threshold": threshold, "lease": {"score": "recency", "grace_mode": grace,
                                                           "prefetch": "none" if variant.endswith("/nopf") else "gate"}}
    return variant, {}


def run(steps: list, variant: str, capacity: int, num_experts: int, gate, batch: int, ms_per_token: float,
        threshold: float = 0.5, grace: str = "fixed") -> dict[str, Any]:
    from harness.techniques.offload.simulate import simulate

    name, params = params_of(variant, threshold, grace)
    hiddens = [[t] * steps[0].shape[1] for t in range(len(steps))]
    out = simulate(steps, name, capacity, num_experts, expert_bytes=EXPERT_BYTES, params={"batch_size": batch, **params},
                   gate=gate, hiddens=hiddens, ms_per_token=ms_per_token)
    ps = out["policy_stats"]
    return {"variant": variant, "capacity": capacity, "resident_fraction": capacity / num_experts,
            **{k: out.get(k) for k in ("hit_rate", "hit_rate_warm", "misses", "new_experts_per_layer_token",
                                       "demand_loads_per_layer_token", "prefetch_issued", "prefetch_precision",
                                       "h2d_bytes_per_token")},
            **{k: ps.get(k) for k in ("lease_hit_rate", "grace_hit_rate", "peak_held_experts", "peak_long_leases",
                                      "preempted", "forced")}}


def sources(args) -> dict[str, dict]:
    import torch

    from harness.techniques.offload.synthetic import SyntheticSpec, reuse_statistics, synthetic_trace
    from harness.techniques.offload.trace import load_trace

    spec = SyntheticSpec(num_layers=12, num_experts=128, top_k=8, requests=args.requests, tokens=args.tokens,
                         seed=args.seed)
    tr = synthetic_trace(spec)
    out = {"skewed": {"trace": tr, "what": f"synthetic skewed trace ({spec})", "reuse": reuse_statistics(tr, lru_layers=4)}}
    for task, f in RECORDED.items():
        path = os.path.join(REPO, "results", "benchmarks", f)
        if os.path.exists(path):
            t = load_trace(path)
            out[f"recorded:{task}"] = {"trace": t, "what": f"embedded trained model, {task} ({os.path.relpath(path, REPO)}: "
                                       f"{t.num_requests} requests, {t.num_tokens} decode tokens)",
                                       "reuse": reuse_statistics(t, lru_layers=t.num_layers)}
    del torch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="0.1,0.2,0.32,0.5,0.75,1.0")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--thresholds", default="0.9,0.7,0.5,0.3")
    ap.add_argument("--gate-precision", type=float, default=0.83,
                    help="emulated next-layer gate precision (the random model's measured one on the H200, 2026-11)")
    ap.add_argument("--ms-per-token", type=float, default=5.0, help="simulated ms per decode step (grace in ms)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "results", "benchmarks", "offload_hit_curves"))
    args = ap.parse_args()
    from tqdm import tqdm

    from harness.results.envinfo import collect_environment
    from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace

    srcs = sources(args)
    result: dict[str, Any] = {
        "benchmark": "offload hit-rate curves (cache bookkeeping replay, no tensors)", "environment": collect_environment("cpu"),
        "engine": "harness.techniques.offload.simulate (the expert cache with no mover)", "weights": "n/a (routing traces)",
        "dtype": "n/a", "expert_bytes": EXPERT_BYTES, "gate_precision": args.gate_precision,
        "ms_per_token": args.ms_per_token, "command": "python benchmarks/offload_hit_curves.py " + " ".join(sys.argv[1:]),
        "sources": {k: {"what": v["what"], "reuse": v["reuse"]} for k, v in srcs.items()},
        "budget": [], "batch": [], "threshold": [], "grace": []}
    jobs = []
    for name, src in srcs.items():
        tr = src["trace"]
        steps = tr.steps_by_batch(1)
        gate = emulated_gate(steps, tr.num_experts, args.gate_precision, args.seed)
        for frac in [float(x) for x in args.budgets.split(",")]:
            cap = max(tr.top_k, round(frac * tr.num_experts))
            for v in POLICIES:
                jobs.append(("budget", name, v, dict(steps=steps, capacity=cap, num_experts=tr.num_experts, gate=gate,
                                                     batch=1)))
        cap32 = max(tr.top_k, round(0.32 * tr.num_experts))
        for thr in [float(x) for x in args.thresholds.split(",")]:
            jobs.append(("threshold", name, "lease", dict(steps=steps, capacity=cap32, num_experts=tr.num_experts,
                                                          gate=gate, batch=1, threshold=thr)))
        for grace in ("fixed", "dynamic"):
            jobs.append(("grace", name, "lease", dict(steps=steps, capacity=cap32, num_experts=tr.num_experts,
                                                      gate=gate, batch=1, grace=grace)))
        if name == "skewed":  # 16 requests (B = 16 needs them), half as long: the same number of row-tokens
            btr = synthetic_trace(SyntheticSpec(num_layers=12, num_experts=128, top_k=8, requests=16,
                                                tokens=args.tokens // 2, seed=args.seed))
            for b in [int(x) for x in args.batches.split(",")]:
                bsteps = btr.steps_by_batch(b)
                bgate = emulated_gate(bsteps, tr.num_experts, args.gate_precision, args.seed + b)
                for v in POLICIES:
                    jobs.append(("batch", name, v, dict(steps=bsteps, capacity=cap32, num_experts=tr.num_experts,
                                                        gate=bgate, batch=b)))
    for section, name, v, kw in tqdm(jobs, desc="replays", unit="replay"):
        r = run(variant=v, ms_per_token=args.ms_per_token, **kw)
        r.update(source=name, batch=kw["batch"], threshold=kw.get("threshold"), grace=kw.get("grace", "fixed"))
        result[section].append(r)
    with open(args.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    md = markdown(result)
    with open(args.out + ".md", "w") as fh:
        fh.write(md)
    print(md)
    plot(result, args.out + ".png")
    print("wrote", args.out + ".{json,md,png}")


def f(v: Any, p: int = 3) -> str:
    return "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(r: dict) -> str:
    md = [f"# Offload hit-rate curves (cache bookkeeping replayed on CPU; exact, no timing)", "",
          f"Command: `{r['command']}`. Emulated next-layer gate precision {r['gate_precision']}; grace in ms on a "
          f"simulated clock of {r['ms_per_token']} ms per token. Time per token needs the GPU "
          "(`benchmarks/bench_offload.py`).", "", "## Sources", "",
          "| source | what | reuse distance median / mean / p90 (tokens) | first-use share | LRU hit at 32 % |",
          "|---|---|---|---|---|"]
    for k, s in r["sources"].items():
        rd, lru = s["reuse"]["reuse_distance"], [x for x in s["reuse"]["lru"] if abs(x["residency"] - 0.32) < 1e-6]
        md.append(f"| {k} | {s['what']} | {f(rd['median'], 1)} / {f(rd['mean'], 1)} / {f(rd['p90'], 1)} | "
                  f"{f(s['reuse']['first_use_share'])} | {f(lru[0]['hit_rate']) if lru else '—'} |")
    md += ["", "## Budget → hit rate (B = 1)", ""]
    for src in r["sources"]:
        rows = [x for x in r["budget"] if x["source"] == src]
        fracs = sorted({x["resident_fraction"] for x in rows})
        md += [f"`{src}`: hit rate (prefetch precision) per budget", "",
               "| variant | " + " | ".join(f"{fr:.2f}" for fr in fracs) + " |", "|---|" + "---|" * len(fracs)]
        for v in POLICIES:
            cells = []
            for fr in fracs:
                x = next(y for y in rows if y["variant"] == v and y["resident_fraction"] == fr)
                cells.append(f(x["hit_rate"]) + (f" ({f(x['prefetch_precision'], 2)})" if x["prefetch_issued"] else ""))
            md.append(f"| {v} | " + " | ".join(cells) + " |")
        md.append("")
    md += ["## Batch → hit rate (skewed: 16 requests × half the tokens, requests decoding together, ~32 %)", "", "| variant | " + " | ".join(
        f"B = {b}" for b in sorted({x['batch'] for x in r['batch']})) + " |", "|---|" + "---|" * len({x['batch'] for x in r['batch']})]
    for v in POLICIES:
        md.append(f"| {v} | " + " | ".join(f(x["hit_rate"]) for x in sorted(
            (y for y in r["batch"] if y["variant"] == v), key=lambda y: y["batch"])) + " |")
    md += ["", "## Lease threshold → long leases, experts held, hit rate (~32 %, B = 1, recency score)", "",
           "| source | threshold | peak long leases | peak experts held | held GB (Qwen3 expert) | hit | lease hit |",
           "|---|---|---|---|---|---|---|"]
    for x in r["threshold"]:
        held = x.get("peak_held_experts")
        md.append(f"| {x['source']} | {x['threshold']} | {f(x.get('peak_long_leases'))} | {f(held)} | "
                  f"{f(held * r['expert_bytes'] / 1e9 if held is not None else None, 2)} | {f(x['hit_rate'])} | "
                  f"{f(x.get('lease_hit_rate'))} |")
    md += ["", "## Grace: fixed 200 ms vs the seed's dynamic 150 ms + 50 ms × occupancy (~32 %, B = 1)", "",
           "| source | grace | hit | lease hit | grace hit | peak experts held |", "|---|---|---|---|---|---|"]
    for x in r["grace"]:
        md.append(f"| {x['source']} | {x['grace']} | {f(x['hit_rate'])} | {f(x.get('lease_hit_rate'))} | "
                  f"{f(x.get('grace_hit_rate'))} | {f(x.get('peak_held_experts'))} |")
    return "\n".join(md) + "\n"


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    srcs = list(r["sources"])
    fig, axes = plt.subplots(1, len(srcs), figsize=(4 * len(srcs), 3.6), squeeze=False)
    for ax, src in zip(axes[0], srcs, strict=True):
        for v in POLICIES:
            rows = sorted((x for x in r["budget"] if x["source"] == src and x["variant"] == v),
                          key=lambda x: x["resident_fraction"])
            ax.plot([x["resident_fraction"] for x in rows], [x["hit_rate"] for x in rows], "o-", ms=3, label=v)
        ax.set(title=src, xlabel="experts on the GPU (share per layer)", ylabel="hit rate", ylim=(0, 1.02))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

"""Benchmark one decode MoE router: the project's Triton router against transformers' Qwen3 router forward.

    python benchmarks/bench_router.py            # H200: ~20 s
    python benchmarks/bench_router.py --smoke    # CPU: same code path, tiny shapes, interpreter (temp dir)

Shapes: Qwen3-30B-A3B's router (128 experts, hidden 2048, top-8, renormalised), bf16, T ∈ {1, 4, 16, 64, 256}
tokens. ``torch`` = ``Qwen3MoeTopKRouter.forward`` (F.linear, softmax, torch.topk, renormalise); ``torch_compiled`` =
the same forward through ``torch.compile`` (what ``hf_compile`` made of it before the kernel); ``kernel`` =
``harness.kernels.router.router_triton``. Checked first (ids equal to the reference's share, weights' relative
error), then timed with ``triton.testing.do_bench`` as CUDA-graph replays (median µs, L2 flushed per call). Floor =
router weight bytes / 4.27 TB/s. Writes ``results/benchmarks/router.json`` / ``.md``. Timer, graph capture and
writer: ``benchmarks/_common.py``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from _common import RESULTS_DIR, Timer, add_device_args, capture_graph, short_error, use_cuda, write_result

COPY_TBS = 4.27


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap)
    args = ap.parse_args()
    cuda = use_cuda(args, interpret=True)   # smoke: the interpreter, before triton is first imported
    if cuda is None:
        return 0
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from harness.results.envinfo import collect_environment
    from harness.kernels.router import router_reference, router_triton

    device = "cuda" if cuda else "cpu"
    experts, hidden, k = (128, 2048, 8) if cuda else (16, 64, 4)
    cfg = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True)
    dtype = torch.bfloat16
    router = Qwen3MoeTopKRouter(cfg).to(device, dtype)
    torch.nn.init.normal_(router.weight, std=hidden ** -0.5)
    compiled = torch.compile(router.forward, dynamic=False) if cuda else router.forward
    timer = Timer(cuda)
    out = args.out or (RESULTS_DIR if cuda else Path(tempfile.mkdtemp()))
    result = {"benchmark": "router", "environment": collect_environment(),
              "config": {"experts": experts, "hidden": hidden, "top_k": k, "dtype": "bfloat16"}, "rows": []}
    floor = experts * hidden * 2 / (COPY_TBS * 1e12) * 1e6
    for t in ((1, 4, 16, 64, 256) if cuda else (1, 3)):
        x = torch.randn(t, hidden, device=device, dtype=dtype)
        ref_logits, ref_w, ref_ids = router_reference(x.float(), router.weight.float(), k)
        row = {"T": t, "floor_us": floor}
        impls = {"torch": lambda: router(x), "torch_compiled": lambda: compiled(x),
                 "kernel": lambda: router_triton(x, router.weight, k)}
        for name, fn in impls.items():
            try:
                _, w, ids = fn()
                entry = {"ids_equal_share": float((ids.sort(-1).values == ref_ids.sort(-1).values).float().mean()),
                         "weights_rel_err": float((w.float() - ref_w).norm() / ref_w.norm())}
                entry.update(timer(capture_graph(fn).replay) if cuda else timer(fn))
            except Exception as exc:  # noqa: BLE001 — one failure must not lose the table
                entry = {"error": short_error(exc)}
            row[name] = entry
        result["rows"].append(row)
        print({n: (round(v["p50_us"], 2) if isinstance(v, dict) and "p50_us" in v else v) for n, v in row.items()},
              flush=True)
    env = result["environment"]
    lines = [f"# MoE router: one decode call ({experts} experts, hidden {hidden}, top-{k}, bf16)", "",
             f"{env.get('device_name')}, torch {env.get('torch_version')}, triton {env.get('triton_version')}. "
             "do_bench median of CUDA-graph replays (µs), L2 flushed; ×48 = all layers of a step.", "",
             "| T | floor µs | torch µs | torch.compile µs | kernel µs | kernel ×48 ms | torch.compile ×48 ms "
             "| ids equal (kernel) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        us = lambda n: f"{r[n]['p50_us']:.1f}" if "p50_us" in r[n] else r[n].get("error", "–")[:30]  # noqa: E731
        x48 = lambda n: f"{r[n]['p50_us'] * 48 / 1e3:.2f}" if "p50_us" in r[n] else "–"  # noqa: E731
        lines.append(f"| {r['T']} | {r['floor_us']:.2f} | {us('torch')} | {us('torch_compiled')} | {us('kernel')} | "
                     f"{x48('kernel')} | {x48('torch_compiled')} | {r['kernel'].get('ids_equal_share', '–')} |")
    write_result(result, out / "router.json", "\n".join(lines) + "\n", indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

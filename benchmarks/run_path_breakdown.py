"""Per-step time breakdown (MoE / attention / other) of a decode step at Qwen3-30B-A3B shapes, by ablation.

    python benchmarks/run_path_breakdown.py                 # H200: B = 1, 16, 64; graph and compiled steps
    python benchmarks/run_path_breakdown.py --smoke         # CPU: tiny shapes, same code path (no graphs)

Why ablation: kernels inside a CUDA graph cannot be timed one by one without the profiler's own overhead, so each
decode step (the engine's two CUDA paths: the manual graph of the eager step, and the compiled regions of
``harness.engines.hf.compiled`` inside the same manual graph) is captured four times — full, MoE blocks stubbed
(``mlp`` returns zeros), attention stubbed (``self_attn`` returns zeros), both stubbed — and each graph's replay is
timed with CUDA events (median of ``--steps``). MoE ≈ full − no-MoE, attention ≈ full − no-attention, other =
both stubbed (embedding, norms, residual adds, lm_head, argmax). The parts need not add up exactly to the full step
(kernels overlap and caches warm differently); the sum is printed beside it.

Model: ``harness.models.real_shapes`` (``model=qwen3_30b_a3b_shapes``: random-init, built on the GPU), fused MoE
kernel, sdpa, bf16, prompt 64 tokens in a StaticCache of 128 (``_common.Decoder``, ``bench_decode_step``'s). Writes
``results/benchmarks/run_path_breakdown.json`` after every variant; a time budget skips what is left.
Imports torch, triton, transformers and harness modules only (no Hydra); model, decoder and graph timer:
``benchmarks/_common.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import (RESULTS_DIR, Decoder, add_device_args, build_qwen3_moe, qwen3_moe_config, replay_times, use_cuda,
                     write_result)

ABLATIONS = ("full", "no_moe", "no_attn", "none")


def stub(model, what: set[str]) -> list:
    """Replace the forwards named in ``what`` (``moe``, ``attn``) by zeros; returns the undo list."""
    undo = []
    for layer in model.model.layers:
        if "moe" in what:
            mlp = layer.mlp
            undo.append((mlp, mlp.__dict__.get("forward")))
            mlp.forward = lambda hidden_states, *a, **k: torch.zeros_like(hidden_states)
        if "attn" in what:
            attn = layer.self_attn
            undo.append((attn, attn.__dict__.get("forward")))
            attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    return undo


def unstub(undo: list) -> None:
    for module, forward in reversed(undo):
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward


def timed_graph(step, steps: int, cuda: bool) -> dict:
    """Capture ``step`` in a CUDA graph (after 2 eager warm-up steps on a side stream) and time its replays
    (``_common.replay_times``; no rewind: the cache position moves on, as it always did here). CPU: the median of
    eager steps only."""
    times, _ = replay_times(step, steps, cuda)
    if not cuda:
        return {"ms": times.median, "steps": steps}
    return {"ms": times.median, "p10_ms": times.quantile(0.1), "p90_ms": times.quantile(0.9), "steps": steps}


KERNEL_SETS = ("stock", "attn", "all")


def set_kernels(model, kset: str) -> None:
    """Put ``model``'s decode kernels in the state ``kset`` names (see ``--kernels``). A router compiled as a region
    by an earlier variant stays the kernel's fallback for long passes (decode passes take the kernel)."""
    from harness.engines.hf import attention_decode as hf_attention_decode
    from harness.engines.hf import decode_forward as hf_decode_forward
    from harness.engines.hf import router as hf_router
    from harness.kernels import fused_moe_small

    if kset not in KERNEL_SETS:
        raise SystemExit(f"--kernels: {kset!r} is not one of {KERNEL_SETS}")
    hf_attention_decode.text_config(model)._attn_implementation = "sdpa"
    hf_decode_forward.uninstall(model)
    hf_router.uninstall(model)
    fused_moe_small.SMALL_PATH_MAX_PAIRS = SMALL_DEFAULT if kset == "all" else 0
    if kset in ("attn", "all"):
        hf_attention_decode.install(model)
    if kset == "all":
        hf_decode_forward.install(model)
        hf_router.install(model)


def _small_default() -> int:
    from harness.kernels import fused_moe_small

    return fused_moe_small.SMALL_PATH_MAX_PAIRS


SMALL_DEFAULT = _small_default()

FAMILIES = (("moe", ("_gate_up", "_down", "_align", "_combine_kernel", "small", "sort", "radix")),
            ("router", ("_logits_kernel", "_select_kernel", "topk")),
            ("attention", ("_attn_kernel", "_attn_combine", "flash", "fmha", "efficient", "attention", "softmax")),
            ("gemm", ("gemm", "gemv", "sm90", "sm80", "cutlass", "nvjet", "cublas", "splitk")),
            ("copy", ("copy", "index", "cat", "elementwise", "fill")),
            ("triton_fused", ("triton_",)))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_steps(dec, compiled: bool, decoding, cuda: bool, steps: int = 5) -> dict:
    """GPU time per kernel and per family in eager steps (kernel durations; the graph removes launch gaps, not
    kernel time): the difference between the kernel sum and the graph replay is idle time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        if compiled:
            with decoding():
                dec.step()
        else:
            dec.step()

    step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for ev in prof.events():
        dev_us = getattr(ev, "device_time", None) if cuda else None
        if cuda and (ev.device_type != torch.autograd.DeviceType.CUDA or not dev_us):
            continue
        if not cuda and ev.name.startswith("aten::") is False:
            continue
        k = kernels.setdefault(ev.name, [0, 0.0])
        k[0] += 1
        k[1] += dev_us if cuda else ev.cpu_time
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    fams: dict[str, float] = {}
    for name, (_, us) in top:
        fams[family(name)] = fams.get(family(name), 0.0) + us / steps
    return {"steps": steps, "kernel_us_per_step": sum(us for _, (_, us) in top) / steps,
            "kernels_per_step": sum(n for _, (n, _) in top) / steps,
            "families_us_per_step": {k: round(v, 1) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
            "top": [{"name": name[:120], "family": family(name), "calls_per_step": n / steps,
                     "us_per_step": round(us / steps, 1)} for name, (n, us) in top[:30]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--paths", default="graph,compiled")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--kernels", default="stock,all",
                    help="kernel sets (comma list): stock = transformers' SDPA + router and the sorted fused MoE; "
                         "attn = + the Triton decode attention; all = the engine's CUDA defaults (decode attention, "
                         "packed QKV forward, Triton router, small-batch MoE path)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile eager steps (torch.profiler): GPU time per kernel family per step")
    add_device_args(ap)
    args = ap.parse_args()
    cuda = use_cuda(args)
    if cuda is None:
        return 0
    from harness.engines.hf import experts as hf_experts
    from harness.engines.hf.compiled import compile_regions, decoding, dynamo_counters
    from harness.results.envinfo import collect_environment

    hf_experts.register()
    device = "cuda" if cuda else "cpu"
    config = qwen3_moe_config(smoke=not cuda)
    out = args.out or RESULTS_DIR / ("run_path_breakdown_smoke.json" if args.smoke else "run_path_breakdown.json")
    t0 = time.perf_counter()
    model, _ = build_qwen3_moe(config, device, torch.bfloat16 if cuda else torch.float32, "harness_fused_moe")
    result = {"benchmark": "run_path_breakdown", "environment": collect_environment(device),
              "config": {"shapes": "qwen3_30b_a3b" + ("" if cuda else " (tiny smoke)"), "weights": "random-init",
                         "experts_implementation": "harness_fused_moe", "dtype": "bfloat16" if cuda else "float32",
                         "prompt": 64, "max_cache_len": 128, "steps": args.steps,
                         "method": "ablation: CUDA-graph replay of the step with MoE / attention stubbed to zeros"},
              "build_s": round(time.perf_counter() - t0, 2), "rows": []}
    compiled = False
    variants = [(path, kset) for kset in args.kernels.split(",") if kset for path in args.paths.split(",") if path]
    for path, attn in variants:
        set_kernels(model, attn)
        if path == "compiled" and not compiled:
            result["compile"] = dict(compile_regions(model))
            compiled = True
        for b in [int(x) for x in args.batches.split(",") if x]:
            try:
                dec = Decoder(model, b, int(config["vocab_size"]), device, seed=b)
            except Exception as exc:  # noqa: BLE001
                result["rows"].append({"path": path, "B": b, "error": f"prefill: {type(exc).__name__}: {exc}"[:300]})
                continue
            row = {"path": path, "kernels": attn, "B": b}
            result["rows"].append(row)
            for abl in ABLATIONS:
                if time.perf_counter() - t0 > args.budget_s:
                    row[abl] = {"skipped": "time budget"}
                    continue
                undo = stub(model, {"full": set(), "no_moe": {"moe"}, "no_attn": {"attn"}, "none": {"moe", "attn"}}[abl])
                try:
                    def step():
                        if path == "compiled":
                            with decoding():
                                dec.step()
                        else:
                            dec.step()
                    with torch.inference_mode():
                        dec.rewind()
                        tc = time.perf_counter()
                        row[abl] = timed_graph(step, args.steps, cuda)
                        row[abl]["wall_incl_capture_s"] = round(time.perf_counter() - tc, 2)
                except Exception as exc:  # noqa: BLE001 - one variant must not lose the rest
                    row[abl] = {"error": f"{type(exc).__name__}: {exc}"[:300], "traceback": traceback.format_exc(limit=4)}
                finally:
                    unstub(undo)
            if args.profile and time.perf_counter() - t0 <= args.budget_s:
                try:
                    with torch.inference_mode():
                        dec.rewind()
                        row["profile"] = profile_steps(dec, path == "compiled", decoding, cuda)
                except Exception as exc:  # noqa: BLE001
                    row["profile"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            ms = {a: row[a].get("ms") for a in ABLATIONS if isinstance(row.get(a), dict)}
            if all(ms.get(a) is not None for a in ABLATIONS):
                row["moe_ms"] = ms["full"] - ms["no_moe"]
                row["attention_ms"] = ms["full"] - ms["no_attn"]
                row["other_ms"] = ms["none"]
                row["parts_sum_ms"] = row["moe_ms"] + row["attention_ms"] + row["other_ms"]
            print(f"{path:<9} {attn:<6} B={b:<3} " + " ".join(f"{a}={ms.get(a) or float('nan'):.2f}" for a in ABLATIONS)
                  + (f" | moe {row['moe_ms']:.2f} attn {row['attention_ms']:.2f} other {row['other_ms']:.2f}"
                     if "moe_ms" in row else ""), flush=True)
            del dec
            if cuda:
                torch.cuda.empty_cache()
            result["elapsed_s"] = round(time.perf_counter() - t0, 1)
            if compiled:
                result["compile"].update(dynamo_counters())
            write_result(result, out)
    write_result(result, out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ.get("HARNESS_CACHE", "/tmp")) / "inductor"))
    sys.exit(main())

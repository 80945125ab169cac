"""Benchmark: VisionZip importance (attention received per patch) on Qwen3-VL vision shapes.

    python benchmarks/bench_importance.py [--out results/benchmarks/importance.json] [--sections main lse]
    python benchmarks/bench_importance.py --smoke --lse-out /tmp/importance_lse.json   # CPU, tiny, interpreter

On CUDA: one vision layer of Qwen3-VL (16 heads, head_dim 72, bf16) for packed batches of 1, 8 and 30
images of 448×448 px (28×28 = 784 patches each). Correctness is checked on the GPU first (bf16 and fp32
against the torch reference); then, timed with ``triton.testing.do_bench`` (median and p10/p90 over
repetitions, L2 flushed between repetitions by do_bench), side by side in one process on the same inputs:

* ``triton``            both passes of :mod:`harness.kernels.importance` (default tiles), timed twice to
                        show the run-to-run noise, plus a small sweep of tile configurations;
* ``triton_pass2``      pass 2 alone, given the row log-sum-exp (what it costs when the layer's own flash
                        attention hands over its lse);
* ``torch_reference``   :func:`harness.techniques.visionzip.pruning.attention_received`, which materialises each
                        image's [heads, n, n] attention in fp32;
* ``sdpa``              one forward of the layer's attention (``scaled_dot_product_attention``, images
                        batched as [images, heads, n, d] — the same work as the varlen call), so the extra
                        cost of scoring relative to the layer's attention is visible; ``sdpa_with_lse``
                        (flash attention returning its lse) when that op is available.

Reported per variant: time, achieved TFLOP/s and fraction of the measured dense bf16 peak (790 TFLOP/s),
achieved bandwidth over the minimal bytes and fraction of the measured copy bandwidth (4.3 TB/s), and peak
memory allocated above the inputs. The importance FLOPs count two QKᵀ per image with the true head_dim 72
(the kernel pads to 128, so its tensor cores do 128/72 of that). Inputs are random (randn q, k, v): the
timing does not depend on the values; nothing here is a trained model's attention.

**LSE reuse** (``--sections lse``, file ``--lse-out``, default ``results/benchmarks/importance_lse.json``):
importance time with the scoring attention's own log-sum-exp handed over (kernel pass 2 only) against the
kernel computing it itself (both passes), for 1, 8 and 30 images; and the whole scoring block as each engine
runs it — vLLM: one varlen flash call (``aten._flash_attention_forward``, ``harness.kernels.attention_lse``)
then the importance; HF: one flash call per image (its vision attention's per-segment path, the registered
attention function) then the importance. Correctness of the reused-LSE result against the float64 reference
is checked before any timing.

On CPU there is nothing worth timing: the script runs a tiny correctness pass through Triton's interpreter
(it sets ``TRITON_INTERPRET=1`` itself when triton was not imported yet), prints it, and writes no file.
Imports only torch, triton and ``harness`` (envinfo, the kernel, its reference); ``do_bench``, the relative
error and the writer are ``benchmarks/_common.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

import _common
from _common import RESULTS_DIR, do_bench_ms, write_result
from harness.results.envinfo import collect_environment

HEADS, HEAD_DIM = 16, 72  # Qwen3-VL vision tower
IMAGE_PX, PATCH = 448, 16
PATCHES = (IMAGE_PX // PATCH) ** 2  # 784
IMAGE_COUNTS = (1, 8, 30)
PEAK_BF16_FLOPS = 790e12  # measured on these H200s (measuring.md)
COPY_BYTES_PER_S = 4.3e12  # measured device copy (measuring.md)
BF16_TOL, FP32_TOL = 1e-2, 1e-5


def make_inputs(n_images: int, dtype: torch.dtype, device: str, seed: int = 0, patches: int = PATCHES,
                heads: int = HEADS, head_dim: int = HEAD_DIM):
    g = torch.Generator(device=device).manual_seed(seed)
    n = n_images * patches
    q, k, v = (torch.randn(n, heads, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
               for _ in range(3))
    cu = torch.arange(0, n + 1, patches, dtype=torch.int32, device=device)
    return q, k, v, cu


#: ``_common.rel_err`` with a NaN output recorded as infinity (what this script's results have always said)
rel_err = functools.partial(_common.rel_err, nan=float("inf"))


def check(q, k, cu, config=None) -> float:
    """Kernel vs the float64 reference on the same inputs; raises when out of tolerance."""
    from harness.kernels.importance import attention_importance
    from harness.techniques.visionzip.pruning import attention_received

    err = rel_err(attention_importance(q, k, cu, config=config), attention_received(q.double(), k.double(), cu))
    tol = FP32_TOL if q.dtype == torch.float32 else BF16_TOL
    if not err < tol:
        raise AssertionError(f"importance kernel wrong: rel err {err:.3g} >= {tol} ({q.dtype}, {config})")
    return err


def measure(fn, n_flops: float, n_bytes: float) -> dict:
    """``do_bench`` quantiles (ms, rep 200 ms) with achieved FLOP/s and bandwidth against the measured peaks, and
    the peak memory one call allocates above its inputs (what ``_common.Timer`` does not report)."""
    fn()  # compile / warm the allocator outside the timed region
    torch.cuda.synchronize()
    p50, p10, p90 = do_bench_ms(fn, warmup_ms=25, rep_ms=200)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    sec = p50 / 1e3
    return {
        "p50_ms": p50, "p10_ms": p10, "p90_ms": p90,
        "tflops": n_flops / sec / 1e12, "flop_fraction": n_flops / sec / PEAK_BF16_FLOPS,
        "gbps": n_bytes / sec / 1e9, "bw_fraction": n_bytes / sec / COPY_BYTES_PER_S,
        "peak_extra_mib": peak / 2**20,
    }


def sweep_configs():
    from harness.kernels.importance import GPU_CONFIG, ImportanceConfig

    return {
        "default": GPU_CONFIG,
        "m128n64_w8": ImportanceConfig(128, 64, 64, 128, num_warps=8, num_stages=2),
        "m64n32_w4s3": ImportanceConfig(64, 32, 32, 64, num_warps=4, num_stages=3),
        "m128n128_w8s1": ImportanceConfig(128, 128, 128, 128, num_warps=8, num_stages=1),
    }


def bench_images(n_images: int) -> dict:
    import torch.nn.functional as F

    from harness.kernels.importance import (
        attention_importance, attention_lse, importance_flops, importance_min_bytes,
    )
    from harness.techniques.visionzip.pruning import attention_received

    q, k, v, cu = make_inputs(n_images, torch.bfloat16, "cuda", seed=n_images)
    n = q.shape[0]
    seqlens = [PATCHES] * n_images
    scale = HEAD_DIM ** -0.5
    q32, k32, _, _ = make_inputs(n_images, torch.float32, "cuda", seed=100 + n_images)
    correctness = {"bf16_rel_err": check(q, k, cu), "fp32_rel_err": check(q32, k32, cu)}
    del q32, k32

    imp_flops = importance_flops(seqlens, HEADS, HEAD_DIM)
    imp_bytes = importance_min_bytes(n, HEADS, HEAD_DIM, q.element_size())
    attn_flops = 4 * sum(s * s for s in seqlens) * HEADS * HEAD_DIM  # QKᵀ + PV
    attn_bytes = 4 * n * HEADS * HEAD_DIM * q.element_size()  # q, k, v in, o out
    lse = attention_lse(q, k, cu, scale=scale, max_seqlen=PATCHES)

    timings: dict[str, dict] = {}
    run = lambda: attention_importance(q, k, cu, scale=scale, max_seqlen=PATCHES)  # noqa: E731
    timings["triton"] = measure(run, imp_flops, imp_bytes)
    timings["triton_repeat"] = measure(run, imp_flops, imp_bytes)
    timings["triton_pass2"] = measure(
        lambda: attention_importance(q, k, cu, scale=scale, lse=lse, max_seqlen=PATCHES), imp_flops / 2, imp_bytes
    )
    sweep = {}
    for name, cfg in sweep_configs().items():
        try:
            check(q, k, cu, config=cfg)
            sweep[name] = {"config": cfg.__dict__, **measure(
                lambda cfg=cfg: attention_importance(q, k, cu, scale=scale, max_seqlen=PATCHES, config=cfg),
                imp_flops, imp_bytes)}
        except Exception as exc:  # a tile shape that does not fit (shared memory, registers): record it
            error = f"{type(exc).__name__}: {exc}"[:300]
            sweep[name] = {"config": cfg.__dict__, "p50_ms": float("inf"), "error": error}
    try:
        timings["torch_reference"] = measure(lambda: attention_received(q, k, cu, scale), imp_flops, imp_bytes)
    except torch.cuda.OutOfMemoryError:
        timings["torch_reference"] = {"p50_ms": float("inf"), "error": "OOM"}

    qb, kb, vb = (t.view(n_images, PATCHES, HEADS, HEAD_DIM).transpose(1, 2).contiguous() for t in (q, k, v))
    timings["sdpa"] = measure(lambda: F.scaled_dot_product_attention(qb, kb, vb, scale=scale), attn_flops, attn_bytes)
    try:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        _, flash_lse, *_ = flash(qb, kb, vb, 0.0, False, False, scale=scale)
        lse_hn = flash_lse.permute(1, 0, 2).reshape(HEADS, n)  # [images, heads, n] → [heads, N]
        correctness["pass2_with_flash_lse_rel_err"] = rel_err(
            attention_importance(q, k, cu, scale=scale, lse=lse_hn), attention_received(q.double(), k.double(), cu))
        timings["sdpa_with_lse"] = measure(lambda: flash(qb, kb, vb, 0.0, False, False, scale=scale),
                                           attn_flops, attn_bytes)
    except (RuntimeError, AttributeError) as exc:
        correctness["flash_lse_unavailable"] = f"{type(exc).__name__}: {exc}"[:200]

    sdpa_ms = timings["sdpa"]["p50_ms"]
    return {
        "n_images": n_images, "tokens": n, "seqlens": f"{n_images} x {PATCHES}",
        "correctness": correctness, "timings": timings, "config_sweep": sweep,
        "flops": {"importance": imp_flops, "attention_forward": attn_flops},
        "min_bytes": {"importance": imp_bytes, "attention_forward": attn_bytes},
        "ratio_to_sdpa": {name: t["p50_ms"] / sdpa_ms for name, t in timings.items()},
        "speedup_over_reference": timings["torch_reference"]["p50_ms"] / timings["triton"]["p50_ms"],
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'images':>6} {'variant':<16} {'p50 ms':>9} {'p10-p90 ms':>17} {'TFLOP/s':>8} {'%peak':>6} " \
           f"{'GB/s':>8} {'%copy':>6} {'+MiB':>8} {'x sdpa':>7}"
    print(head)
    print("-" * len(head))
    for row in rows:
        for name, t in row["timings"].items():
            if "tflops" not in t:
                print(f"{row['n_images']:>6} {name:<16} {'failed':>9}  {t.get('error', '')}")
                continue
            print(f"{row['n_images']:>6} {name:<16} {t['p50_ms']:>9.4f} {t['p10_ms']:>8.4f}-{t['p90_ms']:<8.4f} "
                  f"{t['tflops']:>8.1f} {100 * t['flop_fraction']:>5.1f}% {t['gbps']:>8.1f} "
                  f"{100 * t['bw_fraction']:>5.1f}% {t['peak_extra_mib']:>8.2f} {row['ratio_to_sdpa'][name]:>7.2f}")
        best = min(row["config_sweep"].items(), key=lambda kv: kv[1]["p50_ms"])
        sweep = ", ".join(f"{k} {v['p50_ms']:.4f}" for k, v in row["config_sweep"].items())
        print(f"{'':>6} tile sweep (p50 ms): {sweep}; best {best[0]}")
        print(f"{'':>6} correctness: {row['correctness']}")


def cpu_sanity() -> None:
    """Tiny interpreter pass: the kernel agrees with the reference (no timing, no file)."""
    from harness.kernels.importance import attention_importance
    from harness.techniques.visionzip.pruning import attention_received

    cu = torch.tensor([0, 16, 52, 116], dtype=torch.int32)  # grids 4×4, 6×6, 8×8
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(116, 2, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
        err = rel_err(attention_importance(q, k, cu), attention_received(q.double(), k.double(), cu))
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        print(f"interpreter sanity {dtype}: rel err {err:.2e} ({'ok' if err < tol else 'FAIL'})")


# ----------------------------------------------------------------------------------------- LSE reuse


def _smoke_timer(fn, n_flops: float, n_bytes: float) -> dict:
    """CPU smoke stand-in for :func:`measure`: one call, wall time (no meaning beyond "it runs")."""
    import time

    fn()
    t0 = time.perf_counter()
    fn()
    return {"p50_ms": (time.perf_counter() - t0) * 1e3, "smoke": True}


def bench_lse_reuse(n_images: int, device: str, dtype: torch.dtype, timer, patches: int = PATCHES,
                    heads: int = HEADS, head_dim: int = HEAD_DIM) -> dict:
    """Importance with / without the attention's LSE, alone and with the scoring block's attention."""
    import torch.nn.functional as F

    from harness.kernels.attention_lse import sdpa_with_lse, varlen_attention_with_lse
    from harness.kernels.importance import attention_importance, attention_lse, importance_flops
    from harness.techniques.visionzip.pruning import attention_received

    q, k, v, cu = make_inputs(n_images, dtype, device, seed=7 + n_images, patches=patches, heads=heads,
                              head_dim=head_dim)
    n, scale = q.shape[0], head_dim ** -0.5
    bounds = cu.tolist()
    seqlens = [patches] * n_images
    imp_flops = importance_flops(seqlens, heads, head_dim)
    attn_flops = 4 * sum(x * x for x in seqlens) * heads * head_dim
    qkv_bytes = 3 * n * heads * head_dim * q.element_size()

    _, lse = varlen_attention_with_lse(q, k, v, cu, scale=scale, max_seqlen=patches)
    if lse is None:
        return {"n_images": n_images, "error": f"no LSE-returning attention op for {dtype} on {device}"}
    ref = attention_received(q.double(), k.double(), cu)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    correctness = {
        "reused_lse_rel_err": rel_err(attention_importance(q, k, cu, scale=scale, lse=lse, max_seqlen=patches), ref),
        "own_lse_rel_err": rel_err(attention_importance(q, k, cu, scale=scale, max_seqlen=patches), ref),
        "lse_attention_vs_kernel_max_abs": (lse - attention_lse(q, k, cu, scale=scale, max_seqlen=patches))
        .abs().max().item(),
    }
    if not correctness["reused_lse_rel_err"] < tol:
        raise AssertionError(f"importance with the attention's LSE wrong: {correctness}")

    def hf_attention(with_lse: bool):
        outs, lses = [], []
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if with_lse:
                o, l = sdpa_with_lse(qs, ks, vs, scale)
                lses.append(l[0])
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            outs.append(o)
        return outs, (torch.cat(lses, dim=1) if with_lse else None)

    def vllm_stock():
        varlen_attention_with_lse(q, k, v, cu, scale=scale, max_seqlen=patches)  # the LSE is dropped
        return attention_importance(q, k, cu, scale=scale, max_seqlen=patches)

    def vllm_reuse():
        _, l = varlen_attention_with_lse(q, k, v, cu, scale=scale, max_seqlen=patches)
        return attention_importance(q, k, cu, scale=scale, lse=l, max_seqlen=patches)

    def hf_stock():
        hf_attention(False)
        return attention_importance(q, k, cu, scale=scale, max_seqlen=patches)

    def hf_reuse():
        _, l = hf_attention(True)
        return attention_importance(q, k, cu, scale=scale, lse=l, max_seqlen=patches)

    variants = {
        "importance_own_lse": (lambda: attention_importance(q, k, cu, scale=scale, max_seqlen=patches), imp_flops),
        "importance_reused_lse": (lambda: attention_importance(q, k, cu, scale=scale, lse=lse, max_seqlen=patches),
                                  imp_flops / 2),
        "vllm_block_stock": (vllm_stock, attn_flops + imp_flops),
        "vllm_block_reuse": (vllm_reuse, attn_flops + imp_flops / 2),
        "hf_block_stock": (hf_stock, attn_flops + imp_flops),
        "hf_block_reuse": (hf_reuse, attn_flops + imp_flops / 2),
    }
    timings: dict[str, dict] = {}
    for name, (fn, flops) in variants.items():
        try:
            timings[name] = timer(fn, flops, qkv_bytes)
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
            timings[name] = {"p50_ms": float("inf"), "error": f"{type(exc).__name__}: {exc}"[:300]}
    ms = {k: t["p50_ms"] for k, t in timings.items()}
    saved = {
        "importance_saved_ms": ms["importance_own_lse"] - ms["importance_reused_lse"],
        "importance_speedup": ms["importance_own_lse"] / ms["importance_reused_lse"],
        "vllm_block_saved_ms": ms["vllm_block_stock"] - ms["vllm_block_reuse"],
        "hf_block_saved_ms": ms["hf_block_stock"] - ms["hf_block_reuse"],
    }
    return {"n_images": n_images, "tokens": n, "seqlens": f"{n_images} x {patches}", "dtype": str(dtype),
            "correctness": correctness, "timings": timings, "saved": saved}


def print_lse_table(rows: list[dict]) -> None:
    head = f"{'images':>6} {'variant':<22} {'p50 ms':>9} {'p10-p90 ms':>17}"
    print(head)
    print("-" * len(head))
    for row in rows:
        if "error" in row:
            print(f"{row['n_images']:>6} failed: {row['error']}")
            continue
        for name, t in row["timings"].items():
            spread = f"{t['p10_ms']:>8.4f}-{t['p90_ms']:<8.4f}" if "p10_ms" in t else f"{'':>17}"
            print(f"{row['n_images']:>6} {name:<22} {t['p50_ms']:>9.4f} {spread} {t.get('error', '')}")
        sv = row["saved"]
        print(f"{'':>6} reuse saves {sv['importance_saved_ms']:.4f} ms of importance (x{sv['importance_speedup']:.2f}); "
              f"block: vLLM {sv['vllm_block_saved_ms']:.4f} ms, HF {sv['hf_block_saved_ms']:.4f} ms")
        print(f"{'':>6} correctness: {row['correctness']}")


def run_lse_section(images: list[int], device: str, smoke: bool, out: Path) -> None:
    if smoke:
        rows = [bench_lse_reuse(n, device, torch.float32, _smoke_timer, patches=16, heads=2) for n in images]
    else:
        rows = []
        for n in images:
            try:
                rows.append(bench_lse_reuse(n, device, torch.bfloat16, measure))
            except Exception as exc:  # noqa: BLE001 - keep the other image counts
                rows.append({"n_images": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
    print_lse_table(rows)
    result = {
        "benchmark": "vision_importance_lse_reuse",
        "smoke": smoke,
        "environment": collect_environment(device),
        "dtype": "float32 (smoke)" if smoke else "bfloat16",
        "shapes": {"heads": 2 if smoke else HEADS, "head_dim": HEAD_DIM, "patches_per_image": 16 if smoke else PATCHES,
                   "image_px": None if smoke else IMAGE_PX, "image_counts": images,
                   "model": "Qwen3-VL-30B-A3B vision tower (16 heads x 72, patch 16)"},
        "inputs": "random (torch.randn q, k, v); timings do not depend on values",
        "variants": {
            "importance_own_lse": "Triton kernel, both passes (computes the LSE itself: the fallback)",
            "importance_reused_lse": "Triton kernel pass 2 with the attention's LSE",
            "vllm_block_stock / _reuse": "varlen flash attention (one call) + importance without / with reuse",
            "hf_block_stock / _reuse": "per-image SDPA / flash-with-LSE calls + importance without / with reuse",
        },
        "timing": "smoke: one wall-clock call (not a measurement)" if smoke else
                  "triton.testing.do_bench median (p10/p90), warmup 25 ms, rep 200 ms",
        "results": rows,
    }
    write_result(result, out)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "importance.json")
    parser.add_argument("--lse-out", type=Path, default=RESULTS_DIR / "importance_lse.json")
    parser.add_argument("--images", type=int, nargs="+", default=list(IMAGE_COUNTS))
    parser.add_argument("--sections", nargs="+", choices=("main", "lse"), default=["main", "lse"])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: tiny shapes through Triton's interpreter, the LSE section end to end (no timing)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("No CUDA device: CPU timings of a Triton kernel say nothing, so none are taken.")
        if "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("Set TRITON_INTERPRET=1 for a tiny interpreter correctness pass.")
            return 0
        cpu_sanity()
        if args.smoke:
            run_lse_section([1, 3], "cpu", True, args.lse_out)
        return 0

    status = 0
    if "main" in args.sections:
        try:
            rows = [bench_images(n) for n in args.images]
            print(f"{torch.cuda.get_device_name()} — Qwen3-VL vision layer: {HEADS} heads, head_dim {HEAD_DIM}, "
                  f"{PATCHES} patches/image ({IMAGE_PX}x{IMAGE_PX} px), bf16, random inputs")
            print_table(rows)
            result = {
                "benchmark": "vision_importance",
                "environment": collect_environment("cuda"),
                "dtype": "bfloat16",
                "shapes": {"heads": HEADS, "head_dim": HEAD_DIM, "patches_per_image": PATCHES, "image_px": IMAGE_PX,
                           "patch_size": PATCH, "image_counts": args.images},
                "inputs": "random (torch.randn q, k, v); timings do not depend on values",
                "roofline": {"peak_bf16_flops": PEAK_BF16_FLOPS, "copy_bytes_per_s": COPY_BYTES_PER_S,
                             "importance_flops": "2 QK^T per image with head_dim 72 (kernel pads to 128)",
                             "importance_min_bytes": "q and k read once, [N] float32 written once"},
                "timing": "triton.testing.do_bench median (p10/p90), warmup 25 ms, rep 200 ms, L2 flushed per rep",
                "results": rows,
            }
            write_result(result, args.out)
            print(f"wrote {args.out}")
        except Exception as exc:  # noqa: BLE001 - the LSE section still runs
            print(f"main section failed: {type(exc).__name__}: {exc}")
            status = 1
    if "lse" in args.sections:
        print(f"\nLSE reuse — {torch.cuda.get_device_name()}, bf16, {PATCHES} patches/image ({IMAGE_PX} px)")
        run_lse_section(args.images, "cuda", False, args.lse_out)
    return status


if __name__ == "__main__":
    sys.exit(main())

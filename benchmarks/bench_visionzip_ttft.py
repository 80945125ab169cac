"""TTFT of a Qwen3-VL-30B-A3B-shaped model on a multi-image request, VisionZip keep 1.0 / 0.7 / 0.6 / 0.5 (GPU).

    python benchmarks/bench_visionzip_ttft.py [--images 30 --size 448 --keeps 1.0,0.7,0.6,0.5 --repeats 5]

The request is what the seed's workload looks like: ``--images`` images of ``--size`` px (half text-dense,
half plain scenes, drawn by ``harness.datasets.synthetic.rag_igbench``) inside the RAG-IGBench prompt. TTFT here is the
GPU part of time-to-first-token — inputs already on the device, then (VisionZip on) vision tower + importance
+ selection + pruned prefill, or (off) the stock prefill, until the first token exists — measured with a
device synchronisation on each side; the CPU pre-processing (identical for every keep) is reported apart.
Each keep is measured ``--repeats`` times after warm-up, interleaved across keeps (keep order rotated per
round) so drift hits all alike; median and p10/p90 are reported, with the importance time and the vision
tower's time measured separately.

Weights are random (``weights: random-init``): times depend on shapes, not values, but the selection of a
random vision tower is not a trained one's. Writes ``results/benchmarks/visionzip_ttft.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from _common import RESULTS_DIR, write_result


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return {"median": statistics.median(xs), "p10": pick(0.1), "p90": pick(0.9), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--keeps", default="1.0,0.7,0.6,0.5")
    ap.add_argument("--scope", default="request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="text layers (default: 48, the real model)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "visionzip_ttft"), help="output stem (.json and .md)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_visionzip_ttft needs a CUDA GPU (a 31B-shaped model)")

    from harness.datasets.rag_igbench import render_prompt
    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image
    from harness.engines.hf.visionzip import prepare_visionzip_inputs, visionzip_generation
    from harness.results.envinfo import collect_environment
    from harness.models.real_shapes import random_qwen3_vl_moe
    from harness.models.tiny import TinyModelSpec, build_processor, build_tokenizer

    side = args.size
    spec = TinyModelSpec(min_pixels=side * side, max_pixels=side * side)
    tokenizer = build_tokenizer(spec)
    processor = build_processor(spec, tokenizer)
    tid = lambda t: tokenizer.convert_tokens_to_ids(t)  # noqa: E731
    ids = {"image": tid("<|image_pad|>"), "video": tid("<|video_pad|>"), "vision_start": tid("<|vision_start|>"),
           "vision_end": tid("<|vision_end|>"), "eos": tid("<|im_end|>"), "pad": tid("<|endoftext|>")}

    t0 = time.perf_counter()
    model = random_qwen3_vl_moe(ids, num_layers=args.layers)
    build_s = time.perf_counter() - t0

    rng = random.Random(0)
    images = [(text_dense_image if i % 2 == 0 else plain_scene_image)(rng, side, side) for i in range(args.images)]
    per_note = [list(range(i, min(i + 10, args.images))) for i in range(0, args.images, 10)]
    docs = ["这是一篇笔记，介绍了相关的内容和细节。" * 20 for _ in per_note]
    content = render_prompt("这些图片里有什么信息？", docs, [[str(j) for j in n] for n in per_note])
    parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"} for p in content]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    t0 = time.perf_counter()
    cpu_inputs = processor(text=[text], images=images, return_tensors="pt", padding=True)
    preprocess_ms = (time.perf_counter() - t0) * 1e3
    inputs = {k: v.cuda() for k, v in cpu_inputs.items()}
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    n_visual = int((inputs["input_ids"] == ids["image"]).sum())
    n_prompt = int(inputs["input_ids"].shape[1])

    def vision_only() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def ttft(keep: float) -> tuple[float, float, int]:
        cfg = SimpleNamespace(keep=keep, contextual=0.0, scope=args.scope, layer=-1, min_per_image=1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            run_inputs, ctx = prepare_visionzip_inputs(model, inputs, cfg, pad_token_id=ids["pad"]) \
                if keep < 1.0 else (dict(inputs), None)
            with visionzip_generation(model, ctx):
                model.generate(**run_inputs, max_new_tokens=1, do_sample=False, pad_token_id=ids["pad"])
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        kept = ctx.requests[0].visual_tokens_after if ctx else n_visual
        return ms, (ctx.importance_ms if ctx else 0.0), kept

    keeps = [float(k) for k in args.keeps.split(",")]
    for keep in keeps:  # warm-up: allocator, kernels, Triton compilation
        ttft(keep)
        ttft(keep)
    vision = [vision_only() for _ in range(args.repeats)]
    samples: dict[float, list[tuple[float, float, int]]] = {k: [] for k in keeps}
    for r in range(args.repeats):
        order = keeps[r % len(keeps):] + keeps[: r % len(keeps)]
        for keep in order:
            samples[keep].append(ttft(keep))

    base = statistics.median(s[0] for s in samples[keeps[0]])
    rows = []
    for keep in keeps:
        t = quantiles([s[0] for s in samples[keep]])
        rows.append({"keep": keep, "visual_tokens_kept": samples[keep][0][2], "ttft_ms": t,
                     "importance_ms": statistics.median(s[1] for s in samples[keep]),
                     "ttft_ratio_vs_first": t["median"] / base})
    result = {
        "benchmark": "visionzip_ttft", "environment": collect_environment("cuda"), "weights": "random-init",
        "model": "Qwen3-VL-30B-A3B shapes (Qwen3VLMoeForConditionalGeneration)", "dtype": "bfloat16",
        "images": args.images, "image_px": side, "scope": args.scope, "prompt_tokens": n_prompt,
        "visual_tokens": n_visual, "text_tokens": n_prompt - n_visual, "preprocess_cpu_ms": preprocess_ms,
        "vision_tower_ms": quantiles(vision), "build_s": build_s, "repeats": args.repeats, "rows": rows,
    }
    out = Path(args.out + ".json")
    write_result(result, out)             # the numbers first: a table that fails to format keeps them
    lines = ["| keep | visual tokens kept | TTFT median ms | p10 | p90 | importance ms | TTFT / keep 1.0 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["ttft_ms"]
        lines.append(f"| {r['keep']} | {r['visual_tokens_kept']} | {t['median']:.1f} | {t['p10']:.1f} | "
                     f"{t['p90']:.1f} | {r['importance_ms']:.2f} | {r['ttft_ratio_vs_first']:.3f} |")
    header = (f"TTFT (GPU part) of one request with {args.images} images of {side}×{side} px "
              f"({n_visual} visual + {n_prompt - n_visual} text tokens), random-init Qwen3-VL-30B-A3B shapes, "
              f"bf16, {result['environment']['device_name']}, scope={args.scope}. Vision tower alone: "
              f"{result['vision_tower_ms']['median']:.1f} ms; CPU pre-processing {preprocess_ms:.0f} ms (not in "
              "TTFT above).\n\n")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()

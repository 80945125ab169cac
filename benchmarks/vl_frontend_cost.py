"""Where a 30-image request's time goes before vLLM's GPU sees it: the server front end's CPU work, timed alone.

``python benchmarks/vl_frontend_cost.py [--images 30] [--px 448] [--repeats 5] [--variants noise:png,photo:png,photo:jpeg] [--out results/benchmarks/vl_frontend_cost]``

Why (issue 23, H200 session 17): ``bench_vllm_serve --part vl`` measured keep 1.0 / 0.7 / 0.6 / 0.5 at TTFT p50
≈ 1.0 s each, no keep faster (intervals overlap), where the HF engine at the same shapes gives 434 → 356 ms. VisionZip
removes tokens *after* the vision encoder, so it can only shorten the language model's prefill; whatever the server
spends before that is a floor no keep can lower. This script times, per request, the stages the OpenAI server runs
on its CPU before scheduling — parsing the JSON body, base64 + image decode (the data URLs the harness client
sends: :func:`harness.engines.vllm.client.image_url`) and the Qwen3-VL image processor (resize, normalise,
patchify) — so the floor is measured, not guessed.

**Variants** ``CONTENT:FORMAT``: the serving benchmark's images (``noise``: uniform random pixels, incompressible,
its default; ``photo``: photo-like shading, :func:`bench_vllm_serve.synthetic_image`) sent as ``png`` (lossless,
the client's default) or ``jpeg`` (``load.image_format=jpeg``, quality ``--jpeg-quality``). Each repeat times
every variant once, in a rotated order, after one untimed warm-up round; per stage the median, the min–max spread
and the mean's 95 % bootstrap interval over repeats. It needs torch, transformers, PIL, numpy and scipy only (no
vLLM, no GPU).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--px", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="noise:png", help="CONTENT:FORMAT[,...]: noise|photo : png|jpeg")
    ap.add_argument("--jpeg-quality", type=int, default=90)
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmarks" / "vl_frontend_cost"))
    args = ap.parse_args()

    import torch
    import transformers
    from PIL import Image

    from benchmarks.bench_vllm_serve import vl_requests
    from harness.engines.vllm.client import image_url  # the data URL the harness client sends
    from harness.engines.vllm.served_shapes import QWEN3_VL_IMAGE_SIZE
    from harness.latency.stats import bootstrap_ci

    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    proc_cfg = json.loads((ROOT / "harness/models/checkpoints/tiny-trained-synthetic/processor_config.json").read_text())["image_processor"]
    proc_cfg["size"] = dict(QWEN3_VL_IMAGE_SIZE)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(**{k: v for k, v in proc_cfg.items() if k in (
        "size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")})
    bodies: dict[str, list[str]] = {}  # variant -> one JSON body per round (round 0: warm-up)
    payload: dict[str, float] = {}
    for content, fmt in variants:
        reqs = vl_requests(args.repeats + 1, args.images, args.px, content=content)
        urls = [[image_url(im, fmt, args.jpeg_quality) for im in r.images] for r in reqs]
        payload[f"{content}:{fmt}"] = sum(len(u) for u in urls[0]) / 2**20
        bodies[f"{content}:{fmt}"] = [json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": u}} for u in r_urls]}]}) for r_urls in urls]
    stages = ("json_ms", "decode_ms", "processor_ms", "total_ms")
    rows = {name: {k: [] for k in stages} for name in bodies}
    names = list(bodies)
    tokens = 0
    for rnd in range(args.repeats + 1):  # round 0 is the warm-up; the order rotates every round
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            body = bodies[name][rnd]
            tj = time.perf_counter()
            r_urls = [c["image_url"]["url"] for c in json.loads(body)["messages"][0]["content"]]
            t0 = time.perf_counter()
            imgs = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in r_urls]
            t1 = time.perf_counter()
            out = processor(images=imgs, return_tensors="pt")
            t2 = time.perf_counter()
            tokens = int(out["image_grid_thw"].prod(-1).sum()) // 4
            if rnd:
                for k, v in zip(stages, (t0 - tj, t1 - t0, t2 - t1, t2 - tj)):
                    rows[name][k].append(v * 1e3)

    def summary(v: list[float]) -> dict:
        ci = bootstrap_ci(v)
        return {"median": round(statistics.median(v), 1), "spread": [round(min(v), 1), round(max(v), 1)],
                "mean": round(statistics.fmean(v), 1), "ci": [round(x, 1) for x in ci] if ci else None}

    result = {
        "images": args.images, "px": args.px, "repeats": args.repeats, "visual_tokens": tokens,
        "jpeg_quality": args.jpeg_quality, "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "transformers": transformers.__version__, "torch": torch.__version__, "order": "rotated per round",
        "variants": {name: {"payload_MiB_per_request": round(payload[name], 2),
                            **{k: summary(v) for k, v in rows[name].items()}} for name in names},
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"| variant | MiB per request | JSON ms | decode ms | processor ms | total ms (mean [95 % CI]) |",
             "|---|---|---|---|---|---|"]
    for name, r in result["variants"].items():
        t = r["total_ms"]
        lines.append(f"| {name} | {r['payload_MiB_per_request']} | {r['json_ms']['median']} | {r['decode_ms']['median']} | "
                     f"{r['processor_ms']['median']} | {t['mean']} {t['ci']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

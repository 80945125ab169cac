"""Where a 30-image request's time goes before vLLM's GPU sees it: the server front end's CPU work, timed alone.

``python benchmarks/vl_frontend_cost.py [--images 30] [--px 448] [--repeats 5] [--out results/benchmarks/vl_frontend_cost]``

Why (issue 23, H200 session 17): ``bench_vllm_serve --part vl`` measured keep 1.0 / 0.7 / 0.6 / 0.5 at TTFT p50
≈ 1.0 s each, no keep faster (intervals overlap), where the HF engine at the same shapes gives 434 → 356 ms. VisionZip
removes tokens *after* the vision encoder, so it can only shorten the language model's prefill; whatever the server
spends before that is a floor no keep can lower. This script times, per request, the stages the OpenAI server runs
on its CPU before scheduling — parsing the JSON body, base64 + PNG decode of each image (the harness client sends PNG data URLs, as
``vllm bench serve`` does) and the Qwen3-VL image processor (resize, normalise, patchify) — so the floor is measured,
not guessed. It needs torch, transformers, PIL and numpy only (no vLLM, no GPU).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
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
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmarks" / "vl_frontend_cost"))
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor

    from benchmarks.bench_vllm_serve import QWEN3_VL_IMAGE_SIZE, vl_requests
    from harness.engines.vllm.client import image_url  # the data URL the harness client sends

    reqs = vl_requests(args.repeats + 1, args.images, args.px)
    urls = [[image_url(im) for im in r.images] for r in reqs]
    proc_cfg = json.loads((ROOT / "harness/models/checkpoints/tiny-trained-synthetic/processor_config.json").read_text())["image_processor"]
    proc_cfg["size"] = dict(QWEN3_VL_IMAGE_SIZE)
    proc_cfg.pop("image_processor_type", None)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(**{k: v for k, v in proc_cfg.items() if k in (
        "size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")})
    rows: dict[str, list[float]] = {"json_ms": [], "decode_ms": [], "processor_ms": [], "total_ms": []}
    payload_mb = sum(len(u) for u in urls[0]) / 2**20
    for i, r_urls in enumerate(urls):  # request 0 is warm-up
        body = json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": u}} for u in r_urls]}]})
        tj = time.perf_counter()
        r_urls = [c["image_url"]["url"] for c in json.loads(body)["messages"][0]["content"]]
        t0 = time.perf_counter()
        imgs = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in r_urls]
        t1 = time.perf_counter()
        out = processor(images=imgs, return_tensors="pt")
        t2 = time.perf_counter()
        if i:
            rows["json_ms"].append((t0 - tj) * 1e3)
            rows["decode_ms"].append((t1 - t0) * 1e3)
            rows["processor_ms"].append((t2 - t1) * 1e3)
            rows["total_ms"].append((t2 - tj) * 1e3)
    tokens = int(out["image_grid_thw"].prod(-1).sum()) // 4
    result = {
        "images": args.images, "px": args.px, "repeats": args.repeats, "payload_MiB_per_request": round(payload_mb, 2),
        "visual_tokens": tokens, "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "transformers": transformers.__version__, "torch": torch.__version__,
        **{k: {"median": round(statistics.median(v), 1), "spread": [round(min(v), 1), round(max(v), 1)]}
           for k, v in rows.items()},  # spread: min-max over the repeats (5 by default: too few for an interval)
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

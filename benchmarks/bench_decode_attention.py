"""Benchmark one decode attention call: the project's Triton GQA kernel against transformers' SDPA path.

    python benchmarks/bench_decode_attention.py             # H200: ~1 min
    python benchmarks/bench_decode_attention.py --smoke     # CPU: same code path, tiny shapes, interpreter

Shapes: Qwen3-30B-A3B's attention (32 query heads over 4 KV heads, head_dim 128), bf16, one query per row, a
static cache of ``L`` positions of which the first ``n`` are visible (the rest is the unwritten tail the mask
hides), B ∈ {1, 16, 64}.

Implementations, on the same inputs:

- ``hf_sdpa``  transformers' ``sdpa_attention_forward`` as the decoder layer calls it with a mask (``repeat_kv``
  of K/V to every query head, SDPA with the boolean mask over the whole cache, output transposed);
- ``kernel``   ``harness.kernels.decode_attention.decode_attention_triton`` (the engine's
  ``engine.decode_attention=auto`` on CUDA);
- ``sdpa_gqa`` (diagnostic) ``F.scaled_dot_product_attention(enable_gqa=True)`` on the ``n`` visible positions
  without a mask: what the stock op costs when nothing forces the materialised path.

Each is checked against the float32 reference (relative error), then timed with ``triton.testing.do_bench``
(median, L2 flushed per call) as a CUDA-graph replay. Floor = visible K/V bytes / 4.27 TB/s (the measured device
copy). Writes ``results/benchmarks/decode_attention.json`` / ``.md``. Imports torch, triton, transformers and
harness only; timer, graph capture and writer: ``benchmarks/_common.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from pathlib import Path

import torch

from _common import (RESULTS_DIR, Timer, add_device_args, capture_graph, free_memory, rel_err, short_error, use_cuda,
                     write_result)

COPY_TBS = 4.27
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
# (B, L cache, n visible); hf_sdpa is skipped where its repeated K/V would exceed MAX_REPEAT_BYTES
CASES = [(1, 128, 100), (16, 128, 100), (64, 128, 100), (1, 1024, 1000), (16, 1024, 1000), (64, 1024, 1000),
         (1, 4096, 4000), (16, 4096, 4000), (1, 32768, 18000), (16, 32768, 18000)]
SMOKE_CASES = [(1, 32, 20), (3, 48, 40)]
MAX_REPEAT_BYTES = 6 << 30


class _Module:
    """What ``sdpa_attention_forward`` reads from the attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def make_inputs(b, length, n, heads, kv_heads, d, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, heads, 1, d, generator=g).to(device, dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(device, dtype)
    v = torch.randn(b, kv_heads, length, d, generator=g).to(device, dtype)
    mask = (torch.arange(length, device=device) < n).view(1, 1, 1, length).expand(b, 1, 1, length)
    return q, k, v, mask


def implementations(q, k, v, mask, n, scale):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from harness.kernels.decode_attention import decode_attention_triton

    module = _Module(q.shape[1] // k.shape[1])
    kn, vn = k[:, :, :n], v[:, :, :n]
    return {
        "hf_sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0],
        "kernel": lambda: decode_attention_triton(q, k, v, mask, scale),
        "sdpa_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, kn, vn, scale=scale, enable_gqa=True).transpose(1, 2),
    }


def bench_case(b, length, n, args, cuda, timer) -> dict:
    from harness.kernels.decode_attention import decode_attention_reference, num_splits

    device = "cuda" if cuda else "cpu"
    heads, kv_heads, d = (HEADS, KV_HEADS, HEAD_DIM) if cuda else (8, 2, 32)
    dtype = torch.bfloat16
    q, k, v, mask = make_inputs(b, length, n, heads, kv_heads, d, dtype, device)
    scale = d ** -0.5
    want = decode_attention_reference(q, k[:, :, :n], v[:, :, :n], None, scale).double()
    kv_bytes = 2 * b * kv_heads * n * d * q.element_size()
    row = {"B": b, "L": length, "n": n, "kv_bytes": kv_bytes, "floor_us": kv_bytes / (COPY_TBS * 1e12) * 1e6,
           "splits": num_splits(b, kv_heads, length, 64, torch.device(device)) if cuda else None}
    for name, fn in implementations(q, k, v, mask, n, scale).items():
        if name == "hf_sdpa" and 2 * b * heads * length * d * q.element_size() > MAX_REPEAT_BYTES:
            row[name] = {"skipped": "repeated K/V would exceed the memory cap"}
            continue
        try:
            out = fn()
            entry = {"rel_err": rel_err(out.reshape(want.shape), want)}
            if cuda:
                graph = capture_graph(fn)
                entry.update(timer(graph.replay))
                del graph
            else:
                entry.update(timer(fn))
            row[name] = entry
        except Exception as exc:                     # noqa: BLE001 — one failure must not lose the table
            row[name] = {"error": short_error(exc)}
            traceback.print_exc()
        free_memory(cuda)
    k_us, s_us = row.get("kernel", {}).get("p50_us"), row.get("hf_sdpa", {}).get("p50_us")
    row["speedup_vs_hf_sdpa"] = s_us / k_us if k_us and s_us else None
    return row


def bench_cache_write(b, cuda, timer) -> dict:
    """One token into a static cache: transformers' ``StaticLayer.update`` against ``static_cache_write``."""
    from transformers.cache_utils import StaticLayer

    from harness.kernels.decode_attention import static_cache_write

    device = "cuda" if cuda else "cpu"
    kv_heads, d = (KV_HEADS, HEAD_DIM) if cuda else (2, 32)
    layer = StaticLayer(max_cache_len=128)
    layer.update(*(torch.zeros(b, kv_heads, 64, d, device=device, dtype=torch.bfloat16) for _ in range(2)))
    k, v = (torch.randn(b, kv_heads, 1, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    row = {"B": b}
    pos = layer.cumulative_length

    # each write advances the position by one; the timer calls a write thousands of times (do_bench), which ran
    # past the 128 slots (a device-side assert on the GPU): both variants step back after writing, the same
    # one-element op in each
    impls = {"transformers_update": lambda: (layer.update(k, v), pos.sub_(1)),
             "kernel": lambda: (static_cache_write(k, v, layer.keys, layer.values, pos), pos.sub_(1))}
    for name, fn in impls.items():
        try:
            layer.cumulative_length.zero_()
            row[name] = timer(capture_graph(fn).replay) if cuda else timer(fn)
        except Exception as exc:  # noqa: BLE001
            row[name] = {"error": short_error(exc)}
        layer.cumulative_length.zero_()    # keep the writes inside the cache whatever the replay count
    return row


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Decode attention: one call (Qwen3-30B-A3B heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, bf16)", "",
             f"{env.get('device_name')}, torch {env.get('torch_version')}, triton {env.get('triton_version')}, "
             f"transformers {env.get('transformers_version')}. do_bench median of CUDA-graph replays (µs), L2 flushed "
             f"per call; floor = visible K/V bytes / {COPY_TBS} TB/s. ×48 = one decode step of all layers.", "",
             "| B | cache L | visible n | floor µs | hf_sdpa µs | kernel µs | sdpa_gqa (no mask) µs | kernel vs hf_sdpa "
             "| kernel ×48 ms | hf_sdpa ×48 ms | max rel err (kernel) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def us(entry):
        if "p50_us" in entry:
            return f"{entry['p50_us']:.1f}"
        return entry.get("skipped") and "skipped" or entry.get("error", "–")[:40]

    for r in result["rows"]:
        k, s = r.get("kernel", {}), r.get("hf_sdpa", {})
        x48 = lambda e: f"{e['p50_us'] * 48 / 1e3:.2f}" if "p50_us" in e else "–"   # noqa: E731
        sp = f"{r['speedup_vs_hf_sdpa']:.2f}×" if r.get("speedup_vs_hf_sdpa") else "–"
        lines.append(f"| {r['B']} | {r['L']} | {r['n']} | {r['floor_us']:.1f} | {us(s)} | {us(k)} | "
                     f"{us(r.get('sdpa_gqa', {}))} | {sp} | {x48(k)} | {x48(s)} | {k.get('rel_err', float('nan')):.1e} |")
    if result.get("cache_write"):
        lines += ["", "## One token into a static cache (µs, CUDA-graph replay)", "",
                  "| B | transformers StaticLayer.update | static_cache_write |", "|---|---|---|"]
        for r in result["cache_write"]:
            lines.append(f"| {r['B']} | {us(r.get('transformers_update', {}))} | {us(r.get('kernel', {}))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap, "CPU, interpreter, tiny shapes (writes to a temp dir)")
    args = ap.parse_args()
    cuda = use_cuda(args, interpret=True)   # smoke: the interpreter, before triton is first imported
    if cuda is None:
        return 0
    from harness.results.envinfo import collect_environment

    out = args.out or (RESULTS_DIR if cuda else Path(tempfile.mkdtemp()))
    timer = Timer(cuda)
    result = {"benchmark": "decode_attention", "environment": collect_environment(),
              "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                         "timer": "do_bench median of CUDA-graph replays, L2 flushed"}, "rows": []}
    t0 = time.time()
    for b, length, n in (CASES if cuda else SMOKE_CASES):
        row = bench_case(b, length, n, args, cuda, timer)
        result["rows"].append(row)
        print({k: (round(v["p50_us"], 1) if isinstance(v, dict) and "p50_us" in v else v) for k, v in row.items()},
              flush=True)
        write_result(result, out / "decode_attention.json", markdown, indent=1)
    result["cache_write"] = []
    for b in ((1, 16, 64) if cuda else (1, 3)):
        try:
            result["cache_write"].append(bench_cache_write(b, cuda, timer))
        except Exception as exc:  # noqa: BLE001
            result["cache_write"].append({"B": b, "error": str(exc)[:200]})
    result["total_s"] = round(time.time() - t0, 1)
    write_result(result, out / "decode_attention.json", markdown, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check of the expert-offload mechanism (harness/techniques/offload): correctness first, then the copy path's speed.

    python benchmarks/check_offload_gpu.py            # CUDA (~1-2 min on one H200)
    python benchmarks/check_offload_gpu.py --smoke    # CPU: same code, tiny sizes

Sections (each guarded: one failure does not lose the others; JSON in results/benchmarks/check_offload_gpu.json):

1. ``tokens``: the embedded trained tiny model (4 MoE layers × 16 experts, top-4) through the HF engine in
   float32, resident (``harness_fused_moe`` on CUDA, transformers' default on CPU) vs every policy with 5 slots
   per layer (evictions, chunked prefill streaming), batch 2, 16 new tokens: greedy tokens must be identical;
   the oracle replays a trace recorded by the ``none`` pass. The same in bfloat16 is reported as the share of
   identical outputs (chunked prefill sums partial outputs in another order: not bit-exact by construction).
2. ``copies``: a store with Qwen3-30B-A3B expert shapes (hidden 2048, moe_intermediate 768, bf16: 9.44 MB an
   expert), 8 layers × 128 experts, pinned by cudaHostRegister; an LRU cache of 40 slots per layer replays a
   skewed random trace (top-8, Zipf-like popularity, B = 1) through the real mover (copy stream, events); then
   every resident slot is compared with the host store and the device table with the bookkeeping (any
   overwrite race or table error shows here), and achieved H2D GB/s is reported (~55 GB/s expected, pinned).
3. ``budget``: ``offload.gpu_budget_gb`` binds: with a 1 GB per-process fraction an allocation of 2 GB fails, also
   when the allocator still caches 3 GB freed just before (the fraction is checked only on new driver allocations).

Imports only torch/transformers and harness modules that are lazy about hydra/omegaconf/wandb.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

POLICIES = ("none", "staging", "lru", "lru+gate", "oracle")
PROMPTS = ["hello there", "旅游 美食 推荐", "describe the city at night", "1 2 3 4"]


def engine(device, dtype, offload=None, max_new=16, impl="auto"):
    from harness.engines.hf.engine import HFEngine
    from harness.models.trained import trained_checkpoint

    path, _ = trained_checkpoint()
    cfg = SimpleNamespace(device=device, dtype=dtype, batch_size=2, attn_implementation="sdpa",
                          experts_implementation=impl, cuda_graphs=False, warmup=1)
    return HFEngine(str(path), cfg, SimpleNamespace(max_new_tokens=max_new), sere_cfg=SimpleNamespace(k=None),
                    offload_cfg=offload)


def generate(eng):
    from harness.engines.base import Request

    reqs = [Request(uid=str(i), content=[{"type": "text", "text": t}]) for i, t in enumerate(PROMPTS)]
    try:
        eng.warmup(reqs[:2])
        gens = eng.generate(reqs)
        stats = eng.technique_stats().get("offload")
    finally:
        eng.close()
    errors = [g.error for g in gens if g.error]
    if errors:
        raise RuntimeError(errors[0])
    return [g.text for g in gens], stats


def offload(policy, capacity=5, **kw):
    return {"policy": policy, "capacity": capacity, "capacity_gb": None, "gpu_budget_gb": None, "trace": None,
            "record_trace": None, "warm_after_tokens": 4, "resident_summary": None, "params": {}, **kw}


def section_tokens(device, out_dir):
    rows = []
    for dtype in ("float32", "bfloat16"):
        ref, _ = generate(engine(device, dtype))
        trace = out_dir / f"tiny_trace_{dtype}.pt"
        for policy in POLICIES:
            extra = {"trace": str(trace)} if policy == "oracle" else {}
            if policy == "none":
                extra = {"record_trace": str(trace)}
            texts, st = generate(engine(device, dtype, offload(policy, **extra)))
            same = sum(a == b for a, b in zip(texts, ref))
            rows.append({"dtype": dtype, "policy": policy, "identical": same, "of": len(ref),
                         "hit_rate": st["hit_rate"], "misses": st["misses"], "late": st["late_arrivals"],
                         "prefetch_precision": st["prefetch_precision"], "stall_ms_per_token": st["stall_ms_per_token"],
                         "achieved_gb_s": st["achieved_gb_s"], "pin_method": st["pin_method"]})
            print(f"  {dtype:8s} {policy:9s} identical {same}/{len(ref)}  hit {st['hit_rate']:.3f}  "
                  f"late {st['late_arrivals']}  stall/token {st['stall_ms_per_token']}", flush=True)
    fp32_ok = all(r["identical"] == r["of"] for r in rows if r["dtype"] == "float32")
    return {"rows": rows, "float32_all_identical": fp32_ok}


def skewed_trace(steps, layers, experts, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float) ** 1.1
    out, prev = [], None
    for _ in range(steps):
        rows = []
        for layer in range(layers):
            perm = torch.randperm(experts, generator=g) if prev is None else None
            ids = torch.multinomial(weights, k, replacement=False, generator=g)
            if prev is not None and torch.rand(1, generator=g).item() < 0.6:  # reuse: recent experts come back
                keep = prev[layer][: k // 2]
                ids = torch.cat([keep, ids[~torch.isin(ids, keep)]])[:k]
            rows.append(ids if perm is None else perm[ids])
        prev = rows
        out.append(torch.stack(rows)[None])  # [1, L, k]
    return out


def section_copies(device, smoke):
    from harness.techniques.offload.cache import ExpertCache
    from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy
    from harness.techniques.offload.simulate import replay
    from harness.techniques.offload.store import ExpertStore, Mover

    layers, experts, k, cap, hidden, inter, steps = (2, 16, 4, 6, 64, 32, 20) if smoke else (8, 128, 8, 40, 2048,
                                                                                            768, 200)
    store = ExpertStore(layers, experts, inter, hidden, torch.bfloat16, pin=device == "cuda")
    store.gate_up.copy_(torch.arange(store.gate_up.numel(), dtype=torch.float32).reshape(store.gate_up.shape)
                        .remainder_(997).to(torch.bfloat16))
    store.down.normal_()
    mover = Mover(store, cap, device)
    geometry = Geometry(layers, experts, k, cap, store.expert_bytes)
    cache = ExpertCache(geometry, make_policy("lru", PolicyContext(geometry)), mover, warm_after=8)
    t0 = time.perf_counter()
    replay(cache, skewed_trace(steps, layers, experts, k))
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    summary = cache.summary()
    bad_slots = bad_table = 0
    table = mover.table.cpu()
    for layer in range(layers):
        for e, ent in cache.entries[layer].items():
            bad_slots += int(not torch.equal(mover.gate_up[layer, ent.slot].cpu(), store.gate_up[layer, e]))
            bad_slots += int(not torch.equal(mover.down[layer, ent.slot].cpu(), store.down[layer, e]))
        expect = torch.full((experts,), -1, dtype=torch.long)
        for e, ent in cache.entries[layer].items():
            expect[e] = ent.slot
        bad_table += int((table[layer] != expect).sum())
    res = {"expert_mb": store.expert_bytes / 1e6, "pinned": store.pinned, "pin_method": store.pin_method,
           "hit_rate": summary["hit_rate"], "misses": summary["misses"], "achieved_gb_s": summary["achieved_gb_s"],
           "copy_ms_total": summary["copy_ms_total"], "stall_ms_per_token": summary["stall_ms_per_token"],
           "wall_s": wall, "bad_slots": bad_slots, "bad_table_entries": bad_table}
    print(f"  expert {res['expert_mb']:.2f} MB, pinned {res['pinned']} ({res['pin_method']}), hit {res['hit_rate']:.3f},"
          f" {res['achieved_gb_s']:.1f} GB/s achieved, bad slots {bad_slots}, bad table entries {bad_table}")
    store.unpin()
    return res


def section_budget(device):
    if device != "cuda":
        return {"skipped_reason": "no CUDA device"}
    from harness.engines.hf.offload import OffloadRuntime

    # what a run does: the experts' device memory was freed (to the allocator's cache) just before the budget is set
    cached = torch.empty(int(3e9), dtype=torch.uint8, device="cuda")
    del cached
    rt = OffloadRuntime.__new__(OffloadRuntime)
    rt.device = torch.device("cuda")
    info = rt._enforce_budget(1.0)
    try:
        x = torch.empty(int(2e9), dtype=torch.uint8, device="cuda")
        refused = False
        del x
    except torch.OutOfMemoryError:
        refused = True
    torch.cuda.set_per_process_memory_fraction(1.0)
    print(f"  1 GB budget: a 2 GB allocation refused = {refused}")
    return {**info, "two_gb_allocation_refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--out", default=str(ROOT / "results/benchmarks/check_offload_gpu.json"))
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import transformers

    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "weights": "trained-synthetic (tiny) / synthetic (copies)",
              "sections": {}}
    for name, fn in (("tokens", lambda: section_tokens(device, out_path.parent)),
                     ("copies", lambda: section_copies(device, args.smoke)), ("budget", lambda: section_budget(device))):
        print(f"[{name}]", flush=True)
        try:
            result["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections
            traceback.print_exc()
            result["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"written {out_path}")


if __name__ == "__main__":
    main()

"""Expert offload on one GPU: every policy side by side at Qwen3-30B-A3B expert shapes (random init).

    python benchmarks/bench_offload.py                 # H200: ~3-4 min
    python benchmarks/bench_offload.py --smoke         # CPU, tiny shapes, seconds (checks the script)
    python benchmarks/bench_offload.py --only-headline # H200: ~1 min; B=1, ~32 %, skewed + random, 3 repeats

What runs. A stack of ``--layers`` MoE layers with Qwen3-30B-A3B's per-layer shapes (hidden 2048, expert
intermediate 768, 128 experts, top-8, bf16: 9.44 MB per expert), random-initialised, experts in ONE pinned host
slab per weight kind (``harness.techniques.offload.store``), the GPU expert cache of offload-core (``harness.techniques.offload.cache``,
per-layer pools, copy stream, events, expert→slot table) and the project's fused MoE Triton kernel reading the
cache slots through the table — the same code path as the HF engine's ``harness_offload_moe``, minus attention
(identical for every policy, so it is left out: per-token times are MoE-only). 12 layers instead of 48 keep
pinning and copying in budget (pinning 1 GiB ≈ 0.7 s); per-layer work is identical, so the per-token figures
are also given scaled ×48/layers ("x48" columns) — an extrapolation, stated as such.

Routing sources (the routing of a policy run is fixed in advance, so every policy serves exactly the same
accesses and the oracle's future is exact):

- ``random``: a random-initialised router per layer on the hidden state of a resident run (random token
  embedding + the MoE outputs added layer by layer). Random routers route near-uniformly, with little reuse
  between tokens: read it as the hard, uniform case, not as the real model. ``lru+gate``/``lease`` prefetch with
  the next layer's router on the current hidden state (as in the engine).
- ``skewed``: the synthetic trace of ``harness.techniques.offload.synthetic`` (median reuse distance 2 tokens, per-layer LRU
  at 40 % residency ≈ 94 % hits: the published Qwen3-30B-A3B figures). A trace has no hidden states, so the
  next-layer gate is *emulated*: it returns the true next-layer experts, each replaced by a random one with the
  probability the real gate missed in the ``random`` source (its measured precision is printed and recorded).

Policies: none (all resident), staging, lru, lru+gate, lease (recency score, gate prefetch), lease+pred
(stability predictor, threshold 0.5), oracle (Belady on the same routing), and accelerate's ``cpu_offload``
hooks on each layer's experts module (the naive baseline: every expert of a layer copied at every forward). Budgets: ~20 %, ~32 %, ~60 % of the
experts per layer. B = 1 and 4. Then the seed's threshold sweep (0.9 / 0.7 / 0.5 / 0.3) and SERE on vs off at
B = 4 (``harness.techniques.sere.reroute``, K = 4 of 8, ρ = 0 on a random symmetric similarity: the upper bound
of the union saving; quality is not measured here).

Memory: ``peak_alloc_gb`` = ``torch.cuda.max_memory_allocated`` during the timed steps (slots + activations +
routers; the budget binds because the slots are the only expert storage on the device); ``held_gb`` (lease) =
the peak experts the leases hold (leased or in grace) × expert bytes — what the seed's "peak memory" measures.

Prefetch admission (``offload.prefetch.*``, harness/techniques/offload/prefetch.py): every prefetching policy runs under
the cache's default admission rules (``--prefetch-*`` flags change them); ``lru+gate/legacy`` and
``lease/legacy`` are the same policies with no admission rules and one copy stream (the behaviour before), so
the table shows both side by side.

Repeats (``--repeats N``): each cell is run N times from a fresh cache (same routing); ``ms/tok`` is the median
over repeats and ``spread`` = (max - min) / median — one timed pass is not enough to call a difference of a few
percent. Counts (hits, prefetches) are deterministic per repeat except where CUDA timing decides (late
arrivals, throttling by copies still in flight); the table's counts are those of the median-time repeat.

Writes ``results/benchmarks/offload.json`` (+ ``.md``) with hardware, versions, dtype, weights=random-init.
Every section is guarded: one failure is recorded and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

POLICIES = ("none", "staging", "lru", "lru+gate", "lru+gate/legacy", "lease", "lease/legacy", "lease+pred", "oracle")
HEADLINE_POLICIES = ("none", "lru", "lru+gate", "lru+gate/legacy", "lease", "lease/legacy", "oracle")
PREFETCH = None  # harness.techniques.offload.prefetch.PrefetchSettings of this run (set in main from the --prefetch-* flags)


def split_variant(policy: str):
    """``lru+gate/legacy`` → (``lru+gate``, legacy admission); any other name → (name, this run's settings)."""
    from harness.techniques.offload.prefetch import PrefetchSettings

    if policy.endswith("/legacy"):
        return policy[: -len("/legacy")], PrefetchSettings.legacy()
    return policy, PREFETCH if PREFETCH is not None else PrefetchSettings()


# -- set-up -------------------------------------------------------------------------------------------
class Shapes:
    def __init__(self, smoke: bool, layers: int | None):
        if smoke:
            self.h, self.i, self.e, self.k, self.layers = 64, 32, 16, 4, layers or 3
        else:
            self.h, self.i, self.e, self.k, self.layers = 2048, 768, 128, 8, layers or 12
        self.expert_bytes = 3 * self.h * self.i * 2  # bf16

    def as_dict(self) -> dict:
        return {"hidden": self.h, "expert_intermediate": self.i, "experts": self.e, "top_k": self.k,
                "layers": self.layers, "expert_bytes": self.expert_bytes}


def build_weights(s: Shapes, device: str, seed: int):
    """Resident expert weights [L, E, 2I, H] / [L, E, H, I] and routers [L, E, H] (bf16, std 0.02)."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.empty(s.layers, s.e, 2 * s.i, s.h, dtype=torch.bfloat16, device=device)
    down = torch.empty(s.layers, s.e, s.h, s.i, dtype=torch.bfloat16, device=device)
    for layer in range(s.layers):
        gate_up[layer].normal_(0, 0.02, generator=g)
        down[layer].normal_(0, 0.02, generator=g)
    routers = torch.randn(s.layers, s.e, s.h, generator=g, device=device, dtype=torch.float32) * 0.02
    return gate_up, down, routers


def route(routers: torch.Tensor, layer: int, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = h.float() @ routers[layer].T
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(h.dtype)


def kernel(hidden, gate_up, down, ids, weights):
    from harness.kernels.fused_moe import fused_moe
    from harness.kernels.fused_moe_reference import fused_moe_reference

    if hidden.is_cuda:
        return fused_moe(hidden, gate_up, down, ids, weights)
    return fused_moe_reference(hidden, gate_up, down, ids, weights)


def random_source(s: Shapes, gate_up, down, routers, batch: int, steps: int, device: str, seed: int,
                  drift: float) -> dict:
    """Routing of a resident run of the random model: ids/weights [steps][L] ([B, k]) and hiddens [steps][L]
    ([B, H], each layer's MoE input), plus the next-layer gate's precision (router l+1 on layer l's input).

    Between layers the hidden state gets the MoE output plus Gaussian noise of RMS ``drift`` (the token
    embedding has RMS 1): the stand-in for attention and everything else a real layer adds. Without it the
    random MoE's output is so small that layer l's input predicts layer l+1's routing perfectly; drift 0.2
    gives ~83 % next-layer gate precision at these shapes (near what pre-gating papers report for real
    models), and the measured value is recorded."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids_all, w_all, hid_all = [], [], []
    hit = tot = 0
    for _ in range(steps):
        h = torch.randn(batch, s.h, generator=g, device=device).to(torch.bfloat16)
        ids_s, w_s, h_s = [], [], []
        for layer in range(s.layers):
            ids, w = route(routers, layer, h, s.k)
            if layer:
                guess = route(routers, layer, h_s[-1], s.k)[0]
                hit += sum(len(set(a) & set(b)) for a, b in zip(guess.tolist(), ids.tolist(), strict=True))
                tot += ids.numel()
            ids_s.append(ids)
            w_s.append(w)
            h_s.append(h)
            noise = torch.randn(h.shape, generator=g, device=device) * drift
            h = (h.float() + kernel(h, gate_up[layer], down[layer], ids, w).float() + noise).to(torch.bfloat16)
        ids_all.append(ids_s)
        w_all.append(w_s)
        hid_all.append(h_s)
    return {"ids": ids_all, "weights": w_all, "hiddens": hid_all, "gate_precision": hit / max(tot, 1)}


def skewed_source(s: Shapes, batch: int, steps: int, device: str, seed: int, trace=None) -> dict:
    """Replay of the synthetic trace: the first ``batch`` requests decode together for ``steps`` steps."""
    from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace

    if trace is None:
        trace = synthetic_trace(SyntheticSpec(num_layers=s.layers, num_experts=s.e, top_k=s.k, requests=batch,
                                              tokens=steps, seed=seed))
    sl = trace.request_slices()[:batch]
    ids_all, w_all, emb_all = [], [], []
    for t in range(steps):
        rows = [x.start + t for x in sl]
        ids = trace.ids[rows].to(device)  # [B, L, k]
        w = trace.weights[rows].to(device=device, dtype=torch.bfloat16)
        ids_all.append([ids[:, layer].contiguous() for layer in range(s.layers)])
        w_all.append([w[:, layer].contiguous() for layer in range(s.layers)])
        emb_all.append(trace.embeds[rows].to(device).unsqueeze(1))
    return {"ids": ids_all, "weights": w_all, "hiddens": None, "embeds": emb_all, "trace": trace}


class ListTrace:
    """The routing a run will serve, as an oracle trace (``steps_by_batch`` → [b, L, k] per step)."""

    def __init__(self, ids: list[list[torch.Tensor]]):
        self.steps = [torch.stack([x.cpu() for x in step], dim=1) for step in ids]

    def steps_by_batch(self, batch_size: int):
        return self.steps


def aligned_oracle(ctx, warmup: int):
    """offload-core's Belady oracle, its trace pointer kept on this run's steps across the warm-up reset.

    The engine's oracle assumes the trace holds only the measured steps (the engine warms up on other
    requests); here the warm-up steps are the first steps of the same replay, so after ``reset_stats`` (token
    clock back to 0) trace step = clock step + ``warmup``."""
    from harness.techniques.offload.policies import OraclePolicy

    class AlignedOracle(OraclePolicy):
        offset = 0

        def _now(self, clock):
            return super()._now(clock) + self.offset

        def on_reset(self, clock):
            super().on_reset(clock)
            self.offset = warmup

    pol = AlignedOracle(ctx)
    pol.name = "oracle"
    return pol


# -- one policy run -----------------------------------------------------------------------------------
def run_policy(policy: str, s: Shapes, src: dict, capacity: int, device: str, store, resident, warmup: int,
               params: dict[str, Any], gate_precision: float, seed: int, sere: dict | None = None) -> dict:
    from harness.techniques.offload.cache import ExpertCache
    from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy, policy_class
    from harness.techniques.offload.store import Mover

    import harness.techniques.offload.lease  # noqa: F401  (registers "lease")

    base, pf_settings = split_variant(policy)
    name = "lease" if base.startswith("lease") else base
    cls = policy_class(name)
    cap = s.e if cls.mode == "resident" else capacity
    geometry = Geometry(s.layers, s.e, s.k, cap, s.expert_bytes, tuple(range(s.layers)))
    ids_all = src["ids"] if sere is None else sere["ids"]
    rng = torch.Generator().manual_seed(seed + 7)

    def gate(layer: int, hidden: Any) -> torch.Tensor:
        if src["hiddens"] is not None:  # the real next-layer router on this layer's input
            return route(src["routers"], layer, hidden, s.k)[0]
        true = ids_all[hidden][layer].cpu()  # emulated gate: hidden = the step index
        wrong = torch.rand(true.shape, generator=rng) >= gate_precision
        return torch.where(wrong, torch.randint(0, s.e, true.shape, generator=rng), true)

    ctx = PolicyContext(geometry, {"batch_size": len(ids_all[0][0]), **params}, ListTrace(ids_all), gate, device)
    pol = aligned_oracle(ctx, warmup) if name == "oracle" else make_policy(name, ctx)
    mover = Mover(store, cap, device) if cls.mode != "resident" else None
    cache = ExpertCache(geometry, pol, mover, warm_after=8, prefetch=pf_settings)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps = len(ids_all)
    h_rand = torch.randn(len(ids_all[0][0]), s.h, generator=torch.Generator().manual_seed(seed)).to(
        device=device, dtype=torch.bfloat16)
    t_start = None
    for t in range(steps):
        if t == warmup:
            cache.reset_stats()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_start = time.perf_counter()
        emb = src.get("embeds", [None] * steps)[t]
        cache.begin_pass("decode", rows=len(ids_all[t][0]), row_tokens=len(ids_all[t][0]), embeddings=emb)
        for layer in range(s.layers):
            ids, w = ids_all[t][layer], src["weights"][t][layer]
            hidden = src["hiddens"][t][layer] if src["hiddens"] is not None else h_rand
            needed = sorted(set(ids.reshape(-1).tolist()))
            if cache.mode == "resident":
                cache.acquire(layer, needed)
                kernel(hidden, resident[0][layer], resident[1][layer], ids, w)
            else:
                chunks = cache.plan(layer, needed)
                for chunk in chunks:
                    cache.acquire(layer, chunk)
                    slots = mover.table[layer][ids]
                    if len(chunks) > 1:
                        keep = torch.isin(ids, torch.tensor(chunk, device=ids.device))
                        slots = torch.where(keep, slots, torch.full_like(slots, -1))
                    kernel(hidden, mover.gate_up[layer], mover.down[layer], slots, w)
                    cache.release(layer)
            gate_hidden = hidden if src["hiddens"] is not None else t
            cache.prefetch(pol.prefetch(layer, cache.clock, gate_hidden))
        cache.end_pass()
    sync()
    elapsed = time.perf_counter() - t_start
    measured = steps - warmup
    rows = len(ids_all[0][0])
    summ = cache.summary()
    ps = pol.stats()
    out = {
        "policy": policy, "capacity": cap, "resident_fraction": cap / s.e,
        "decode_ms_per_token": elapsed * 1e3 / measured, "tokens_per_s": rows * measured / elapsed,
        "decode_ms_per_token_x48": elapsed * 1e3 / measured * 48 / s.layers,
        "tokens_per_s_x48": rows * measured / elapsed * s.layers / 48,
        "peak_alloc_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "slots_gb": (mover.device_bytes / 1e9) if mover is not None else s.layers * s.e * s.expert_bytes / 1e9,
        "held_gb": ps["peak_held_bytes"] / 1e9 if "peak_held_bytes" in ps else None,
        **{k: summ.get(k) for k in ("hit_rate", "hit_rate_warm", "hit_rate_cold", "late_arrivals", "misses",
                                    "new_experts_per_layer_token", "prefetch_precision", "prefetch_recall_on_time",
                                    "wasted_bytes", "h2d_bytes_per_token", "achieved_gb_s", "stall_ms_per_token",
                                    "prefetch_issued", "prefetch_capped", "prefetch_throttled", "prefetch_dropped")},
        "prefetch_settings": dict(pf_settings.__dict__),
        "policy_stats": ps,
    }
    del mover, cache
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_repeated(repeats: int, *args, **kwargs) -> dict:
    """``run_policy`` ``repeats`` times (fresh cache each time, same routing): the median-time run's numbers, plus
    ``ms_per_token_repeats``, ``ms_min``/``ms_max`` and ``spread`` = (max - min) / median of ms/token."""
    runs = [run_policy(*args, **kwargs) for _ in range(max(1, repeats))]
    runs.sort(key=lambda r: r["decode_ms_per_token"])
    out = dict(runs[len(runs) // 2])
    ms = [r["decode_ms_per_token"] for r in runs]
    out.update(repeats=len(runs), ms_per_token_repeats=ms, ms_min=ms[0], ms_max=ms[-1],
               spread=(ms[-1] - ms[0]) / out["decode_ms_per_token"] if out["decode_ms_per_token"] else None,
               late_arrivals_repeats=[r["late_arrivals"] for r in runs])
    return out


def accelerate_baseline(s: Shapes, src: dict, store, device: str, steps: int) -> dict:
    """accelerate's naive offload (what ``device_map`` with CPU-offloaded experts does): ``cpu_offload`` hooks on
    each layer's experts module copy the module's whole weights (all E experts) to the GPU at every forward and
    drop them after. The modules' host weights are the pinned store's own slabs (no extra host memory); the same
    fused kernel computes. One untimed step first, then ``steps`` timed ones."""
    from accelerate import cpu_offload

    class Experts(torch.nn.Module):
        def __init__(self, gate_up, down):
            super().__init__()
            self.gate_up = torch.nn.Parameter(gate_up, requires_grad=False)
            self.down = torch.nn.Parameter(down, requires_grad=False)

        def forward(self, h, ids, w):
            return kernel(h, self.gate_up, self.down, ids, w)

    mods = [cpu_offload(Experts(store.gate_up[layer], store.down[layer]), execution_device=torch.device(device))
            for layer in range(s.layers)]
    b = len(src["ids"][0][0])
    h = torch.randn(b, s.h, device=device).to(torch.bfloat16)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for t in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        for layer, mod in enumerate(mods):
            mod(h, src["ids"][t][layer], src["weights"][t][layer])
        sync()
        times.append(time.perf_counter() - t0)
    ms = sorted(times[1:])[len(times[1:]) // 2] * 1e3
    from importlib.metadata import version

    return {"policy": "accelerate", "batch": b, "decode_ms_per_token": ms, "tokens_per_s": b * 1e3 / ms,
            "decode_ms_per_token_x48": ms * 48 / s.layers, "tokens_per_s_x48": b * 1e3 / ms * s.layers / 48,
            "accelerate_version": version("accelerate"), "steps": steps,
            "h2d_bytes_per_token": s.layers * s.e * s.expert_bytes}


def policy_params(policy: str, predictor: str | None, threshold: float = 0.5) -> dict:
    policy = split_variant(policy)[0]
    if policy == "lease":
        return {"threshold": threshold, "lease": {"score": "recency", "prefetch": "gate"}}
    if policy == "lease+pred":
        return {"threshold": threshold, "lease": {"score": "predictor", "predictor": predictor, "prefetch": "gate"}}
    return {}


# -- tables -------------------------------------------------------------------------------------------
def fmt(v: Any, p: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:.{p}f}" if isinstance(v, float) else str(v)


def table(rows: list[dict], cols: list[tuple[str, str, int]]) -> str:
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt(r.get(c[1]), c[2]) for c in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


MAIN_COLS = [("source", "source", 0), ("B", "batch", 0), ("budget", "resident_fraction", 2), ("policy", "policy", 0),
             ("ms/tok", "decode_ms_per_token", 2), ("spread", "spread", 2), ("tok/s", "tokens_per_s", 1), ("tok/s x48", "tokens_per_s_x48", 1),
             ("share of resident", "share_of_resident", 3), ("hit", "hit_rate", 3), ("hit warm", "hit_rate_warm", 3),
             ("late", "late_arrivals", 0), ("new/layer/tok", "new_experts_per_layer_token", 2),
             ("pf issued", "prefetch_issued", 0), ("pf prec", "prefetch_precision", 2),
             ("pf recall", "prefetch_recall_on_time", 2),
             ("stall ms/tok", "stall_ms_per_token", 2), ("GB/s", "achieved_gb_s", 1), ("peak GB", "peak_alloc_gb", 2)]


def goal_check(runs: list[dict], frac: float) -> list[dict]:
    """The issue's headline goal per source at B = 1 and the budget nearest ~32 %, for lru+gate and lease."""
    out = []
    cell = [r for r in runs if r.get("batch") == 1 and r.get("resident_fraction") is not None
            and abs(r["resident_fraction"] - frac) < 0.02]
    for source in ("skewed", "random"):
        lru = next((r for r in cell if r.get("source") == source and r["policy"] == "lru"), None)
        for r in cell:
            if r.get("source") != source or r["policy"] not in ("lru+gate", "lease"):
                continue
            lo, hi = r.get("ms_min", r["decode_ms_per_token"]), r.get("ms_max", r["decode_ms_per_token"])
            llo = lru.get("ms_min", lru["decode_ms_per_token"]) if lru else None
            lhi = lru.get("ms_max", lru["decode_ms_per_token"]) if lru else None
            share = r.get("share_of_resident")
            out.append({"source": source, "policy": r["policy"], "share_of_resident": share, "ms_min": lo,
                        "ms_max": hi, "lru_ms_min": llo, "lru_ms_max": lhi,
                        "half_of_resident": None if share is None else share >= 0.5,
                        "beats_lru": None if llo is None else hi < llo})
    return out


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script end to end")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default 12; smoke 3)")
    ap.add_argument("--tokens", type=int, default=None, help="timed decode steps per run (default 48; smoke 6)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 12; smoke 3)")
    ap.add_argument("--max-seconds", type=float, default=285.0,
                    help="stop starting new runs after this many seconds (skipped runs are listed in the JSON)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--budgets", default="0.2,0.32,0.6")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--thresholds", default="0.9,0.7,0.5,0.3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accelerate-steps", type=int, default=4, help="timed steps of accelerate's offload (0 = skip)")
    ap.add_argument("--drift", type=float, default=0.2, help="per-layer hidden-state noise RMS (random source)")
    ap.add_argument("--out", default=None, help="output stem (default results/benchmarks/offload; "
                    "offload_headline with --only-headline)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell, median reported (default 1; "
                    "3 with --only-headline)")
    ap.add_argument("--only-headline", action="store_true",
                    help="only the issue's headline cell: B=1, ~32 %%, skewed + random, none/lru/lru+gate/lease/"
                         "oracle (+ the /legacy prefetch variants), --repeats 3; no predictor, sweep, SERE, accelerate")
    ap.add_argument("--prefetch-max-per-layer", type=int, default=None, help="offload.prefetch.max_per_layer")
    ap.add_argument("--prefetch-max-inflight", type=int, default=None, help="offload.prefetch.max_inflight")
    ap.add_argument("--prefetch-protect-tokens", type=int, default=None, help="offload.prefetch.protect_tokens")
    ap.add_argument("--prefetch-stream", default=None, help="offload.prefetch.stream (separate | shared)")
    args = ap.parse_args()
    global PREFETCH
    from harness.techniques.offload.prefetch import PrefetchSettings

    d = PrefetchSettings()
    PREFETCH = PrefetchSettings(
        max_per_layer=d.max_per_layer if args.prefetch_max_per_layer is None else args.prefetch_max_per_layer,
        max_inflight=d.max_inflight if args.prefetch_max_inflight is None else args.prefetch_max_inflight,
        protect_tokens=d.protect_tokens if args.prefetch_protect_tokens is None else args.prefetch_protect_tokens,
        stream=args.prefetch_stream or d.stream)
    if args.out is None:
        args.out = os.path.join(REPO, "results", "benchmarks", "offload_headline" if args.only_headline else "offload")
    if args.only_headline:
        args.batches, args.budgets, args.accelerate_steps = "1", "0.32", 0
        if args.policies == ",".join(POLICIES):
            args.policies = ",".join(HEADLINE_POLICIES)
    repeats = args.repeats or (3 if args.only_headline else 1)
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_offload needs a CUDA GPU (use --smoke on CPU)")
    s = Shapes(args.smoke, args.layers)
    tokens = args.tokens or (6 if args.smoke else 48)
    warmup = args.warmup if args.warmup is not None else (3 if args.smoke else 12)
    steps = warmup + tokens
    batches = [int(x) for x in args.batches.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    if args.smoke:
        args.out = args.out + "_smoke"
    from harness.results.envinfo import collect_environment

    t_all = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "offload", "environment": collect_environment(device), "dtype": "bfloat16",
                              "weights": "random-init", "shapes": s.as_dict(), "timed_steps": tokens,
                              "warmup_steps": warmup, "scaled_to_layers": 48, "drift": args.drift, "errors": [], "runs": [],
                              "threshold_sweep": [], "sere": [], "max_seconds": args.max_seconds,
                              "repeats": repeats, "only_headline": args.only_headline,
                              "prefetch_settings": dict(PREFETCH.__dict__)}
    log = lambda m: print(f"[{time.perf_counter() - t_all:6.1f}s] {m}", flush=True)  # noqa: E731

    def guarded(label: str, fn):
        if time.perf_counter() - t_all > args.max_seconds:
            result.setdefault("skipped_over_time", []).append(label)
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            traceback.print_exc()
            result["errors"].append({"section": label, "error": f"{type(e).__name__}: {e}"})
            return None

    # weights, store (pinned), routing sources
    t0 = time.perf_counter()
    gate_up, down, routers = build_weights(s, device, args.seed)
    from harness.techniques.offload.store import ExpertStore

    store = ExpertStore(s.layers, s.e, s.i, s.h, torch.bfloat16, pin=device.startswith("cuda"))
    for layer in range(s.layers):
        store.put(layer, gate_up[layer], down[layer])
    result["setup"] = {"build_and_pin_s": time.perf_counter() - t0, "pinned": store.pinned,
                       "pin_method": getattr(store, "pin_method", None), "host_store_gb": store.nbytes / 1e9}
    log(f"store: {store.nbytes / 1e9:.2f} GB host ({'pinned' if store.pinned else 'pageable'})")

    # predictor for lease+pred / the threshold sweep: trained on other requests of the same generator
    pred_path = None

    def train_pred():
        from harness.techniques.offload.predictor import save_predictor, train_predictor
        from harness.techniques.offload.synthetic import SyntheticSpec, synthetic_trace

        tr = synthetic_trace(SyntheticSpec(num_layers=s.layers, num_experts=s.e, top_k=s.k,
                                           requests=8 if args.smoke else 48, tokens=24 if args.smoke else 128,
                                           seed=args.seed + 1000))
        model, report = train_predictor([tr], epochs=5 if args.smoke else 25)
        path = save_predictor(model, report, args.out + "_predictor")
        result["predictor"] = {"path": os.path.relpath(str(path), REPO), "params": report["params"],
                               "held_out": report["held_out"], "split": report["split"]}
        h = report["held_out"]
        log(f"predictor: {report['params']} params, held-out MSE {h['predictor']['mse']:.4f} (mean "
            f"{h['baseline_mean']['mse']:.4f}, recency {h['baseline_recency']['mse']:.4f}), AUC "
            f"{h['predictor']['auc']:.3f} (recency {h['baseline_recency']['auc']:.3f})")
        return str(path)

    pred_path = None if args.only_headline else guarded("predictor", train_pred)

    sources: dict[tuple[str, int], dict] = {}
    gate_precision = 0.8
    for b in batches:
        src = guarded(f"random source B={b}", lambda b=b: random_source(s, gate_up, down, routers, b, steps, device,
                                                                         args.seed + b, args.drift))
        if src is not None:
            src["routers"] = routers
            sources[("random", b)] = src
            gate_precision = src["gate_precision"]
            result.setdefault("gate_precision", {})[str(b)] = src["gate_precision"]
    log(f"next-layer gate precision on the random model: {result.get('gate_precision')}")
    skewed_trace = None
    for b in batches:
        src = guarded(f"skewed source B={b}", lambda b=b: skewed_source(s, b, steps, device, args.seed))
        if src is not None:
            sources[("skewed", b)] = src
    skewed_trace = guarded("skewed stats", lambda: __import__("harness.techniques.offload.synthetic", fromlist=["x"]).
                           reuse_statistics(sources[("skewed", max(batches))]["trace"], lru_layers=4))
    result["skewed_trace_stats"] = skewed_trace

    resident = (gate_up, down)
    # 'none' first (needs the resident weights), then free them so the budgets' peaks are the slots' own
    if "none" in policies:
        for (name, b), src in sources.items():
            r = guarded(f"none {name} B={b}", lambda src=src: run_repeated(repeats, "none", s, src, s.e, device,
                                                                           store, resident, warmup, {},
                                                                           gate_precision, args.seed))
            if r is not None:
                r.update(source=name, batch=b, share_of_resident=1.0)
                result["runs"].append(r)
                src["resident_tps"] = r["tokens_per_s"]
                log(f"none {name} B={b}: {r['tokens_per_s']:.1f} tok/s")
    del resident, gate_up, down
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    def policy_runs(name: str, b: int, frac: float) -> None:
        src = sources.get((name, b))
        if src is None:
            return
        cap = max(1, min(s.e, round(frac * s.e)))
        for policy in policies:
            if policy == "none" or (policy == "lease+pred" and (pred_path is None or name != "skewed")):
                continue  # the predictor reads trace embeddings: the random source has none it was trained on
            r = guarded(f"{policy} {name} B={b} cap={cap}", lambda policy=policy, src=src, cap=cap: run_repeated(
                repeats, policy, s, src, cap, device, store, None, warmup, policy_params(policy, pred_path),
                gate_precision, args.seed))
            if r is None:
                continue
            r.update(source=name, batch=b,
                     share_of_resident=r["tokens_per_s"] / src["resident_tps"] if src.get("resident_tps") else None)
            result["runs"].append(r)
            log(f"{policy:15s} {name} B={b} cap={cap}: {r['tokens_per_s']:8.1f} tok/s (median of {r['repeats']}, "
                f"spread {fmt(r['spread'], 2)}) hit {fmt(r['hit_rate'])} pf issued {r['prefetch_issued']}")

    # the seed's threshold sweep: lease + predictor on the skewed trace, ~32 % budget
    cap32 = max(1, round(0.32 * s.e))

    def sweep(b: int) -> None:
        src = sources.get(("skewed", b))
        if src is None or pred_path is None:
            return
        for thr in [float(x) for x in args.thresholds.split(",")]:
            r = guarded(f"sweep thr={thr} B={b}", lambda thr=thr, src=src: run_policy(
                "lease+pred", s, src, cap32, device, store, None, warmup, policy_params("lease+pred", pred_path, thr),
                gate_precision, args.seed))
            if r is not None:
                r.update(source="skewed", batch=b, threshold=thr,
                         long_leases=r["policy_stats"].get("long"), lease_hit_rate=r["policy_stats"].get("lease_hit_rate"),
                         share_of_resident=r["tokens_per_s"] / src["resident_tps"] if src.get("resident_tps") else None)
                result["threshold_sweep"].append(r)
                log(f"threshold {thr} B={b}: {r['tokens_per_s']:.1f} tok/s, held {fmt(r['held_gb'])} GB")

    # SERE on vs off at the largest batch: distinct experts per layer-step and misses
    def sere_section(name: str, b: int):
        from harness.techniques.sere.reroute import reroute

        src = sources[(name, b)]
        g = torch.Generator().manual_seed(args.seed + 11)
        a = torch.rand(s.e, s.e, generator=g)
        sim = ((a + a.T) / 2).fill_diagonal_(1.0).to(device)
        k_primary = max(1, s.k // 2)
        new_ids = [[reroute(ids, sim, k_primary, 0.0) for ids in step] for step in src["ids"]]
        for label, ids_all in (("off", src["ids"]), ("on", new_ids)):
            distinct = sum(len(set(x.reshape(-1).tolist())) for step in ids_all[warmup:] for x in step)
            distinct /= (len(ids_all) - warmup) * s.layers
            for policy in ("lru", "lease"):
                r = run_policy(policy, s, src, cap32, device, store, None, warmup, policy_params(policy, pred_path),
                               gate_precision, args.seed, sere={"ids": ids_all})
                r.update(source=name, batch=b, sere=label, k_primary=k_primary if label == "on" else None,
                         distinct_experts_per_layer_step=distinct,
                         misses_per_token=(r["misses"] or 0) / tokens)
                result["sere"].append(r)
                log(f"SERE {label} {name} B={b} {policy}: distinct {distinct:.1f}, hit {fmt(r['hit_rate'])}, "
                    f"{r['tokens_per_s']:.1f} tok/s")

    # accelerate's naive offload (B = 1, skewed routing: it copies every expert anyway, routing is irrelevant)
    def accelerate_section() -> None:
        if ("skewed", batches[0]) not in sources or args.accelerate_steps <= 0:
            return
        src = sources[("skewed", batches[0])]
        r = guarded("accelerate", lambda: accelerate_baseline(s, src, store, device, args.accelerate_steps))
        if r is not None:
            r.update(source="skewed", resident_fraction=0.0,
                     share_of_resident=r["tokens_per_s"] / src["resident_tps"] if src.get("resident_tps") else None)
            result["runs"].append(r)
            log(f"accelerate cpu_offload B={r['batch']}: {r['tokens_per_s']:.2f} tok/s")

    # priority order (--max-seconds stops starting new runs): the headline cell first (B = 1, ~32 %),
    # then its threshold sweep, larger batches, the baselines, the other budgets
    main_frac = min(budgets, key=lambda f: abs(f - 0.32))
    small = [b for b in batches if b == min(batches)]
    large = [b for b in batches if b != min(batches)]
    for b in small:
        for name in ("skewed", "random"):
            policy_runs(name, b, main_frac)
        if not args.only_headline:
            sweep(b)
    if args.only_headline:  # the headline cell only
        large, budgets = [], [main_frac]
    for b in large:
        for name in ("skewed", "random"):
            policy_runs(name, b, main_frac)
    accelerate_section()
    for name in ("skewed", "random") if not args.only_headline else ():
        if (name, max(batches)) in sources:
            guarded(f"sere {name}", lambda name=name: sere_section(name, max(batches)))
    for frac in [f for f in budgets if f != main_frac]:
        for b in batches:
            for name in ("skewed", "random"):
                policy_runs(name, b, frac)
    for b in large:
        sweep(b)
    order = {p: i for i, p in enumerate((*POLICIES, "accelerate"))}
    result["runs"].sort(key=lambda r: (r.get("source", ""), r.get("batch", 0), r.get("resident_fraction", 0),
                                       order.get(r["policy"], 99)))

    if hasattr(store, "unpin"):
        store.unpin()
    result["total_s"] = time.perf_counter() - t_all
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    md = [f"# Expert offload benchmark ({result['environment']['device_name']}, bf16, random-init, "
          f"{s.layers} MoE layers of Qwen3-30B-A3B shape; x48 = scaled to 48 layers)", "",
          table(result["runs"], MAIN_COLS), "", "## Threshold sweep (lease + predictor, skewed trace, ~32 % budget)", "",
          table(result["threshold_sweep"], [("B", "batch", 0), ("threshold", "threshold", 1),
                                              ("tok/s", "tokens_per_s", 1), ("hit", "hit_rate", 3),
                                              ("lease hit", "lease_hit_rate", 3), ("long leases", "long_leases", 0),
                                              ("held GB", "held_gb", 3), ("peak GB", "peak_alloc_gb", 2)]),
          "", "## SERE on vs off (~32 % budget)", "",
          table(result["sere"], [("source", "source", 0), ("B", "batch", 0), ("SERE", "sere", 0),
                                 ("policy", "policy", 0), ("distinct/layer/step", "distinct_experts_per_layer_step", 2),
                                 ("misses/token", "misses_per_token", 1), ("hit", "hit_rate", 3),
                                 ("tok/s", "tokens_per_s", 1)]), ""]
    result["goal"] = goal_check(result["runs"], main_frac)
    md += ["## Issue 15 goal (B=1, ~32 %: lease or lru+gate >= 50 % of resident AND beats lru)", "",
           "A policy *beats* lru only when its slowest repeat is faster than lru's fastest (ranges of ms/tok over "
           "repeats do not overlap); with --repeats 1 that is a single pass and says little.", "",
           *[f"- {g['source']}: {g['policy']} {fmt(g['share_of_resident'])} of resident, ms/tok "
             f"[{fmt(g['ms_min'], 2)}, {fmt(g['ms_max'], 2)}] vs lru [{fmt(g['lru_ms_min'], 2)}, "
             f"{fmt(g['lru_ms_max'], 2)}] -> share>=0.5: {g['half_of_resident']}, beats lru: {g['beats_lru']}"
             for g in result["goal"]], ""]
    if result["errors"]:
        md += ["## Errors", "", *[f"- {e['section']}: {e['error']}" for e in result["errors"]]]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    log(f"wrote {args.out}.json / .md")


if __name__ == "__main__":
    main()

"""Expert offload on one GPU, every policy timed side by side under the harness's latency protocol (issue 27).

    python benchmarks/bench_offload.py               # H200: ~3.5 min; writes results/benchmarks/offload.{json,md}
    python benchmarks/bench_offload.py --smoke       # CPU, tiny shapes, ~1 min (checks the script end to end)
    python benchmarks/bench_offload.py --plot results/benchmarks/offload.json   # the curves as PNGs beside it

What runs. ``--layers`` MoE layers with Qwen3-30B-A3B's per-layer shapes (hidden 2048, expert intermediate 768,
128 experts, top-8, bf16: 9.44 MB an expert), random-initialised, experts in one pinned host slab per weight
kind (:mod:`harness.techniques.offload.store`), the expert cache of :mod:`harness.techniques.offload.cache` and
the project's fused MoE Triton kernel reading the slots through the expert→slot table: the HF engine's
``harness_offload_moe`` path minus attention (the same for every policy, so per-token times are MoE-only).
Every layer reads its routing on the host (one device→host read per layer, as the engine does).

Protocol (``benchmarks/offload_protocol.py``): per cell, one untimed run of every variant first (warm-up of the
shape), then ``--repeats`` rounds, each running every variant once in a rotated order (A B C, B C A, ...), the
resident model among them; each run builds a fresh cache, decodes ``--warmup`` untimed steps, then
``--tokens`` timed ones. Reported per variant: mean ms/token with a bootstrap interval over the rounds, median,
spread; against lru: the paired per-round ratio with its interval and the verdict (``faster``/``slower`` only
when the two intervals do not overlap, else ``n.s.``); share of resident speed (paired).

Routing sources (fixed before the runs: every policy serves exactly the same accesses, the oracle's future is
exact); each table names its source and the JSON records its reuse distances:

- ``skewed``: the synthetic trace of :mod:`harness.techniques.offload.synthetic` (median reuse distance 2
  tokens, built to the published Qwen3-30B-A3B figures). No hidden states: the next-layer gate is emulated on
  the host (the true next-layer experts, each replaced by a random one with the probability the real gate
  missed on the ``random`` source);
- ``random``: random-initialised routers on the hidden states of a resident run (near-uniform routing: the
  hard case, not a trained model); the gate is the next layer's router on the current input, read in the same
  device→host transfer as the layer's own ids (:mod:`harness.techniques.offload.gate_read`);
- ``recorded:rag`` / ``recorded:ocr`` / ``recorded:mcq``: the routing the embedded trained model produced on its
  own tasks (``results/benchmarks/offload_trace_tiny{,_ocr,_mcq}.pt``, recorded with
  ``python -m harness.commands.offload_trace``: 4 MoE layers × 16 experts, top-4), replayed at Qwen3-30B-A3B
  expert sizes, requests one after another at B = 1 (gate emulated as for ``skewed``).

Sections, in priority order (``--max-seconds`` stops starting new ones; skipped ones are listed): the headline
cell (B = 1, ~32 % budget) on each source; a torch.profiler capture of lru and lease; budget → hit rate and
tokens/s; B = 1/4/16 against resident; lease threshold → long leases / held experts / tokens/s; accelerate's
``cpu_offload`` (copies every expert every step: the naive baseline, a median of a few steps, no interval).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from offload_protocol import compare, rounds  # noqa: E402

HEADLINE = ("none", "lru", "lfu", "lru+gate", "lease", "lease/nopf", "lease/dynamic", "oracle")
#: routing traces of the embedded trained model on its own tasks (python -m harness.commands.offload_trace)
RECORDED = {"rag": "offload_trace_tiny.pt", "ocr": "offload_trace_tiny_ocr.pt", "mcq": "offload_trace_tiny_mcq.pt"}


class Shapes:
    """Per-layer shapes: Qwen3-30B-A3B (or tiny with ``smoke``); ``e``/``k``/``layers`` may be overridden."""

    def __init__(self, smoke: bool, layers: int, e: int | None = None, k: int | None = None):
        self.h, self.i = (64, 32) if smoke else (2048, 768)
        self.e, self.k = e or (16 if smoke else 128), k or (4 if smoke else 8)
        self.layers = layers
        self.expert_bytes = 3 * self.h * self.i * 2  # bf16

    def as_dict(self) -> dict:
        return {"hidden": self.h, "expert_intermediate": self.i, "experts": self.e, "top_k": self.k,
                "layers": self.layers, "expert_bytes": self.expert_bytes}


def build_weights(s: Shapes, device: str, seed: int):
    """Resident experts ``[L, E, 2I, H]`` / ``[L, E, H, I]`` and routers ``[L, E, H]`` (std 0.02)."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.empty(s.layers, s.e, 2 * s.i, s.h, dtype=torch.bfloat16, device=device)
    down = torch.empty(s.layers, s.e, s.h, s.i, dtype=torch.bfloat16, device=device)
    for layer in range(s.layers):
        gate_up[layer].normal_(0, 0.02, generator=g)
        down[layer].normal_(0, 0.02, generator=g)
    routers = torch.randn(s.layers, s.e, s.h, generator=g, device=device, dtype=torch.float32) * 0.02
    return gate_up, down, routers


def route(routers: torch.Tensor, layer: int, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = torch.topk(torch.softmax(h.float() @ routers[layer].T, -1), k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(h.dtype)


def kernel(hidden, gate_up, down, ids, weights):
    from harness.kernels.fused_moe import fused_moe
    from harness.kernels.fused_moe_reference import fused_moe_reference

    if hidden.is_cuda:
        return fused_moe(hidden, gate_up, down, ids, weights)
    return fused_moe_reference(hidden, gate_up, down, ids, weights)


# -- routing sources ----------------------------------------------------------------------------------
def random_source(s: Shapes, gate_up, down, routers, steps: int, device: str, seed: int, drift: float) -> dict:
    """Routing of a resident run of the random model at B = 1 (ids, weights and each layer's MoE input), and
    the next-layer gate's precision. Between layers the hidden state gets the MoE output plus Gaussian noise
    of RMS ``drift``: the stand-in for attention (without it layer l's input predicts layer l+1 perfectly)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids_all, w_all, hid_all = [], [], []
    hit = tot = 0
    for _ in range(steps):
        h = torch.randn(1, s.h, generator=g, device=device).to(torch.bfloat16)
        ids_s, w_s, h_s = [], [], []
        for layer in range(s.layers):
            ids, w = route(routers, layer, h, s.k)
            if layer:
                guess = route(routers, layer, h_s[-1], s.k)[0]
                hit += len(set(guess.flatten().tolist()) & set(ids.flatten().tolist()))
                tot += ids.numel()
            ids_s.append(ids)
            w_s.append(w)
            h_s.append(h)
            noise = torch.randn(h.shape, generator=g, device=device) * drift
            h = (h.float() + kernel(h, gate_up[layer], down[layer], ids, w).float() + noise).to(torch.bfloat16)
        ids_all.append(ids_s)
        w_all.append(w_s)
        hid_all.append(h_s)
    host = torch.stack([torch.stack([x.cpu() for x in step], 1) for step in ids_all])  # [T, 1, L, k]
    return {"ids": ids_all, "weights": w_all, "hiddens": hid_all, "host": host, "routers": routers,
            "gate_precision": hit / max(tot, 1), "rows": 1}


def replay_source(rows: torch.Tensor, weights: torch.Tensor, device: str) -> dict:
    """A replay: ``rows`` ``[T, B, L, k]`` ids (and weights) → per step and layer device tensors ``[B, k]``."""
    ids_all, w_all = [], []
    for t in range(rows.shape[0]):
        ids = rows[t].to(device)
        w = weights[t].to(device=device, dtype=torch.bfloat16)
        ids_all.append([ids[:, layer].contiguous() for layer in range(rows.shape[2])])
        w_all.append([w[:, layer].contiguous() for layer in range(rows.shape[2])])
    return {"ids": ids_all, "weights": w_all, "hiddens": None, "host": rows, "rows": rows.shape[1]}


def skewed_rows(trace, batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch`` requests of a synthetic trace decoding together: ``[steps, B, L, k]``."""
    sl = trace.request_slices()[:batch]
    idx = torch.tensor([[x.start + t for x in sl] for t in range(steps)])
    return trace.ids[idx], trace.weights[idx]


def emulated_guesses(host: torch.Tensor, num_experts: int, precision: float, seed: int) -> list[list[list]]:
    """Per step and layer, the emulated next-layer gate's rows on the host: the true ids of that layer, each
    replaced by a random expert with probability ``1 - precision`` (drawn once, before any run)."""
    g = torch.Generator().manual_seed(seed)
    wrong = torch.rand(host.shape, generator=g) >= precision
    guess = torch.where(wrong, torch.randint(0, num_experts, host.shape, generator=g), host)  # [T, B, L, k]
    return [[guess[t, :, layer].tolist() for layer in range(host.shape[2])] for t in range(host.shape[0])]


def trace_of(host: torch.Tensor):
    """A :class:`RoutingTrace` of a replay (B = 1: one request) for :func:`reuse_statistics`."""
    from harness.techniques.offload.trace import RoutingTrace

    ids = host[:, 0].long()
    n, nl, k = ids.shape
    return RoutingTrace(ids, torch.ones(n, nl, k), torch.zeros(n, 1), torch.zeros(n, dtype=torch.long),
                        torch.arange(n), torch.arange(nl))


class ListTrace:
    """The routing a run serves, as the oracle's trace (``steps_by_batch`` → ``[b, L, k]`` per step)."""

    def __init__(self, host: torch.Tensor):
        self.steps = [host[t] for t in range(host.shape[0])]

    def steps_by_batch(self, batch_size: int):
        return self.steps


def aligned_oracle(ctx, warmup: int):
    """Belady on this run's steps, its pointer kept aligned across the warm-up reset (trace step = clock step +
    ``warmup``: the warm-up steps are the first steps of the same replay)."""
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


def variant_params(variant: str, threshold: float = 0.5) -> tuple[str, dict]:
    """``lease/dynamic`` → (``lease``, dynamic grace); ``lease/nopf`` → no gate prefetch; ``lease@0.7`` →
    threshold 0.7; others as named."""
    if variant.startswith("lease"):
        lease = {"score": "recency", "prefetch": "none" if "/nopf" in variant else "gate"}
        if "/dynamic" in variant:
            lease["grace_mode"] = "dynamic"
        if "@" in variant:
            threshold = float(variant.split("@")[1])
        return "lease", {"threshold": threshold, "lease": lease}
    return variant, {}


# -- one run ------------------------------------------------------------------------------------------
def run_once(variant: str, s: Shapes, src: dict, capacity: int, device: str, store, resident, warmup: int,
             tokens: int, profile: bool = False, verify: bool = False) -> dict:
    """One run: a fresh cache, ``warmup`` untimed steps, ``tokens`` timed ones. Returns ms/token and counts.
    ``verify``: afterwards, every resident slot is compared with the host store and the device table with the
    cache's bookkeeping (a copy race or a table error shows as ``slots_verified: false``)."""
    from harness.techniques.offload.cache import ExpertCache
    from harness.techniques.offload.gate_read import GateReader
    from harness.techniques.offload.policy import Geometry, PolicyContext, make_policy, policy_class
    from harness.techniques.offload.store import Mover

    name, params = variant_params(variant)
    cls = policy_class(name)
    cap = s.e if cls.mode == "resident" else capacity
    geometry = Geometry(s.layers, s.e, s.k, cap, s.expert_bytes, tuple(range(s.layers)))
    uses_gate = cls.needs_gate or (name == "lease" and params["lease"]["prefetch"] == "gate")
    reader = None
    if src["hiddens"] is not None:  # the real next-layer router, read with the layer's own ids
        reader = GateReader((lambda layer, h: route(src["routers"], layer, h, s.k)[0]) if uses_gate else None,
                            s.layers)
        gate = reader
    else:  # emulated on the host: hidden = the step index
        guesses = src["guesses"]
        gate = (lambda layer, t: guesses[t][layer]) if uses_gate else None
    ctx = PolicyContext(geometry, {"batch_size": src["rows"], **params}, ListTrace(src["host"]), gate, device)
    pol = aligned_oracle(ctx, warmup) if name == "oracle" else make_policy(name, ctx)
    mover = Mover(store, cap, device) if cls.mode != "resident" else None
    cache = ExpertCache(geometry, pol, mover, warm_after=8)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    h_rand = torch.randn(src["rows"], s.h, generator=torch.Generator().manual_seed(1)).to(device=device,
                                                                                         dtype=torch.bfloat16)
    rf = torch.profiler.record_function if profile else None
    t_start = None
    for t in range(warmup + tokens):
        if t == warmup:
            cache.reset_stats()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_start = time.perf_counter()
        cache.begin_pass("decode", rows=src["rows"], row_tokens=src["rows"])
        for layer in range(s.layers):
            ids, w = src["ids"][t][layer], src["weights"][t][layer]
            hidden = src["hiddens"][t][layer] if src["hiddens"] is not None else h_rand
            ctxm = rf("route_read") if rf else None
            if ctxm:
                ctxm.__enter__()
            rows = reader.read(layer, ids, hidden) if reader is not None else ids.tolist()  # the sync per layer
            needed = sorted({e for r in rows for e in r})
            if ctxm:
                ctxm.__exit__(None, None, None)
            if cache.mode == "resident":
                cache.acquire(layer, needed)
                kernel(hidden, resident[0][layer], resident[1][layer], ids, w)
            else:
                chunks = cache.plan(layer, needed)
                for chunk in chunks:
                    if rf:
                        with rf("acquire"):
                            cache.acquire(layer, chunk)
                    else:
                        cache.acquire(layer, chunk)
                    slots = mover.table[layer][ids]
                    if len(chunks) > 1:
                        keep = torch.isin(ids, torch.tensor(chunk, device=ids.device))
                        slots = torch.where(keep, slots, torch.full_like(slots, -1))
                    kernel(hidden, mover.gate_up[layer], mover.down[layer], slots, w)
                    if rf:
                        with rf("release_on_access"):
                            cache.release(layer)
                    else:
                        cache.release(layer)
            gh = hidden if src["hiddens"] is not None else t
            if rf:
                with rf("prefetch"):
                    cache.prefetch(pol.prefetch(layer, cache.clock, gh))
            else:
                cache.prefetch(pol.prefetch(layer, cache.clock, gh))
        cache.end_pass()
    sync()
    elapsed = time.perf_counter() - t_start
    summ, ps = cache.summary(), pol.stats()
    verified = None
    if verify and mover is not None:
        verified = True
        for layer, entries in enumerate(cache.entries):
            table = mover.table[layer].tolist()
            for e, ent in entries.items():
                verified &= table[e] == ent.slot
                dev = mover.gate_up.device
                verified &= bool(torch.equal(mover.gate_up[layer, ent.slot], store.gate_up[layer, e].to(dev)))
                verified &= bool(torch.equal(mover.down[layer, ent.slot], store.down[layer, e].to(dev)))
            verified &= sum(x >= 0 for x in table) == len(entries)
    out = {
        "variant": variant, "capacity": cap, "resident_fraction": cap / s.e,
        "ms_per_token": elapsed * 1e3 / tokens, "tokens_per_s": src["rows"] * tokens / elapsed,
        "peak_alloc_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "held_gb": ps["peak_held_bytes"] / 1e9 if "peak_held_bytes" in ps else None,
        "slots_verified": verified, "gate_reads": reader.reads if reader else None, "gate_fallbacks": reader.fallbacks if reader else None,
        **{k: summ.get(k) for k in ("hit_rate", "late_arrivals", "misses", "new_experts_per_layer_token",
                                    "prefetch_issued", "prefetch_precision", "prefetch_recall_on_time",
                                    "stall_ms_per_token", "achieved_gb_s", "h2d_bytes_per_token")},
        **{k: ps.get(k) for k in ("lease_hit_rate", "peak_long_leases", "peak_held_experts", "preempted", "forced",
                                  "trace_mismatch_steps")},
    }
    del mover, cache
    return out


def timed_cell(variants: list[str], repeats: int, run, log, verify: bool = True) -> dict:
    """Warm-up run of every variant (its slots verified), then ``repeats`` rotated rounds; the comparison."""
    verified = {v: run(v, verify=verify).get("slots_verified") for v in variants}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for order in rounds(variants, repeats):
        for v in order:
            runs[v].append(run(v))
    ms = {v: [r["ms_per_token"] for r in rs] for v, rs in runs.items()}
    cmp = compare(ms, reference="lru" if "lru" in ms else variants[0], resident="none")
    out = {}
    for v in variants:
        last = runs[v][-1]
        out[v] = {**{k: last[k] for k in last if k not in ("ms_per_token", "slots_verified")}, "ms": cmp[v],
                  "slots_verified_in_warmup": verified[v],
                  "hit_rate_rounds": [r["hit_rate"] for r in runs[v]]}
        c = cmp[v]
        share = c.get("share_of_resident", {}).get("mean")
        log(f"  {v:14s} {c['mean']:8.3f} ms/tok CI [{c['ci'][0] if c['ci'] else float('nan'):.3f}, "
            f"{c['ci'][1] if c['ci'] else float('nan'):.3f}] spread {c['spread']:.3f} hit {last['hit_rate']} "
            f"share {share if share is None else round(share, 3)} {c.get('verdict_vs_lru', '')}")
    return out


# -- tables and plots ---------------------------------------------------------------------------------
def f(v: Any, p: int = 3) -> str:
    return "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def ci(c: dict | None, p: int = 3) -> str:
    return "—" if not c or not c.get("ci") else f"[{c['ci'][0]:.{p}f}, {c['ci'][1]:.{p}f}]"


def cell_table(cell: dict) -> list[str]:
    head = ("| variant | ms/token mean | 95 % CI | spread | vs lru (paired) | CI | verdict vs lru | share of resident "
            "| hit | new/layer/tok | pf issued | pf prec | late | stall ms/tok | peak GB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for v, r in cell.items():
        m = r["ms"]
        vs = m.get("vs_lru") or {}
        sh = m.get("share_of_resident") or {}
        lines.append(f"| {v} | {f(m['mean'])} | {ci(m)} | {f(m['spread'], 2)} | {f(vs.get('mean'))} | {ci(vs)} | "
                     f"{m.get('verdict_vs_lru', '—')} | {f(sh.get('mean'))} {ci(sh, 2)} | {f(r.get('hit_rate'))} | "
                     f"{f(r.get('new_experts_per_layer_token'), 2)} | {f(r.get('prefetch_issued'))} | "
                     f"{f(r.get('prefetch_precision'), 2)} | {f(r.get('late_arrivals'))} | "
                     f"{f(r.get('stall_ms_per_token'), 2)} | {f(r.get('peak_alloc_gb'), 2)} |")
    return lines


def markdown(result: dict) -> str:
    env = result["environment"]
    md = [f"# Expert offload, paired protocol ({env.get('device_name')}, {result['dtype']}, {result['weights']}; "
          f"torch {env.get('torch_version')}, triton {env.get('triton_version')}, git {env.get('git_commit')})", "",
          f"Command: `{result['command']}`. {result['shapes']['layers']} MoE layers of Qwen3-30B-A3B expert shape "
          f"(MoE-only per-token times), {result['warmup_steps']} untimed + {result['timed_steps']} timed decode steps "
          "per run, a fresh cache per run, one untimed run per variant first, then rotated rounds. Interval: "
          "bootstrap (BCa) of the mean over rounds; verdict `faster`/`slower` only when the intervals of the "
          "variant and lru do not overlap, else `n.s.`; `vs lru` and `share of resident` are per-round paired "
          "ratios (ms/ms).", ""]
    for key, cell in result["cells"].items():
        src = result["sources"].get(cell["source"], {})
        rd = (src.get("reuse") or {}).get("reuse_distance", {})
        md += [f"## {key}", "", f"Source `{cell['source']}`: {src.get('what', '')}; reuse distance median "
               f"{f(rd.get('median'), 1)} / mean {f(rd.get('mean'), 1)} / p90 {f(rd.get('p90'), 1)} tokens; "
               f"B = {cell['batch']}, capacity {cell['capacity']} of {cell['experts']} experts per layer, "
               f"{cell.get('layers')} MoE layers, {cell.get('timed_steps')} timed steps per run, {cell['repeats']} "
               "rounds.", "", *cell_table(cell["variants"]), ""]
    if result.get("budget_curve"):
        md += ["## Budget → hit rate and tokens/s (skewed, B = 1)", "",
               "| budget | variant | hit | tokens/s (mean of rounds) | ms/token CI |", "|---|---|---|---|---|"]
        for row in result["budget_curve"]:
            md.append(f"| {row['resident_fraction']:.2f} | {row['variant']} | {f(row['hit_rate'])} | "
                      f"{f(row['tokens_per_s'], 1)} | {ci(row['ms'])} |")
        md.append("")
    if result.get("threshold_sweep"):
        md += ["## Lease threshold → long leases, held experts, tokens/s (skewed, B = 1, recency score, fixed cache)",
               "", "| threshold | long leases (peak) | held experts (peak) | held GB | hit | lease hit | tokens/s | "
               "ms/token CI |", "|---|---|---|---|---|---|---|---|"]
        for row in result["threshold_sweep"]:
            md.append(f"| {row['threshold']} | {f(row.get('peak_long_leases'))} | {f(row.get('peak_held_experts'))} | "
                      f"{f(row.get('held_gb'), 2)} | {f(row.get('hit_rate'))} | {f(row.get('lease_hit_rate'))} | "
                      f"{f(row['tokens_per_s'], 1)} | {ci(row['ms'])} |")
        md.append("")
    if result.get("accelerate"):
        a = result["accelerate"]
        md += [f"accelerate `cpu_offload` (every expert copied at every forward, B = 1): {f(a['ms_per_token'], 1)} "
               f"ms/token (median of {a['steps']} steps, no interval).", ""]
    if result.get("skipped"):
        md += ["Skipped (time budget or --skip): " + ", ".join(result["skipped"]), ""]
    if result["errors"]:
        md += ["## Errors", "", *[f"- {e['section']}: {e['error']}" for e in result["errors"]], ""]
    return "\n".join(md) + "\n"


def plot(path: str) -> list[str]:
    """PNG curves beside ``path`` from a result JSON: budget → hit rate / tokens/s, threshold → held experts /
    tokens/s, batch → tokens/s per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.load(open(path))
    stem, written = os.path.splitext(path)[0], []
    if r.get("budget_curve"):
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for v in sorted({x["variant"] for x in r["budget_curve"]}):
            rows = sorted((x for x in r["budget_curve"] if x["variant"] == v), key=lambda x: x["resident_fraction"])
            ax[0].plot([x["resident_fraction"] for x in rows], [x["hit_rate"] for x in rows], "o-", label=v)
            ax[1].plot([x["hit_rate"] for x in rows], [x["tokens_per_s"] for x in rows], "o-", label=v)
        ax[0].set(xlabel="experts on the GPU (share per layer)", ylabel="hit rate")
        ax[1].set(xlabel="hit rate", ylabel="tokens/s (MoE layers only)")
        ax[1].legend()
        fig.suptitle(f"{r['environment'].get('device_name')}, skewed trace, B = 1")
        fig.tight_layout()
        fig.savefig(stem + "_budget.png", dpi=110)
        written.append(stem + "_budget.png")
    batch = {k: c for k, c in r["cells"].items() if c["source"] == "skewed"}
    if len(batch) > 1:
        fig, ax = plt.subplots(figsize=(5, 4))
        names = sorted({v for c in batch.values() for v in c["variants"]})
        for v in names:
            pts = sorted((c["batch"], c["variants"][v]["tokens_per_s"]) for c in batch.values() if v in c["variants"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=v)
        ax.set(xscale="log", xlabel="batch", ylabel="tokens/s (last round)", title="skewed, ~32 % budget")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + "_batch.png", dpi=110)
        written.append(stem + "_batch.png")
    if r.get("threshold_sweep"):
        rows = r["threshold_sweep"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot([x["threshold"] for x in rows], [x.get("peak_held_experts") or 0 for x in rows], "o-", label="held experts")
        ax2 = ax.twinx()
        ax2.plot([x["threshold"] for x in rows], [x["tokens_per_s"] for x in rows], "s--", color="C1", label="tokens/s")
        ax.set(xlabel="offload.threshold", ylabel="peak experts held by leases")
        ax2.set_ylabel("tokens/s")
        fig.tight_layout()
        fig.savefig(stem + "_threshold.png", dpi=110)
        written.append(stem + "_threshold.png")
    return written


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--plot", default=None, help="only draw the curves of this result JSON")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default 12; smoke 3)")
    ap.add_argument("--tokens", type=int, default=None, help="timed decode steps per run (default 40; smoke 6)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per run first (default 10; smoke 3)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of the headline cells (default 7; smoke 5)")
    ap.add_argument("--curve-repeats", type=int, default=3, help="rounds of the budget/batch/threshold cells")
    ap.add_argument("--budget", type=float, default=0.32, help="headline share of experts on the GPU")
    ap.add_argument("--budgets", default="0.1,0.2,0.32,0.5,0.75,1.0")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--thresholds", default="0.9,0.7,0.5,0.3")
    ap.add_argument("--sources", default="skewed,random,recorded:rag,recorded:ocr,recorded:mcq")
    ap.add_argument("--accelerate-steps", type=int, default=2)
    ap.add_argument("--drift", type=float, default=0.2, help="per-layer hidden-state noise RMS (random source)")
    ap.add_argument("--max-seconds", type=float, default=200.0, help="no new section starts after this")
    ap.add_argument("--skip", default="", help="sections not to run, comma-separated labels as the log prints them "
                                               "(e.g. 'budget curve,batch 16'): a re-run of the later sections")
    ap.add_argument("--profile-dir", default=None, help="write the torch.profiler tables of lru and lease here")
    ap.add_argument("--out", default=None, help="output stem (default results/benchmarks/offload[_smoke])")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.plot:
        for p in plot(args.plot):
            print("wrote", p)
        return
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_offload needs a CUDA GPU (use --smoke on CPU)")
    s = Shapes(smoke, args.layers or (3 if smoke else 12))
    tokens = args.tokens or (6 if smoke else 40)
    warmup = args.warmup if args.warmup is not None else (3 if smoke else 10)
    repeats = args.repeats or (5 if smoke else 7)
    steps = warmup + tokens
    out = args.out or os.path.join(REPO, "results", "benchmarks", "offload_smoke" if smoke else "offload")
    from harness.results.envinfo import collect_environment
    from harness.techniques.offload.store import ExpertStore
    from harness.techniques.offload.synthetic import SyntheticSpec, reuse_statistics, synthetic_trace

    t_all = time.perf_counter()
    env = collect_environment(device)
    if not env.get("git_commit"):
        env["git_commit"] = os.environ.get("HARNESS_GIT_COMMIT")
    result: dict[str, Any] = {
        "benchmark": "offload", "protocol": "paired rounds (benchmarks/offload_protocol.py)",
        "command": "python benchmarks/bench_offload.py " + " ".join(sys.argv[1:]), "environment": env,
        "engine": "harness offload cache + fused MoE Triton kernel (HF engine's harness_offload_moe path, no attention)",
        "dtype": "bfloat16", "weights": "random-init", "shapes": s.as_dict(), "timed_steps": tokens,
        "warmup_steps": warmup, "repeats": repeats, "curve_repeats": args.curve_repeats, "sources": {},
        "cells": {}, "budget_curve": [], "threshold_sweep": [], "errors": [], "skipped": []}
    log = lambda m: print(f"[{time.perf_counter() - t_all:6.1f}s] {m}", flush=True)  # noqa: E731

    skip = {x.strip() for x in args.skip.split(",") if x.strip()}

    def guarded(label: str, fn):
        if label in skip:
            result["skipped"].append(f"{label} (--skip)")
            log(f"skipped (--skip): {label}")
            return None
        if time.perf_counter() - t_all > args.max_seconds:
            result["skipped"].append(label)
            log(f"skipped (time): {label}")
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            traceback.print_exc()
            result["errors"].append({"section": label, "error": f"{type(e).__name__}: {e}"})
            return None

    def make_store(shapes: Shapes, gate_up, down):
        st = ExpertStore(shapes.layers, shapes.e, shapes.i, shapes.h, torch.bfloat16, pin=not smoke)
        for layer in range(shapes.layers):
            st.put(layer, gate_up[layer], down[layer])
        return st

    t0 = time.perf_counter()
    gate_up, down, routers = build_weights(s, device, args.seed)
    store = make_store(s, gate_up, down)
    result["setup"] = {"build_and_pin_s": time.perf_counter() - t0, "pinned": store.pinned,
                       "host_store_gb": store.nbytes / 1e9}
    log(f"store {store.nbytes / 1e9:.2f} GB ({'pinned' if store.pinned else 'pageable'})")
    resident = (gate_up, down)
    cap = max(1, round(args.budget * s.e))
    sources: dict[str, dict] = {}
    wanted = args.sources.split(",")

    rnd = guarded("random source", lambda: random_source(s, gate_up, down, routers, steps, device, args.seed,
                                                           args.drift))
    precision = rnd["gate_precision"] if rnd else 0.8
    if rnd is not None and "random" in wanted:
        sources["random"] = rnd
        result["sources"]["random"] = {"what": "random-initialised routers on a resident run's hidden states (B = 1)",
                                       "gate": "next layer's router on the current input (measured precision "
                                               f"{precision:.3f})", "reuse": reuse_statistics(trace_of(rnd["host"]), lru_layers=4)}
    log(f"next-layer gate precision (random model): {precision:.3f}")
    spec = SyntheticSpec(num_layers=s.layers, num_experts=s.e, top_k=s.k, requests=16, tokens=steps, seed=args.seed)
    synth = synthetic_trace(spec)

    def skewed(batch: int) -> dict:
        rows, w = skewed_rows(synth, batch, steps)
        src = replay_source(rows, w, device)
        src["guesses"] = emulated_guesses(rows, s.e, precision, args.seed + batch)
        return src

    if "skewed" in wanted:
        sources["skewed"] = skewed(1)
        result["sources"]["skewed"] = {"what": "synthetic skewed trace (harness.techniques.offload.synthetic, "
                                               f"{spec})", "gate": f"emulated, precision {precision:.3f}",
                                       "reuse": reuse_statistics(synth, lru_layers=4)}

    def headline(name: str, src: dict, shapes: Shapes, st, res, capacity: int, batch: int, variants, reps: int,
                 n_tokens: int = tokens):
        log(f"cell {name} B={batch} capacity {capacity}/{shapes.e}")
        cell = timed_cell(list(variants), reps, lambda v, **kw: run_once(v, shapes, src, capacity, device, st, res,
                                                                            warmup, n_tokens, **kw), log)
        result["cells"][f"{name}, B = {batch}, {capacity}/{shapes.e} experts per layer"] = {
            "source": name, "batch": batch, "capacity": capacity, "experts": shapes.e, "repeats": reps,
            "timed_steps": n_tokens, "layers": shapes.layers, "variants": cell}

    for name in ("skewed", "random"):
        if name in sources:
            guarded(f"headline {name}", lambda name=name: headline(name, sources[name], s, store, resident, cap, 1,
                                                                   HEADLINE, repeats))

    def recorded(task: str) -> None:
        from harness.techniques.offload.trace import load_trace

        path = os.path.join(REPO, "results", "benchmarks", RECORDED[task])
        tr = load_trace(path)
        rs = Shapes(smoke, tr.num_layers, tr.num_experts, tr.top_k)
        n = min(tr.num_tokens, warmup + 4 * tokens)  # 4 layers: 4x the steps in about the same time
        rows, w = tr.ids[:n].unsqueeze(1), tr.weights[:n].unsqueeze(1)  # requests one after another, B = 1
        src = replay_source(rows, w, device)
        src["guesses"] = emulated_guesses(rows, rs.e, precision, args.seed + 99)
        gu, dn, _ = build_weights(rs, device, args.seed + 5)
        st = make_store(rs, gu, dn)
        result["sources"][f"recorded:{task}"] = {
            "what": f"routing of the embedded trained model on its {task} task ({os.path.relpath(path, REPO)}:"
                    f" {tr.num_requests} requests, {tr.num_tokens} decode tokens, {tr.num_layers} MoE layers x "
                    f"{tr.num_experts} experts, top-{tr.top_k}), replayed at Qwen3-30B-A3B expert size, B = 1",
            "gate": f"emulated, precision {precision:.3f}", "reuse": reuse_statistics(tr, lru_layers=tr.num_layers),
            "trace_meta": {k: tr.meta.get(k) for k in ("model", "dataset", "weights", "overrides")}}
        headline(f"recorded:{task}", src, rs, st, (gu, dn), max(rs.k, round(args.budget * rs.e)), 1, HEADLINE,
                 repeats, n - warmup)
        if hasattr(st, "unpin"):
            st.unpin()

    for task in RECORDED:
        if f"recorded:{task}" in wanted and os.path.exists(os.path.join(REPO, "results", "benchmarks", RECORDED[task])):
            guarded(f"headline recorded:{task}", lambda task=task: recorded(task))

    def profile() -> None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not smoke else [])
        os.makedirs(args.profile_dir, exist_ok=True)
        prof_out = {}
        for v in ("lru", "lease"):
            with tprof(activities=acts) as p:
                r = run_once(v, s, sources["skewed"], cap, device, store, resident, warmup, tokens, profile=True)
            table = p.key_averages().table(sort_by="cpu_time_total", row_limit=25)
            with open(os.path.join(args.profile_dir, f"offload_profile_{v.replace('+', '_')}.txt"), "w") as fh:
                fh.write(table)
            # A record_function range appears twice in key_averages (its CPU range and its GPU-side annotation,
            # the latter with no CPU time): keep the largest CPU total per name, not whichever came last.
            ev: dict[str, float] = {}
            for e in p.key_averages():
                if e.key in ("route_read", "acquire", "release_on_access", "prefetch"):
                    ev[e.key] = max(ev.get(e.key, 0.0), e.cpu_time_total / 1e3 / (warmup + tokens))
            prof_out[v] = {"ms_per_token_under_profiler": r["ms_per_token"], "host_ms_per_step": ev}
            log(f"profile {v}: {ev}")
        result["profile"] = prof_out

    if args.profile_dir and "skewed" in sources:
        guarded("profile", profile)

    def budget_curve() -> None:
        src = sources["skewed"]
        for frac in [float(x) for x in args.budgets.split(",")]:
            c = max(s.k, round(frac * s.e))
            log(f"budget {frac}")
            cell = timed_cell(["lru", "lease", "oracle"], args.curve_repeats,
                              lambda v, c=c, **kw: run_once(v, s, src, c, device, store, resident, warmup, tokens, **kw),
                              lambda m: None, verify=False)
            for v, r in cell.items():
                result["budget_curve"].append({"variant": v, "resident_fraction": c / s.e, "capacity": c,
                                               "hit_rate": r["hit_rate"], "ms": r["ms"],
                                               "tokens_per_s": 1e3 / r["ms"]["mean"]})

    if "skewed" in sources:
        guarded("budget curve", budget_curve)
    for b in [int(x) for x in args.batches.split(",") if x]:
        def batch_cell(b=b):
            headline("skewed", skewed(b), s, store, resident, cap, b, ("none", "lru", "lease", "oracle"),
                     args.curve_repeats)
        if "skewed" in sources:
            guarded(f"batch {b}", batch_cell)

    def thresholds() -> None:
        src = sources["skewed"]
        vs = [f"lease@{t}" for t in args.thresholds.split(",")]
        cell = timed_cell(vs, args.curve_repeats, lambda v, **kw: run_once(v, s, src, cap, device, store, resident,
                                                                           warmup, tokens, **kw), log, verify=False)
        for v, r in cell.items():
            result["threshold_sweep"].append({"threshold": float(v.split("@")[1]), **r,
                                              "tokens_per_s": 1e3 / r["ms"]["mean"]})

    if "skewed" in sources:
        guarded("threshold sweep", thresholds)

    def accelerate() -> None:
        from accelerate import cpu_offload

        class Experts(torch.nn.Module):
            def __init__(self, gu, dn):
                super().__init__()
                self.gate_up = torch.nn.Parameter(gu, requires_grad=False)
                self.down = torch.nn.Parameter(dn, requires_grad=False)

            def forward(self, h, ids, w):
                return kernel(h, self.gate_up, self.down, ids, w)

        mods = [cpu_offload(Experts(store.gate_up[i], store.down[i]), execution_device=torch.device(device))
                for i in range(s.layers)]
        src, times = sources["skewed"], []
        h = torch.randn(1, s.h, device=device).to(torch.bfloat16)
        for t in range(args.accelerate_steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i, m in enumerate(mods):
                m(h, src["ids"][t][i], src["weights"][t][i])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        from importlib.metadata import version

        result["accelerate"] = {"ms_per_token": sorted(times[1:])[len(times[1:]) // 2] * 1e3,
                                "steps": args.accelerate_steps, "accelerate_version": version("accelerate")}

    if not smoke and args.accelerate_steps > 0 and "skewed" in sources:
        guarded("accelerate", accelerate)
    if hasattr(store, "unpin"):
        store.unpin()
    result["total_s"] = time.perf_counter() - t_all
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    md = markdown(result)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    print(md)
    log(f"wrote {out}.json / .md")


if __name__ == "__main__":
    main()

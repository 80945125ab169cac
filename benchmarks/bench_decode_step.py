"""Benchmark a whole decode step (TPOT) of a Qwen3-30B-A3B-shaped model: experts implementation × SERE.

    python benchmarks/bench_decode_step.py --modes graph            # manual CUDA graphs, B = 1, 16, 64 (~2 min)
    python benchmarks/bench_decode_step.py --modes compile          # torch.compile reduce-overhead (budget-bound)
    python benchmarks/bench_decode_step.py --modes compile --batches 1,16 --sere off,k1
    python benchmarks/bench_decode_step.py                          # both modes in one process (graph first)
    python benchmarks/bench_decode_step.py --smoke                  # CPU: tiny model, same code path

Model: ``transformers.Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's shapes (hidden 2048, 48 layers, 32 q /
4 kv heads, head_dim 128, 128 experts, top-8, moe_intermediate 768, norm_topk_prob, vocab 151936;
30.5 B parameters, 57 GiB bf16), **random-initialised** directly on the GPU (built under
``torch.device("cuda")``, transformers' own normal init; no checkpoint). Random routers route near-uniformly,
unlike a trained model: the expert unions here are larger than a real model's, state it with the numbers.

Per batch size B: a 64-token random prompt is prefilled once into a ``StaticCache`` (max 128 positions);
every variant then decodes from position 64 (the cache's position counters are reset before each
variant, so each one sees the same prefix), greedy tokens fed back on the device. TPOT = median over
``--steps`` decode steps of CUDA-event time per step (p10/p90 too, and the wall-clock mean).

Variants, measured side by side in one process on one model:

- experts implementation: ``grouped_mm`` (transformers' default, the stock baseline) and
  ``harness_fused_moe`` (``harness.engines.hf.experts``), switched with ``model.set_experts_implementation``;
  ``batched_mm`` / ``eager`` can be added with ``--impls`` (batched_mm ran out of memory at B = 64 before;
  eager syncs the host and cannot be graphed);
- SERE: ``off``, ``k2`` (k_primary 2, rho 0), ``k1`` (k_primary 1, rho 0), random per-layer similarity
  1 − d/max d over random 64-d vectors (seeded). Applied to the decode steps only, by
  ``harness.engines.hf.sere.install_sere`` when importable (mode "decode", no statistics while timing),
  with the re-routing op wrapped as a ``torch.library`` custom op (opaque to dynamo, CUDA-graph safe); else
  by an equivalent forward hook on every ``mlp.gate``. One extra untimed eager step per (B, SERE) records
  the mean per-layer expert union before/after re-routing.

Modes (``--modes``):

- ``graph``: the eager HF decode step (forward + argmax + feed-back) captured manually in one
  ``torch.cuda.CUDAGraph`` and replayed; cheap to build (one capture per variant);
- ``compile``: ``torch.compile(step, mode="reduce-overhead", dynamic=False)`` (inductor + CUDA-graph
  trees), ``torch._dynamo.reset()`` between variants; compile time and graph-break counts are recorded.
  This is the stock baseline of environment.md (grouped_mm compiled: 7.8 / 22.3 / 32.9 ms at B = 1/16/64).

Before timing, one eager step per batch compares ``harness_fused_moe`` with ``grouped_mm`` from the same
cache state (logits relative error, greedy-token agreement). Byte floor per step (weights only): the
non-expert weights + active experts × 3·H·I·2 per layer, at the measured 4.27 TB/s.

Robustness: every variant runs in its own try/except (an error or OOM is recorded, the rest go on); JSON +
Markdown are rewritten after every variant (``results/benchmarks/decode_step_<modes>.json`` / ``.md``, e.g.
``decode_step_graph.json``, so separate runs per mode do not overwrite each other); a time
budget (``--budget-s``, default 480 s) skips what is left, marked as skipped, so a 10-minute device command
always returns its file. Imports torch, triton, transformers and harness (envinfo, SERE, the kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     decoder_sparse_step=1, mlp_only_layers=[])
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48,
             norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             decoder_sparse_step=1, mlp_only_layers=[])
BATCHES = [1, 16, 64]
IMPLS = ["grouped_mm", "harness_fused_moe"]
SERE = {"off": None, "k2": 2, "k1": 1}
MODES = ["graph", "compile"]
PROMPT = 64
MAX_CACHE = 128
COPY_BYTES_PER_S = 4.27e12
STOCK_COMPILED_MS = {1: 7.8, 16: 22.3, 64: 32.9}   # environment.md, grouped_mm, reduce-overhead


# -------------------------------------------------------------------------------------------- the model


def build_model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**shape)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    t0 = time.perf_counter()
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    if device == "cuda":
        torch.cuda.synchronize()
    misplaced = [n for n, p in model.named_parameters()
                 if p.device.type != torch.device(device).type or p.dtype != dtype]
    if misplaced:
        raise RuntimeError(f"{len(misplaced)} parameters not {dtype} on {device}, e.g. {misplaced[:3]}")
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    if not (torch.isfinite(experts).all() and experts.float().std() > 0):
        raise RuntimeError("expert weights were not initialised (NaN/inf or constant)")
    return model, time.perf_counter() - t0


def set_impl(model, impl: str) -> None:
    model.set_experts_implementation(impl)
    got = {m.config._experts_implementation for m in model.modules() if hasattr(m, "gate_up_proj")}
    if got != {impl}:
        raise RuntimeError(f"set_experts_implementation({impl!r}) left {got}")


def cache_layers(cache):
    return [layer for layer in cache.layers if hasattr(layer, "cumulative_length")]


def reset_position(cache, position: int) -> None:
    """Rewind every static layer's write position (in place: the tensors keep their static addresses)."""
    for layer in cache_layers(cache):
        if isinstance(layer.cumulative_length, torch.Tensor):
            layer.cumulative_length.fill_(position)
        else:
            layer.cumulative_length = position


# ------------------------------------------------------------------------------------------------- SERE


_SERE_OP = None


def sere_op():
    """``harness_bench::sere_reroute``: ``reroute_op`` behind a custom op (one opaque node for dynamo)."""
    global _SERE_OP
    if _SERE_OP is None:
        from harness.kernels.reroute import reroute_op

        @torch.library.custom_op("harness_bench::sere_reroute", mutates_args=())
        def _op(ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
                protected: Optional[torch.Tensor] = None, row_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            return reroute_op(ids, similarity, k_primary, rho, protected, row_mask)     # always a new tensor

        @_op.register_fake
        def _(ids, similarity, k_primary, rho, protected=None, row_mask=None):
            return torch.empty_like(ids)

        _SERE_OP = _op
    # hf_sere calls op(ids, similarity, k_primary, rho, protected, live_rows)
    return lambda ids, sim, kp, rho, protected=None, row_mask=None: _SERE_OP(ids, sim, kp, float(rho), protected,
                                                                             row_mask)


class GateHookSere:
    """Fallback when ``harness.engines.hf.sere`` is not available: the same rule (decode passes only)
    with one forward hook per router."""

    def __init__(self, model, sims, k_primary, rho, collect_stats=False):
        from harness.techniques.sere.reroute import expert_union

        self.before, self.after, self.hooks = [], [], []
        op = sere_op()
        blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        for block, sim in zip(blocks, sims, strict=True):
            state = {"decode": False}

            def pre(module, args, state=state):
                state["decode"] = args[0].dim() == 3 and args[0].shape[1] == 1

            def hook(module, args, out, sim=sim, state=state):
                if not state["decode"]:
                    return None
                new = op(out[2], sim, k_primary, rho)
                if collect_stats:
                    self.before.append(expert_union(out[2]))
                    self.after.append(expert_union(new))
                return (out[0], out[1], new)

            self.hooks += [block.register_forward_pre_hook(pre), block.gate.register_forward_hook(hook)]

    def stats(self):
        mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
        return {"expert_union_before": mean(self.before), "expert_union_after": mean(self.after)}

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []


_FALLBACK_WARNED: list[str] = []


def install(model, sims, k_primary, rho, collect_stats, which: str):
    """SERE hooks: ``hf_sere.install_sere`` (``which`` = hf_sere, or auto when it imports and installs),
    else the bench's own gate hook (same rule)."""
    if which in ("auto", "hf_sere"):
        try:
            from harness.engines.hf.sere import install_sere

            handle = install_sere(model, torch.stack(sims), k_primary, rho, mode="decode",
                                  collect_stats=collect_stats, op=sere_op())
            handle.hook_name = "harness.engines.hf.sere.install_sere"
            return handle
        except Exception as exc:  # noqa: BLE001 - auto: fall back to the equivalent own hook
            if which == "hf_sere":
                raise
            if not _FALLBACK_WARNED:
                _FALLBACK_WARNED.append(short_error(exc))
                print(f"hf_sere.install_sere unusable ({_FALLBACK_WARNED[0]}); using the bench gate hook",
                      flush=True)
    return GateHookSere(model, sims, k_primary, rho, collect_stats)


def random_similarities(layers: int, num_experts: int, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        vecs = torch.randn(num_experts, 64, generator=g)
        dist = torch.cdist(vecs, vecs)
        out.append((1.0 - dist / dist.max()).fill_diagonal_(1.0).to(device))
    return out


# ----------------------------------------------------------------------------------------------- a step


class Decoder:
    """One batch: its static cache (prefilled once), input buffer and step function."""

    def __init__(self, model, batch: int, vocab: int, device: str, seed: int):
        from transformers import StaticCache

        self.model, self.batch, self.device = model, batch, device
        self.cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (batch, PROMPT), generator=g).to(device)
        with torch.inference_mode():
            out = model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.prefill_finite = bool(torch.isfinite(out.logits).all())
        self.first_ids = out.logits[:, -1].argmax(-1, keepdim=True).clone()
        self.ids = self.first_ids.clone()
        del out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def step(self) -> None:
        """Eager step with greedy feed-back (what the manual CUDA graph captures)."""
        logits = self.forward(self.ids)
        self.ids.copy_(logits.argmax(-1, keepdim=True))

    def rewind(self) -> None:
        reset_position(self.cache, PROMPT)
        self.ids.copy_(self.first_ids)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(run_step, steps: int, device: str) -> dict:
    """Per-step CUDA-event times (ms) and the wall-clock mean; CPU: host times."""
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        sync(device)
        t0 = time.perf_counter()
        for start, end in events:
            start.record()
            run_step()
            end.record()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3 / steps
        times = [s.elapsed_time(e) for s, e in events]
    else:
        times = []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            run_step()
            times.append((time.perf_counter() - t) * 1e3)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"tpot_ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9), "wall_mean_ms": wall,
            "steps": steps}


def run_graph(dec: Decoder, steps: int, warmup: int, device: str) -> dict:
    """Manual CUDA graph of the eager step (CPU smoke: the eager step itself)."""
    res = {}
    with torch.inference_mode():
        if device != "cuda":
            dec.rewind()
            dec.step()
            dec.rewind()
            res.update(time_steps(dec.step, steps, device))
            return res
        dec.rewind()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                dec.step()
        torch.cuda.current_stream().wait_stream(stream)
        dec.rewind()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            dec.step()
        res["capture_s"] = time.perf_counter() - t0
        dec.rewind()
        for _ in range(warmup):
            graph.replay()
        res.update(time_steps(graph.replay, steps, device))
        del graph
    return res


def run_compile(dec: Decoder, steps: int, warmup: int, device: str) -> dict:
    """torch.compile(mode="reduce-overhead") of the forward; argmax feed-back outside (two small kernels)."""
    import torch._dynamo as dynamo
    import torch._dynamo.utils

    dynamo.reset()
    dynamo.utils.counters.clear()
    backend = {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "aot_eager", "fullgraph": True}
    compiled = torch.compile(dec.forward, dynamic=False, **backend)
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)

    def step():
        mark()
        logits = compiled(dec.ids)
        dec.ids.copy_(logits.argmax(-1, keepdim=True))

    res = {}
    with torch.inference_mode():
        dec.rewind()
        t0 = time.perf_counter()
        step()
        sync(device)
        res["compile_s"] = time.perf_counter() - t0
        for _ in range(max(2, warmup)):
            step()
        dec.rewind()
        res.update(time_steps(step, steps, device))
    counters = dynamo.utils.counters
    res["graph_breaks"] = sum(counters["graph_break"].values())
    res["unique_graphs"] = counters["stats"].get("unique_graphs")
    res["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0)   # > 0: ran without CUDA graphs
    dynamo.reset()
    return res


def compare_impls(model, dec: Decoder, impls: list[str]) -> dict:
    """One eager step per implementation from the same cache state: logits vs the first impl."""
    outs = {}
    with torch.inference_mode():
        for impl in impls:
            set_impl(model, impl)
            dec.rewind()
            outs[impl] = dec.forward(dec.ids).float()
    base = outs[impls[0]]
    res = {}
    for impl in impls[1:]:
        res[impl] = {"vs": impls[0],
                     "logits_rel_err": float((outs[impl] - base).norm() / base.norm()),
                     "argmax_agree": float((outs[impl].argmax(-1) == base.argmax(-1)).float().mean())}
    return res


def sere_union(model, dec: Decoder, sims, kp, rho, which) -> dict:
    """Mean per-layer expert union of one eager decode step, before / after re-routing (syncs; untimed)."""
    handle = install(model, sims, kp if kp else 10**6, rho, True, which)
    try:
        with torch.inference_mode():
            dec.rewind()
            dec.forward(dec.ids)
        st = handle.stats()
        return {"expert_union_before": st.get("expert_union_before"),
                "expert_union_after": st.get("expert_union_after"),
                "hook": getattr(handle, "hook_name", "bench gate hook (GateHookSere)")}
    finally:
        handle.remove()


def floor_ms(shape: dict, batch: int, active_experts: float | None) -> float | None:
    """Bytes one decode step must read at least (bf16): attention, router and lm_head weights, the active
    experts' weights per layer, and the static KV cache (sdpa reads all MAX_CACHE positions), at 4.27 TB/s."""
    if active_experts is None:
        return None
    h, i, L = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + shape["num_experts"] * h + active_experts * 3 * h * i
    kv_cache = batch * L * 2 * kv * MAX_CACHE
    return 2 * (L * per_layer + shape["vocab_size"] * h + kv_cache) / COPY_BYTES_PER_S * 1e3


# ---------------------------------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = ["# Decode step (TPOT) of a random-initialised Qwen3-30B-A3B-shaped model", "",
             f"{env.get('device_name')}, torch {env.get('torch_version')}, triton {env.get('triton_version')}, "
             f"transformers {env.get('transformers_version')}; {result['config']['dtype']}, prompt {PROMPT}, "
             f"StaticCache {MAX_CACHE}, "
             f"random weights (near-uniform routing); TPOT = median CUDA-event time per step over "
             f"{result['config']['steps']} greedy steps. SERE rho = 0, random similarity.", "",
             "| mode | B | SERE | experts/layer (before → after) | floor ms | grouped_mm ms | harness_fused_moe ms "
             "| speed-up | notes |", "|---|---|---|---|---|---|---|---|---|"]
    rows: dict = {}
    for r in result["rows"]:
        rows.setdefault((r["mode"], r["B"], r["sere"]), {})[r["impl"]] = r
    for (mode, batch, sere), by_impl in rows.items():
        union = result["sere_unions"].get(f"{batch}/{sere}", {})
        before, after = union.get("expert_union_before"), union.get("expert_union_after")
        uni = f"{before:.1f} → {after:.1f}" if before is not None and after is not None else "–"
        fl = floor_ms(result["config"]["shape"], batch, after if sere != "off" else before)

        def cell(impl):
            r = by_impl.get(impl)
            if r is None:
                return "–"
            if "tpot_ms" in r:
                return f"{r['tpot_ms']:.2f}"
            return "skipped" if r.get("skipped") else ("OOM" if "OutOfMemory" in r.get("error", "") else "err")

        g, f = by_impl.get("grouped_mm", {}), by_impl.get("harness_fused_moe", {})
        speed = f"{g['tpot_ms'] / f['tpot_ms']:.2f}×" if "tpot_ms" in g and "tpot_ms" in f else "–"
        notes = []
        for impl, r in by_impl.items():
            if r.get("graph_breaks"):
                notes.append(f"{impl}: {r['graph_breaks']} graph breaks")
            if r.get("cudagraph_skips"):
                notes.append(f"{impl}: CUDA graphs skipped")
            if r.get("error"):
                notes.append(f"{impl}: {r['error'][:80]}")
        others = [f"{impl} {cell(impl)}" for impl in by_impl if impl not in ("grouped_mm", "harness_fused_moe")]
        lines.append(f"| {mode} | {batch} | {sere} | {uni} | {f'{fl:.2f}' if fl else '–'} | {cell('grouped_mm')} | "
                     f"{cell('harness_fused_moe')} | {speed} | {'; '.join(others + notes)} |")
    if result.get("checks"):
        lines += ["", "Eager-step check (same cache state): " + "; ".join(
            f"B={b}: {impl} logits rel err {c['logits_rel_err']:.2e}, greedy agree {c['argmax_agree']:.0%}"
            for b, per in result["checks"].items() for impl, c in per.items()
            if isinstance(c, dict) and "logits_rel_err" in c)]
    lines += ["", f"Stock compiled grouped_mm measured earlier (environment.md): "
              f"{STOCK_COMPILED_MS[1]} / {STOCK_COMPILED_MS[16]} / {STOCK_COMPILED_MS[64]} ms at B = 1 / 16 / 64."]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(result))


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--impls", default=",".join(IMPLS), help="experts implementations (grouped_mm first)")
    parser.add_argument("--sere", default=",".join(SERE), help=f"subset of {list(SERE)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES}, run in this order")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip what is left after this many seconds")
    parser.add_argument("--sere-hook", choices=["auto", "hf_sere", "own"], default="auto")
    parser.add_argument("--quick", action="store_true", help="B=1,16; graph mode; SERE off,k1")
    parser.add_argument("--smoke", action="store_true", help="CPU run of the code path on a tiny model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("No CUDA device: nothing to time. Use --smoke for a CPU run of the code path on a tiny model.")
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.quick:
        args.batches, args.modes, args.sere = "1,16", "graph", "off,k1"
    batches = [int(b) for b in args.batches.split(",") if b]
    impls = [i for i in args.impls.split(",") if i]
    seres = [s for s in args.sere.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for name, chosen, known in (("sere", seres, SERE), ("mode", modes, MODES)):
        if any(c not in known for c in chosen):
            parser.error(f"unknown {name} in {chosen}; known: {list(known)}")

    from harness.engines.hf import experts as hf_experts
    from harness.results.envinfo import collect_environment

    hf_experts.register()
    device = "cuda" if cuda else "cpu"
    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    dtype = torch.bfloat16 if cuda else torch.float32
    default_dir = Path(tempfile.gettempdir()) if args.smoke else ROOT / "results" / "benchmarks"
    out_path = args.out or default_dir / f"decode_step{'_smoke' if args.smoke else ''}_{'+'.join(modes)}.json"
    t_start = time.perf_counter()
    if cuda:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(64, dynamo.config.cache_size_limit)

    model, build_s = build_model(shape, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {n_params / 1e9:.2f} B-parameter model on {device} in {build_s:.1f} s", flush=True)
    sims = random_similarities(shape["num_hidden_layers"], shape["num_experts"], device, args.seed + 1)
    result = {
        "benchmark": "decode_step",
        "environment": collect_environment(device),
        "config": {"shape": shape, "parameters": n_params, "dtype": str(dtype).removeprefix("torch."),
                   "weights": "random-init (transformers init, on device)", "prompt": PROMPT,
                   "max_cache_len": MAX_CACHE, "steps": args.steps, "warmup": args.warmup, "batches": batches,
                   "impls": impls, "sere": seres, "modes": modes, "rho": 0.0, "seed": args.seed,
                   "similarity": "per layer 1 - d/max d over random 64-d expert vectors",
                   "attn_implementation": "sdpa", "build_s": build_s},
        "rows": [], "checks": {}, "sere_unions": {},
    }

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    decoders: dict[int, Decoder] = {}
    for mode in modes:
        for batch in batches:
            try:
                if batch not in decoders:
                    if decoders:            # one cache at a time
                        decoders.clear()
                        if cuda:
                            torch.cuda.empty_cache()
                    set_impl(model, impls[0])
                    decoders[batch] = Decoder(model, batch, shape["vocab_size"], device, args.seed + batch)
                dec = decoders[batch]
            except Exception as exc:  # noqa: BLE001
                for impl in impls:
                    for sere in seres:
                        result["rows"].append({"mode": mode, "B": batch, "impl": impl, "sere": sere,
                                               "error": "prefill: " + short_error(exc)})
                decoders.clear()
                continue
            if str(batch) not in result["checks"] and not over_budget():
                check = {"prefill_logits_finite": dec.prefill_finite}
                try:
                    if len(impls) > 1:
                        check.update(compare_impls(model, dec, impls))
                except Exception as exc:  # noqa: BLE001
                    check["error"] = short_error(exc)
                result["checks"][str(batch)] = check
            for sere in seres:
                kp = SERE[sere]
                key = f"{batch}/{sere}"
                if key not in result["sere_unions"] and not over_budget():
                    try:
                        set_impl(model, impls[0])
                        result["sere_unions"][key] = sere_union(model, dec, sims, kp, 0.0, args.sere_hook)
                    except Exception as exc:  # noqa: BLE001
                        result["sere_unions"][key] = {"error": short_error(exc)}
                for impl in impls:
                    row = {"mode": mode, "B": batch, "impl": impl, "sere": sere}
                    result["rows"].append(row)
                    if over_budget():
                        row["skipped"] = f"time budget {args.budget_s:.0f} s exhausted"
                        continue
                    handle = None
                    try:
                        set_impl(model, impl)
                        if kp is not None:
                            handle = install(model, sims, kp, 0.0, False, args.sere_hook)
                        runner = run_graph if mode == "graph" else run_compile
                        row.update(runner(dec, args.steps, args.warmup, device))
                    except Exception as exc:  # noqa: BLE001 - one variant must not lose the others
                        row["error"] = short_error(exc)
                        row["traceback"] = traceback.format_exc(limit=6)
                        if cuda:
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                    finally:
                        if handle is not None:
                            handle.remove()
                    msg = (f"{row['tpot_ms']:.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f}, "
                           f"wall {row['wall_mean_ms']:.2f})" if "tpot_ms" in row else row.get("error"))
                    extra = f" compile {row['compile_s']:.1f}s breaks {row['graph_breaks']}" \
                        if "compile_s" in row else ""
                    print(f"{mode:<8} B={batch:<3} sere={sere:<3} {impl:<18} {msg}{extra}", flush=True)
                    result["elapsed_s"] = time.perf_counter() - t_start
                    write(result, out_path)
    result["elapsed_s"] = time.perf_counter() - t_start
    result["sere_hook_fallback_reason"] = _FALLBACK_WARNED[0] if _FALLBACK_WARNED else None
    if cuda:
        result["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    write(result, out_path)
    print(markdown(result))
    print(f"wrote {out_path} and {out_path.with_suffix('.md')} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

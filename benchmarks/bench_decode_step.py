"""Benchmark a whole decode step (TPOT) of a Qwen3-30B-A3B-shaped model: experts implementation × SERE.

    python benchmarks/bench_decode_step.py --modes graph            # manual CUDA graphs, B = 1, 16, 64 (~2 min)
    python benchmarks/bench_decode_step.py --modes compile          # torch.compile reduce-overhead (budget-bound)
    python benchmarks/bench_decode_step.py --modes compile --batches 1,16 --sere off,k1
    python benchmarks/bench_decode_step.py                          # both modes in one process (graph first)
    python benchmarks/bench_decode_step.py --smoke                  # CPU: tiny model, same code path

Model: ``transformers.Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's shapes (hidden 2048, 48 layers, 32 q /
4 kv heads, head_dim 128, 128 experts, top-8, moe_intermediate 768, norm_topk_prob, vocab 151936;
30.5 B parameters, 57 GiB bf16), **random-initialised** directly on the GPU: ``harness.models.real_shapes``
(``shapes_config("qwen3_30b_a3b")`` — the checkpoint's rope theta and special ids too — and
``build_shapes_model``: N(0, 0.02) weights drawn from ``--seed``, norms 1, the distribution of transformers' own
init; no checkpoint), through ``_common.build_qwen3_moe``. Random routers route near-uniformly,
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
always returns its file. Imports torch, triton, transformers and harness (envinfo, SERE, the kernel, real_shapes);
the model, decoder, timers and writer are ``benchmarks/_common.py``'s.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from _common import (MAX_CACHE, PROMPT, Decoder, add_device_args, build_qwen3_moe, free_memory, qwen3_moe_config,
                     random_similarities, results_path, run_graph, sere_op, set_impl, short_error, sync, text_shape,
                     time_steps, use_cuda, write_result)

BATCHES = [1, 16, 64]
IMPLS = ["grouped_mm", "harness_fused_moe"]
SERE = {"off": None, "k2": 2, "k1": 1}
MODES = ["graph", "compile"]
COPY_BYTES_PER_S = 4.27e12
STOCK_COMPILED_MS = {1: 7.8, 16: 22.3, 64: 32.9}   # environment.md, grouped_mm, reduce-overhead


# ------------------------------------------------------------------------------------------------- SERE


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


# ----------------------------------------------------------------------------------------------- a step
# (graph mode: ``_common.run_graph``, the manual CUDA graph of ``_common.Decoder.step``, shared with run_path_gaps)


def run_compile(dec: Decoder, steps: int, warmup: int, cuda: bool) -> dict:
    """torch.compile(mode="reduce-overhead") of the forward; argmax feed-back outside (two small kernels)."""
    import torch._dynamo as dynamo
    import torch._dynamo.utils

    dynamo.reset()
    dynamo.utils.counters.clear()
    backend = {"mode": "reduce-overhead"} if cuda else {"backend": "aot_eager", "fullgraph": True}
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
        sync(cuda)
        res["compile_s"] = time.perf_counter() - t0
        for _ in range(max(2, warmup)):
            step()
        dec.rewind()
        res.update(time_steps(step, steps, cuda))
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
    parser.add_argument("--seed", type=int, default=0)
    add_device_args(parser, "CPU run of the code path on a tiny model")
    args = parser.parse_args()

    cuda = use_cuda(args, interpret=True)
    if cuda is None:
        return 0
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
    config = qwen3_moe_config(args.smoke)
    shape = text_shape(config)
    dtype = torch.bfloat16 if cuda else torch.float32
    out_path = args.out or results_path(f"decode_step{'_smoke' if args.smoke else ''}_{'+'.join(modes)}.json",
                                        args.smoke)
    t_start = time.perf_counter()
    if cuda:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(64, dynamo.config.cache_size_limit)

    model, build_s = build_qwen3_moe(config, device, dtype, "grouped_mm", seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {n_params / 1e9:.2f} B-parameter model on {device} in {build_s:.1f} s", flush=True)
    sims = random_similarities(shape["num_hidden_layers"], shape["num_experts"], device, args.seed + 1)
    result = {
        "benchmark": "decode_step",
        "environment": collect_environment(device),
        "config": {"shape": shape, "parameters": n_params, "dtype": str(dtype).removeprefix("torch."),
                   "weights": "random-init (harness.models.real_shapes: N(0, 0.02) from --seed, norms 1, on device)", "prompt": PROMPT,
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
                        row.update(runner(dec, args.steps, args.warmup, cuda))
                    except Exception as exc:  # noqa: BLE001 - one variant must not lose the others
                        row["error"] = short_error(exc)
                        row["traceback"] = traceback.format_exc(limit=6)
                        free_memory(cuda)
                    finally:
                        if handle is not None:
                            handle.remove()
                    msg = (f"{row['tpot_ms']:.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f}, "
                           f"wall {row['wall_mean_ms']:.2f})" if "tpot_ms" in row else row.get("error"))
                    extra = f" compile {row['compile_s']:.1f}s breaks {row['graph_breaks']}" \
                        if "compile_s" in row else ""
                    print(f"{mode:<8} B={batch:<3} sere={sere:<3} {impl:<18} {msg}{extra}", flush=True)
                    result["elapsed_s"] = time.perf_counter() - t_start
                    write_result(result, out_path, markdown)
    result["elapsed_s"] = time.perf_counter() - t_start
    result["sere_hook_fallback_reason"] = _FALLBACK_WARNED[0] if _FALLBACK_WARNED else None
    if cuda:
        result["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    write_result(result, out_path, markdown)
    print(markdown(result))
    print(f"wrote {out_path} and {out_path.with_suffix('.md')} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

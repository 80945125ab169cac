"""Why the run path and the benchmark scripts disagree (issue 17): the two gaps of results/benchmarks/run_path.md.

    python benchmarks/run_path_gaps.py            # H200: ~2-3 min; results/benchmarks/run_path_gaps.json + a table
    python benchmarks/run_path_gaps.py --smoke    # CPU: tiny shapes, the same code path (timings meaningless)
    python benchmarks/run_path_gaps.py --only sere --batches 16

(A) **SERE decode step.** The engine's SERE step (``install_sere`` as ``HFEngine`` installs it: statistics on, the
    engine's EOS list) against ``bench_decode_step.py``'s (statistics off, its custom-op wrapper), each captured in a
    manual CUDA graph of ``_common.Decoder.step`` and timed by CUDA events over ``--steps`` replays
    (median; ``_common.run_graph``, as ``bench_decode_step`` runs it). Variants, one piece toggled at a time:

    - ``off``: no SERE (the reference both paths agree on);
    - ``bench``: the benchmark's SERE (statistics off, ``harness_bench::sere_reroute`` custom op);
    - ``nostats``: the engine's op, statistics off;
    - ``stats_torch``: statistics on, the ~44-op torch path per layer (the engine before this branch);
    - ``stats_fused``: statistics on, one Triton launch per layer (``harness.kernels.sere_stats``, the engine now);
    - ``stats_fused_eos``: as ``stats_fused`` with EOS ids, so the live-row mask is built and applied (a run without
      ``generation.ignore_eos``).

    Confirms the explanation if ``stats_torch − nostats`` ≈ the 3.3–3.7 ms gap of run_path.md and
    ``stats_fused − nostats`` is a small fraction of it; ``nostats ≈ bench`` (same kernels).
    (A') the same variants in the engine's own decode loop (``StaticGreedyDecoder``, its CUDA-event clock, 64 tokens):
    ``stats_torch`` should reproduce run_path.md's graph rows (12.63 / 19.62 ms at B = 1 / 16), ``stats_fused`` fall
    to about ``nostats``.

(B) **30-image TTFT** (``model=qwen3_vl_30b_a3b_shapes``, ``dataset=synthetic_load``: 30 noise images of 448×448 and
    1,960 synthetic tokens, B = 1) at keep 1.0 and 0.5, split into the run path's own stages, each with a device
    synchronisation on both sides (median of ``--repeats``):

    - ``engine_ttft``: ``HFEngine.generate_batch`` (warm-up first) → ``Generation.ttft_ms``, what summary.json reports;
      ``engine_ttft_host_patchify``: the same with ``hf_direct.DEVICE_PATCHIFY = False`` (the engine run_path.md ran);
    - ``host_build``: ``hf_direct.build_inputs`` (uint8 pixels to the device, patchified there) — inside the run
      path's TTFT (the batch clock starts before it), outside the benchmark's; ``host_build_host_patchify``: the
      first version (float32 patches built on the host, 138 MB copied);
    - ``vision_tower``: ``get_image_features`` alone; ``visionzip_prepare``: ``prepare_visionzip_inputs`` (tower +
      importance + selection; keep < 1 only), with its ``importance_ms``;
    - ``static_prefill``: the engine's ``StaticGreedyDecoder.generate(..., 1)`` on the prepared inputs (prefill + first
      token; at keep 1.0 it runs the tower inside); ``generate_prefill``: ``model.generate(max_new_tokens=1)`` on the
      same inputs (the benchmark's path);
    - ``bench_ttft``: ``bench_visionzip_ttft``'s timed region (prepare + generate) on these inputs.

    Confirms the explanation if ``engine_ttft ≈ host_build + [visionzip_prepare] + static_prefill``,
    ``engine_ttft − host_build ≈ bench_ttft`` at both keeps, and ``engine_ttft_host_patchify − engine_ttft ≈
    host_build_host_patchify − host_build`` (the fix's saving).

Every section and variant is guarded (an error is recorded, the rest goes on); the JSON is rewritten after each; a
time budget (``--budget-s``) skips what is left. Imports torch, triton, transformers and harness only (no Hydra); the
model, decoder, timers and SERE op are ``benchmarks/_common.py``'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from _common import (ROOT, TINY_TEXT, Decoder, add_device_args, build_qwen3_moe, qwen3_moe_config, random_similarities,
                     results_path, run_graph, sere_op, set_impl, sync, use_cuda, write_result)

SERE_VARIANTS = ("off", "bench", "nostats", "stats_torch", "stats_fused", "stats_fused_eos")
TINY_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, deepstack_visual_indexes=[0])


def err(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc(limit=5)}


def timed(fn, cuda: bool):
    """(ms, result) of ``fn()`` with a device synchronisation on each side."""
    sync(cuda)
    t0 = time.perf_counter()
    out = fn()
    sync(cuda)
    return (time.perf_counter() - t0) * 1e3, out


def med(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)} if xs else {}


def free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ (A) SERE


def install_variant(model, sims, variant: str, k: int):
    """The SERE handle of one variant (None for ``off``)."""
    from harness.engines.hf.sere import install_sere

    if variant == "off":
        return None
    if variant == "bench":   # exactly bench_decode_step.install(..., collect_stats=False)
        return install_sere(model, torch.stack(sims), k, 0.0, mode="decode", collect_stats=False, op=sere_op())
    eos = [int(model.config.vocab_size) - 1] if variant == "stats_fused_eos" else []  # the engine passes its own list
    handle = install_sere(model, torch.stack(sims), k, 0.0, mode="decode", collect_stats=variant != "nostats",
                          eos_token_ids=eos)
    handle.stats_impl = {"stats_torch": "torch", "stats_fused": "fused", "stats_fused_eos": "fused"}.get(variant, "auto")
    return handle


def section_sere(args, cuda: bool, result: dict, save, over_budget) -> None:
    from harness.engines.hf import experts as hf_experts

    hf_experts.register()
    device = "cuda" if cuda else "cpu"
    config = qwen3_moe_config(smoke=not cuda)
    model, build_s = build_qwen3_moe(config, device, torch.bfloat16 if cuda else torch.float32, "grouped_mm")
    set_impl(model, "harness_fused_moe")
    sims = random_similarities(config["num_hidden_layers"], config["num_experts"], device, seed=1)
    sec = result["sere"] = {"shape": "Qwen3-30B-A3B" if cuda else "tiny (smoke)", "build_s": round(build_s, 1),
                            "k_primary": args.k, "rho": 0.0, "steps": args.steps, "rows": []}
    for batch in [int(b) for b in args.batches.split(",") if b]:
        try:
            dec = Decoder(model, batch, config["vocab_size"], device, seed=batch)
        except Exception as exc:  # noqa: BLE001
            sec["rows"].append({"B": batch, **err(exc)})
            continue
        for variant in SERE_VARIANTS:
            row = {"B": batch, "variant": variant}
            sec["rows"].append(row)
            if over_budget():
                row["skipped"] = "time budget"
                continue
            handle = None
            try:
                handle = install_variant(model, sims, variant, args.k)
                row.update(run_graph(dec, args.steps, 3, cuda))
                if handle is not None and handle.collect_stats:
                    st = handle.stats()   # replays of a captured graph do not add Python-side step counts here
                    row["stats_device_rows"] = st["per_layer"][0]["tokens"]
            except Exception as exc:  # noqa: BLE001 - one variant must not lose the others
                row.update(err(exc))
            finally:
                if handle is not None:
                    handle.remove()
            print(f"sere B={batch:<3} {variant:<16} " + (f"{row['tpot_ms']:.3f} ms" if "tpot_ms" in row
                                                        else row.get("error", row.get("skipped", ""))), flush=True)
            save()
        del dec
        free(cuda)
    engine_decoder_rows(model, sims, args, cuda, sec, save, over_budget)
    by = {(r["B"], r["variant"]): r.get("tpot_ms") for r in sec["rows"]}
    sec["deltas_ms"] = {str(b): {name: (by[(b, x)] - by[(b, y)]) if by.get((b, x)) and by.get((b, y)) else None
                                 for name, x, y in (("stats_torch_minus_nostats", "stats_torch", "nostats"),
                                                    ("stats_fused_minus_nostats", "stats_fused", "nostats"),
                                                    ("eos_mask_cost", "stats_fused_eos", "stats_fused"),
                                                    ("nostats_minus_bench", "nostats", "bench"))}
                        for b in sorted({r["B"] for r in sec["rows"]})}
    del model
    free(cuda)


DECODER_VARIANTS = ("off", "nostats", "stats_torch", "stats_fused")


def engine_decoder_rows(model, sims, args, cuda: bool, sec: dict, save, over_budget) -> None:
    """The engine's own decode loop (``hf_graphs.StaticGreedyDecoder``, as ``engine.decode_path=graph`` runs it):
    TPOT = (last token − first token) / (steps − 1) from its CUDA-event clock, 64 tokens after a 64-token prompt,
    after a 2-token generation that captures the graph (as the engine's warm-up does)."""
    from harness.engines.hf.graphs import StaticGreedyDecoder

    device = "cuda" if cuda else "cpu"
    new_tokens = 64 if cuda else 4
    rows = sec.setdefault("engine_decoder_rows", [])
    for batch in [int(b) for b in args.batches.split(",") if b]:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, int(model.config.vocab_size) - 8, (batch, 64), generator=g).to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        decoder = StaticGreedyDecoder(model, [], 0)
        for variant in DECODER_VARIANTS:
            row = {"B": batch, "variant": variant}
            rows.append(row)
            if over_budget():
                row["skipped"] = "time budget"
                continue
            handle = None
            try:
                handle = install_variant(model, sims, variant, args.k)
                with torch.inference_mode():
                    decoder.generate(inputs, 2, reserve_new_tokens=new_tokens)
                    res = decoder.generate(inputs, new_tokens, reserve_new_tokens=new_tokens)
                steps = len(res.times) - 1
                row.update(tpot_ms=(res.times[-1] - res.times[0]) * 1e3 / steps, steps=steps, mode=res.mode)
            except Exception as exc:  # noqa: BLE001
                row.update(err(exc))
            finally:
                if handle is not None:
                    handle.remove()
            print(f"decoder B={batch:<3} {variant:<12} " + (f"{row['tpot_ms']:.3f} ms ({row['mode']})"
                                                           if "tpot_ms" in row else row.get("error", row.get("skipped", ""))),
                  flush=True)
            save()
        del decoder
        free(cuda)


# ------------------------------------------------------------------------------------------------- (B) TTFT


def make_engine(cuda: bool, keep: float, max_new_tokens: int):
    """``HFEngine`` as ``python -m harness model=qwen3_vl_30b_a3b_shapes dataset=synthetic_load
    engine.decode_path=graph visionzip.keep=<keep>`` builds it (configs as plain namespaces, no Hydra)."""
    from harness.engines.hf.engine import HFEngine

    engine_cfg = SimpleNamespace(device="auto", dtype="auto", batch_size=1, attn_implementation="sdpa",
                                 experts_implementation="auto", cuda_graphs=True, decode_path="graph", warmup=1,
                                 graph_states=3, device_map=None, max_memory=None)
    gen_cfg = SimpleNamespace(max_new_tokens=max_new_tokens, ignore_eos=True, do_sample=False)
    shapes = SimpleNamespace(arch="qwen3_vl_30b_a3b", num_layers=None if cuda else 2, reuse=True,
                             text=None if cuda else TINY_TEXT, vision=None if cuda else TINY_VISION)
    vz = SimpleNamespace(keep=keep, contextual=0.0, scope="request", layer=-1, min_per_image=1)
    return HFEngine("shapes", engine_cfg, gen_cfg, visionzip_cfg=vz, shapes_cfg=shapes, model_id="shapes")


def requests(n: int, n_images: int, side: int, prompt_tokens: int):
    """The run's own requests: ``harness.datasets.synthetic_load.load`` → ``Request`` as ``harness/run/experiment.py`` makes them."""
    from harness.datasets.synthetic_load import load
    from harness.engines.base import Request

    cfg = SimpleNamespace(n_images=n_images, image_width=side, image_height=side, prompt_tokens=prompt_tokens,
                          output_tokens=8, num_requests=n, limit=None, seed=0)
    return [Request(s.uid, s.content, s.load_images()) for s in load(cfg, ROOT)]


def stages(engine, req, keep: float, cuda: bool) -> dict:
    """One request's stage times with the engine's own functions (see the module doc)."""
    from harness.engines.hf.direct import build_inputs
    from harness.engines.hf.graphs import StaticGreedyDecoder
    from harness.engines.hf.visionzip import prepare_visionzip_inputs, visionzip_generation

    from harness.engines.hf import direct as hf_direct

    model, out = engine.model, {}
    build = lambda: build_inputs([req], model.config, engine.processor.tokenizer,  # noqa: E731
                                 engine.pad_id, engine._input_device(), engine.dtype)
    hf_direct.DEVICE_PATCHIFY = False        # the first version: float32 patches built on the host
    try:
        out["host_build_host_patchify"], _ = timed(build, cuda)
    finally:
        hf_direct.DEVICE_PATCHIFY = True
    out["host_build"], inputs = timed(build, cuda)
    with torch.inference_mode():
        out["vision_tower"], _ = timed(lambda: model.model.get_image_features(inputs["pixel_values"],
                                                                              inputs["image_grid_thw"]), cuda)
        ctx = None
        if keep < 1.0:
            out["visionzip_prepare"], (ri, ctx) = timed(
                lambda: prepare_visionzip_inputs(model, inputs, engine.vz_cfg, pad_token_id=engine.pad_id), cuda)
            out["importance"] = ctx.importance_ms
        else:
            ri = inputs
        decoder = engine._graph_decoder or StaticGreedyDecoder(model, engine.stop_ids, engine.pad_id, use_graphs=False)
        with visionzip_generation(model, ctx) if ctx is not None else _null():
            out["static_prefill"], _ = timed(lambda: decoder.generate(dict(ri), 1,
                                                                      reserve_new_tokens=engine.gen_cfg.max_new_tokens),
                                             cuda)
            out["generate_prefill"], _ = timed(lambda: model.generate(**ri, max_new_tokens=1, do_sample=False,
                                                                      pad_token_id=engine.pad_id), cuda)

        def bench_region():   # bench_visionzip_ttft.ttft(): prepare (keep < 1) + generate, inputs already on device
            rin, c = prepare_visionzip_inputs(model, inputs, engine.vz_cfg, pad_token_id=engine.pad_id) \
                if keep < 1.0 else (dict(inputs), None)
            with visionzip_generation(model, c) if c is not None else _null():
                model.generate(**rin, max_new_tokens=1, do_sample=False, pad_token_id=engine.pad_id)
        out["bench_ttft"], _ = timed(bench_region, cuda)
    out["prompt_tokens_lm"] = int(ri["input_ids"].shape[1])
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def section_ttft(args, cuda: bool, result: dict, save, over_budget) -> None:
    n_images, side, prompt = (args.images, args.size, args.prompt_tokens) if cuda else (2, 64, 16)
    sec = result["ttft"] = {"images": n_images, "image_px": side, "prompt_tokens": prompt, "repeats": args.repeats,
                            "rows": []}
    reqs = requests(args.repeats + 1, n_images, side, prompt)
    for keep in [float(k) for k in args.keeps.split(",") if k]:
        row = {"keep": keep}
        sec["rows"].append(row)
        if over_budget():
            row["skipped"] = "time budget"
            continue
        try:
            t0 = time.perf_counter()
            engine = make_engine(cuda, keep, 8)
            row["engine_build_s"] = round(time.perf_counter() - t0, 1)
            row["decode_path"] = engine.decode_path
            engine.warmup([reqs[0]])
            gens = [engine.generate_batch([r])[0] for r in reqs[1:]]
            row["engine_ttft"] = med([g.ttft_ms for g in gens if g.ttft_ms is not None])
            from harness.engines.hf import direct as hf_direct

            hf_direct.DEVICE_PATCHIFY = False   # the engine as run_path.md measured it (host patchify)
            try:
                old = [engine.generate_batch([r])[0] for r in reqs[1:]]
            finally:
                hf_direct.DEVICE_PATCHIFY = True
            row["engine_ttft_host_patchify"] = med([g.ttft_ms for g in old if g.ttft_ms is not None])
            row["lm_prompt_tokens_engine"] = gens[0].prompt_tokens
            stages(engine, reqs[0], keep, cuda)   # warm-up of the stage functions themselves (generate's path)
            per = [stages(engine, r, keep, cuda) for r in reqs[1:]]
            for name in per[0]:
                row[name] = med([p[name] for p in per]) if name != "prompt_tokens_lm" else per[0][name]
            parts = ["host_build", "static_prefill"] + (["visionzip_prepare"] if keep < 1.0 else [])
            row["host_build_plus_stages"] = sum(row[p]["median"] for p in parts)
            row["engine_minus_host_build"] = row["engine_ttft"]["median"] - row["host_build"]["median"]
            engine.close()
        except Exception as exc:  # noqa: BLE001
            row.update(err(exc))
        print("ttft keep={keep} ".format(keep=keep) + " ".join(
            f"{k}={v['median']:.1f}" for k, v in row.items() if isinstance(v, dict) and "median" in v)
            + (f" ERROR {row['error']}" if "error" in row else ""), flush=True)
        free(cuda)
        save()


# --------------------------------------------------------------------------------------------------- report


def table(result: dict) -> str:
    lines = []
    sere = result.get("sere")
    if sere:
        lines += ["(A) SERE decode step, CUDA-graph replay, median ms "
                  f"(K={sere['k_primary']}, rho=0, {sere['shape']})", "",
                  "| B | " + " | ".join(SERE_VARIANTS) + " |", "|---" * (len(SERE_VARIANTS) + 1) + "|"]
        by = {(r["B"], r["variant"]): r for r in sere["rows"] if "variant" in r}
        for b in sorted({r["B"] for r in sere["rows"]}):
            cells = []
            for v in SERE_VARIANTS:
                r = by.get((b, v), {})
                cells.append(f"{r['tpot_ms']:.2f}" if "tpot_ms" in r else ("skip" if "skipped" in r else "err"))
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines += ["", "deltas (ms): " + json.dumps({b: {k: (round(v, 3) if v is not None else None)
                                                         for k, v in d.items()} for b, d in sere["deltas_ms"].items()})
                  if "deltas_ms" in sere else "", ""]
        dec = {(r["B"], r["variant"]): r for r in sere.get("engine_decoder_rows", [])}
        if dec:
            lines += ["(A') the engine's StaticGreedyDecoder (graph path), TPOT ms from its own clock", "",
                      "| B | " + " | ".join(DECODER_VARIANTS) + " |", "|---" * (len(DECODER_VARIANTS) + 1) + "|"]
            for b in sorted({k[0] for k in dec}):
                lines.append(f"| {b} | " + " | ".join(
                    f"{dec[(b, v)]['tpot_ms']:.2f}" if "tpot_ms" in dec.get((b, v), {}) else "err"
                    for v in DECODER_VARIANTS) + " |")
            lines.append("")
    ttft = result.get("ttft")
    if ttft:
        cols = ["engine_ttft_host_patchify", "engine_ttft", "host_build_host_patchify", "host_build", "vision_tower", "visionzip_prepare", "importance", "static_prefill",
                "generate_prefill", "bench_ttft"]
        lines += [f"(B) TTFT stages, median ms ({ttft['images']} images of {ttft['image_px']} px + "
                  f"{ttft['prompt_tokens']} tokens, B = 1)", "",
                  "| keep | LM tokens | " + " | ".join(cols) + " | engine − host_build | host_build + stages |",
                  "|---" * (len(cols) + 4) + "|"]
        for r in ttft["rows"]:
            if "error" in r or "skipped" in r:
                lines.append(f"| {r['keep']} | {r.get('error', r.get('skipped'))[:120]} |")
                continue
            cell = lambda k: f"{r[k]['median']:.1f}" if isinstance(r.get(k), dict) and "median" in r[k] else "–"  # noqa: E731
            lines.append(f"| {r['keep']} | {r.get('prompt_tokens_lm')} | " + " | ".join(cell(c) for c in cols)
                         + f" | {r['engine_minus_host_build']:.1f} | {r['host_build_plus_stages']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["sere", "ttft"], default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--keeps", default="1.0,0.5")
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--prompt-tokens", type=int, default=1960)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=150.0)
    add_device_args(ap, "CPU, tiny shapes: the code path only")
    args = ap.parse_args()
    cuda = use_cuda(args, interpret=True)
    if cuda is None:
        return 0
    if args.smoke:
        if args.batches == "1,16,64":
            args.batches = "1,4"
        args.steps = min(args.steps, 3)
        args.repeats = min(args.repeats, 2)
    from harness.results.envinfo import collect_environment

    out = args.out or results_path("run_path_gaps_smoke.json" if args.smoke else "run_path_gaps.json", args.smoke)
    t0 = time.perf_counter()
    result = {"benchmark": "run_path_gaps", "environment": collect_environment("cuda" if cuda else "cpu"),
              "weights": "random-init", "dtype": "bfloat16" if cuda else "float32", "smoke": args.smoke,
              "args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write_result(result, out)

    def over_budget() -> bool:
        return time.perf_counter() - t0 > args.budget_s

    for name, fn in (("sere", section_sere), ("ttft", section_ttft)):
        if args.only not in (None, name):
            continue
        try:
            fn(args, cuda, result, save, over_budget)
        except Exception as exc:  # noqa: BLE001 - one section must not lose the other
            result[name + "_error"] = err(exc)
            print(f"section {name} failed: {result[name + '_error']['error']}", flush=True)
        free(cuda)
        save()
    text = table(result)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ.get("HARNESS_CACHE", "/tmp")) / "inductor"))
    sys.exit(main())

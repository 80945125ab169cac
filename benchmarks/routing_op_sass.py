"""Where the routing op's time can go, read off the code the H200 runs: the op's kernels compiled for sm_90 on
any machine (no GPU), beside the µs per layer the H200 (and, from session 23, an H100) measured for the same kernels.

    pip install --target /tmp/t36 triton==3.6.0      # the GPU machine's Triton (shared/notes/environment.md)
    PYTHONPATH=/tmp/t36 python benchmarks/routing_op_sass.py [--tokens 1,4,16,64,256 --arch 90]

Why (issue 23): the routing target (≤ 5 µs per layer at B ≤ 64) is missed — 5.2 µs at T ≤ 4, 10.0 at 16, 15.5
at 64 (``results/benchmarks/routing_op_h200.json``) — and no session that could profile it on the H200 had the
minutes. The cubin is fixed at compile time, so what an instruction-level profile would start from can be read
here: registers and spills, instructions, global loads, shuffles and barriers per kernel and per source
function, and the longest chain of dependent instructions (``benchmarks/_sass.py`` says how it is counted and
what it cannot see). The op's own dispatch and launch code runs (``fused_routing_triton`` with a forced plan) on
CPU tensors with every launch turned into a compilation (``_sass.compile_only``), so the kernels, tilings and
constexprs are those a CUDA run would launch.

Variants as ``bench_routing_op.py`` times them (Qwen3-30B-A3B's router: 128 experts, top-8, every row a decode
row): ``stock`` (softmax top-8), ``sere2`` (SERE K=2, ρ 0, with its counters), ``sere2_nostats``, ``sere1``,
``top2`` (``moe.top_k=2`` with its counters), each through ``one`` program or the ``multi``-program plan; at
T <= 16 also through one program of 1 or 2 warps (``one_w1``, ``one_w2``; the default is 4 warps up to 8 rows)
and, for SERE, the slot-by-slot re-route that the all-slots gather replaced (``one_loop``, session 8). The
measured column is the GPU's figure for the same kernel code and tiling where one was taken (H200 or H100, which time
these kernels alike) (:func:`measured_us`; Triton
3.6.0). Writes ``results/benchmarks/routing_op_sass_sm90.{json,md}`` (or ``--out``).
Imports torch, triton and the harness's kernel modules.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS_DIR, random_similarity, write_result
from _sass import compile_only, profile_kernel

E, K = 128, 8
#: the GPU machine's Triton (shared/notes/environment.md): the SASS is the H200's only when built by it
DEVICE_TRITON = "3.6.0"
MEASURED = RESULTS_DIR / "routing_op_h200.json"


def specs() -> dict[str, tuple[Any, bool, bool]]:
    """variant -> (RoutingSpec, SERE counters, top-K counters)."""
    from harness.kernels.fused_routing import RoutingSpec

    sim = random_similarity(E, seed=0)
    return {"stock": (RoutingSpec(K, True), False, False),
            "sere2": (RoutingSpec(K, True, k_primary=2, rho=0.0, similarity=sim), True, False),
            "sere2_nostats": (RoutingSpec(K, True, k_primary=2, rho=0.0, similarity=sim), False, False),
            "sere1": (RoutingSpec(K, True, k_primary=1, rho=0.0, similarity=sim), True, False),
            "top2": (RoutingSpec(K, True, trunc_k=2), False, True)}


def measured_as(variant: str, plan: str, tokens: int) -> str:
    """``bench_routing_op.py``'s name for the kernels this plan compiles at ``tokens`` rows, tiling included: a
    figure timed at another tiling is another kernel, whatever its source. The dispatch's plans name the forced
    variant of the same tiling: one program with a warp per row (``one_sere2_w1`` at one row) or its default
    warps (``one_sere2``, 4–8 warps, unchanged since the first timings); the multi-program plan its tiling sweep's
    name (``multi_sere2_t1w1r2``: rows, launch 1 warps, launch 2 warps; stock and top-2 launch once)."""
    if plan.startswith("one_w"):
        return f"one_{variant}_w{plan[5:]}"
    from harness.kernels.fused_routing import _tile_rows, one_program_warps
    from harness.kernels.fused_routing_multi import multi_tile

    block_e = max(16, 1 << (E - 1).bit_length())
    if plan == "one":
        warps = one_program_warps(_tile_rows(tokens, block_e), block_e)
        return f"one_{variant}_w{warps}" if warps <= 2 else f"one_{variant}"
    if plan == "multi":
        rows, warps, warps_2 = multi_tile(tokens, block_e)
        return f"multi_{variant}_t{rows}w{warps}" + (f"r{warps_2}" if "sere" in variant and warps_2 != warps else "")
    return f"{plan}_{variant}"


def compile_variant(spec, sere_stats: bool, topk_stats: bool, tokens: int, plan: str, arch: int) -> list:
    """The kernels one call of the op launches for this step, compiled for ``sm_<arch>``, in launch order.
    ``plan``: ``one`` / ``multi`` (the dispatch's tilings), ``one_w<N>`` (one program with N warps), ``one_loop``
    (one program, SERE's slot-by-slot re-route: ``vec_cells=0``)."""
    from harness.kernels.fused_routing import COUNTERS, fused_routing_triton

    logits = torch.randn(tokens, E).to(torch.bfloat16)
    decode = torch.ones(tokens, dtype=torch.bool)
    counters = [torch.zeros(len(COUNTERS), dtype=torch.long) if on else None for on in (sere_stats, topk_stats)]
    with compile_only(arch) as compiled:
        fused_routing_triton(logits, spec, decode, None, *counters, multi=plan == "multi",
                             num_warps=int(plan[5:]) if plan.startswith("one_w") else None,
                             vec_cells=0 if plan == "one_loop" else None)
    return list(compiled)


def measured_us(paths: list[Path]) -> dict[tuple[str, int], float]:
    """(bench_routing_op variant, T) -> median µs per layer from ``bench_routing_op.py`` result files (a later
    file's figure wins; an absent file adds nothing), for the kernel code compiled here only: a file that records
    ``kernel_sources`` (session 23 on) gives the rows of the plans whose hashes match today's (a ``fused_*`` row
    through its ``dispatched_as``, session 24 on); an older file gives its one-program rows only (that kernel's
    code is unchanged since them, docstrings aside; the multi-program plan was rebuilt in session 22)."""
    from harness.kernels.fused_routing import kernel_sources

    now = kernel_sources()
    out: dict[tuple[str, int], float] = {}
    for path in paths:
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        recorded = doc.get("kernel_sources")
        same = {plan for plan in ("one", "multi") if (recorded[plan] == now[plan] if recorded else plan == "one")}
        # a fused_* row (the dispatch's choice) stands for the forced variant it compiled; a forced row wins
        for key in ("dispatched_as", "variant"):
            out.update({(r[key], r["tokens"]): r["us_per_layer"] for r in doc["rows"]
                        if r.get(key) and r[key].split("_")[0] in same})
    return out


def summary(kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per step: the launches' figures added (they run one after the other), registers and spills the
    largest of any launch, the critical paths added (launch 2 starts when launch 1 has ended)."""
    add = ("instructions", "global_load", "shuffle", "barrier", "shared_load", "warp_reduce")
    row: dict[str, Any] = {k: sum(p[k] for p in kernels) for k in add}
    row.update(launches=len(kernels), reg=max(p["reg"] for p in kernels), local=max(p["local"] for p in kernels),
               loops=sum(p["loops"] for p in kernels),
               critical_path=sum(p["critical_path"]["length"] for p in kernels),
               path_global_loads=sum(p["critical_path"].get("on_path_global_load", 0) for p in kernels),
               path_barriers=sum(p["critical_path"].get("on_path_barrier", 0) for p in kernels),
               path_shuffles=sum(p["critical_path"].get("on_path_shuffle", 0) for p in kernels))
    return row


#: warp schedulers per SM on sm_90: warps beyond this many share a scheduler's issue slots
SCHEDULERS = 4


def one_program_fit(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A three-term fit of the GPU's one-program timings to the static figures, and what it predicts for the
    one-program kernels not timed yet (``one_w1`` / ``one_w2``). Why: the static counts say what code is on the
    path, not how long it takes; a fit over the kernels that were timed says how the two relate, and turns each
    untimed candidate into a prediction the next GPU call can falsify. Terms: a fixed cost (launch, graph
    node), instructions issued per scheduler (a warp's instructions × the warps sharing a scheduler), barriers on
    the longest chain. Only loop-free single-kernel steps (T <= 16), where the static counts are the executed
    ones. None with fewer than five timed rows."""
    import numpy as np

    def features(k: dict[str, Any]) -> list[float]:
        issued = k["instructions"] * max(1.0, k["num_warps"] / SCHEDULERS) / 1000.0
        return [1.0, issued, k["critical_path"].get("on_path_barrier", 0) / 10.0]

    usable = [r for r in rows if r["plan"].startswith("one") and r["tokens"] <= 16 and len(r["kernels"]) == 1
              and r["kernels"][0]["loops"] == 0]
    timed = [r for r in usable if r["measured_us"] is not None]
    if len(timed) < 5:
        return None
    x = np.array([features(r["kernels"][0]) for r in timed])
    y = np.array([r["measured_us"] for r in timed])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    loo = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        loo.append(float(x[i] @ np.linalg.lstsq(x[keep], y[keep], rcond=None)[0] - y[i]))
    r2 = 1.0 - float(((y - x @ coef) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    terms = ["fixed µs", "µs per 1,000 instructions issued per scheduler", "µs per 10 barriers on the chain"]
    return {"terms": terms,
            "coef": [round(float(c), 3) for c in coef], "r2": round(r2, 3), "timed_rows": len(timed),
            "leave_one_out_error_us": {f"{r['variant']}/{r['plan']}/T={r['tokens']}": round(e, 2)
                                       for r, e in zip(timed, loo)},
            "predicted_us": {f"{r['variant']}/{r['plan']}/T={r['tokens']}":
                             round(float(np.array(features(r["kernels"][0])) @ coef), 2)
                             for r in usable if r["measured_us"] is None}}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# The routing op's kernels for sm_{doc['arch']}, read statically", "",
             f"Triton {doc['env']['triton']} (the H200's: {doc['env']['triton'] == DEVICE_TRITON}), compiled on "
             f"{doc['env']['host']}; 128 experts, top-8, every row a decode row. Measured: "
             f"{', '.join(f'`{m}`' for m in doc['measured_from'])} (µs per layer, median over rounds), "
             "beside the same kernel code and tiling only (a file's `kernel_sources`; older files: one-program "
             "rows). Static "
             "counts are per "
             "thread and per launch, summed over the launches of a step; loops count once.", "",
             "| variant | plan | T | measured µs/layer | launches | instructions | global loads | barriers | shuffles "
             "| regs | spill B | loops | critical path (instr / global loads / barriers / shuffles) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        s = r["summary"]
        us = f"{r['measured_us']:.2f}" if r.get("measured_us") is not None else "–"
        lines.append(f"| {r['variant']} | {r['plan']} | {r['tokens']} | {us} | {s['launches']} | {s['instructions']} "
                     f"| {s['global_load']} | {s['barrier']} | {s['shuffle']} | {s['reg']} | {s['local']} "
                     f"| {s['loops']} "
                     f"| {s['critical_path']} / {s['path_global_loads']} / {s['path_barriers']} / "
                     f"{s['path_shuffles']} |")
    fit = doc.get("one_program_fit")
    if fit:
        lines += ["", "## What the timed one-program kernels say about the untimed ones (a fit, not a measurement)", "",
                  f"{len(fit['coef'])}-term least squares over {fit['timed_rows']} timed rows: "
                  + ", ".join(f"{c} {t}" for c, t in zip(fit["coef"], fit["terms"]))
                  + f"; R² {fit['r2']}; leave-one-out errors (µs): "
                  + ", ".join(f"{k} {v:+}" for k, v in fit["leave_one_out_error_us"].items()) + ".", "",
                  "| untimed kernel | predicted µs/layer |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in fit["predicted_us"].items()]
    lines += ["", "## Instructions per source function (helpers are inlined; Triton's library lines count for the "
              "call before them)", ""]
    seen = set()
    for r in doc["rows"]:
        for k in r["kernels"]:
            key = (r["variant"], r["plan"], k["kernel"], k["instructions"])
            if key in seen:
                continue
            seen.add(key)
            parts = ", ".join(f"{f} {v['instructions']} ({v.get('global_load', 0)} gl, {v.get('barrier', 0)} bar)"
                              for f, v in k["by_function"].items())
            lines.append(f"- {r['variant']} / {r['plan']} (from T={r['tokens']}) `{k['kernel']}`, "
                         f"{k['num_warps']} warps, {k['instructions']} instr: {parts}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,16,64,256")
    ap.add_argument("--variants", default="stock,sere2,sere2_nostats,sere1,top2")
    ap.add_argument("--plans", default="one,multi,one_w1,one_w2,one_loop",
                    help="one_w<N>: one program with N warps; one_loop: SERE's slot-by-slot re-route (both at T <= 16)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (H100/H200: 90)")
    ap.add_argument("--measured", type=Path, nargs="*", default=[MEASURED],
                    help="bench_routing_op.py result files whose µs sit beside the counts and feed the fit (a later "
                         "file wins), e.g. the next GPU call's routing_op_warps_h200.json after the default")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "routing_op_sass_sm90.json")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("routing_op_sass: unset TRITON_INTERPRET (an interpreted kernel never compiles)")
    import triton

    if triton.__version__ != DEVICE_TRITON:
        print(f"note: Triton {triton.__version__}, not the GPU machine's {DEVICE_TRITON}: the SASS may differ from "
              "what the H200 runs", flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    doc: dict[str, Any] = {
        "benchmark": "routing_op_sass", "arch": args.arch, "experts": E, "top_k": K, "commit": head,
        "env": {"triton": triton.__version__, "torch": torch.__version__, "host": platform.node() or "?",
                "device": f"none: compiled for sm_{args.arch}, nothing ran"},
        "spread": "none: static counts of the compiled code, identical on every run with the same Triton",
        "measured_from": [str(p.name) for p in args.measured], "rows": []}
    measured = measured_us(args.measured)
    table = specs()
    for name in args.variants.split(","):
        spec, sere_stats, topk_stats = table[name]
        for plan in args.plans.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                if plan not in ("one", "multi") and (tokens > 16 or plan == "one_loop" and "sere" not in name):
                    continue  # the forced one-program variants: small steps (and the loop: SERE only)
                kernels = [profile_kernel(k, c) for k, c in
                           compile_variant(spec, sere_stats, topk_stats, tokens, plan, args.arch)]
                as_ = measured_as(name, plan, tokens)
                row = {"variant": name, "plan": plan, "tokens": tokens, "measured_as": as_,
                       "measured_us": measured.get((as_, tokens)), "summary": summary(kernels), "kernels": kernels}
                doc["rows"].append(row)
                s = row["summary"]
                print(f"{name:14s} {plan:5s} T={tokens:<4d} {s['instructions']:5d} instr, {s['global_load']:4d} "
                      f"global loads, {s['barrier']:3d} barriers, regs {s['reg']}, spill {s['local']} B, "
                      f"path {s['critical_path']}", flush=True)
    doc["one_program_fit"] = one_program_fit(doc["rows"])
    write_result(doc, args.out, markdown, indent=1)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()

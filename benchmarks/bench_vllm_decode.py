"""Per-step decode time inside vLLM with the harness plugin: stock vLLM vs SERE K=2 / K=1 vs plain top-2, at
Qwen3-30B-A3B shapes with vLLM's dummy weights, bf16, CUDA graphs on (issue 23).

    python benchmarks/bench_vllm_decode.py [--variants stock,sere2,sere1,top2,stock --batches 1,16,64]

No checkpoint, no tokenizer: the parent writes a ``config.json`` of the real shapes
(``harness.models.real_shapes.shapes_config``) and a random SERE similarity artifact, then runs each variant
in a fresh subprocess (the plugin's settings are per process: vLLM builds each MoE layer with its routing
function once): ``LLM(load_format="dummy", skip_tokenizer_init=True)``, the plugin registered in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), V1 model runner. For each batch B, B prompts of 64 random tokens:
one warm-up of each length, then ``--reps`` pairs of (1 output token, 65 output tokens, ``ignore_eos``);
per-step decode = (t65 - t1) / 64 per pair; the median over pairs with a 95 % bootstrap interval.
The variant order runs stock first and last, so drift between engines shows as the two stock rows
disagreeing. With SERE / top-2 the plugin's device counters are read per B (expert union per layer and
step before / after): proof that the routing was engaged under CUDA graphs.

Prints a table and writes ``results/benchmarks/vllm_decode_<card>.json`` (``h200``, ``h100``; ``--out``). Random weights route
near-uniformly, unlike a trained model: times only, no quality (``weights: random-init (vLLM dummy)``).
Needs a CUDA vLLM (``../shared/device/vllm_stage.sh``) and the harness importable (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, STEPS = 64, 64
VARIANTS = {"stock": {}, "sere2": {"HARNESS_SERE_K": "2"}, "sere1": {"HARNESS_SERE_K": "1"},
            "top2": {"HARNESS_MOE_TOP_K": "2"}, "sere2_nostats": {"HARNESS_SERE_K": "2", "HARNESS_ROUTING_STATS": "0"},
            "top2_nostats": {"HARNESS_MOE_TOP_K": "2", "HARNESS_ROUTING_STATS": "0"}}


def bootstrap_ci(values, n=2000, seed=0):
    import random

    rng = random.Random(seed)
    meds = sorted(sorted(rng.choice(values) for _ in values)[len(values) // 2] for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def write_model(root: str, layers: int | None) -> tuple[str, str]:
    import torch
    from safetensors.torch import save_file

    from harness.models.real_shapes import shapes_config

    cfg = shapes_config("qwen3_30b_a3b", num_layers=layers)
    cfg["torch_dtype"] = "bfloat16"
    model = os.path.join(root, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f)
    e = int(cfg["num_experts"])
    g = torch.Generator().manual_seed(0)
    sims = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        out = torch.randn(e, 64, generator=g)
        d = torch.cdist(out, out)
        sims[f"similarity.{layer}"] = (1.0 - d / d.max()).fill_diagonal_(1.0).contiguous()
    sim_path = os.path.join(root, "similarity.safetensors")
    save_file(sims, sim_path)
    return model, sim_path


def child(args) -> None:
    import statistics

    import torch

    from harness.engines.vllm.plugin import register

    register()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_model_len=PROMPT + STEPS + 8, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              gpu_memory_utilization=0.85)
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    sere = bool(os.environ.get("HARNESS_SERE_K"))
    topk = bool(os.environ.get("HARNESS_MOE_TOP_K"))
    stats_on = os.environ.get("HARNESS_ROUTING_STATS", "1") != "0"
    out = {"variant": args.child, "engine_start_s": start_s, "batches": {}}
    for b in args.batches:
        prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (PROMPT,), generator=g).tolist()}
                   for _ in range(b)]
        one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
        many = SamplingParams(max_tokens=STEPS + 1, min_tokens=STEPS + 1, ignore_eos=True, detokenize=False,
                              temperature=0.0)

        def timed(sp):
            torch.cuda.synchronize()
            s = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            assert all(len(r.outputs[0].token_ids) == sp.max_tokens for r in res)
            return time.perf_counter() - s

        timed(one), timed(many)                                   # warm-up of both lengths
        if stats_on and (sere or topk):
            llm.collective_rpc("harness_sere_stats" if sere else "harness_moe_stats", kwargs={"reset": True})
        per_step = []
        for _ in range(args.reps):
            t1, tn = timed(one), timed(many)
            per_step.append((tn - t1) / STEPS * 1000.0)
        row = {"per_step_ms": statistics.median(per_step), "ci95": bootstrap_ci(per_step), "pairs": per_step}
        if stats_on and (sere or topk):
            st = llm.collective_rpc("harness_sere_stats" if sere else "harness_moe_stats")[0]
            row["expert_union_before"] = st.get("expert_union_before")
            row["expert_union_after"] = st.get("expert_union_after")
            row["routing_steps_counted"] = st.get("steps")
        out["batches"][str(b)] = row
        print(f"[{args.child}] B={b}: {row['per_step_ms']:.2f} ms/step {row['ci95']}", flush=True)
    import vllm

    out["env"] = {"torch": torch.__version__, "vllm": vllm.__version__, "device": torch.cuda.get_device_name()}
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="stock,sere2,sere1,top2,stock")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    ap.add_argument("--out", default=None, help="default results/benchmarks/vllm_decode_<card>.json (h100, h200)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.child:
        return child(args)
    root = tempfile.mkdtemp(prefix="bench_vllm_decode_")
    model, sim = write_model(root, args.layers)
    results: list[dict] = []
    state = {"cut": None}

    def on_term(signum, frame):  # a time limit's SIGTERM: keep what was measured (the JSON is written per variant)
        state["cut"] = f"stopped by signal {signum}"
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for name in args.variants.split(","):
            results.append(run_variant(name, args, model, sim))
            write_results(args, results, state["cut"])
    except KeyboardInterrupt:
        state["cut"] = state["cut"] or "interrupted"
        print(f"cut: {state['cut']}; {len(results)} variant(s) measured", flush=True)
        write_results(args, results, state["cut"])   # the loop wrote every finished variant; record the cut
    print_table(results, args.batches)


def run_variant(name: str, args, model: str, sim: str) -> dict:
    """One variant in a fresh child process; its per-B lines stream through as they are measured."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", **VARIANTS[name]}
    if "HARNESS_SERE_K" in env:
        env.update(HARNESS_SERE_SIMILARITY=sim, HARNESS_SERE_RHO="0.0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, __file__, "--child", name, "--model", model, "--batches",
           ",".join(map(str, args.batches)), "--reps", str(args.reps)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    err_tail: list[str] = []
    try:
        def drain_stderr():  # vLLM logs a lot on stderr: read it alongside, keep its tail for a failure
            for line in proc.stderr:
                err_tail.append(line)
                del err_tail[:-200]

        t = threading.Thread(target=drain_stderr, daemon=True)
        t.start()
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("["):   # the child's per-B lines, as they are measured
                print(line, end="", flush=True)
        proc.wait()
        t.join(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    got = [line[7:] for line in lines if line.startswith("RESULT ")]
    if proc.returncode != 0 or not got:
        print(f"[{name}] failed (exit {proc.returncode}):\n{''.join(lines)[-3000:]}\n{''.join(err_tail)[-6000:]}",
              flush=True)
        return {"variant": name, "error": "".join(err_tail)[-2000:]}
    res = json.loads(got[0])
    print(f"[{name}] engine start {res['engine_start_s']:.0f} s", flush=True)
    return res


def print_table(results: list[dict], batches: list[int]) -> None:
    stock = [r for r in results if r.get("variant") == "stock" and "batches" in r]
    print(f"\n{'variant':16s}" + "".join(f"{'B=' + str(b):>26s}" for b in batches))
    for r in results:
        if "batches" not in r:
            print(f"{r['variant']:16s} failed")
            continue
        cells = []
        for b in batches:
            row = r["batches"][str(b)]
            cell = f"{row['per_step_ms']:.2f} [{row['ci95'][0]:.2f},{row['ci95'][1]:.2f}]"
            if stock and r["variant"] != "stock":
                base = [s["batches"][str(b)] for s in stock]
                speed = min(s["per_step_ms"] for s in base) / row["per_step_ms"]
                sig = row["ci95"][1] < min(s["ci95"][0] for s in base) or row["ci95"][0] > max(s["ci95"][1] for s in base)
                cell += f" {speed:.2f}x" + ("" if sig else " n.s.")
            cells.append(f"{cell:>26s}")
        print(f"{r['variant']:16s}" + "".join(cells))


def write_results(args, results: list[dict], cut: str | None) -> None:
    """Written after every variant, so a run cut by a time limit keeps what it measured."""
    env = {"python": sys.version.split()[0]}
    env.update(next((r["env"] for r in results if "env" in r), {}))   # read in the children: this process stays off CUDA
    out = args.out
    if out is None:
        from _common import card_slug

        out = os.path.join(REPO, "results", "benchmarks", f"vllm_decode_{card_slug(env.get('device'))}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    doc = {"benchmark": "vllm_decode", "env": env, "model": "qwen3_30b_a3b shapes",
           "layers": args.layers or 48, "dtype": "bfloat16", "weights": "random-init (vLLM dummy)",
           "cuda_graphs": True, "prompt_tokens": PROMPT, "decode_steps": STEPS, "reps": args.reps,
           "variants_asked": args.variants.split(","),
           "protocol": "per variant a fresh engine; warm-up of each length; per pair (t65 - t1)/64; "
                       "median, 95% bootstrap CI; stock first and last (drift check); speed-up against "
                       "the faster stock run, n.s. when the intervals overlap either stock run",
           "results": results}
    if cut:
        doc["cut"] = cut
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out, flush=True)

if __name__ == "__main__":
    main()

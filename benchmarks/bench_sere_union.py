"""Distinct experts per MoE layer per decode step vs batch size, with and without SERE (GPU).

    python benchmarks/bench_sere_union.py [--batches 1,2,4,8,16,32,64,128] [--steps 8] [--layers 48]

A random-initialised model with Qwen3-30B-A3B shapes (48 layers, 128 experts, top-8) decodes ``--steps``
tokens for B prompts; SERE's hooks (``harness.engines.hf.sere``) count, per layer and decode step, the
distinct experts the batch routes to before re-routing and after it. Rows: SERE off (k_primary = top-k:
nothing moves), K = 2 and K = 1 with ρ = 0 — the upper bound of the saving: every secondary slot moves into
the primary union P, so the union after re-routing is |P ∪ protected| whatever the similarity matrix
(a random symmetric one is used; with ρ > 0 a calibrated matrix decides how much of that is reached).

Random weights route near-uniformly, unlike a trained model (the seed's Qwen3-30B-A3B: 8 → 93 of 128 experts
per layer from batch 1 to 128): read the "off" column as the uniform-routing bound, not as the real model.
Writes ``results/benchmarks/sere_union.json`` and ``.md`` (``_common.write_result``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from _common import RESULTS_DIR, write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS_DIR / "sere_union"), help="output stem (.json and .md)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sere_union needs a CUDA GPU (a 30B-shaped model)")

    from harness.engines.hf.sere import install_sere
    from harness.results.envinfo import collect_environment
    from harness.models.real_shapes import random_qwen3_moe
    from harness.techniques.sere.calibration import find_moe_blocks

    t0 = time.perf_counter()
    model = random_qwen3_moe(num_layers=args.layers)
    build_s = time.perf_counter() - t0
    blocks = find_moe_blocks(model)
    n_exp = blocks[0].num_experts
    top_k = model.config.num_experts_per_tok
    g = torch.Generator(device="cpu").manual_seed(0)
    sim = {}
    for ref in blocks:
        a = torch.rand(n_exp, n_exp, generator=g)
        sim[ref.layer] = ((a + a.T) / 2).fill_diagonal_(1.0)
    settings = [("off", top_k), ("K=2", 2), ("K=1", 1)]
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        ids = torch.randint(0, model.config.vocab_size, (b, args.prompt), generator=g).cuda()
        row = {"batch": b}
        for name, k in settings:
            handle = install_sere(model, sim, k, 0.0)
            try:
                with torch.inference_mode():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.steps + 1,
                                   min_new_tokens=args.steps + 1, do_sample=False, pad_token_id=0)
                st = handle.stats()
            finally:
                handle.remove()
            key = "union_before" if name == "off" else f"union_after_{name}"
            row[key] = st["expert_union_after"]
            row[f"per_layer_{name}"] = [p["expert_union_after"] for p in st["per_layer"]]
            row[f"moved_fraction_{name}"] = st["moved_fraction"]
            row[f"steps_{name}"] = st["steps"]
        rows.append(row)
        print(f"B={b:4d}  off {row['union_before']:6.1f}  K=2 {row['union_after_K=2']:6.1f}  "
              f"K=1 {row['union_after_K=1']:6.1f}  (of {n_exp})", flush=True)

    result = {
        "benchmark": "sere_union", "environment": collect_environment("cuda"), "weights": "random-init",
        "model": "Qwen3-30B-A3B shapes (Qwen3MoeForCausalLM)", "layers": len(blocks), "experts": n_exp,
        "top_k": top_k, "rho": 0.0, "prompt_tokens": args.prompt, "decode_steps": args.steps,
        "dtype": "bfloat16", "build_s": build_s, "rows": rows,
        "note": "random weights route near-uniformly; rho=0 is the upper bound of the union reduction",
    }
    out = Path(args.out + ".json")
    write_result(result, out)             # the numbers first: a table that fails to format keeps them
    lines = ["| batch | distinct experts / layer / step, SERE off | K=2, ρ=0 | K=1, ρ=0 |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['union_before']:.1f} | {r['union_after_K=2']:.1f} | {r['union_after_K=1']:.1f} |"
              for r in rows]
    header = (f"Distinct experts per MoE layer per decode step (mean over {len(blocks)} layers × {args.steps} "
              f"steps), {result['environment']['device_name']}, random-init Qwen3-30B-A3B shapes, bf16. "
              "Random routing is near-uniform, unlike a trained model's.\n\n")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()

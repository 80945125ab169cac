"""TPOT of the engine's graph decode loop with and without the one-step lookahead stop check (issue 17).

    python benchmarks/bench_lookahead.py            # H200, Qwen3-30B-A3B shapes (random init, bf16): ~1-2 min
    python benchmarks/bench_lookahead.py --smoke    # CPU, tiny shapes, emulated graphs: the code path only

Why: ``hf_graphs.StaticGreedyDecoder`` used to read the device "all rows done" flag after every replay, so the GPU
idled for the host's wake-up + the next launch on every token (run path 3.71 ms vs 3.54 ms back to back at B=1).
With ``lookahead`` (the default under real graphs, without SERE) the host decides one step behind. Per batch size,
three rows, all from the same captured graph (fused MoE kernel, sdpa, 64-token prompt, 64 new tokens, no EOS):

- ``plain``: ``lookahead=False``, TPOT = (last token - first token) / (steps - 1) from the decoder's own clock;
- ``lookahead``: the default (``lookahead=None``), same measure;
- ``back_to_back``: the same graph replayed 63 times in a row between two CUDA events (the floor).

Then an early-stop check: EOS = the token each row produced at step 24 (so rows stop at or before it), lookahead on
vs off: tokens and step counts must be identical (``same``); ``e2e_ms`` includes the dropped extra step's wait.
Writes ``results/benchmarks/bench_lookahead.json`` (or ``--out``) after every row; torch/transformers/harness only
(the model builder and the writer: ``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import RESULTS_DIR, build_qwen3_moe, qwen3_moe_config, set_impl, write_result


def tpot_ms(res) -> float:
    return (res.times[-1] - res.times[0]) * 1e3 / (len(res.times) - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, emulated graphs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    out = args.out or RESULTS_DIR / "bench_lookahead.json"

    import transformers

    from harness.engines.hf import experts as hf_experts
    from harness.engines.hf.graphs import StaticGreedyDecoder

    hf_experts.register()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model, build_s = build_qwen3_moe(qwen3_moe_config(smoke=not cuda), device, dtype, "grouped_mm")
    set_impl(model, "harness_fused_moe" if cuda else "grouped_mm")
    use_graphs = None if cuda else "emulate"
    new, prompt = (64, 64) if cuda else (8, 16)
    result = {"engine": "hf StaticGreedyDecoder", "weights": "random", "dtype": str(dtype).removeprefix("torch."),
              "shape": "Qwen3-30B-A3B" if cuda else "tiny (smoke)", "build_s": round(build_s, 1),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()},
              "hardware": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
              "prompt_tokens": prompt, "new_tokens": new, "repeats": args.repeats, "rows": [], "early_stop": []}

    def save() -> None:
        write_result(result, out, indent=1)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    def decoder(lookahead, eos=()):
        return StaticGreedyDecoder(model, list(eos), 0, use_graphs=use_graphs,
                                   lookahead=True if (lookahead is None and not cuda) else lookahead)

    for batch in [int(b) for b in args.batches.split(",") if b]:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, int(model.config.vocab_size) - 8, (batch, prompt), generator=g).to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        row = {"B": batch}
        result["rows"].append(row)
        if over_budget():
            row["skipped"] = "time budget"
            save()
            continue
        tokens = {}
        try:
            with torch.inference_mode():
                for name, lookahead in (("plain", False), ("lookahead", None)):
                    dec = decoder(lookahead)
                    dec.generate(inputs, 2, reserve_new_tokens=new)          # captures, as the engine's warm-up
                    runs = [dec.generate(inputs, new, reserve_new_tokens=new) for _ in range(args.repeats)]
                    row[name] = {"tpot_ms": statistics.median(tpot_ms(r) for r in runs),
                                 "steps": len(runs[0].times), "mode": runs[-1].mode}
                    tokens[name] = runs[-1].tokens
                    if name == "plain" and cuda:                               # the same graph back to back
                        st = next(iter(dec.states.values()))
                        per = []
                        for _ in range(args.repeats):
                            dec.generate(inputs, 1, reserve_new_tokens=new)      # prefill only: buffers reset
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            for _ in range(new - 1):
                                st.graph.replay()
                            end.record()
                            end.synchronize()
                            per.append(start.elapsed_time(end) / (new - 1))
                        row["back_to_back"] = {"tpot_ms": statistics.median(per)}
                    del dec
            row["same_tokens"] = tokens["plain"] == tokens["lookahead"]
            row["saved_ms"] = row["plain"]["tpot_ms"] - row["lookahead"]["tpot_ms"]
        except Exception as exc:  # noqa: BLE001
            row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        print(json.dumps(row)[:400], flush=True)
        save()

        check = {"B": batch}
        result["early_stop"].append(check)
        if over_budget() or "error" in row:
            check["skipped"] = "time budget" if over_budget() else "row failed"
            save()
            continue
        try:
            stop_at = min(24, new - 2)
            eos = sorted({r[stop_at] for r in tokens["plain"]})
            got = {}
            with torch.inference_mode():
                for name, lookahead in (("plain", False), ("lookahead", None)):
                    dec = decoder(lookahead, eos)
                    dec.generate(inputs, 2, reserve_new_tokens=new)
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    res = dec.generate(inputs, new, reserve_new_tokens=new)
                    got[name] = res
                    check[name] = {"steps": len(res.times), "replays": res.replays, "mode": res.mode,
                                   "e2e_ms": (time.perf_counter() - t0) * 1e3}
                    del dec
            a, b = got["plain"], got["lookahead"]
            check["same"] = (a.tokens, len(a.times), a.replays, a.mode) == (b.tokens, len(b.times), b.replays, b.mode)
        except Exception as exc:  # noqa: BLE001
            check.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        print(json.dumps(check)[:400], flush=True)
        save()

    print(f"\nTPOT ms ({result['shape']}, {result['hardware']}, {new} tokens after {prompt})\n")
    print("| B | plain | lookahead | back to back | saved | same tokens | early stop same (steps) |")
    print("|---|---|---|---|---|---|---|")
    for row, check in zip(result["rows"], result["early_stop"] + [{}] * len(result["rows"])):
        if "plain" not in row or "lookahead" not in row:
            print(f"| {row['B']} | {row.get('error', row.get('skipped', 'err'))[:100]} |")
            continue
        b2b = row.get("back_to_back", {}).get("tpot_ms")
        es = (f"{check['same']} ({check['plain']['steps']})" if "same" in check
              else check.get("error", check.get("skipped", "-"))[:60])
        print(f"| {row['B']} | {row['plain']['tpot_ms']:.3f} | {row['lookahead']['tpot_ms']:.3f} | "
              f"{'-' if b2b is None else f'{b2b:.3f}'} | {row['saved_ms']:.3f} | {row['same_tokens']} | {es} |")
    print(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

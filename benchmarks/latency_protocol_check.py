"""Does the latency protocol (harness/latency/) catch what it must on the GPU? (issue 17 item 1)

    python benchmarks/latency_protocol_check.py            # CUDA: tiny model, CUDA graphs on
    python benchmarks/latency_protocol_check.py --smoke    # CPU, a few tokens (what the tests' machine can run)

It runs the HF engine, with its static decoder replaying CUDA graphs, through
:class:`harness.latency.runner.TimedBatches` (the loop ``python -m harness`` uses) without Hydra, on
batches of several sizes and prompt lengths. Three sections, each guarded so that one failure keeps the others:

1. ``first_batch``: only the first batch is warmed. Every other batch size needs a new CUDA graph, so its
   first timed batch must show up as an event: ``cuda_graph_captures +1`` and/or a first-seen shape, re-timed.
   The table lists the events and the TTFT of the timing that was thrown away against the kept one;
2. ``per_shape``: one warm-up per shape key. No timed batch may capture (0 events expected);
3. ``repeats``: the ``per_shape`` engine timed 5 times. TTFT/TPOT mean, p50, the bootstrap 95 % interval (when
   scipy is installed; otherwise null) and the pass-to-pass CV;
4. ``per_shape_graph_states_5``: the same with ``engine.graph_states=5``. The batches need 4 (batch, cache length)
   states, one more than the default 3 keeps, so section 2 recaptures per batch; here no batch may capture.

Weights: the tiny embedded model, random-init (shapes matter here, not values). Writes
``results/benchmarks/latency_protocol_check.json``. Imports torch, transformers and harness modules that
need nothing else (scipy optional).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_engine(device: str, max_new: int, graph_states: int = 3):
    from harness.engines.hf.engine import HFEngine
    from harness.models.tiny import TinyModelSpec, ensure_tiny_model

    path = ensure_tiny_model(TinyModelSpec())
    cfg = SimpleNamespace(device=device, dtype="auto", batch_size=4, attn_implementation="sdpa",
                          experts_implementation="auto", cuda_graphs=True, warmup=1, graph_states=graph_states)
    return HFEngine(str(path), cfg, SimpleNamespace(max_new_tokens=max_new))


def make_batches():
    """Batches of sizes 2, 2, 1, 4, 1 with short and long prompts (two length buckets)."""
    from harness.engines.base import Request

    words = "the quick brown fox jumps over the lazy dog near the river bank at dawn".split()

    def req(uid: str, n_words: int) -> Request:
        return Request(uid, [{"type": "text", "text": " ".join(words[i % len(words)] for i in range(n_words))}])

    sizes_lengths = [(2, 8), (2, 9), (1, 8), (4, 120), (1, 120)]
    return [[req(f"b{b}r{i}", n + i) for i in range(size)] for b, (size, n) in enumerate(sizes_lengths)]


def cfg(warmup: str, repeats: int = 1):
    return SimpleNamespace(warmup=warmup, bucket=None, on_compile="retime", max_retime=2, repeats=repeats)


def section_first_batch(device: str, max_new: int) -> dict:
    from harness.latency.runner import TimedBatches

    engine = make_engine(device, max_new)
    try:
        batches = make_batches()
        timer = TimedBatches(engine, cfg("first_batch"), "baseline")
        timer.warm_up(batches)
        for i, b in enumerate(batches):
            timer.time_batch(b, 0, i)
        kept = {s["batch"]: s["ttft_ms"] for s in timer.samples}
        block = timer.protocol_block()
        return {"events": block["events"], "retimed": block["batches_retimed"],
                "excluded": block["batches_excluded"], "kept_ttft_ms": kept,
                "captures": engine.compile_counters()}
    finally:
        engine.close()


def section_per_shape(device: str, max_new: int, repeats: int, graph_states: int = 3) -> dict:
    from harness.latency.runner import TimedBatches
    from harness.latency.stats import repeat_summary

    engine = make_engine(device, max_new, graph_states)
    try:
        batches = make_batches()
        timer = TimedBatches(engine, cfg("per_shape", repeats), "baseline")
        timer.warm_up(batches)
        captures_after_warmup = engine.compile_counters()["cuda_graph_captures"]
        for i, b in enumerate(batches):
            timer.time_batch(b, 0, i)
        first_pass_events = list(timer.events)
        for p in range(1, repeats):
            for i, b in enumerate(batches):
                timer.time_batch(b, p, i)
        try:
            stats = repeat_summary(timer.samples, max_cv=0.1)
        except ImportError:  # no scipy on this box: the interval needs it
            import harness.latency.stats as st

            st.bootstrap_ci = lambda *a, **k: None
            stats = repeat_summary(timer.samples, max_cv=0.1)
        keep = ("mean", "p50", "p90", "ci", "cv", "n", "pass_means", "noisy")
        return {"graph_states": graph_states, "protocol": {k: v for k, v in timer.protocol_block().items()
                                                           if k in ("graph_states", "shapes_needing_states")},
                "warmup_batches": timer.warmup_batches, "captures_after_warmup": captures_after_warmup,
                "captures_at_end": engine.compile_counters()["cuda_graph_captures"],
                "first_pass_events": first_pass_events, "all_events": timer.events,
                "stats": {m: {k: stats[m][k] for k in keep} for m in ("ttft_ms", "tpot_ms", "e2e_ms")}}
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, few tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(REPO, "results/benchmarks/latency_protocol_check.json"))
    args = ap.parse_args()
    import torch
    import transformers

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    max_new = 4 if args.smoke else 32
    repeats = 2 if args.smoke else args.repeats
    result: dict = {"device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "dtype": "bfloat16" if device == "cuda" else "float32", "weights": "random-init (tiny)",
                    "max_new_tokens": max_new, "repeats": repeats, "sections": {}}
    t0 = time.perf_counter()
    for name, fn in (("first_batch", lambda: section_first_batch(device, max_new)),
                     ("per_shape_repeats", lambda: section_per_shape(device, max_new, repeats)),
                     # 4 shapes > the default 3 states: engine.graph_states=5 keeps every graph (no capture expected)
                     ("per_shape_graph_states_5", lambda: section_per_shape(device, max_new, repeats, 5))):
        try:
            result["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - one failed section keeps the others
            result["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 1)

    fb = result["sections"].get("first_batch", {})
    ps = result["sections"].get("per_shape_repeats", {})
    print(f"device {result['device_name']} · torch {result['torch']} · transformers {result['transformers']}")
    print("\n1. first_batch warm-up: events the protocol caught (expected: one per unwarmed batch size/bucket)")
    if "error" in fb:
        print("   error:", fb["error"])
    for e in fb.get("events", []):
        kept_ms = fb["kept_ttft_ms"].get(e["batch"])
        print(f"   batch {e['batch']} shape {e['shape']['batch_size']}x{e['shape']['prompt_bucket']}: "
              f"{e['action']:<8} {'; '.join(e['reasons'])}  TTFT of that call {e['ttft_ms']:.2f} ms"
              + (f", kept timing {kept_ms:.2f} ms" if kept_ms is not None else ""))
    print("\n2. per_shape warm-up: timed batches that captured or ran an unwarmed shape (expected: none)")
    if "error" in ps:
        print("   error:", ps["error"])
    else:
        print(f"   warm-up batches {ps['warmup_batches']}, graph captures after warm-up {ps['captures_after_warmup']}, "
              f"at the end {ps['captures_at_end']}, events {len(ps['all_events'])}")
        print(f"\n3. {repeats} passes     mean      p50       95% CI of the mean     CV")
        for m, s in ps["stats"].items():
            ci = f"[{s['ci'][0]:.3f}, {s['ci'][1]:.3f}]" if s["ci"] else "n/a (no scipy)"
            cv = f"{s['cv']:.1%}" if s["cv"] is not None else "n/a"
            print(f"   {m:<10} {s['mean']:9.3f} {s['p50']:9.3f}   {ci:<22} {cv}")
    g5 = result["sections"].get("per_shape_graph_states_5", {})
    print("\n4. per_shape warm-up with engine.graph_states=5 (expected: no capture after warm-up)")
    print("   error: " + g5["error"] if "error" in g5 else
          f"   captures after warm-up {g5['captures_after_warmup']}, at the end {g5['captures_at_end']}, "
          f"events {len(g5['all_events'])}, protocol {g5['protocol']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\n{args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

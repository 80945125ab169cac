"""benchmarks/bench_vllm_decode.py's parent process, with a fake child in place of vLLM: a device call's time limit
can cut the run between variants, so each variant's figures must reach the JSON as soon as they exist, a failed
variant must be recorded with its error (not dropped), and the card in the file comes from the children (the
parent never touches CUDA)."""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_vllm_decode as b  # noqa: E402

FAKE_CHILD = r'''
import json, sys
name = sys.argv[sys.argv.index("--child") + 1]
if name == "top2":
    sys.stderr.write("boom: no routing function\n"); sys.exit(3)
ms = {"stock": 4.0, "sere2": 2.0}[name]
print(f"[{name}] B=1: {ms:.2f} ms/step", flush=True)
print("RESULT " + json.dumps({"variant": name, "engine_start_s": 1.0,
      "env": {"torch": "t", "vllm": "v", "device": "NVIDIA H200"},
      "batches": {"1": {"per_step_ms": ms, "ci95": [ms - 0.1, ms + 0.1], "pairs": [ms]}}}), flush=True)
'''


def test_each_variant_is_written_as_it_finishes_and_a_failure_is_kept(tmp_path, monkeypatch, capsys):
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    monkeypatch.setattr(b, "__file__", str(child))
    out = tmp_path / "decode.json"
    args = types.SimpleNamespace(batches=[1], reps=1, layers=2, out=str(out), variants="stock,sere2,top2")
    results = []
    for name in args.variants.split(","):
        results.append(b.run_variant(name, args, "model", "sim"))
        b.write_results(args, results, None)
        assert len(json.loads(out.read_text())["results"]) == len(results)
    doc = json.loads(out.read_text())
    assert doc["env"]["device"] == "NVIDIA H200" and doc["variants_asked"] == ["stock", "sere2", "top2"]
    assert [r["variant"] for r in doc["results"]] == ["stock", "sere2", "top2"]
    assert "boom" in doc["results"][2]["error"] and "cut" not in doc
    b.print_table(results, [1])
    printed = capsys.readouterr().out
    assert "[sere2] B=1: 2.00 ms/step" in printed                       # streamed as measured
    assert "2.00 [1.90,2.10] 2.00x" in printed and "top2             failed" in printed
    b.write_results(args, results[:1], "stopped by signal 15")
    assert json.loads(out.read_text())["cut"] == "stopped by signal 15"

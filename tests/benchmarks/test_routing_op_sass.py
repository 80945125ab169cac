"""benchmarks/routing_op_sass.py's fit of timed kernels to their static counts: it recovers a relation that holds
exactly, predicts only the untimed loop-free one-program rows, and declines with too few timed rows."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import routing_op_sass as ros  # noqa: E402


def _row(variant, plan, tokens, instructions, warps, barriers, measured=None, loops=0, kernels=1):
    kernel = {"instructions": instructions, "num_warps": warps, "loops": loops,
              "critical_path": {"on_path_barrier": barriers}}
    return {"variant": variant, "plan": plan, "tokens": tokens, "measured_us": measured,
            "kernels": [kernel] * kernels}


def _truth(instructions, warps, barriers):
    return 1.5 + 2.0 * instructions * max(1, warps / 4) / 1000 + 0.5 * barriers / 10


def test_the_fit_recovers_an_exact_relation_and_predicts_the_untimed_rows():
    shapes = [(400, 4, 30), (450, 4, 2), (700, 8, 3), (900, 4, 40), (1700, 4, 10), (2400, 8, 5), (600, 4, 35)]
    rows = [_row("v", "one", i, n, w, b, _truth(n, w, b)) for i, (n, w, b) in enumerate(shapes)]
    rows += [_row("v", "one_w1", 1, 1100, 1, 0),                        # untimed: predicted
             _row("v", "one", 64, 4000, 8, 6, 20.0, loops=2),           # a loop: static counts are not executed ones
             _row("v", "multi", 1, 900, 1, 0, 12.0, kernels=2),         # two launches: not this fit's kind
             _row("v", "one", 32, 900, 4, 3)]                           # T > 16: not predicted
    fit = ros.one_program_fit(rows)
    assert fit["timed_rows"] == len(shapes)
    assert fit["coef"] == [1.5, 2.0, 0.5] and fit["r2"] == 1.0
    assert all(abs(e) < 1e-6 for e in fit["leave_one_out_error_us"].values())
    assert fit["predicted_us"] == {"v/one_w1/T=1": round(_truth(1100, 1, 0), 2)}


def test_too_few_timed_rows_give_no_fit():
    rows = [_row("v", "one", i, 400 + i, 4, i, 3.0 + i) for i in range(4)]
    assert ros.one_program_fit(rows) is None


def test_measurements_pair_only_with_the_kernel_code_they_timed(tmp_path):
    """A timing file sits beside today's compiled code only where it timed that code: a file with the current
    ``kernel_sources`` gives every plan, one with another multi-program hash its one-program rows, a file from
    before the hashes existed its one-program rows only (the multi-program plan was rebuilt after it)."""
    import json

    from harness.kernels.fused_routing import kernel_sources

    now = kernel_sources()
    rows = [{"variant": "one_sere2", "tokens": 1, "us_per_layer": 5.2},
            {"variant": "multi_sere2", "tokens": 64, "us_per_layer": 15.5}]

    def write(name, hashes):
        path = tmp_path / name
        path.write_text(json.dumps({"rows": rows, **({"kernel_sources": hashes} if hashes is not None else {})}))
        return path

    assert ros.measured_us([write("legacy.json", None)]) == {("one_sere2", 1): 5.2}
    assert ros.measured_us([write("other.json", {"one": now["one"], "multi": "another"})]) == {("one_sere2", 1): 5.2}
    assert ros.measured_us([write("same.json", now)]) == {("one_sere2", 1): 5.2, ("multi_sere2", 64): 15.5}
    assert ros.measured_us([tmp_path / "absent.json"]) == {}


def test_a_dispatched_row_stands_for_the_forced_variant_it_compiled(tmp_path):
    """``fused_*`` rows (the op as vLLM calls it) carry ``dispatched_as``: with today's hashes they pair as that
    forced variant; a forced row of the same name in the file wins; with another multi hash only one-program ones."""
    import json

    from harness.kernels.fused_routing import kernel_sources

    now = kernel_sources()
    rows = [{"variant": "fused_sere2", "tokens": 1, "us_per_layer": 4.19, "dispatched_as": "one_sere2_w1"},
            {"variant": "fused_sere2", "tokens": 64, "us_per_layer": 6.83, "dispatched_as": "multi_sere2_t1w1r2"},
            {"variant": "fused_top2", "tokens": 64, "us_per_layer": 4.06, "dispatched_as": "multi_top2_t1w1"},
            {"variant": "multi_top2_t1w1", "tokens": 64, "us_per_layer": 4.07}]

    def write(name, hashes):
        path = tmp_path / name
        path.write_text(json.dumps({"rows": rows, "kernel_sources": hashes}))
        return path

    assert ros.measured_us([write("same.json", now)]) == {("one_sere2_w1", 1): 4.19, ("multi_sere2_t1w1r2", 64): 6.83,
                                                          ("multi_top2_t1w1", 64): 4.07}
    assert ros.measured_us([write("other.json", {"one": now["one"], "multi": "x"})]) == {("one_sere2_w1", 1): 4.19}


def test_a_figure_is_paired_with_the_tiling_the_dispatch_compiles():
    # one program: a warp per row on one- and two-row steps (the forced-warps variants), else the default variant
    assert ros.measured_as("sere2", "one", 1) == "one_sere2_w1"
    assert ros.measured_as("top2", "one", 2) == "one_top2_w2"
    assert ros.measured_as("sere2", "one", 4) == "one_sere2"
    # the multi-program plan: its tiling sweep's name (launch 2's warps for SERE only)
    assert ros.measured_as("sere2", "multi", 64) == "multi_sere2_t1w1r2"
    assert ros.measured_as("stock", "multi", 256) == "multi_stock_t1w1"
    assert ros.measured_as("sere2", "multi", 512) == "multi_sere2_t2w1r2"   # a name the sweep times
    assert ros.measured_as("sere2", "one_w2", 16) == "one_sere2_w2"

"""Markdown table and console rows of ``benchmarks/bench_fused_moe.py`` (pure functions of its result dict).

Kept apart so the bench script stays one job (inputs, timing, the run loop). Imports nothing heavy.
"""

from __future__ import annotations

from fused_moe_small_sweep import small_sweep_markdown


def markdown(result: dict) -> str:
    lines = [
        "# Fused MoE: one decode MoE layer",
        "",
        f"{result['environment'].get('device_name')}, torch {result['environment'].get('torch_version')}, "
        f"triton {result['environment'].get('triton_version')}, transformers "
        f"{result['environment'].get('transformers_version')}; shapes {result['config']['shapes']}, "
        f"{result['config']['dtype']}, random weights; routing: {result['config']['routing']}",
        "",
        "Times: do_bench median (µs), L2 flushed per call; `graph` = CUDA-graph replay of one call. "
        "BW = weight bytes / time as a fraction of the 4.27 TB/s measured copy.",
        "",
        "`fused` = the sorted path (sort + align + grouped tiles), `small` = the small-batch path (no sort, "
        "no align; timed for S = B·k ≤ %d), `auto` = the path `fused_moe_triton` picks (small at S ≤ %s)."
        % (result["config"].get("small_bench_max_pairs", "?"),
           result["config"].get("small_path_max_pairs", "?")),
        "",
        "| B | variant | experts | floor µs | fused graph | fused eager | small graph | small eager | auto "
        "| grouped_mm graph | grouped_mm eager | batched_mm graph | eager loop | best BW | fused / small (graph) "
        "| best / grouped (graph) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(row, name, mode):
        res = row["impls"].get(name, {})
        if mode in res:
            return f"{res[mode]['p50_us']:.1f}"
        err = res.get(f"{mode}_error") if mode == "graph" else None
        err = err or res.get("error")
        return "OOM" if err and "OutOfMemory" in err else ("err" if err else "–")

    def ratio(a: dict, b: dict) -> str:
        return f"{a['p50_us'] / b['p50_us']:.2f}×" if a.get("p50_us") and b.get("p50_us") else "–"

    for row in result["rows"]:
        fused = row["impls"].get("fused", {}).get("graph", {})
        small = row["impls"].get("small", {}).get("graph", {})
        grouped = row["impls"].get("grouped_mm", {}).get("graph", {})
        best = min((t for t in (fused, small) if t.get("p50_us")), key=lambda t: t["p50_us"], default={})
        bw = f"{best['frac_copy_bw']:.0%}" if "frac_copy_bw" in best else "–"
        lines.append(
            f"| {row['B']} | {row['variant']} | {row['experts']} | {row['floor_us']:.1f} | "
            f"{cell(row, 'fused', 'graph')} | {cell(row, 'fused', 'eager')} | {cell(row, 'small', 'graph')} | "
            f"{cell(row, 'small', 'eager')} | {row.get('auto_path', '–')} | {cell(row, 'grouped_mm', 'graph')} | "
            f"{cell(row, 'grouped_mm', 'eager')} | {cell(row, 'batched_mm', 'graph')} | {cell(row, 'eager', 'eager')} "
            f"| {bw} | {ratio(fused, small)} | {ratio(grouped, best)} |")
    bad = [f"B={r['B']} {r['variant']} {n}: rel_err {v.get('rel_err')}" for r in result["rows"]
           for n, v in r["impls"].items() if v.get("correct") is False]
    bad += [f"small sweep B={r['B']} {r['config']}: rel_err {r.get('rel_err')}"
            for r in result.get("small_sweep", []) if r.get("correct") is False]
    lines += ["", "Correctness (rel. error vs fp32 reference, bound 2e-2): " + ("all pass" if not bad else
                                                                                  "; ".join(bad))]
    if result.get("sweep"):
        lines += ["", "## Tile sweep (fused, graph replay, top8)", "", "| B | config (bm, up n/k, down n/k, "
                  "warps, stages) | µs | default |", "|---|---|---|---|"]
        for r in result["sweep"]:
            c = r["config"]
            key = (c["block_m"], c["up_block_n"], c["up_block_k"], c["down_block_n"], c["down_block_k"],
                   c["num_warps"], c["num_stages"])
            t = r.get("graph", {}).get("p50_us")
            lines.append(f"| {r['B']} | {key} | {f'{t:.1f}' if t else r.get('error', '–')} | "
                         f"{'yes' if r['is_default'] else ''} |")
    lines += small_sweep_markdown(result)
    return "\n".join(lines) + "\n"


def print_row(row: dict) -> None:
    parts = [f"B={row['B']:<4} {row['variant']:<8} experts={row['experts']:<4} floor={row['floor_us']:.1f}us"]
    for name, res in row["impls"].items():
        if "skipped" in res:
            continue
        if "error" in res:
            parts.append(f"{name}=ERR({res['error'][:60]})")
            continue
        g = res.get("graph", {}).get("p50_us")
        e = res.get("eager", {}).get("p50_us")
        err = res.get("rel_err")
        parts.append(f"{name}={e:.1f}" + (f"/g{g:.1f}" if g else "") + (f" e{err:.1e}" if err is not None else ""))
    print("  ".join(parts), flush=True)

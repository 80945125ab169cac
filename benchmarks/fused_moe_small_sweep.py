"""Tile sweep of the small-batch fused MoE path (``harness.kernels.fused_moe_small``), for
``benchmarks/bench_fused_moe.py`` (``--small-sweep``, on by default; ``--small-sweep-batches``).

Times, per tile configuration, gate_up alone, down alone and the whole small-path call at decode batch sizes
(top-8 routing), so the best tiles of each kernel can be read off separately, and reports them combined
(copy that into ``SMALL_GPU_CONFIG`` if it beats the default, the first row). The bench passes its timer,
routing and error functions in, so this module needs nothing from it. Imports torch, harness and
``_common`` only.
"""

from __future__ import annotations

from typing import Callable

import torch

from _common import free_memory, short_error

SMALL_SWEEP = [  # up n/k, down n/k, up/down warps, stages, unroll, down all slots; first = SMALL_GPU_CONFIG
    (16, 256, 8, 128, 4, 4, 3, 2, True),
    (16, 256, 8, 256, 4, 4, 3, 1, True),
    (16, 256, 16, 128, 4, 4, 3, 2, True),
    (16, 256, 4, 128, 4, 2, 3, 2, True),
    (16, 256, 8, 256, 4, 4, 3, 2, False),
    (16, 256, 16, 256, 4, 4, 3, 2, False),
    (8, 256, 8, 128, 2, 2, 3, 2, True),
    (32, 256, 8, 128, 4, 8, 3, 2, True),
    (16, 128, 8, 64, 4, 4, 3, 2, True),
    (16, 512, 8, 128, 4, 4, 3, 1, True),
    (16, 256, 8, 128, 8, 8, 3, 2, True),
    (16, 256, 8, 128, 4, 4, 1, 1, True),
    (16, 256, 8, 128, 4, 4, 3, 1, True),
    (16, 256, 8, 128, 4, 4, 3, 4, True),
    (64, 128, 32, 128, 8, 8, 3, 1, False),
]
SMALL_SWEEP_SMOKE = [SMALL_SWEEP[0], SMALL_SWEEP[4]]


def small_sweep(experts, shapes: dict, batches: list[int], *, seed: int, cuda: bool,
                time_call: Callable[[Callable[[], object]], dict],
                routing: Callable[[int, int, int, int], tuple[torch.Tensor, torch.Tensor]],
                rel_err: Callable[[torch.Tensor, torch.Tensor], float], tol: float) -> list[dict]:
    """Each small-path config at each batch (top8 routing from ``routing(B, E, k, seed)``): gate_up alone,
    down alone and the whole call, each timed by ``time_call`` (the bench's graph replay on CUDA). The
    kernels are timed apart so the best gate_up tiles and the best down tiles can be read off separately;
    :func:`best_small_config` combines them. A config that fails records its error and the sweep goes on."""
    from harness.kernels.fused_moe import fused_moe_triton
    from harness.kernels.fused_moe_reference import fused_moe_reference
    from harness.kernels.fused_moe_small import (SmallMoEConfig, default_small_config, launch_down_small,
                                                 launch_gate_up_small)

    rows = []
    w1, w2 = experts.gate_up_proj, experts.down_proj
    dev = w1.device
    for batch in batches:
        ids, w = routing(batch, shapes["num_experts"], shapes["top_k"], seed + batch)
        ids, w = ids.to(dev), w.to(dev, w1.dtype)
        x = torch.randn(batch, shapes["hidden"], device=dev, dtype=w1.dtype)
        want = fused_moe_reference(x, w1, w2, ids, w, out_dtype=torch.float32)
        out = torch.empty_like(x)
        act = torch.empty(ids.numel(), shapes["inter"], device=dev, dtype=w1.dtype)
        default = default_small_config(dev)
        for params in (SMALL_SWEEP if cuda else SMALL_SWEEP_SMOKE):
            un, uk, dn, dk, uw, dw, stages, unroll, all_slots = params
            cfg = SmallMoEConfig(up_block_n=un, up_block_k=uk, down_block_n=dn, down_block_k=dk, up_warps=uw,
                                 down_warps=dw, num_stages=stages, unroll=unroll, down_all_slots=all_slots)
            row = {"B": batch, "config": cfg.__dict__, "is_default": cfg == default}
            calls = {
                "total": lambda cfg=cfg: fused_moe_triton(x, w1, w2, ids, w, out=out, path="small",
                                                          small_config=cfg),
                "gate_up": lambda cfg=cfg: launch_gate_up_small(x, w1, ids, act, cfg),
                "down": lambda cfg=cfg: launch_down_small(act, w2, ids, w, out, cfg),
            }
            try:
                row["rel_err"] = rel_err(calls["total"](), want)
                row["correct"] = bool(row["rel_err"] < tol)
                for part, call in calls.items():
                    row[part] = time_call(call)
            except Exception as exc:  # noqa: BLE001 - one failing config must not lose the others
                row["error"] = short_error(exc)
                free_memory(cuda)
            rows.append(row)
            print(f"  small sweep B={batch:<3} {str(params):<36} " + (
                "  ".join(f"{p}={row[p]['p50_us']:.1f}us" for p in calls if p in row) or str(row.get("error")))
                + ("  (default)" if row["is_default"] else ""), flush=True)
    return rows


def best_small_config(rows: list[dict], batch: int) -> dict | None:
    """The fastest gate_up tiles with the fastest down tiles at ``batch`` (stages/unroll from gate_up's)."""
    ok = [r for r in rows if r["B"] == batch and "gate_up" in r and "down" in r]
    if not ok:
        return None
    up = min(ok, key=lambda r: r["gate_up"]["p50_us"])["config"]
    down = min(ok, key=lambda r: r["down"]["p50_us"])["config"]
    return {**up, **{f: down[f] for f in ("down_block_n", "down_block_k", "down_warps", "down_all_slots")}}


def small_sweep_markdown(result: dict) -> list[str]:
    """The sweep's section of the bench's markdown report (empty without a sweep)."""
    lines: list[str] = []
    if not result.get("small_sweep"):
        return lines
    lines += ["", "## Tile sweep (small path, top8; graph replay on CUDA)", "",
              "| B | config (up n/k, down n/k, up/down warps, stages, unroll, all slots) | gate_up µs | down µs "
              "| total µs "
              "| default |", "|---|---|---|---|---|---|"]
    for r in result["small_sweep"]:
        c = r["config"]
        key = (c["up_block_n"], c["up_block_k"], c["down_block_n"], c["down_block_k"], c["up_warps"],
               c["down_warps"], c["num_stages"], c["unroll"], c["down_all_slots"])
        t = {p: (f"{r[p]['p50_us']:.1f}" if p in r else r.get("error", "–"))
             for p in ("gate_up", "down", "total")}
        lines.append(f"| {r['B']} | {key} | {t['gate_up']} | {t['down']} | {t['total']} | "
                     f"{'yes' if r['is_default'] else ''} |")
    for batch, cfg in (result.get("best_small_config") or {}).items():
        lines += ["", f"Best gate_up + best down tiles at B={batch}: `{cfg}`"]
    return lines

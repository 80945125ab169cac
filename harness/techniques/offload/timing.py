"""Speed numbers of an offload run (``summary.json`` ``offload``): TTFT apart from decode, as a prefill touches
most experts and would otherwise swamp the per-token cost.

Per measured batch (after the warm-up), from the engine's step timestamps (CUDA-synchronised after each step):
TTFT = batch start → first token; decode time = first token → last step; decode steps = steps after the first.
``decode_ms_per_token`` = decode time / decode steps (per step: one token per row); ``tokens_per_s`` =
rows × decode steps / decode time (rows that already ended still compute in a static batch and are counted:
it is the batch's throughput); ``share_of_resident`` = tokens/s ÷ the tokens/s of a ``policy=none`` summary
given as ``offload.resident_summary`` (same model, batch, device) — null when none is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["BatchTiming", "offload_summary"]


class BatchTiming:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.batches = 0
        self.ttft_ms: list[float] = []
        self.decode_ms = 0.0
        self.decode_steps = 0
        self.row_tokens = 0

    def add_batch(self, t0: float, times: list[float], rows: int) -> None:
        self.batches += 1
        self.ttft_ms.append((times[0] - t0) * 1e3)
        steps = len(times) - 1
        self.decode_steps += steps
        self.row_tokens += steps * rows
        self.decode_ms += (times[-1] - times[0]) * 1e3

    def summary(self) -> dict[str, Any]:
        d = self.decode_ms
        return {"batches": self.batches,
                "ttft_ms_mean": sum(self.ttft_ms) / len(self.ttft_ms) if self.ttft_ms else None,
                "decode_ms_per_token": d / self.decode_steps if self.decode_steps else None,
                "tokens_per_s": self.row_tokens / (d / 1e3) if d > 0 else None,
                "decode_steps_timed": self.decode_steps}


def _resident_tokens_per_s(path: str | None) -> float | None:
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    block = data.get("offload") or {}
    if block.get("policy") != "none":
        raise ValueError(f"offload.resident_summary={path}: its offload.policy is {block.get('policy')!r}, not 'none'")
    return block.get("tokens_per_s")


def offload_summary(runtime: Any) -> dict[str, Any]:
    """The whole ``offload`` block: cache statistics, memory, timing, share of resident speed."""
    out = runtime.stats()
    timing = runtime.timing.summary()
    out.update(timing)
    ref = _resident_tokens_per_s(runtime.cfg.get("resident_summary"))
    out["resident_tokens_per_s"] = ref
    out["share_of_resident"] = (timing["tokens_per_s"] / ref if ref and timing["tokens_per_s"] else None)
    steps = out.get("decode_steps") or 0
    out["decode_steps_match"] = steps == timing["decode_steps_timed"]
    return out

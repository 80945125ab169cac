"""``harness.engines.vllm.load.drive_load`` without vLLM: the order of warm-up, the ``after_warmup`` hook (where the
serve mode reads the server's counters, so that its phases cover the measured requests only) and the measured
requests, and what the load records about the prompts it cycled."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from harness.engines.base import Request
from harness.engines.vllm.load import burst_sizes, drive_load, warmup_bursts_on


def _engine():
    return SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)), _count_visual=lambda ids: 0,
                           visionzip_stats=lambda src: None, _sere_partial=False)


def test_after_warmup_runs_between_the_warmup_and_the_first_measured_request():
    events: list[str] = []

    async def stream(i: int, kind: str):
        events.append(kind)
        now = time.perf_counter()
        return {"sent": now, "chunks": [now, now + 1e-3], "ids": [1, 2], "prompt_ids": [5, 6, 7],
                "finish_reason": "length"}

    requests = [Request(f"r{i}", [{"type": "text", "text": "a"}]) for i in range(2)]
    gens, info = asyncio.run(drive_load(_engine(), requests, stream, 1000.0, 1.0, 5, 2, 0,
                                        after_warmup=lambda: events.append("hook")))
    assert events == ["warmup", "warmup", "hook", "load", "load", "load", "load", "load"]
    assert info["num_requests"] == 5 and info["distinct_requests"] == 2 and info["completed"] == 5
    assert [g.uid for g in gens] == ["r0#0", "r1#0", "r0#1", "r1#1", "r0#2"]


def test_warmup_bursts_reach_each_step_bucket_and_come_before_the_hook():
    """Each burst is sent at once (all its requests in flight together), sized from the first warm-up request's
    prompt so that its first step prefills about one bucket's tokens; failures are counted, not measured."""
    in_flight = {"now": 0, "peak": []}
    events: list[str] = []

    async def stream(i: int, kind: str):
        events.append(kind)
        in_flight["now"] += 1
        await asyncio.sleep(0.01)
        in_flight["peak"].append(in_flight["now"])
        in_flight["now"] -= 1
        now = time.perf_counter()
        return {"sent": now, "chunks": [now, now + 1e-3], "ids": [1, 2], "prompt_ids": list(range(64)),
                "finish_reason": "length"}

    requests = [Request(f"r{i}", [{"type": "text", "text": "a"}]) for i in range(3)]
    gens, info = asyncio.run(drive_load(_engine(), requests, stream, 1000.0, 1.0, 2, 0, 0, bursts=True,
                                        after_warmup=lambda: events.append("hook")))
    sizes = burst_sizes(64)
    assert sizes == [9, 12, 16, 24, 32, 48, 64, 96, 128]
    assert info["warmup_bursts"] == {"sizes": sizes, "prompt_tokens": 64, "failed": 0}
    assert events.index("hook") == 1 + sum(sizes) and events[-2:] == ["load", "load"]
    assert max(in_flight["peak"]) == 128                  # the largest burst was in flight at once
    assert burst_sizes(5880) == [2]                        # a 30-image VL prompt: steps beyond 512 tokens already
    assert len(gens) == 2 and all(not g.error for g in gens)


def test_warmup_bursts_default_to_cuda_only():
    assert warmup_bursts_on({"warmup_bursts": None}, "cuda") and not warmup_bursts_on({}, "cpu")
    assert warmup_bursts_on({"warmup_bursts": True}, "cpu") and not warmup_bursts_on({"warmup_bursts": False}, "cuda")

"""``harness.engines.vllm.load.drive_load`` without vLLM: the order of warm-up, the ``after_warmup`` hook (where the
serve mode reads the server's counters, so that its phases cover the measured requests only) and the measured
requests, and what the load records about the prompts it cycled."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from harness.engines.base import Request
from harness.engines.vllm.load import drive_load


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

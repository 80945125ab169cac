"""Where a ``vllm serve`` start-up went, read from the server's own log (issue 23: a start at Qwen3-30B-A3B shapes
took ~180 s on an H100, so a serving pair's three starts did not fit a 10-minute device call, and nothing said
which part took the time).

vLLM logs each phase's duration as it ends; this module reads those lines (the formats of vLLM 0.26 – 0.33, both
tenses where they changed) from the part of the log one start wrote. The phases nest (the engine's init includes
the compilation, the profiling run and the CUDA-graph capture), so they are recorded as vLLM states them, beside
the harness's own wall time to ``/health``, and never summed. A phase vLLM did not log (eager mode: no compile, no
graphs) is absent, not zero.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["PHASES", "startup_phases"]

#: phase name -> pattern of the vLLM log line that states its seconds (group 1)
PHASES: dict[str, re.Pattern[str]] = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_loading_s": re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds"),
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "torch_compile_s": re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total"),
    "profile_run_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "cuda_graphs_s": re.compile(r"Graph capturing finished in ([\d.]+) secs?"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


def startup_phases(log_path: str | Path | None, offset: int = 0) -> dict[str, float]:
    """The phases one start logged: ``log_path`` read from byte ``offset`` (where this start's output begins: a
    log the harness appends to on every start of the same run directory). The last line of each phase wins (a
    phase logged by several workers or retried states its final figure last). Unreadable log: empty."""
    if log_path is None:
        return {}
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, float] = {}
    for name, pattern in PHASES.items():
        for m in pattern.finditer(text):
            found[name] = float(m.group(1))
    return found

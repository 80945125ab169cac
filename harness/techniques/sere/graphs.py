"""SERE's routing step as a tensor program that a CUDA graph can capture: persistent inputs, device counters,
and the engagement canary.

Why. On a CUDA-graph replay no Python runs: the kernels recorded at capture run again on the *same memory*.
A routing function is therefore graph-safe only if (a) every tensor it reads that changes from step to step
lives in a buffer allocated once and written in place before each step (never re-created, never sliced from
a new tensor), (b) no Python decision depends on the step (a branch taken at capture is baked in: e.g.
"no mask yet, skip re-routing" during vLLM's dummy capture runs would make every replayed decode step
stock), and (c) statistics are device counters that the recorded kernels advance, read after the run — a
host ``+= 1`` in the function counts eager steps only. This module is that contract, engine-agnostic:

- :class:`StepRows`: one persistent bool buffer per device, ``[capacity]`` (vLLM: ``max_num_batched_tokens``),
  row t = "this row of the current step is a decode row". :meth:`StepRows.write` copies the step's host mask
  into it in place (non-blocking) and zeroes the rest; :meth:`StepRows.clear` marks a dummy / profile step
  (all False). The routing function reads ``buffer[:num_rows]`` (a view: same storage on every call).
  Once :meth:`StepRows.freeze` is called (before graphs are captured) the buffer can no longer be
  re-allocated: a step larger than the capacity raises instead of silently reading a new buffer.
- :class:`RoutingCounters`: per layer, one int64 device vector advanced by tensor ops on every call:
  ``calls`` (calls with at least one decode row), ``rows`` (decode rows), distinct experts before/after,
  ``|P|``, moved slots, secondary slots. A capture records the additions; each replay performs them with the
  step's mask, so replayed steps count exactly as eager ones. :meth:`RoutingCounters.reset` zeroes **in
  place** (a graph keeps writing into the captured tensor; replacing it would lose every replayed step).
- :func:`route`: ids -> re-routed ids for one layer: mask from the buffer, ``op`` (the fused Triton op or the
  reference), counters. The only Python branch is the eager skip of a step that has no decode row (the
  host knows it: :attr:`StepRows.active`); it is never taken while capturing or compiling
  (:func:`capturing`), so a graph always contains the op and reads the mask.
- :func:`engagement` / :func:`check_engagement`: the canary. A SERE run whose decode tokens were never
  re-routed (no routing call saw a decode row) or whose counted decode rows differ from the decode tokens
  the engine generated did not run SERE as configured, whatever its summary says; the run fails with the
  reason instead (``harness.run.experiment``).

Decode tokens: a request that generated n tokens fed n - 1 of them back (the first comes from the prefill,
the last is never fed), so a run's decode rows per MoE layer = sum(n - 1) over its requests, when nothing is
recomputed (vLLM recomputes after a preemption: then rows >= tokens, see :func:`engagement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.techniques.sere.errors import SereNotEngaged  # noqa: F401 (importable from here too)

__all__ = ["COUNTERS", "RoutingCounters", "SereNotEngaged", "StepRows", "capture_mode", "capturing",
           "check_engagement", "decode_tokens", "engagement", "route"]

COUNTERS = ("calls", "rows", "before", "after", "primary", "moved", "secondary")
_FORCED_CAPTURE = [0]


class capture_mode:
    """Context manager: :func:`capturing` is True inside (what a graph capture or a trace must see; tests
    use it around ``make_fx``, engines could around a capture that is not a CUDA stream capture)."""

    def __enter__(self) -> "capture_mode":
        _FORCED_CAPTURE[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        _FORCED_CAPTURE[0] -= 1


def capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream, while torch.compile traces, or
    inside :class:`capture_mode`: no host-side shortcut may be taken then (it would be baked in)."""
    if _FORCED_CAPTURE[0]:
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return True
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class StepRows:
    """The persistent decode-row mask of the current step, one bool buffer per device (module doc)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = max(1, int(capacity))
        self.buffers: dict[Any, torch.Tensor] = {}
        self.active = 0          # decode rows of the current step (host int: the eager skip only)
        self.frozen = False

    def buffer(self, device: Any, rows: int = 0) -> torch.Tensor:
        """The device's buffer (allocated at ``max(capacity, rows)`` on first use; grown only if not frozen)."""
        device = torch.device(device)
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < rows:
            if capturing():
                raise RuntimeError("SERE: the decode-row buffer would be allocated during a graph capture (a "
                                   "replay would read a buffer no step writes); allocate it before capturing")
            if buf is not None and self.frozen:
                raise RuntimeError(f"SERE: a step of {rows} rows exceeds the decode-row buffer ({buf.numel()}) "
                                   "after graphs were captured; raise its capacity (max_num_batched_tokens)")
            size = max(self.capacity, int(rows))
            with torch.inference_mode(False):  # a normal tensor: written in place in any mode
                new = torch.zeros(size, dtype=torch.bool, device=device)
            if buf is not None:
                new[: buf.numel()].copy_(buf)
            self.buffers[device] = buf = new
            self.capacity = max(self.capacity, size)
        return buf

    def freeze(self) -> None:
        """From now on buffers keep their storage (call before capturing graphs that read them)."""
        self.frozen = True

    def write(self, device: Any, mask: torch.Tensor, total: int | None = None) -> None:
        """The step's decode-row mask (bool [n], host) into the buffer, in place; rows n .. total-1 (padding)
        and the rest of the buffer False."""
        mask = mask.reshape(-1).to(torch.bool)
        n = int(mask.numel())
        buf = self.buffer(device, max(n, int(total or 0)))
        src = mask.pin_memory() if buf.is_cuda and not mask.is_cuda and torch.cuda.is_available() else mask
        if n:
            buf[:n].copy_(src, non_blocking=True)
        buf[n:].zero_()
        self.active = int(mask.sum())

    def clear(self, device: Any = None) -> None:
        """A dummy / profile step: no decode rows (every buffer, or the device's)."""
        for dev, buf in self.buffers.items():
            if device is None or dev == torch.device(device):
                buf.zero_()
        self.active = 0

    def rows(self, device: Any, num_rows: int) -> torch.Tensor:
        """``buffer[:num_rows]``: what the routing function reads (the same storage on every call)."""
        return self.buffer(device, num_rows)[:num_rows]


class RoutingCounters:
    """One layer's routing statistics as an int64 device vector over :data:`COUNTERS` (module doc)."""

    def __init__(self, layer: int, num_experts: int, protected: int = 0) -> None:
        self.layer, self.num_experts, self.protected = int(layer), int(num_experts), int(protected)
        self.acc: dict[Any, torch.Tensor] = {}

    def counter(self, device: Any) -> torch.Tensor:
        device = torch.device(device)
        acc = self.acc.get(device)
        if acc is None:
            if capturing():
                raise RuntimeError("SERE: routing counters would be allocated during a graph capture (replays "
                                   "would count into a temporary); call the routing function eagerly first")
            with torch.inference_mode(False):
                acc = self.acc[device] = torch.zeros(len(COUNTERS), dtype=torch.long, device=device)
        return acc

    def add(self, old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, k_primary: int) -> None:
        """Count one call (fixed shapes, no host sync: capturable)."""
        e = self.num_experts
        t, k = old.shape
        kp = min(int(k_primary), k)
        none = torch.full_like(old, e)            # rows outside the mask and invalid ids -> spare bin e

        def keep(ids: torch.Tensor) -> torch.Tensor:
            ids = torch.where(mask[:, None], ids, none[:, : ids.shape[1]])
            return torch.where((ids >= 0) & (ids < e), ids, e).reshape(-1).long()

        bins = e + 1
        flat = torch.cat([keep(old), keep(new) + bins, keep(old[:, :kp]) + 2 * bins])
        seen = torch.zeros(3 * bins, dtype=torch.bool, device=old.device).index_fill_(0, flat, True)
        distinct = seen.view(3, bins)[:, :e].sum(1)
        rows = mask.sum()
        moved = ((old != new) & mask[:, None]).sum()
        vals = torch.stack([(rows > 0).long(), rows, distinct[0], distinct[1], distinct[2], moved, rows * (k - kp)])
        self.counter(old.device).add_(vals)

    def reset(self) -> None:
        """Zero in place (captured graphs keep counting into the same tensors)."""
        for acc in self.acc.values():
            acc.zero_()

    def read(self) -> dict[str, int]:
        """Sums over devices (one device-to-host copy per device)."""
        total = [0] * len(COUNTERS)
        for acc in self.acc.values():
            total = [a + b for a, b in zip(total, acc.tolist(), strict=True)]
        return dict(zip(COUNTERS, total, strict=True))


def route(ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
          protected: torch.Tensor | None, rows: StepRows, counters: RoutingCounters | None,
          op: Callable) -> torch.Tensor:
    """SERE re-routing of one layer's top-k ids ``[T, k]`` with the step's decode rows from ``rows``.

    Eagerly, a step with no decode row returns ``ids`` untouched without launching anything (the counters
    would add zeros). While capturing/compiling the op always runs: the graph reads the mask on replay."""
    if k_primary >= ids.shape[1]:
        return ids
    # persistent state first, also on skipped eager steps: the first (eager, e.g. profile) call allocates it,
    # so a later capture records these tensors (allocating them while capturing raises)
    mask = rows.rows(ids.device, ids.shape[0])
    if counters is not None:
        counters.counter(ids.device)
    if not capturing() and rows.active == 0:   # this order: a tracer never reads (and guards on) ``active``
        return ids
    ids = ids.contiguous()
    new = op(ids, similarity, k_primary, rho, protected, mask)
    if counters is not None:
        counters.add(ids, new, mask, k_primary)
    return new


# ----------------------------------------------------------------------------------------- the canary


def decode_tokens(output_lengths: list[int]) -> int:
    """Decode rows a run fed, from its requests' generated-token counts (module doc): sum(max(n - 1, 0))."""
    return sum(max(int(n) - 1, 0) for n in output_lengths)


@dataclass
class _Layer:
    layer: int
    calls: int
    rows: int


def engagement(per_layer: list[dict[str, Any]], expected_tokens: int, *, recomputed: bool = False) -> dict:
    """The canary's verdict as a ``summary.json`` block: ``ok``, ``reason`` (None when ok), the decode
    tokens expected, and per layer the routing calls that saw decode rows and the rows counted.

    ``per_layer``: dicts with ``layer``, ``calls``, ``rows`` (as :meth:`RoutingCounters.read` gives them,
    summed over workers). ``recomputed``: the engine recomputed decode tokens (vLLM preemption): then a layer
    may count more rows than tokens, never fewer."""
    layers = [_Layer(int(d["layer"]), int(d.get("calls") or 0), int(d.get("rows") or 0)) for d in per_layer]
    reason = None
    if expected_tokens > 0 and not layers:
        reason = f"SERE is on and the run fed {expected_tokens} decode tokens, but no MoE layer has a routing function"
    elif expected_tokens > 0 and all(st.calls == 0 for st in layers):
        reason = (f"SERE is on and the run fed {expected_tokens} decode tokens, but no routing call saw a decode "
                  "row: the decode steps ran the stock routing")
    else:
        bad = [st for st in layers if (st.rows < expected_tokens or (st.rows > expected_tokens and not recomputed))]
        if bad:
            st = bad[0]
            reason = (f"SERE statistics count {st.rows} decode rows in layer {st.layer} ({st.calls} calls), the run "
                      f"fed {expected_tokens} decode tokens: some decode steps were not re-routed (or counted) "
                      f"({len(bad)} of {len(layers)} layers disagree)")
    return {"ok": reason is None, "reason": reason, "decode_tokens": int(expected_tokens),
            "recomputed": bool(recomputed),
            "layers": {str(st.layer): {"calls": st.calls, "rows": st.rows} for st in layers}}


def check_engagement(technique_stats: dict[str, Any]) -> None:
    """Raise :class:`SereNotEngaged` when ``technique_stats["sere"]["engagement"]`` says SERE did not act."""
    block = (technique_stats or {}).get("sere") or {}
    verdict = block.get("engagement") if isinstance(block, dict) else None
    if isinstance(verdict, dict) and not verdict.get("ok", True):
        raise SereNotEngaged(verdict.get("reason") or "SERE was not engaged")

"""Routing traces: which experts every decode token selected at every MoE layer, and what the predictor reads.

A trace is what the oracle policy (Belady's eviction needs the future) and the stability predictor (trained
on recorded routing) consume, and what the benchmark replays. One file pair per trace:

    NAME.pt    torch.save of a dict of CPU tensors (loadable with ``weights_only=True``):
               ids      int16   [N, L, k]  selected expert ids per decode token and MoE layer (router order:
                                           highest weight first; -1 = no expert)
               weights  float16 [N, L, k]  the router's weights for those ids (as the experts receive them)
               embeds   float16 [N, H]     the token's input embedding (``embed_tokens`` of the token fed at
                                           that step: what the stability predictor reads); may be [N, 0]
               request  int32   [N]        request index (0..R-1) of the token
               step     int32   [N]        decode step of the token within its request (0, 1, ...)
               layers   int32   [L]        the decoder-layer index of each MoE layer column
    NAME.json  meta: format, model, dataset, seed, num_experts, top_k, versions, source ("hf" | "synthetic")
               and how it was produced.

Rows are ordered by (request, step), so the tokens of one request are contiguous and in decode order.
Only decode tokens are recorded (a prefill touches most experts anyway and is not what a decode-time
cache policy is judged on). A batch of B requests decoded together is replayed as B rows per step: use
:meth:`RoutingTrace.steps_by_batch` to regroup requests into static batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "RoutingTrace", "load_trace", "save_trace"]

FORMAT = "harness-routing-trace/1"


@dataclass
class RoutingTrace:
    """One routing trace in memory (see the module doc for the fields)."""

    ids: torch.Tensor
    weights: torch.Tensor
    embeds: torch.Tensor
    request: torch.Tensor
    step: torch.Tensor
    layers: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, nl, k = self.ids.shape
        for name, t, shape in (("weights", self.weights, (n, nl, k)), ("request", self.request, (n,)),
                               ("step", self.step, (n,)), ("layers", self.layers, (nl,))):
            if tuple(t.shape) != shape:
                raise ValueError(f"trace {name} has shape {tuple(t.shape)}, expected {shape}")
        if self.embeds.dim() != 2 or self.embeds.shape[0] != n:
            raise ValueError(f"trace embeds must be [N={n}, H], got {tuple(self.embeds.shape)}")
        self.meta.setdefault("num_experts", int(self.ids.max().item()) + 1 if n else 0)
        self.meta.setdefault("top_k", k)

    # -- shape --------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def num_requests(self) -> int:
        return int(self.request.max().item()) + 1 if self.num_tokens else 0

    def request_slices(self) -> list[slice]:
        """Row range of every request (rows are contiguous per request, in order)."""
        counts = torch.bincount(self.request.long(), minlength=self.num_requests).tolist()
        out, start = [], 0
        for c in counts:
            out.append(slice(start, start + c))
            start += c
        return out

    def subset(self, requests: list[int]) -> RoutingTrace:
        """The trace of the given requests (renumbered 0..len-1, in the given order)."""
        sl = self.request_slices()
        rows = torch.cat([torch.arange(sl[r].start, sl[r].stop) for r in requests]) if requests else \
            torch.zeros(0, dtype=torch.long)
        new_req = torch.cat([torch.full((sl[r].stop - sl[r].start,), i, dtype=torch.int32)
                             for i, r in enumerate(requests)]) if requests else torch.zeros(0, dtype=torch.int32)
        return RoutingTrace(self.ids[rows], self.weights[rows], self.embeds[rows], new_req, self.step[rows],
                            self.layers.clone(), dict(self.meta, subset_of=len(sl)))

    def steps_by_batch(self, batch_size: int) -> list[torch.Tensor]:
        """Replay order for a static batch of ``batch_size`` requests: a list of ``[b, L, k]`` id tensors, one
        per decode step (requests 0..B-1 decode together, then B..2B-1, ...; a request that ended leaves
        its batch, as in ``generate``, so late steps have fewer rows)."""
        sl = self.request_slices()
        out: list[torch.Tensor] = []
        for g in range(0, len(sl), batch_size):
            group = sl[g:g + batch_size]
            longest = max(s.stop - s.start for s in group)
            for t in range(longest):
                rows = [s.start + t for s in group if s.start + t < s.stop]
                out.append(self.ids[rows])
        return out


def _paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    base = p.with_suffix("") if p.suffix in (".pt", ".json") else p
    return base.with_suffix(".pt"), base.with_suffix(".json")


def save_trace(trace: RoutingTrace, path: str | Path) -> Path:
    """Write ``NAME.pt`` + ``NAME.json``; returns the ``.pt`` path."""
    pt, js = _paths(path)
    pt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": trace.ids.to(torch.int16).contiguous(), "weights": trace.weights.to(torch.float16),
                "embeds": trace.embeds.to(torch.float16), "request": trace.request.to(torch.int32),
                "step": trace.step.to(torch.int32), "layers": trace.layers.to(torch.int32)}, pt)
    meta = dict(trace.meta, format=FORMAT, num_tokens=trace.num_tokens, num_layers=trace.num_layers,
                num_requests=trace.num_requests, hidden_size=trace.embeds.shape[1])
    js.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return pt


def load_trace(path: str | Path) -> RoutingTrace:
    """Read a trace written by :func:`save_trace` (either file of the pair may be named)."""
    pt, js = _paths(path)
    blob = torch.load(pt, map_location="cpu", weights_only=True)
    meta = json.loads(js.read_text()) if js.exists() else {}
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{js}: trace format {meta.get('format')!r}, this harness reads {FORMAT!r}")
    return RoutingTrace(blob["ids"].long(), blob["weights"].float(), blob["embeds"].float(),
                        blob["request"].long(), blob["step"].long(), blob["layers"].long(), meta)

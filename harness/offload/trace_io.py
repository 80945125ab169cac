"""Routing traces for the oracle: the format of ``harness.offload.trace`` (branch offload-lease), read and written
here without depending on that module, so this branch stands alone; when that module is importable it is used.

Format (``NAME.pt`` = torch.save of CPU tensors, ``NAME.json`` = meta): ``ids`` int16 ``[N, L, k]`` (decode
tokens × MoE layers × top-k, -1 = none), ``weights`` f16 ``[N, L, k]``, ``embeds`` f16 ``[N, H]``, ``request``
int32 ``[N]``, ``step`` int32 ``[N]``, ``layers`` int32 ``[L]``; rows ordered by (request, step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["TraceRecorder", "load_trace", "MiniTrace"]

FORMAT = "harness-routing-trace/1"


class MiniTrace:
    """The part of ``RoutingTrace`` the oracle reads: ``steps_by_batch(B)`` (same regrouping rule)."""

    def __init__(self, ids: torch.Tensor, request: torch.Tensor, step: torch.Tensor,
                 embeds: torch.Tensor | None = None, num_experts: int | None = None):
        self.ids, self.request, self.step = ids, request, step
        self.embeds = embeds if embeds is not None else torch.zeros(ids.shape[0], 0)
        self.num_experts = num_experts if num_experts is not None else (int(ids.max()) + 1 if len(ids) else 0)

    def steps_by_batch(self, batch_size: int) -> list[torch.Tensor]:
        n_req = int(self.request.max()) + 1 if len(self.request) else 0
        counts = torch.bincount(self.request.long(), minlength=n_req).tolist()
        starts = [sum(counts[:i]) for i in range(n_req)]
        out = []
        for g in range(0, n_req, batch_size):
            group = list(range(g, min(g + batch_size, n_req)))
            for t in range(max(counts[r] for r in group)):
                rows = [starts[r] + t for r in group if t < counts[r]]
                out.append(self.ids[rows])
        return out


def load_trace(path: str | Path) -> Any:
    """A trace object with ``steps_by_batch`` (``harness.offload.trace.load_trace`` when available)."""
    try:
        from harness.offload.trace import load_trace as full  # type: ignore[import-not-found]

        return full(path)
    except ImportError:
        pass
    p = Path(path)
    pt = p.with_suffix(".pt") if p.suffix in (".pt", ".json", "") else p
    blob = torch.load(pt, map_location="cpu", weights_only=True)
    js = pt.with_suffix(".json")
    meta = json.loads(js.read_text()) if js.exists() else {}
    return MiniTrace(blob["ids"].long(), blob["request"].long(), blob["step"].long(), blob["embeds"].float(),
                     meta.get("num_experts"))


class TraceRecorder:
    """Collects decode routing per pass (all rows of the batch, as the HF engine computes them) and saves it."""

    def __init__(self, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]] = []
        self._pass: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._embeds: torch.Tensor | None = None
        self.request_base = 0
        self.batch_rows = 0

    def begin_batch(self, rows: int) -> None:
        self.request_base += self.batch_rows
        self.batch_rows = rows

    def begin_pass(self, embeds: torch.Tensor | None) -> None:
        self._pass = {}
        self._embeds = None if embeds is None else embeds.detach().reshape(embeds.shape[0], -1)[:, :].float().cpu()

    def layer(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._pass[layer] = (ids.detach().cpu(), weights.detach().float().cpu())

    def end_pass(self, step: int) -> None:
        if len(self._pass) != len(self.layer_ids):
            return
        ids = torch.stack([self._pass[i][0] for i in range(len(self.layer_ids))], 1)
        w = torch.stack([self._pass[i][1] for i in range(len(self.layer_ids))], 1)
        self.rows.append((ids, w, self._embeds, self.request_base, step))

    def save(self, path: str | Path, meta: dict[str, Any]) -> Path:
        ids, ws, embeds, req, step = [], [], [], [], []
        for i, w, e, base, s in self.rows:
            ids.append(i)
            ws.append(w)
            embeds.append(e if e is not None else torch.zeros(i.shape[0], 0))
            req.append(torch.arange(base, base + i.shape[0]))
            step.append(torch.full((i.shape[0],), s))
        if not ids:
            raise RuntimeError("no decode step was recorded")
        req_t, step_t = torch.cat(req), torch.cat(step)
        order = sorted(range(len(req_t)), key=lambda r: (int(req_t[r]), int(step_t[r])))
        blob = {"ids": torch.cat(ids)[order].to(torch.int16), "weights": torch.cat(ws)[order].to(torch.float16),
                "embeds": torch.cat(embeds)[order].to(torch.float16), "request": req_t[order].to(torch.int32),
                "step": step_t[order].to(torch.int32), "layers": torch.tensor(self.layer_ids, dtype=torch.int32)}
        p = Path(path)
        pt = p.with_suffix(".pt")
        pt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, pt)
        pt.with_suffix(".json").write_text(json.dumps(
            dict(meta, format=FORMAT, source="hf", num_tokens=len(order), num_layers=len(self.layer_ids),
                 num_requests=int(req_t.max()) + 1, hidden_size=blob["embeds"].shape[1]),
            indent=2, sort_keys=True, default=str) + "\n")
        return pt

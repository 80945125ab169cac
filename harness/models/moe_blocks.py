"""Where a model's MoE blocks are, and which routing it carries: the model-structure helpers that SERE
calibration and protection, the HF engine's routing hooks, expert offload and the routing-trace recorder
all need (``shared/notes/layout.md``: ``models/moe_blocks``). They used to live in
``harness.techniques.sere.calibration``, which still re-exports them.

MoE blocks are found through the model's family (``harness.models.families``: the router attribute, ``gate`` or
GPT-OSS's ``router``, beside ``.experts`` with a 3-D ``gate_up_proj``); a model type no family claims is searched
generically (``.gate`` + ``.experts.gate_up_proj``, softmax routing renormalised as the router's
``norm_topk_prob`` says). Each :class:`MoeBlockRef` carries its router and the family's routing rule. A block's
key is its decoder-layer index parsed from its module name (``...layers.<i>.mlp``), the same index vLLM's
``prefix`` carries. Imports: torch and the family registry.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

from harness.models.families import MoeFamily, RoutingRule, family_of

__all__ = ["MoeBlockRef", "find_moe_blocks", "model_fingerprint"]


@dataclass(frozen=True)
class MoeBlockRef:
    """One MoE block of a model: its decoder-layer index, module name and the module itself; its router, the
    model's family (None: generic) and the routing rule the router applies."""

    layer: int
    name: str
    block: torch.nn.Module
    router: torch.nn.Module | None = None
    family: MoeFamily | None = None
    rule: RoutingRule | None = None

    @property
    def gate(self) -> torch.nn.Module:
        """The router (``block.gate``; GPT-OSS ``block.router``)."""
        return self.router if self.router is not None else self.block.gate

    @property
    def num_experts(self) -> int:
        return int(self.block.experts.gate_up_proj.shape[0])

    def bias(self) -> torch.Tensor | None:
        """The router's selection bias (DeepSeek-V3 ``e_score_correction_bias``), read live; None without one."""
        attr = self.family.bias_attr if self.family is not None else None
        return getattr(self.gate, attr, None) if attr else None


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _is_moe_block(module: torch.nn.Module, router_attr: str = "gate") -> bool:
    gate, experts = getattr(module, router_attr, None), getattr(module, "experts", None)
    w = getattr(experts, "gate_up_proj", None)
    return isinstance(gate, torch.nn.Module) and isinstance(experts, torch.nn.Module) \
        and isinstance(w, torch.Tensor) and w.dim() == 3


def generic_rule(router: torch.nn.Module) -> RoutingRule:
    """The rule assumed for a model type no family claims: softmax top-k, renormalised unless the router's
    ``norm_topk_prob`` says otherwise (the Qwen3 rule the harness was written for)."""
    flag = getattr(router, "norm_topk_prob", None)
    return RoutingRule(renormalize=True if flag is None else bool(flag))


def find_moe_blocks(model: torch.nn.Module) -> list[MoeBlockRef]:
    """Every MoE block (the family's router attribute + ``.experts`` with a 3-D ``gate_up_proj``), by layer.

    The key is the decoder-layer index from the module name (``model.language_model.layers.7.mlp`` -> 7);
    when names carry no unique index, the blocks are numbered 0, 1, ... in module order.
    """
    family = family_of(model) if hasattr(model, "config") else None
    attr = family.router_attr if family is not None else "gate"
    rule = family.routing_rule(model.config) if family is not None else None
    found = [(name, m) for name, m in model.named_modules() if _is_moe_block(m, attr)]
    parsed = []
    for name, _ in found:
        hits = _LAYER_RE.findall(name)
        parsed.append(int(hits[-1]) if hits else None)
    if found and None not in parsed and len(set(parsed)) == len(parsed):
        keys = parsed
    else:
        keys = list(range(len(found)))
    refs = [MoeBlockRef(i, n, m, getattr(m, attr), family, rule or generic_rule(getattr(m, attr)))
            for i, (n, m) in zip(keys, found, strict=True)]
    return sorted(refs, key=lambda r: r.layer)


def model_fingerprint(model: torch.nn.Module) -> str:
    """Identity of a MoE model's routing: sha256 over its MoE layer indices, expert-weight shapes and
    router weights (upcast to float32, so a bf16 and an fp32 load of one checkpoint agree). Cheap
    (routers are E x H) and different for any two differently-trained or differently-seeded models."""
    h = hashlib.sha256()
    for ref in find_moe_blocks(model):
        ex = ref.block.experts
        h.update(f"{ref.layer}:{tuple(ex.gate_up_proj.shape)}:{tuple(ex.down_proj.shape)};".encode())
        for w in (getattr(ref.gate, "weight", None), getattr(ref.gate, "bias", None), ref.bias()):
            if isinstance(w, torch.Tensor) and w.device.type != "meta":
                h.update(w.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

"""Where a model's MoE blocks are, and which routing it carries: the model-structure helpers that SERE
calibration and protection, the HF engine's routing hooks, expert offload and the routing-trace recorder
all need (``shared/notes/layout.md``: ``models/moe_blocks``). They used to live in
``harness.techniques.sere.calibration``, which still re-exports them.

MoE blocks are found generically (Qwen3-MoE, Qwen3-VL-MoE, any module with ``.gate`` and ``.experts`` whose
``gate_up_proj`` is 3-D); a block's key is its decoder-layer index parsed from its module name
(``...layers.<i>.mlp``), the same index vLLM's ``prefix`` carries. Imports: torch only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

__all__ = ["MoeBlockRef", "find_moe_blocks", "model_fingerprint"]


@dataclass(frozen=True)
class MoeBlockRef:
    """One MoE block of a model: its decoder-layer index, module name and the module itself."""

    layer: int
    name: str
    block: torch.nn.Module

    @property
    def num_experts(self) -> int:
        return int(self.block.experts.gate_up_proj.shape[0])


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _is_moe_block(module: torch.nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    w = getattr(experts, "gate_up_proj", None)
    return isinstance(gate, torch.nn.Module) and isinstance(experts, torch.nn.Module) \
        and isinstance(w, torch.Tensor) and w.dim() == 3


def find_moe_blocks(model: torch.nn.Module) -> list[MoeBlockRef]:
    """Every MoE block (``.gate`` + ``.experts`` with a 3-D ``gate_up_proj``), ordered by layer.

    The key is the decoder-layer index from the module name (``model.language_model.layers.7.mlp`` -> 7);
    when names carry no unique index, the blocks are numbered 0, 1, ... in module order.
    """
    found = [(name, m) for name, m in model.named_modules() if _is_moe_block(m)]
    parsed = []
    for name, _ in found:
        hits = _LAYER_RE.findall(name)
        parsed.append(int(hits[-1]) if hits else None)
    if found and None not in parsed and len(set(parsed)) == len(parsed):
        refs = [MoeBlockRef(i, n, m) for i, (n, m) in zip(parsed, found, strict=True)]
    else:
        refs = [MoeBlockRef(i, n, m) for i, (n, m) in enumerate(found)]
    return sorted(refs, key=lambda r: r.layer)


def model_fingerprint(model: torch.nn.Module) -> str:
    """Identity of a MoE model's routing: sha256 over its MoE layer indices, expert-weight shapes and
    router weights (upcast to float32, so a bf16 and an fp32 load of one checkpoint agree). Cheap
    (routers are E x H) and different for any two differently-trained or differently-seeded models."""
    h = hashlib.sha256()
    for ref in find_moe_blocks(model):
        ex = ref.block.experts
        h.update(f"{ref.layer}:{tuple(ex.gate_up_proj.shape)}:{tuple(ex.down_proj.shape)};".encode())
        w = getattr(ref.block.gate, "weight", None)
        if isinstance(w, torch.Tensor) and w.device.type != "meta":
            h.update(w.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

"""``moe.routing`` (random_p | top_p) in the Hugging Face engine: SERE's trivial baselines (issue 31).

The definitions are :mod:`harness.techniques.moe_routing`. The mechanism is SERE's and ``moe.top_k``'s
(:mod:`harness.engines.hf.routing`): the same three hooks per MoE block, decode steps only (``S == 1``), live
rows only (finished rows of a static batch neither build P nor count), and the same statistics
(``summary.json`` ``moe``: distinct experts per layer and decode step before = the router's top-k, after = the
baseline's; for ``random_p`` also ``primary_union`` = |P| and ``moved_fraction``), so a report reads a
baseline's union beside SERE's. The handle sits in its own per-block slot ``_harness_routing_baseline``.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.engines.hf.routing import RoutedLayer, RoutingHandle, attach, block_device, refuse_if_installed
from harness.models.moe_blocks import find_moe_blocks
from harness.techniques.moe_routing import RoutingSettings, random_p, top_p

__all__ = ["RoutingBaselineHandle", "install_routing_baseline"]


class RoutingBaselineHandle(RoutingHandle):
    """Installed ``moe.routing`` hooks: ``settings``, ``stats()``, ``reset_stats()``, ``remove()``."""

    kind = "moe.routing"
    slot = "_harness_routing_baseline"

    def __init__(self, settings: RoutingSettings, collect_stats: bool, device: torch.device):
        kp = settings.k_primary if settings.routing == "random_p" else 1
        super().__init__(kp, 0.0, "decode", collect_stats, op=None)
        self.settings = settings
        self.generator = torch.Generator(device=device).manual_seed(int(settings.seed))

    def _rewrite(self, st: RoutedLayer, output: Any, live: torch.Tensor | None) -> Any:
        logits, weights, ids = output[0], output[1], output[2]
        if self.settings.routing == "random_p":
            new_ids = random_p(ids, self.settings.k_primary, st.num_experts, self.generator, live)
            new_weights = weights
        else:
            new_weights, new_ids = top_p(logits, ids, self.settings.p)
            if live is not None:  # finished rows keep the router's output (they do not count either)
                new_ids = torch.where(live[:, None], new_ids, ids)
                new_weights = torch.where(live[:, None], new_weights, weights.to(new_weights.dtype))
            new_weights = new_weights.to(weights.dtype)
        if self.collect_stats:
            self._record(st, ids, new_ids, live)
        rest = output[3:]
        return (logits, new_weights, new_ids, *rest) if isinstance(output, tuple) else type(output)(
            [logits, new_weights, new_ids, *rest])

    def _on_prefill(self, input_ids: torch.Tensor | None) -> None:
        """Re-seed ``random_p``'s draws from ``moe.seed`` and the batch's prompt ids at every prefill, so a batch
        gets the same draws whatever ran before it: the latency protocol's warm-ups and re-timings (which depend
        on ``engine.warmup``, ``latency.warmup`` and which shapes compiled) generate extra batches, and with one
        seeding at install they shifted every later draw (the same ``moe.seed`` gave edit 0.278 with
        ``engine.warmup=0`` and 0.028 with the CLI's defaults on the 12 bundled requests). One host read of the
        prompt ids per batch: ``random_p`` runs eager (its draws cannot be graphed)."""
        if self.settings.routing != "random_p":
            return
        mix = 0 if input_ids is None else hash(tuple(input_ids.reshape(-1).tolist())) & 0xFFFFFFFF
        self.generator.manual_seed((int(self.settings.seed) * 0x9E3779B1 + mix) & 0x7FFFFFFFFFFFFFFF)

    def stats(self) -> dict[str, Any]:
        """``summary.json`` ``moe``: the settings (``routing``, ``k_primary``, ``p``, ``seed``) and the union
        statistics of :meth:`RoutingHandle.stats`."""
        full = super().stats()
        s = self.settings
        out: dict[str, Any] = {"routing": s.routing, "k_primary": s.k_primary if s.routing == "random_p" else None,
                               "p": s.p if s.routing == "top_p" else None,
                               "seed": s.seed if s.routing == "random_p" else None, "scope": "decode"}
        keys = ("layers", "steps", "tokens_per_step", "expert_union_before", "expert_union_after", "experts_saved",
                "by_batch_size")
        out.update({k: full[k] for k in keys})
        if s.routing == "random_p":
            out.update(primary_union=full["primary_union"], moved_fraction=full["moved_fraction"],
                       outside_primary_fraction=full["outside_primary_fraction"])
        out["per_layer"] = [{k: row[k] for k in ("layer", "steps", "tokens", "expert_union_before",
                                                  "expert_union_after")} for row in full["per_layer"]]
        return out


def install_routing_baseline(model: torch.nn.Module, settings: RoutingSettings, *, collect_stats: bool = True,
                             eos_token_ids: Any = None) -> RoutingBaselineHandle:
    """Install the ``moe.routing`` baseline on every MoE block of ``model`` (module doc)."""
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError("no MoE block found in the model")
    refuse_if_installed(blocks, RoutingBaselineHandle.slot)
    handle = RoutingBaselineHandle(settings, collect_stats, block_device(blocks[0].block))
    for ref in blocks:
        handle.layers.append(RoutedLayer(ref.layer, ref.block, ref.block.gate, ref.num_experts, None, None))
    attach(handle, model, eos_token_ids)
    return handle

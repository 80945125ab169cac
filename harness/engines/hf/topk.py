"""``moe.top_k`` in the Hugging Face engine: every router keeps its K highest experts (plain top-K truncation).

The definition is :mod:`harness.techniques.moe_topk` (the router's K highest ids, weights recomputed from
the router logits and renormalised as the router does; for every family through its rule,
``harness.models.families``: what the family's router built with K returns, DeepSeek's scaling, bias and groups
included). The mechanism is SERE's — both stand on the shared
base :mod:`harness.engines.hf.routing` — so both behave alike where it matters for comparing them:

- the same three hooks per MoE block (block pre-hook: is this a decode step; gate hook: rewrite the router's
  ``(logits, weights, ids)``; block post-hook: lower the flag), and the same decode rule (``S == 1``);
  ``scope="all"`` rewrites every pass, prefill included;
- the experts receive ``[T, K]`` ids and weights: they compute K experts per token, so the fused MoE kernel's
  cost follows the smaller union (no padding slots in this engine);
- statistics over live rows (finished rows of a static batch excluded, as for SERE): distinct experts per
  layer and decode step before (the router's top-k) and after (its top-K), per batch size; read once by
  :meth:`TopKHandle.stats` into ``summary.json`` ``moe``;
- the handle is a ``RoutingHandle``, as SERE's is, for ``hf_graphs`` (the CUDA-graph decoder replays its
  device counters the same way), kept in its own per-block slot ``_harness_topk``.

**With SERE** (``moe.top_k=K'`` and ``sere.k=K``, :mod:`harness.techniques.moe_topk`): install top-K first,
then SERE. Forward hooks run in registration order and each sees the output the previous one returned, so
SERE re-routes the truncated ``[T, K']`` routing (slots K..K'-1); :func:`install_topk` refuses a model that
already carries SERE, where the order would be the wrong one. The ``moe`` statistics describe the
truncation (top-k → top-K'), the ``sere`` statistics the re-routing of the truncated routing.

A layer whose ``top_k`` is at least the router's top-k is left unchanged (the ids and weights the router
returned), so ``moe.top_k = k`` is the baseline bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.engines.hf.routing import attach, refuse_if_installed, RoutedLayer, RoutingHandle
from harness.models.moe_blocks import find_moe_blocks
from harness.techniques.moe_topk import moe_settings, pad_routing, truncate_routing, SCOPES

__all__ = ["TopKHandle", "install_topk", "topk_from_config"]

_SCOPE_TO_MODE = {"decode": "decode", "all": "all"}
_STAT_KEYS = ("layers", "steps", "tokens_per_step", "expert_union_before", "expert_union_after",
              "experts_saved", "by_batch_size")


def router_renormalizes(gate: torch.nn.Module) -> bool:
    """Whether the router renormalises its top-k weights: Qwen3-MoE's says so in ``norm_topk_prob``;
    Qwen3-VL-MoE's router has no flag and always renormalises (transformers' source)."""
    flag = getattr(gate, "norm_topk_prob", None)
    return True if flag is None else bool(flag)


class TopKHandle(RoutingHandle):
    """Installed top-K hooks: ``top_k``, ``scope``, ``stats()``, ``reset_stats()``, ``remove()``."""

    kind = "moe.top_k"
    slot = "_harness_topk"

    def __init__(self, top_k: int, scope: str, collect_stats: bool):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        super().__init__(top_k, 0.0, _SCOPE_TO_MODE[scope], collect_stats, op=None)
        self.top_k = top_k
        self.scope = scope

    def _rewrite(self, st: RoutedLayer, output: Any, live: torch.Tensor | None) -> Any:
        logits, _, ids = output[0], output[1], output[2]
        k = ids.shape[-1]
        if self.top_k >= k:
            if self.collect_stats:
                self._record(st, ids, ids, live)
            return None
        if st.rule is not None:  # the family's rule (harness.models.families): its router built with K
            weights, ids_k = st.rule.truncate(logits, ids, self.top_k, st.bias() if st.bias is not None else None)
        else:
            weights, ids_k = truncate_routing(logits, ids, self.top_k, st.renormalize)
        if self.collect_stats:  # the padded form names exactly the kept experts: union after = top-K's
            self._record(st, ids, pad_routing(weights, ids_k, k)[1], live)
        rest = output[3:]
        return (logits, weights, ids_k, *rest) if isinstance(output, tuple) else type(output)(
            [logits, weights, ids_k, *rest])

    def stats(self) -> dict[str, Any]:
        """``summary.json`` ``moe``: ``top_k``, ``scope``, ``renormalize``, and the expert-union statistics
        of :meth:`RoutingHandle.stats` (live rows; before = the router's top-k, after = its top-K)."""
        full = super().stats()
        out: dict[str, Any] = {"top_k": self.top_k, "scope": self.scope,
                               "renormalize": sorted({st.renormalize for st in self.layers}) == [True]}
        out.update({key: full[key] for key in _STAT_KEYS})
        out["per_layer"] = [{k: row[k] for k in ("layer", "steps", "tokens", "expert_union_before",
                                                  "expert_union_after")} for row in full["per_layer"]]
        return out


def install_topk(model: torch.nn.Module, top_k: int, scope: str = "decode", *, collect_stats: bool = True,
                 eos_token_ids: Any = None) -> TopKHandle:
    """Install top-K truncation on every MoE block of ``model`` (see the module doc)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError("no MoE block found in the model")
    refuse_if_installed(blocks, TopKHandle.slot)
    if any(getattr(ref.block, "_harness_sere", None) is not None for ref in blocks):
        raise RuntimeError("install moe.top_k before SERE: SERE must re-route the truncated routing "
                           "(hooks run in the order they were installed)")
    handle = TopKHandle(top_k, scope, collect_stats)
    for ref in blocks:
        refusal = ref.family.refusal("moe.top_k") if ref.family is not None else None
        if refusal:
            raise ValueError(refusal)
        handle.layers.append(RoutedLayer.of(ref))
    attach(handle, model, eos_token_ids)
    return handle


def topk_from_config(model: torch.nn.Module, moe_cfg: Any, sere_cfg: Any = None,
                     eos_token_ids: Any = None) -> TopKHandle | None:
    """``moe`` config group → installed handle, or None when ``moe.top_k`` is null."""
    settings = moe_settings(moe_cfg, sere_cfg)
    if settings is None:
        return None
    return install_topk(model, settings[0], settings[1], eos_token_ids=eos_token_ids)

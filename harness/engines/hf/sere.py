"""SERE in the Hugging Face engine: re-route each MoE router's top-k ids at decode steps.

:func:`install_sere` puts three hooks on every MoE block (found as in
``harness.models.moe_blocks.find_moe_blocks``: every family of ``harness.models.families``; the hook mechanism
is ``harness.engines.hf.routing``, shared with ``moe.top_k``; a router with unsorted slots, DeepSeek's, has its
slots sorted by the family's rank key first, so the primary slots are the highest-ranked experts):

- a forward **pre-hook on the block** decides whether this pass is re-routed and raises the block's flag;
- a forward **hook on the router** (``block.gate``; GPT-OSS ``block.router``), returning
  ``(logits, weights, ids)``, replaces the ids
  by ``reroute_op(ids, similarity, k_primary, rho, protected)`` when the flag is up — the fused Triton op
  on CUDA, the torch reference on CPU, same ids. The weights are returned unchanged (the reference
  semantics: a moved slot's gate weight multiplies its new expert's output);
- a forward **hook on the block** lowers the flag, so a router called outside its block's forward (e.g. by
  a calibration tool) is never rewritten.

**Decode vs prefill.** The router sees the flattened ``[B*S, H]`` tokens and cannot tell; the block sees
``[B, S, H]``. A pass is a decode step iff ``S == 1``: in ``generate`` every decode step feeds exactly one
new token per row, while a prefill (also a chunked one) feeds the prompt. Only decode steps are
re-routed (the seed's rule); prefill keeps the original top-k. Caveat: a prompt of a single token would
be taken for a decode step (impossible with a chat template). ``handle.mode`` overrides the rule:
``"decode"`` (default), ``"all"`` (every pass, as the reference vLLM plugin does; P then spans every
token of the pass, left padding included) or ``"off"``.

**P in decode** is the union over the step's **live** rows. In a left-padded HF batch every row is a
real token at decode time, but ``generate`` keeps rows that already finished (the row fed its EOS, then pad
tokens) in the batch until every row is done. Such a row's output is discarded, so it must not shape the
others' routing: a forward pre-hook on the model reads the token each row is fed and keeps a per-row
"finished" flag (set when the fed token is an EOS id; reset at every prefill), and the gate hook passes
``row_mask = live rows`` to the op — a finished row is neither re-routed nor part of P, as in a serving
engine, where a finished request leaves the batch (vLLM's plugin: the running decode rows). The flag
lives in one persistent device buffer per batch size, updated in place with no host synchronisation, so a
CUDA graph captured around the decode step (``hf_graphs``) keeps it current on replay; ``hf_graphs``
saves and restores it around its warm-up steps (:meth:`SereHandle.row_state` /
:meth:`SereHandle.load_row_state`). EOS ids: the ones given to :func:`install_sere` (the engine passes its
own), else the model's ``generation_config.eos_token_id``; with none, every row counts as live.

**Statistics** (decode passes only, or every re-routed pass with ``mode="all"``), per layer, over live
rows only: distinct experts named by the ids before and after re-routing, the size of P, moved secondary
slots, live rows. They are accumulated in int64 device tensors per layer (no host synchronisation in the
hook; step counts are Python ints known from shapes) and read once by :meth:`SereHandle.stats`. An id
outside ``[0, E)`` (-1 = "no expert") never counts as an expert, in P or anywhere else. On CUDA one Triton
launch per layer and step does the counting (``harness.kernels.sere_stats``); the torch version it replaces
was ~44 small ops per layer, ~2,000 kernels per step in the decode CUDA graph at 48 layers, ~3.5 ms of an
H200 step (docs/latency.md, "Run path vs benchmark scripts"). ``handle.stats_impl`` = ``"auto"`` (that
choice) | ``"torch"`` | ``"fused"``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from harness.techniques.sere.setup import calibration_kwargs, sere_artifacts_from_config  # noqa: F401 (re-exported)
from harness.engines.hf.routing import (  # noqa: F401 (the hook mechanism; these names also import from here)
    COUNTERS,
    INTERPRETER_AUTO,
    MODES,
    RoutedLayer,
    RoutingHandle,
    _union_counts,
    attach,
    block_device,
    model_eos_ids,
    refuse_if_installed,
)
from harness.engines.hf.routing import triton_wanted
from harness.models.moe_blocks import find_moe_blocks
from harness.techniques.sere.reroute import check_reroute_args, reroute as reference

__all__ = ["MODES", "SereHandle", "install_sere", "sere_from_config"]

_Layer = RoutedLayer  # the old private name, still importable from here


def _default_op() -> Callable:
    """The re-route the hooks call: the fused Triton op on CUDA, the torch reference on CPU (same ids).

    Which one runs is ``routing.triton_wanted`` (the rule the statistics follow too); the kernel is checked
    against the reference in tests/kernels/test_reroute.py, and in the engine by tests/engines/hf/test_hf_sere.py
    with ``INTERPRETER_AUTO`` up."""
    try:
        from harness.kernels.reroute import reroute_op
    except ImportError:  # no Triton on this platform: the reference has the same semantics
        return reference

    def op(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if triton_wanted(ids):
            return reroute_op(ids, *args, **kwargs)
        return reference(ids, *args, **kwargs)

    return op


class SereHandle(RoutingHandle):
    """Installed SERE hooks on one model: ``mode``, ``stats()``, ``reset_stats()``, ``remove()``."""

    kind = "sere"
    slot = "_harness_sere"  # the per-block attribute naming the installed handle (hf_graphs finds it there)

    # -- hooks ------------------------------------------------------------------------------------
    def _rewrite(self, st: _Layer, output: Any, live: torch.Tensor | None) -> Any:
        """SERE: new ids from ``reroute_op`` (finished rows masked out), weights unchanged; None = keep."""
        ids = output[2]
        k = ids.shape[-1]
        new = ids if self.k_primary >= k else self.op(ids, st.similarity, self.k_primary, self.rho,
                                                       st.protected, live)
        if self.collect_stats:
            self._record(st, ids, new, live)
        if new is ids:
            return None
        return (*output[:2], new, *output[3:]) if isinstance(output, tuple) else type(output)(
            [*output[:2], new, *output[3:]])


def install_sere(model: torch.nn.Module, similarity: dict[int, torch.Tensor] | torch.Tensor, k_primary: int,
                 rho: float, protected: dict[int, torch.Tensor] | None = None, *, mode: str = "decode",
                 collect_stats: bool = True, op: Callable | None = None,
                 eos_token_ids: Any = None) -> SereHandle:
    """Install SERE re-routing on every MoE block of ``model`` (see the module doc).

    ``similarity``: ``{layer: [E, E]}`` for exactly the model's MoE layers (decoder-layer indices), or one
    [L, E, E] tensor in block order. ``protected``: ``{layer: bool [E]}``; a missing layer has none.
    ``op``: the re-routing function (default ``harness.kernels.reroute.reroute_op``).
    ``eos_token_ids``: ids that end a row (finished rows leave P and the statistics); default the model's
    ``generation_config.eos_token_id``.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError("no MoE block found in the model")
    if isinstance(similarity, torch.Tensor):
        if similarity.dim() != 3 or similarity.shape[0] != len(blocks):
            raise ValueError(f"similarity tensor {tuple(similarity.shape)}: expected [{len(blocks)}, E, E]")
        similarity = {ref.layer: similarity[i] for i, ref in enumerate(blocks)}
    layers = {ref.layer for ref in blocks}
    if set(similarity) != layers:
        raise ValueError(f"similarity covers layers {sorted(similarity)}, the model's MoE layers are "
                         f"{sorted(layers)}")
    extra = set(protected or {}) - layers
    if extra:
        raise ValueError(f"protection given for layers {sorted(extra)} that are not MoE layers")
    if isinstance(rho, torch.Tensor) or math.isnan(float(rho)):
        raise ValueError(f"rho must be a Python number, got {rho!r}")
    if isinstance(k_primary, bool) or not isinstance(k_primary, int) or k_primary < 1:
        raise ValueError(f"k_primary must be an int >= 1, got {k_primary!r}")
    refuse_if_installed(blocks)

    handle = SereHandle(k_primary, rho, mode, collect_stats, op or _default_op())
    for ref in blocks:
        refusal = ref.family.refusal("sere") if ref.family is not None else None
        if refusal:
            raise ValueError(refusal)
        device = block_device(ref.block, ref.gate)
        e = ref.num_experts
        sim = similarity[ref.layer].detach().to(device=device, dtype=torch.float32).contiguous()
        prot = (protected or {}).get(ref.layer)
        if prot is not None:
            prot = prot.detach().to(device=device, dtype=torch.bool).contiguous()
        probe = torch.zeros(1, 1, dtype=torch.long, device=device)
        check_reroute_args(probe, sim, k_primary, rho, prot, None)  # shapes/devices only
        if sim.shape[0] != e:
            raise ValueError(f"layer {ref.layer}: similarity is {tuple(sim.shape)}, the block has {e} experts")
        handle.layers.append(_Layer.of(ref, sim, prot))
    attach(handle, model, eos_token_ids)
    return handle


def sere_from_config(model: torch.nn.Module, tokenizer: Any, sere_cfg: Any, model_id: str,
                     cache_dir: str | None = None, eos_token_ids: Any = None) -> SereHandle | None:
    """Build SERE from the ``sere`` config group (``k``, ``rho``, ``protect``, ``similarity``,
    ``protection``, ``calibration_text``, ``calibration_tokens``); None when ``sere.k`` is null. Missing
    artifacts are computed from the calibration data and cached (``similarity_for`` / ``protection_for``)."""
    artifacts = sere_artifacts_from_config(model, tokenizer, sere_cfg, model_id, cache_dir)
    if artifacts is None:
        return None
    similarity, protected = artifacts
    return install_sere(model, similarity, int(sere_cfg.k), float(sere_cfg.rho), protected,
                        eos_token_ids=eos_token_ids)

"""SERE in the Hugging Face engine: re-route each MoE router's top-k ids at decode steps.

:func:`install_sere` puts three hooks on every MoE block (found as in
``harness.techniques.sere_calibration.find_moe_blocks``; Qwen3-MoE and Qwen3-VL-MoE):

- a forward **pre-hook on the block** decides whether this pass is re-routed and raises the block's flag;
- a forward **hook on ``block.gate``** (the router, returning ``(logits, weights, ids)``) replaces the ids
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

**P in decode** is the union over the B rows of the step (``row_mask`` is not used): in a left-padded HF
batch every row is a real token at decode time. Rows that already finished keep generating pad tokens
in HF (``generate`` stops only when every row is done), and those rows' routing also joins P and the
statistics — unlike a serving engine, where a finished request leaves the batch. State the batch size
with any number.

**Statistics** (decode passes only, or every re-routed pass with ``mode="all"``), per layer: distinct
experts named by the ids before and after re-routing, the size of P, moved secondary slots. They are
accumulated in one int64 device tensor per layer (no host synchronisation in the hook; step and slot
counts are Python ints known from shapes) and read once by :meth:`SereHandle.stats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.techniques.sere import check_reroute_args
from harness.techniques.sere_calibration import find_moe_blocks

__all__ = ["MODES", "SereHandle", "install_sere", "sere_from_config"]

MODES = ("decode", "all", "off")


def _default_op() -> Callable:
    try:
        from harness.kernels.reroute import reroute_op
    except ImportError:  # no Triton on this platform: the reference has the same semantics
        from harness.techniques.sere import reroute as reroute_op
    return reroute_op


# Per-layer device counters, summed over decode steps (read once by ``stats()``):
# distinct experts before / after re-routing, |P|, moved secondary slots, secondary slots outside P,
# of those the ones kept because no primary was similar enough (critical), and the ones kept because protected.
COUNTERS = ("before", "after", "primary", "moved", "outside", "critical", "protected_hits")


def _union_counts(old: torch.Tensor, new: torch.Tensor, kp: int, num_experts: int,
                  offsets: torch.Tensor) -> torch.Tensor:
    """[distinct ids of old, of new, of old's first kp columns] as one int64 [3] device tensor.

    One scatter into three bins of E+1 flags (the last flag of each bin swallows ids outside [0, E)):
    a dozen small kernels per layer and step, no host sync, fixed shapes."""
    flat = torch.cat([old.reshape(-1), new.reshape(-1), old[:, :kp].reshape(-1)])
    valid = (flat >= 0) & (flat < num_experts)
    idx = torch.where(valid, flat, num_experts) + offsets
    seen = torch.zeros(3 * (num_experts + 1), dtype=torch.bool, device=old.device).index_fill_(0, idx, True)
    return seen.view(3, num_experts + 1)[:, :num_experts].sum(1)


@dataclass
class _Layer:
    layer: int
    block: torch.nn.Module
    gate: torch.nn.Module
    num_experts: int
    similarity: torch.Tensor
    protected: torch.Tensor | None
    active: bool = False
    steps: int = 0
    tokens: int = 0
    secondary_slots: int = 0
    acc: torch.Tensor | None = None  # int64 [N_COUNTERS], see COUNTERS
    by_batch: dict = field(default_factory=dict)  # batch size -> [steps (host int), int64 [2] before/after]
    offsets: torch.Tensor | None = None
    offsets_key: tuple | None = None
    hooks: list = field(default_factory=list)


class SereHandle:
    """Installed SERE hooks on one model: ``mode``, ``stats()``, ``reset_stats()``, ``remove()``."""

    def __init__(self, k_primary: int, rho: float, mode: str, collect_stats: bool, op: Callable):
        self.k_primary = k_primary
        self.rho = float(rho)
        self.mode = mode
        self.collect_stats = collect_stats
        self.op = op
        self.layers: list[_Layer] = []
        self.removed = False

    # -- mode -------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {value!r}")
        self._mode = value

    def _wants(self, hidden: torch.Tensor) -> bool:
        if self._mode == "all":
            return True
        if self._mode == "off":
            return False
        return hidden.dim() == 3 and hidden.shape[1] == 1

    # -- hooks ------------------------------------------------------------------------------------
    def _install(self, st: _Layer) -> None:
        def block_pre(module, args, kwargs):
            hs = args[0] if args else kwargs.get("hidden_states")
            st.active = isinstance(hs, torch.Tensor) and self._wants(hs)

        def block_post(module, args, output):
            st.active = False

        def gate_post(module, args, output):
            if not st.active:
                return None
            ids = output[2]
            k = ids.shape[-1]
            new = ids if self.k_primary >= k else self.op(ids, st.similarity, self.k_primary, self.rho,
                                                           st.protected)
            if self.collect_stats:
                self._record(st, ids, new)
            if new is ids:
                return None
            return (*output[:2], new, *output[3:]) if isinstance(output, tuple) else type(output)(
                [*output[:2], new, *output[3:]])

        st.hooks = [
            st.block.register_forward_pre_hook(block_pre, with_kwargs=True),
            st.block.register_forward_hook(block_post),
            st.gate.register_forward_hook(gate_post),
        ]
        st.block._harness_sere = self

    def _record(self, st: _Layer, old: torch.Tensor, new: torch.Tensor) -> None:
        t, k = old.shape
        kp = min(self.k_primary, k)
        key = (t, k, kp, old.device)
        if st.offsets_key != key:  # bin offsets of the three segments, built once per batch shape
            e1, dev = st.num_experts + 1, old.device
            with torch.inference_mode(False):  # built on the device: no host-to-device copy
                st.offsets = torch.cat([torch.zeros(t * k, dtype=torch.long, device=dev),
                                        torch.full((t * k,), e1, dtype=torch.long, device=dev),
                                        torch.full((t * kp,), 2 * e1, dtype=torch.long, device=dev)])
            st.offsets_key = key
        counts = _union_counts(old, new, kp, st.num_experts, st.offsets)
        sec_old, sec_new = old[:, kp:], new[:, kp:]
        valid = (sec_old >= 0) & (sec_old < st.num_experts)
        # index_fill_ with a Python scalar: no host-to-device copy, so this is capturable in a CUDA graph
        in_p = torch.zeros(st.num_experts + 1, dtype=torch.bool, device=old.device).index_fill_(
            0, old[:, :kp].clamp(0, st.num_experts).reshape(-1), True)
        outside = valid & ~in_p[:-1][sec_old.clamp(0, st.num_experts - 1)]
        stayed = outside & (sec_old == sec_new)
        prot = st.protected[sec_old.clamp(0, st.num_experts - 1)] & stayed if st.protected is not None \
            else torch.zeros_like(stayed)
        extra = torch.stack([(old != new).sum(), outside.sum(), (stayed & ~prot).sum(), prot.sum()])
        if st.acc is None or st.acc.device != old.device:
            with torch.inference_mode(False):  # a normal tensor: updatable inside and outside inference mode
                st.acc = torch.zeros(len(COUNTERS), dtype=torch.long, device=old.device)
        st.acc[:3] += counts
        st.acc[3:] += extra
        entry = st.by_batch.get(t)
        if entry is None:
            with torch.inference_mode(False):
                entry = st.by_batch[t] = [0, torch.zeros(2, dtype=torch.long, device=old.device)]
        entry[0] += 1
        entry[1] += counts[:2]
        st.steps += 1
        st.tokens += t
        st.secondary_slots += t * (k - kp)

    # -- public API -------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        for st in self.layers:
            st.steps = st.tokens = st.secondary_slots = 0
            st.acc = None
            st.by_batch = {}

    def _read_counters(self) -> list[list[int]]:
        """Every layer's COUNTERS sums: one device-to-host copy per device."""
        by_device: dict[torch.device, list[int]] = {}
        for i, st in enumerate(self.layers):
            if st.acc is not None:
                by_device.setdefault(st.acc.device, []).append(i)
        rows = [[0] * len(COUNTERS) for _ in self.layers]
        for idx in by_device.values():
            for i, row in zip(idx, torch.stack([self.layers[i].acc for i in idx]).tolist(), strict=True):
                rows[i] = row
        return rows

    def stats(self) -> dict[str, Any]:
        """Decode-step routing statistics, for ``summary.json["sere"]`` (one host read of the counters).

        Means are over (step, layer) pairs: ``expert_union_before`` / ``_after`` = distinct experts a
        layer computes per step without / with SERE, ``primary_union`` = |P|, ``moved_fraction`` = moved
        secondary slots / all secondary slots (B x (k - K) per step and layer), ``outside_primary_fraction``
        = secondary slots whose expert is not in P, ``critical_fraction`` = of all secondary slots, those
        outside P kept because no primary expert was similar enough (sim < ρ), ``protected_hits`` = secondary
        slots outside P kept because their expert is protected, ``by_batch_size`` = the unions per decode
        batch size (rows of the step; finished rows of a static HF batch still count).
        """
        rows = self._read_counters()
        per_layer = []
        tot_steps = tot_slots = 0
        sums = [0] * len(COUNTERS)
        batch: dict[int, list[int]] = {}
        for st in self.layers:
            for t, (n, acc) in st.by_batch.items():
                b = batch.setdefault(t, [0, 0, 0])
                before_after = acc.tolist()
                b[0] += n
                b[1] += before_after[0]
                b[2] += before_after[1]
        for st, row in zip(self.layers, rows, strict=True):
            before, after, prim, moved, outside, critical, prot_hits = row
            steps = st.steps
            per_layer.append({
                "layer": st.layer,
                "steps": steps,
                "tokens": st.tokens,
                "expert_union_before": before / steps if steps else None,
                "expert_union_after": after / steps if steps else None,
                "primary_union": prim / steps if steps else None,
                "moved_slots": moved,
                "secondary_slots": st.secondary_slots,
                "moved_fraction": moved / st.secondary_slots if st.secondary_slots else None,
                "critical_fraction": critical / st.secondary_slots if st.secondary_slots else None,
                "protected_hits": prot_hits,
                "protected": int(st.protected.sum()) if st.protected is not None else 0,
            })
            tot_steps += steps
            tot_slots += st.secondary_slots
            sums = [a + b for a, b in zip(sums, row, strict=True)]
        n_steps = max((st.steps for st in self.layers), default=0)
        n_tokens = max((st.tokens for st in self.layers), default=0)
        mean = (lambda v: v / tot_steps) if tot_steps else (lambda v: None)
        before, after = mean(sums[0]), mean(sums[1])
        return {
            "k_primary": self.k_primary,
            "rho": self.rho,
            "mode": self._mode,
            "layers": len(self.layers),
            "steps": n_steps,
            "tokens_per_step": n_tokens / n_steps if n_steps else None,
            "expert_union_before": before,
            "expert_union_after": after,
            "experts_saved": before - after if tot_steps else None,
            "primary_union": mean(sums[2]),
            "moved_fraction": sums[3] / tot_slots if tot_slots else None,
            "outside_primary_fraction": sums[4] / tot_slots if tot_slots else None,
            "critical_fraction": sums[5] / tot_slots if tot_slots else None,
            "protected_hits": sums[6],
            "by_batch_size": {str(t): {"steps": n // max(len(self.layers), 1),
                                       "expert_union_before": bsum / n, "expert_union_after": asum / n}
                              for t, (n, bsum, asum) in sorted(batch.items())},
            "per_layer": per_layer,
        }

    def remove(self) -> None:
        """Take every hook off; the model routes exactly as before ``install_sere``. Idempotent."""
        for st in self.layers:
            for h in st.hooks:
                h.remove()
            st.hooks = []
            st.active = False
            if getattr(st.block, "_harness_sere", None) is self:
                del st.block._harness_sere
        self.removed = True

    def __enter__(self) -> "SereHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def install_sere(model: torch.nn.Module, similarity: dict[int, torch.Tensor] | torch.Tensor, k_primary: int,
                 rho: float, protected: dict[int, torch.Tensor] | None = None, *, mode: str = "decode",
                 collect_stats: bool = True, op: Callable | None = None) -> SereHandle:
    """Install SERE re-routing on every MoE block of ``model`` (see the module doc).

    ``similarity``: ``{layer: [E, E]}`` for exactly the model's MoE layers (decoder-layer indices), or one
    [L, E, E] tensor in block order. ``protected``: ``{layer: bool [E]}``; a missing layer has none.
    ``op``: the re-routing function (default ``harness.kernels.reroute.reroute_op``).
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
    for ref in blocks:
        if getattr(ref.block, "_harness_sere", None) is not None:
            raise RuntimeError(f"SERE is already installed on {ref.name}: remove() the first handle")

    handle = SereHandle(k_primary, rho, mode, collect_stats, op or _default_op())
    for ref in blocks:
        device = ref.block.gate.weight.device if hasattr(ref.block.gate, "weight") \
            else ref.block.experts.gate_up_proj.device
        e = ref.num_experts
        sim = similarity[ref.layer].detach().to(device=device, dtype=torch.float32).contiguous()
        prot = (protected or {}).get(ref.layer)
        if prot is not None:
            prot = prot.detach().to(device=device, dtype=torch.bool).contiguous()
        probe = torch.zeros(1, 1, dtype=torch.long, device=device)
        check_reroute_args(probe, sim, k_primary, rho, prot, None)  # shapes/devices only
        if sim.shape[0] != e:
            raise ValueError(f"layer {ref.layer}: similarity is {tuple(sim.shape)}, the block has {e} experts")
        handle.layers.append(_Layer(ref.layer, ref.block, ref.block.gate, e, sim, prot))
    for st in handle.layers:
        handle._install(st)
    return handle


def sere_from_config(model: torch.nn.Module, tokenizer: Any, sere_cfg: Any, model_id: str,
                     cache_dir: str | None = None) -> SereHandle | None:
    """Build SERE from the ``sere`` config group (``k``, ``rho``, ``protect``, ``similarity``,
    ``protection``); None when ``sere.k`` is null. Missing artifacts are computed and cached
    (``similarity_for`` / ``protection_for``)."""
    if sere_cfg.k is None:
        return None
    from harness.techniques.sere_calibration import load_similarity, similarity_for

    if sere_cfg.similarity:
        similarity, _ = load_similarity(sere_cfg.similarity)
    else:
        similarity = similarity_for(model, tokenizer, model_id, cache_dir)
    protected = None
    n = int(sere_cfg.protect or 0)
    if n > 0 or sere_cfg.protection:
        from harness.techniques.sere_protection import load_protection, protection_for

        if sere_cfg.protection:
            protected, _ = load_protection(sere_cfg.protection, n=n or None)
        else:
            protected = protection_for(model, tokenizer, model_id, similarity, int(sere_cfg.k),
                                       float(sere_cfg.rho), n, cache_dir)
    return install_sere(model, similarity, int(sere_cfg.k), float(sere_cfg.rho), protected)

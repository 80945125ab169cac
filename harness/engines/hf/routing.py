"""The routing-hook mechanism of the Hugging Face engine, shared by SERE (``hf_sere``) and ``moe.top_k``
(``hf_topk``): three hooks per MoE block (block pre-hook: is this pass rewritten; gate hook: rewrite the
router's ``(logits, weights, ids)``; block post-hook: lower the flag), the live-row tracking of a static batch
(finished rows leave the statistics), and the per-layer device counters the CUDA-graph decoder (``hf_graphs``)
replays. A technique subclasses :class:`RoutingHandle` and defines ``kind``, ``slot`` (the per-block attribute
naming the installed handle) and :meth:`RoutingHandle._rewrite`. The rules (decode vs prefill, P over live
rows, the statistics) are described in :mod:`harness.engines.hf.sere`'s module doc.

Why a module of its own: ``moe.top_k`` used to subclass SERE's private hook classes; both now stand on this
neutral base, and ``hf_sere`` re-exports the names it used to define (``COUNTERS``, ``_Layer``, ``attach``,
``refuse_if_installed``, ``block_device``, ``model_eos_ids``; ``INTERPRETER_AUTO`` is read here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from harness.kernels._triton import interpreting

__all__ = ["COUNTERS", "INTERPRETER_AUTO", "MODES", "RoutedLayer", "RoutingHandle", "attach", "block_device",
           "model_eos_ids", "refuse_if_installed", "triton_wanted"]

MODES = ("decode", "all", "off")


# Per-layer device counters, summed over decode steps (read once by ``stats()``):
# distinct experts before / after re-routing, |P|, moved secondary slots, secondary slots outside P,
# of those the ones kept because no primary was similar enough (critical), the ones kept because protected,
# and the live rows (tokens) the step counted.
COUNTERS = ("before", "after", "primary", "moved", "outside", "critical", "protected_hits", "rows")


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


#: ``stats_impl="auto"`` and the default re-route also take their Triton kernels under the interpreter on CPU
#: (tests only)
INTERPRETER_AUTO = False


def triton_wanted(t: torch.Tensor) -> bool:
    """Whether a hook's op on ``t`` takes its Triton kernel: on CUDA always, on CPU only under the interpreter and
    only when :data:`INTERPRETER_AUTO` asks for it. One interpreted launch per layer and decode step made every CPU
    run with SERE 5-6x slower than the same run without it (CI's sensitivity runs: ~400 s against ~70); the
    kernels are checked against their torch references in tests/kernels. Read at call time (tests flip the flag)."""
    return t.is_cuda or (INTERPRETER_AUTO and interpreting())


@dataclass
class RoutedLayer:
    layer: int
    block: torch.nn.Module
    gate: torch.nn.Module
    num_experts: int
    similarity: torch.Tensor | None
    protected: torch.Tensor | None
    renormalize: bool = True  # the router renormalises its top-k weights (moe.top_k uses it)
    active: bool = False
    steps: int = 0
    # rows fed per step, finished ones included (host ints: hf_graphs replays them); stats() reports the
    # live rows from the device counter "rows" instead
    tokens: int = 0
    secondary_slots: int = 0
    slot_width: int = 0  # secondary slots per row (k - K) of the last recorded pass
    acc: torch.Tensor | None = None  # int64 [N_COUNTERS], see COUNTERS
    # rows of the step t -> [steps (host int), int64 [t + 1, 3] (steps, before, after) by live-row count]
    by_batch: dict = field(default_factory=dict)
    offsets: torch.Tensor | None = None
    offsets_key: tuple | None = None
    hooks: list = field(default_factory=list)
    # the family's routing rule (harness.models.families; None: the Qwen3 softmax rule) and its selection bias,
    # read live (DeepSeek-V3's e_score_correction_bias; None without one)
    rule: Any = None
    bias: Callable[[], Any] | None = None

    @classmethod
    def of(cls, ref: Any, similarity: torch.Tensor | None = None, protected: torch.Tensor | None = None
           ) -> "RoutedLayer":
        """The layer of a ``harness.models.moe_blocks.MoeBlockRef``: its router, rule and bias."""
        rule = getattr(ref, "rule", None)
        return cls(ref.layer, ref.block, ref.gate, ref.num_experts, similarity, protected,
                   renormalize=rule.renormalize if rule is not None else True, rule=rule,
                   bias=ref.bias if hasattr(ref, "bias") else None)


def _with(output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
    """The router output ``(logits, weights, ids, ...)`` with new weights and ids (tuple or list kept)."""
    rest = output[3:]
    return (output[0], weights, ids, *rest) if isinstance(output, tuple) else type(output)(
        [output[0], weights, ids, *rest])


class RoutingHandle:
    """Installed routing hooks on one model: ``mode``, ``stats()``, ``reset_stats()``, ``remove()``."""

    kind = "routing"
    slot = "_harness_routing"  # the per-block attribute naming the installed handle (hf_graphs finds it there)
    #: every technique's ``slot`` (filled by ``__init_subclass__``): the CUDA-graph decoder finds the installed
    #: handles through them and adds each replayed step's host-side counts back (hf.graph_counters.sere_handles)
    slots: ClassVar[set[str]] = set()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RoutingHandle.slots.add(cls.slot)

    def __init__(self, k_primary: int, rho: float, mode: str, collect_stats: bool, op: Callable | None):
        self.k_primary = k_primary
        self.rho = float(rho)
        self.mode = mode
        self.collect_stats = collect_stats
        # "auto": the one-launch Triton kernel on CUDA (under TRITON_INTERPRET only with INTERPRETER_AUTO), torch
        # ops elsewhere;
        # "torch" / "fused" force one (benchmarks/run_path_gaps.py times both)
        self.stats_impl = "auto"
        self.op = op
        self.layers: list[RoutedLayer] = []
        self.removed = False
        self._eos: torch.Tensor | None = None           # EOS ids on the model's device
        self._finished: dict[tuple, torch.Tensor] = {}  # (rows, device) -> bool [rows], persistent
        self._live: torch.Tensor | None = None           # live rows of the current pass (None = all)
        self._model_hook = None

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

    # -- live rows ----------------------------------------------------------------------------------
    def _install_model_hook(self, model: torch.nn.Module, eos_ids: list[int], device: torch.device) -> None:
        """Forward pre-hook on the model: which rows of a decode step still generate (module doc)."""
        self._eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device) if eos_ids else None

        def model_pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._live = None
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
                for buf in self._finished.values():  # a prefill: a new batch starts, every row is live
                    buf.zero_()
                self._on_prefill(ids if isinstance(ids, torch.Tensor) else None)
                return
            if self._eos is None:
                return
            key = (ids.shape[0], ids.device)
            buf = self._finished.get(key)
            if buf is None:
                with torch.inference_mode(False):  # a normal tensor: updated in place in any mode
                    buf = self._finished[key] = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            eos = self._eos if self._eos.device == ids.device else self._eos.to(ids.device)
            buf.logical_or_(torch.isin(ids[:, 0], eos))
            self._live = ~buf

        self._model_hook = model.register_forward_pre_hook(model_pre, with_kwargs=True)

    def row_state(self) -> dict[tuple, torch.Tensor]:
        """A copy of the per-row finished flags (``hf_graphs`` restores them after its warm-up steps)."""
        return {k: v.clone() for k, v in self._finished.items()}

    def load_row_state(self, saved: dict[tuple, torch.Tensor]) -> None:
        """Put flags saved by :meth:`row_state` back in place (buffers keep their identity)."""
        for key, buf in self._finished.items():
            if key in saved:
                buf.copy_(saved[key])
            else:
                buf.zero_()

    def _live_rows(self, rows: int) -> torch.Tensor | None:
        live = self._live
        return live if live is not None and live.shape[0] == rows else None

    # -- hooks ------------------------------------------------------------------------------------
    def _on_prefill(self, input_ids: torch.Tensor | None) -> None:
        """Called when a batch's prefill starts (a new generation); ``random_p`` re-seeds its draws here."""

    def _rewrite(self, st: RoutedLayer, output: Any, live: torch.Tensor | None) -> Any:
        """The router output ``(logits, weights, ids, ...)`` this handle returns instead, or None to keep it
        (``live``: the live rows of the pass, None = all). Each technique defines it."""
        raise NotImplementedError

    def _install(self, st: RoutedLayer) -> None:
        def block_pre(module, args, kwargs):
            hs = args[0] if args else kwargs.get("hidden_states")
            st.active = isinstance(hs, torch.Tensor) and self._wants(hs)

        def block_post(module, args, output):
            st.active = False

        def gate_post(module, args, output):
            if not st.active:
                return None
            live = self._live_rows(output[2].shape[0])
            rule = st.rule
            if rule is None or rule.sorted_slots:
                return self._rewrite(st, output, live)
            # a router with unsorted slots (DeepSeek): slot 0 must be the highest-ranked expert before a technique
            # reads "the first K slots"; the same experts and weights, so the MoE output is unchanged
            output = _with(output, *rule.sort_slots(output[0], output[1], output[2],
                                                    st.bias() if st.bias is not None else None))
            new = self._rewrite(st, output, live)
            return output if new is None else new

        st.hooks = [
            st.block.register_forward_pre_hook(block_pre, with_kwargs=True),
            st.block.register_forward_hook(block_post),
            st.gate.register_forward_hook(gate_post),
        ]
        setattr(st.block, self.slot, self)

    def _fused_stats(self, old: torch.Tensor) -> bool:
        """Whether this pass's statistics go through the one-launch Triton kernel (``stats_impl``)."""
        if self.stats_impl == "torch":
            return False
        if self.stats_impl == "fused":
            return True
        # Decided before importing the kernel module: a CPU venv may lack triton.
        if not triton_wanted(old):
            return False
        from harness.kernels.sere_stats import FUSED_MAX_TOKENS

        # one program per layer: decode-sized passes; a long prefill (mode="all") keeps the wide torch ops
        return old.shape[0] <= FUSED_MAX_TOKENS

    def _record(self, st: RoutedLayer, old: torch.Tensor, new: torch.Tensor, live: torch.Tensor | None = None) -> None:
        """Add one re-routed pass to the layer's counters: device tensors updated in place (no host sync),
        then the host ints. On CUDA one Triton launch (``harness.kernels.sere_stats``), else ~44 torch ops."""
        t, k = old.shape
        kp = min(self.k_primary, k)
        dev = old.device
        if st.acc is None or st.acc.device != dev:
            with torch.inference_mode(False):  # a normal tensor: updatable inside and outside inference mode
                st.acc = torch.zeros(len(COUNTERS), dtype=torch.long, device=dev)
        entry = st.by_batch.get(t)
        if entry is None:
            with torch.inference_mode(False):
                entry = st.by_batch[t] = [0, torch.zeros(t + 1, 3, dtype=torch.long, device=dev)]
        if self._fused_stats(old):
            from harness.kernels.sere_stats import record_stats

            try:
                record_stats(old, new, st.num_experts, kp, live, st.protected, st.acc, entry[1])
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot build must not fail the run
                if self.stats_impl == "fused":
                    raise
                import warnings

                warnings.warn(f"SERE statistics kernel unavailable ({type(exc).__name__}: {str(exc)[:200]}); "
                              "counting with torch ops (slower decode steps)", RuntimeWarning, stacklevel=2)
                self.stats_impl = "torch"
                self._record_torch(st, old, new, live, entry[1])
        else:
            self._record_torch(st, old, new, live, entry[1])
        entry[0] += 1
        st.steps += 1
        st.tokens += t
        st.secondary_slots += t * (k - kp)
        st.slot_width = k - kp

    def _record_torch(self, st: RoutedLayer, old: torch.Tensor, new: torch.Tensor, live: torch.Tensor | None,
                      hist: torch.Tensor) -> None:
        """The statistics in plain torch ops (CPU; the reference the fused kernel is tested against)."""
        t, k = old.shape
        kp = min(self.k_primary, k)
        e = st.num_experts
        dev = old.device
        key = (t, k, kp, dev)
        if st.offsets_key != key:  # bin offsets of the three segments, built once per batch shape
            e1 = e + 1
            with torch.inference_mode(False):  # built on the device: no host-to-device copy
                st.offsets = torch.cat([torch.zeros(t * k, dtype=torch.long, device=dev),
                                        torch.full((t * k,), e1, dtype=torch.long, device=dev),
                                        torch.full((t * kp,), 2 * e1, dtype=torch.long, device=dev)])
            st.offsets_key = key
        if live is not None:  # finished rows name no expert: -1 is outside [0, E) everywhere below
            old = torch.where(live[:, None], old, -1)
            new = torch.where(live[:, None], new, -1)
            n_live = live.sum()
        else:
            n_live = torch.full((), t, dtype=torch.long, device=dev)  # a fill: graph-capturable
        counts = _union_counts(old, new, kp, e, st.offsets)
        sec_old, sec_new = old[:, kp:], new[:, kp:]
        valid = (sec_old >= 0) & (sec_old < e)
        prim = old[:, :kp]
        # invalid primary ids (-1) go to the spare bin E, never to expert 0; index_fill_ with a Python scalar:
        # no host-to-device copy, so this is capturable in a CUDA graph
        prim = torch.where((prim >= 0) & (prim < e), prim, e)
        in_p = torch.zeros(e + 1, dtype=torch.bool, device=dev).index_fill_(0, prim.reshape(-1), True)
        safe = sec_old.clamp(0, e - 1)
        outside = valid & ~in_p[:-1][safe]
        stayed = outside & (sec_old == sec_new)
        prot = st.protected[safe] & stayed if st.protected is not None else torch.zeros_like(stayed)
        extra = torch.stack([(old != new).sum(), outside.sum(), (stayed & ~prot).sum(), prot.sum(), n_live])
        st.acc[:3] += counts
        st.acc[3:] += extra
        one = torch.ones(1, dtype=torch.long, device=dev)
        hist.index_add_(0, n_live.reshape(1), torch.cat([one, counts[:2]]).reshape(1, 3))

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

        Live rows only (finished rows of a static HF batch are left out, see the module doc). Means are
        over (step, layer) pairs: ``expert_union_before`` / ``_after`` = distinct experts a layer computes
        per step without / with SERE, ``primary_union`` = |P|, ``moved_fraction`` = moved secondary slots /
        all secondary slots (live rows x (k - K) per step and layer), ``outside_primary_fraction`` =
        secondary slots whose expert is not in P, ``critical_fraction`` = of all secondary slots, those
        outside P kept because no primary expert was similar enough (sim < ρ), ``protected_hits`` = secondary
        slots outside P kept because their expert is protected, ``tokens_per_step`` = live rows per step,
        ``by_batch_size`` = the unions per number of live rows in the step.
        """
        rows = self._read_counters()
        per_layer = []
        tot_steps = tot_slots = 0
        sums = [0] * len(COUNTERS)
        batch: dict[int, list[int]] = {}
        for st in self.layers:
            for _t, (_n, hist) in st.by_batch.items():
                for live, (n, bsum, asum) in enumerate(hist.tolist()):
                    if n:
                        b = batch.setdefault(live, [0, 0, 0])
                        b[0] += n
                        b[1] += bsum
                        b[2] += asum
        for st, row in zip(self.layers, rows, strict=True):
            before, after, prim, moved, outside, critical, prot_hits, tokens = row
            steps = st.steps
            slots = tokens * st.slot_width
            per_layer.append({
                "layer": st.layer,
                "steps": steps,
                "tokens": tokens,
                "expert_union_before": before / steps if steps else None,
                "expert_union_after": after / steps if steps else None,
                "primary_union": prim / steps if steps else None,
                "moved_slots": moved,
                "secondary_slots": slots,
                "moved_fraction": moved / slots if slots else None,
                "critical_fraction": critical / slots if slots else None,
                "protected_hits": prot_hits,
                "protected": int(st.protected.sum()) if st.protected is not None else 0,
            })
            tot_steps += steps
            tot_slots += slots
            sums = [a + b for a, b in zip(sums, row, strict=True)]
        n_steps = max((st.steps for st in self.layers), default=0)
        n_tokens = max((p["tokens"] for p in per_layer), default=0)
        mean = (lambda v: v / tot_steps) if tot_steps else (lambda v: None)
        before, after = mean(sums[0]), mean(sums[1])
        n_layers = max(len(self.layers), 1)
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
            "by_batch_size": {str(t): {"steps": n // n_layers,
                                       "expert_union_before": bsum / n, "expert_union_after": asum / n}
                              for t, (n, bsum, asum) in sorted(batch.items())},
            "per_layer": per_layer,
        }

    def remove(self) -> None:
        """Take every hook off; the model routes exactly as before ``install_sere``. Idempotent."""
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        for st in self.layers:
            for h in st.hooks:
                h.remove()
            st.hooks = []
            st.active = False
            if getattr(st.block, self.slot, None) is self:
                delattr(st.block, self.slot)
        self.removed = True

    def __enter__(self) -> "RoutingHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def block_device(block: torch.nn.Module, router: torch.nn.Module | None = None) -> torch.device:
    router = router if router is not None else getattr(block, "gate", None)
    return router.weight.device if hasattr(router, "weight") else block.experts.gate_up_proj.device


def refuse_if_installed(blocks: list, slot: str = "_harness_sere") -> None:
    """One handle of a kind per model (SERE in ``_harness_sere``, ``moe.top_k`` in ``_harness_topk``)."""
    for ref in blocks:
        other = getattr(ref.block, slot, None)
        if other is not None:
            raise RuntimeError(f"{getattr(other, 'kind', 'SERE')} is already installed on {ref.name}: "
                               "remove() the first handle")


def model_eos_ids(model: torch.nn.Module, eos_token_ids: Any = None) -> list[int]:
    """``eos_token_ids`` as a list, else the model's ``generation_config.eos_token_id`` (int or list)."""
    eos = eos_token_ids
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple, set, frozenset)) else [eos])]


def attach(handle: RoutingHandle, model: torch.nn.Module, eos_token_ids: Any = None) -> None:
    """Put the handle's hooks on the model (live-row hook) and on every layer of ``handle.layers``."""
    device = block_device(handle.layers[0].block, handle.layers[0].gate)
    handle._install_model_hook(model, model_eos_ids(model, eos_token_ids), device)
    for st in handle.layers:
        handle._install(st)

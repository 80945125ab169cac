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


#: ``stats_impl="auto"`` also takes the statistics kernel under Triton's interpreter on CPU (tests only)
INTERPRETER_AUTO = False


@dataclass
class _Layer:
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


class SereHandle:
    """Installed SERE hooks on one model: ``mode``, ``stats()``, ``reset_stats()``, ``remove()``."""

    kind = "sere"
    slot = "_harness_sere"  # the per-block attribute naming the installed handle (hf_graphs finds it there)

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
        self.layers: list[_Layer] = []
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

    def _install(self, st: _Layer) -> None:
        def block_pre(module, args, kwargs):
            hs = args[0] if args else kwargs.get("hidden_states")
            st.active = isinstance(hs, torch.Tensor) and self._wants(hs)

        def block_post(module, args, output):
            st.active = False

        def gate_post(module, args, output):
            if not st.active:
                return None
            return self._rewrite(st, output, self._live_rows(output[2].shape[0]))

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
        import os

        # On CPU only when INTERPRETER_AUTO asks for it: an interpreted launch per layer and step made CPU runs (the
        # CI's SERE runs) minutes slower; tests/kernels/test_sere_stats.py checks the kernel against the torch ops.
        # Decided before importing the kernel module: a CPU venv may lack triton.
        if not (old.is_cuda or (INTERPRETER_AUTO and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))):
            return False
        from harness.kernels.sere_stats import FUSED_MAX_TOKENS

        # one program per layer: decode-sized passes; a long prefill (mode="all") keeps the wide torch ops
        return old.shape[0] <= FUSED_MAX_TOKENS

    def _record(self, st: _Layer, old: torch.Tensor, new: torch.Tensor, live: torch.Tensor | None = None) -> None:
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

    def _record_torch(self, st: _Layer, old: torch.Tensor, new: torch.Tensor, live: torch.Tensor | None,
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

    def __enter__(self) -> "SereHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


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
        device = block_device(ref.block)
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
    attach(handle, model, eos_token_ids)
    return handle


def block_device(block: torch.nn.Module) -> torch.device:
    return block.gate.weight.device if hasattr(block.gate, "weight") else block.experts.gate_up_proj.device


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


def attach(handle: SereHandle, model: torch.nn.Module, eos_token_ids: Any = None) -> None:
    """Put the handle's hooks on the model (live-row hook) and on every layer of ``handle.layers``."""
    device = block_device(handle.layers[0].block)
    handle._install_model_hook(model, model_eos_ids(model, eos_token_ids), device)
    for st in handle.layers:
        handle._install(st)


def calibration_kwargs(sere_cfg: Any) -> dict[str, Any]:
    """``text_path`` / ``text_field`` / ``max_tokens`` for the calibration builders from ``sere.calibration_*``
    (absent keys: the builders' defaults)."""
    from harness.techniques.sere_calibration import DEFAULT_MAX_TOKENS

    get = (lambda k: sere_cfg.get(k)) if isinstance(sere_cfg, dict) else (lambda k: getattr(sere_cfg, k, None))
    return {"text_path": get("calibration_text") or None, "text_field": get("calibration_field") or None,
            "max_tokens": int(get("calibration_tokens") or DEFAULT_MAX_TOKENS)}


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


def sere_artifacts_from_config(model: torch.nn.Module, tokenizer: Any, sere_cfg: Any, model_id: str,
                               cache_dir: str | None = None) -> tuple[dict, dict | None] | None:
    """``(similarity, protected)`` for the ``sere`` config group (read, or computed on the stock model and
    cached), None when ``sere.k`` is null. Separate from installing, so the engine can compute them before
    any routing hook is on the model and install ``moe.top_k`` before SERE."""
    if sere_cfg.k is None:
        return None
    from harness.techniques.sere_calibration import load_similarity, similarity_for

    data = calibration_kwargs(sere_cfg)
    if sere_cfg.similarity:
        similarity, _ = load_similarity(sere_cfg.similarity)
    else:
        similarity = similarity_for(model, tokenizer, model_id, cache_dir, **data)
    protected = None
    n = int(sere_cfg.protect or 0)
    if n > 0 or sere_cfg.protection:
        from harness.techniques.sere_protection import load_protection, protection_for

        if sere_cfg.protection:
            protected, _ = load_protection(sere_cfg.protection, n=n or None)
        else:
            protected = protection_for(model, tokenizer, model_id, similarity, int(sere_cfg.k),
                                       float(sere_cfg.rho), n, cache_dir, **data)
    return similarity, protected

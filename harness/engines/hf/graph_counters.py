"""The SERE counter bookkeeping around the static decoder's CUDA-graph capture and replay.

Routing handles (:class:`harness.engines.hf.routing.RoutingHandle`: SERE, ``moe.top_k``, the ``moe.routing``
baselines) count in two places: Python ints (``steps``, ``tokens``, ``secondary_slots``, ``by_batch`` step
counts) and per-layer device tensors (``acc``, ``by_batch`` tensors), plus per-row "finished" flags. The static
decoder (:mod:`harness.engines.hf.graphs`, whose module doc gives the full account) changes all three in ways
``generate`` never does: its warm-up steps and an emulated capture run the hooks, so every counter and flag
must be snapshotted before and put back after them (warm-up leaves no trace); a real capture runs the hooks
once, but a replay runs no Python, so the capture measures what one step adds to the ints
(:func:`counter_delta`) and :func:`add_replayed_steps` adds it once per replay; ``reset_stats()`` drops the
device tensors a graph writes to, so :func:`attach_counters` re-attaches the captured (zeroed) ones before a
replay, or says the graph must be recaptured. Only that way does ``SereHandle.stats()`` equal the eager run's.

Why a module of its own: this is the one place that reads and writes the handles' per-layer fields (a rename
in ``hf_sere`` / ``hf_routing`` fails here, and the tests comparing ``stats()`` with ``generate``'s catch it);
:mod:`harness.engines.hf.graphs` keeps the decode loop, the static state and the capture itself, and calls
these snapshot / restore / delta helpers at its fixed points.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.engines.hf.routing import RoutingHandle


def sere_handles(model: torch.nn.Module) -> list:
    """Installed routing handles: each technique's ``hf_routing.RoutingHandle`` subclass sits on every MoE block
    under its ``slot`` (SERE ``_harness_sere``, ``moe.top_k`` ``_harness_topk``, a ``moe.routing`` baseline
    ``_harness_routing_baseline``), all listed in ``RoutingHandle.slots``. A handle not found here is still replayed
    (its ops are in the graph) but its host-side step counts are not: ``moe.routing=top_p`` reported 0 decode steps
    on the H200 while this function knew only SERE's and top-k's slots (2026-12-03)."""
    found: dict[int, Any] = {}
    slots = sorted(RoutingHandle.slots)
    for module in model.modules():
        for slot in slots:
            handle = getattr(module, slot, None)
            if handle is not None and not getattr(handle, "removed", False):
                found[id(handle)] = handle
    return list(found.values())


def host_counters(handles: list) -> list:
    """Python-side SERE counters per handle and layer: (steps, tokens, secondary_slots, {batch: steps})."""
    return [[(st.steps, st.tokens, st.secondary_slots, {t: e[0] for t, e in st.by_batch.items()})
             for st in h.layers] for h in handles]


def restore_host_counters(handles: list, saved: list) -> None:
    for h, layers in zip(handles, saved, strict=True):
        for st, (steps, tokens, slots, counts) in zip(h.layers, layers, strict=True):
            st.steps, st.tokens, st.secondary_slots = steps, tokens, slots
            for t, entry in st.by_batch.items():
                entry[0] = counts.get(t, 0)


def counter_delta(before: list, after: list) -> list:
    return [[(a[0] - b[0], a[1] - b[1], a[2] - b[2], {t: n - b[3].get(t, 0) for t, n in a[3].items()})
             for b, a in zip(hb, ha, strict=True)] for hb, ha in zip(before, after, strict=True)]


def add_replayed_steps(handles: list, per_step: list, replays: int) -> None:
    """Add ``replays`` x one captured step's Python-side counting (``per_step``) to the handles."""
    for h, layers in zip(handles, per_step, strict=True):
        for st, (steps, tokens, slots, counts) in zip(h.layers, layers, strict=True):
            st.steps += replays * steps
            st.tokens += replays * tokens
            st.secondary_slots += replays * slots
            for t, n in counts.items():
                st.by_batch[t][0] += replays * n


def device_counters(handles: list) -> list:
    return [[(None if st.acc is None else st.acc.clone(), {t: e[1].clone() for t, e in st.by_batch.items()})
             for st in h.layers] for h in handles]


def row_states(handles: list) -> list:
    """Each handle's per-row "finished" flags (``hf_sere``: finished rows leave SERE's P); the warm-up and an
    emulated capture change them like any other step state, so they are put back with the buffers."""
    return [h.row_state() if hasattr(h, "row_state") else None for h in handles]


def restore_row_states(handles: list, saved: list) -> None:
    for h, state in zip(handles, saved, strict=True):
        if state is not None:
            h.load_row_state(state)


def restore_device_counters(handles: list, saved: list) -> None:
    """Values back in place (tensors keep their identity); counters born since the snapshot are zeroed."""
    for h, layers in zip(handles, saved, strict=True):
        for st, (acc, by_batch) in zip(h.layers, layers, strict=True):
            if st.acc is not None:
                if acc is not None:
                    st.acc.copy_(acc)
                else:
                    st.acc.zero_()
            for t, entry in st.by_batch.items():
                if t in by_batch:
                    entry[1].copy_(by_batch[t])
                else:
                    entry[1].zero_()


def captured_counters(handles: list, batch: int) -> list:
    """Per handle and layer, the device counters a capture writes to: (acc, by_batch[batch] tensor)."""
    return [[(st.acc, st.by_batch[batch][1] if batch in st.by_batch else None) for st in h.layers]
            for h in handles]


def attach_counters(handles: list, captured: list, batch: int) -> bool:
    """Make the handles count into the captured tensors again after ``reset_stats`` dropped them (zeroed:
    a reset means zero). False when a handle counts into other live tensors: the graph must be recaptured."""
    pairs = [(st, acc, bb) for h, layers in zip(handles, captured, strict=True)
             for st, (acc, bb) in zip(h.layers, layers, strict=True)]
    for st, acc, bb in pairs:
        entry = st.by_batch.get(batch)
        if (st.acc is not None and st.acc is not acc) or (entry is not None and entry[1] is not bb):
            return False
    for st, acc, bb in pairs:
        if st.acc is None and acc is not None:
            st.acc = acc.zero_()
        if batch not in st.by_batch and bb is not None:
            st.by_batch[batch] = [0, bb.zero_()]
    return True

"""The routing handles' counter bookkeeping around CUDA-graph capture and replay
(``harness.engines.hf.graph_counters``): every technique's handle is found, so its replayed steps are counted.
The counters' values under capture, replay and ``reset_stats`` are checked against ``generate`` end to end in
``test_hf_graphs.py`` (SERE statistics, emulated and on CUDA)."""

from __future__ import annotations

import torch


def test_every_routing_technique_is_replayed_with_its_counts():
    """A CUDA-graph replay re-runs a handle's ops but not its Python step counting; ``sere_handles`` adds the
    captured step's counts back per replay for every handle it finds. It must find every technique's: a
    ``moe.routing=top_p`` baseline on a model is found like SERE's and top-k's (it reported 0 decode steps on the
    H200 while only those two slots were looked up)."""
    from harness.engines.hf import routing_baselines, sere, topk  # noqa: F401 - the subclasses register
    from harness.engines.hf.graph_counters import sere_handles
    from harness.engines.hf.routing import RoutingHandle

    assert {"_harness_sere", "_harness_topk", "_harness_routing_baseline"} <= RoutingHandle.slots
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    handles = [object.__new__(routing_baselines.RoutingBaselineHandle), object.__new__(topk.TopKHandle)]
    for h in handles:
        h.removed = False
    setattr(model[0], routing_baselines.RoutingBaselineHandle.slot, handles[0])
    setattr(model[1], topk.TopKHandle.slot, handles[1])
    assert {id(h) for h in sere_handles(model)} == {id(h) for h in handles}

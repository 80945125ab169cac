"""Which decode path a run takes, and why not another (``harness.engines.hf.decode_path``): ``auto`` on CUDA and
elsewhere, an unknown path refused, a reason (a model split over devices, ``moe.routing=random_p``) forcing the
eager path on CUDA. The eager-attention reason needs the families' models: ``test_hf_families.py``."""

from __future__ import annotations

import pytest

from harness.engines.hf.decode_path import random_routing_reason, resolve_decode_path


def test_resolve_decode_path():
    assert resolve_decode_path("auto", "cuda", True) == ("compiled", None)
    assert resolve_decode_path("auto", "cuda", False) == ("eager", None)
    assert resolve_decode_path("auto", "cpu", True) == ("eager", None)
    assert resolve_decode_path("graph", "cpu", True) == ("graph", None)
    path, why = resolve_decode_path("compiled", "cuda", True, "split over devices")
    assert path == "eager" and why == "split over devices"
    with pytest.raises(ValueError):
        resolve_decode_path("fast", "cuda", True)


def test_random_p_decodes_eagerly_where_a_graph_would_replay_its_draws():
    """A CUDA graph replays the generator offsets it captured (the capture itself refuses a generator re-seeded
    outside it: the H200 run of tests/run/test_baselines.py failed so), so ``random_p`` takes the eager path on CUDA;
    ``top_p`` draws nothing and keeps the graph."""
    from harness.techniques.moe_routing import RoutingSettings

    rand = random_routing_reason(RoutingSettings("random_p", 2, 0.0, 0))
    path, reason = resolve_decode_path("auto", "cuda", True, rand)
    assert path == "eager" and "random_p" in reason
    assert random_routing_reason(RoutingSettings("top_p", 0, 0.5, 0)) is None
    assert random_routing_reason(None) is None
    assert resolve_decode_path("auto", "cpu", True, rand) == ("eager", None)

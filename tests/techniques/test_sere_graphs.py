"""SERE's capture/replay contract on CPU (``harness.techniques.sere.graphs``).

A CUDA graph records kernels once and replays them on the same memory without running Python. The closest
CPU stand-ins: ``make_fx`` records the routing function's aten ops once ("capture") into a graph module whose
replay runs no line of the routing function, with every closed-over tensor (mask buffer, similarity,
counters) held by reference; ``torch.compile(fullgraph=True)`` traces it once and must neither recompile nor
graph-break when only buffer contents change. In both, the captured program must re-route each later step
exactly as eager does, from the buffers written before that step, and advance the device counters.
"""

from __future__ import annotations

import pytest
import torch

from harness.techniques.sere.reroute import reroute
from harness.techniques.sere.graphs import (
    COUNTERS,
    RoutingCounters,
    SereNotEngaged,
    StepRows,
    capture_mode,
    check_engagement,
    decode_tokens,
    engagement,
    route,
)

E, K, KP, RHO, T = 16, 4, 2, 0.3, 6


def _case(seed: int, rows: int = T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(rows, E, generator=g).topk(K).indices
    mask = torch.rand(rows, generator=g) < 0.6
    mask[0] = True
    return ids, mask


@pytest.fixture()
def setup():
    g = torch.Generator().manual_seed(0)
    sim = torch.rand(E, E, generator=g)
    prot = torch.zeros(E, dtype=torch.bool)
    prot[3] = True
    rows = StepRows(capacity=32)
    rows.buffer("cpu")
    rows.freeze()
    counters = RoutingCounters(0, E, 1)
    counters.counter("cpu")
    return sim, prot, rows, counters


def _eager_counts(steps, sim, prot):
    ref = RoutingCounters(0, E)
    for ids, mask in steps:
        new = reroute(ids, sim, KP, RHO, prot, mask)
        if mask.any():
            ref.add(ids, new, mask, KP)
    return ref.read()


def _steps():
    out = [_case(s) for s in (1, 2, 3)]
    out.append((_case(4)[0], torch.zeros(T, dtype=torch.bool)))      # a prefill-only step in between
    out.append(_case(5))
    return out


def test_make_fx_capture_replays_from_the_buffers(setup):
    from torch.fx.experimental.proxy_tensor import make_fx

    sim, prot, rows, counters = setup

    def fn(ids):
        return route(ids, sim, KP, RHO, prot, rows, counters, reroute)

    rows.clear()                                  # vLLM captures during dummy runs: every row False
    example = _case(0)[0]
    with capture_mode():
        graph = make_fx(fn)(example)
    counters.reset()                              # the tracing ran the ops once: drop those (zeros anyway)
    code = graph.code
    assert "route" not in code and "reroute" not in code        # a replay runs aten ops only
    consts = [getattr(graph, n) for n in dir(graph) if n.startswith("_tensor_constant")]
    assert any(c.data_ptr() == rows.buffers[torch.device("cpu")].data_ptr() for c in consts), \
        "the captured program must read the persistent mask buffer itself"

    steps = _steps()
    for ids, mask in steps:
        rows.write("cpu", mask)                   # written before the step, in place
        got = graph(ids)                          # "replay": no Python of the routing function runs
        assert torch.equal(got, reroute(ids, sim, KP, RHO, prot, mask))
        assert torch.equal(got[~mask], ids[~mask])               # prefill rows untouched
    assert counters.read() == _eager_counts(steps, sim, prot)
    assert counters.read()["moved"] > 0                          # the steps do re-route
    assert counters.read()["calls"] == 4 and counters.read()["rows"] == sum(int(m.sum()) for _, m in steps)


def test_the_check_catches_a_routing_function_that_skips_at_capture(setup):
    """Negative control: a function that decides on the host ("no decode rows yet -> stock") bakes the stock
    routing into the captured program, and the replay check above would see it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    sim, prot, rows, counters = setup

    def old_style(ids):
        if rows.active == 0:                      # evaluated once, at capture
            return ids.clone()
        return reroute(ids, sim, KP, RHO, prot, rows.rows(ids.device, ids.shape[0]))

    rows.clear()
    graph = make_fx(old_style)(_case(0)[0])
    ids, mask = _case(1)
    rows.write("cpu", mask)
    want = reroute(ids, sim, KP, RHO, prot, mask)
    assert not torch.equal(want, ids)             # this step does re-route something
    assert torch.equal(graph(ids), ids)           # ... but the captured program is stock


def test_route_skips_eager_steps_without_decode_rows_but_never_while_capturing(setup):
    sim, prot, rows, counters = setup
    calls = []

    def op(*args):
        calls.append(1)
        return reroute(*args)

    ids, _ = _case(1)
    rows.clear()
    assert route(ids, sim, KP, RHO, prot, rows, counters, op) is ids and not calls
    with capture_mode():
        out = route(ids, sim, KP, RHO, prot, rows, counters, op)
    assert calls and torch.equal(out, ids)
    assert counters.read()["calls"] == 0 and counters.read()["rows"] == 0


def test_torch_compile_follows_the_buffers_without_recompiling(setup):
    import torch._dynamo

    sim, prot, rows, counters = setup
    torch._dynamo.reset()

    def fn(ids):
        return route(ids, sim, KP, RHO, prot, rows, counters, reroute)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    steps = _steps()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ids, mask in steps:
            rows.write("cpu", mask)
            assert torch.equal(compiled(ids), reroute(ids, sim, KP, RHO, prot, mask))
    assert counters.read() == _eager_counts(steps, sim, prot)


def test_step_rows_keep_their_storage():
    rows = StepRows(capacity=8)
    buf = rows.buffer("cpu")
    rows.write("cpu", torch.tensor([True, False, True]), total=5)
    assert rows.active == 2 and rows.buffers[torch.device("cpu")] is buf
    assert buf.tolist() == [True, False, True, False, False, False, False, False]
    assert rows.rows("cpu", 3).data_ptr() == buf.data_ptr()
    rows.write("cpu", torch.ones(12, dtype=torch.bool))         # not frozen: may grow (and keeps content)
    assert rows.buffers[torch.device("cpu")].numel() == 12
    rows.freeze()
    with pytest.raises(RuntimeError, match="exceeds the decode-row buffer"):
        rows.write("cpu", torch.ones(13, dtype=torch.bool))
    rows.clear()
    assert rows.active == 0 and not rows.buffers[torch.device("cpu")].any()


def test_counters_match_reroute_stats_on_the_decode_rows():
    from harness.techniques.sere.reroute import reroute_stats

    g = torch.Generator().manual_seed(3)
    sim = torch.rand(E, E, generator=g)
    ids, mask = _case(7, rows=9)
    new = reroute(ids, sim, KP, 0.0, None, mask)
    c = RoutingCounters(5, E)
    c.add(ids, new, mask, KP)
    got = c.read()
    st = reroute_stats(ids[mask], new[mask], KP)
    assert got["before"] == st["experts_before"] and got["after"] == st["experts_after"]
    assert got["moved"] == st["slots_moved"] > 0 and got["secondary"] == st["slots_considered"]
    assert got["rows"] == int(mask.sum()) and got["calls"] == 1
    assert got["primary"] == int(torch.unique(ids[mask][:, :KP]).numel())
    acc = c.acc[torch.device("cpu")]
    c.reset()
    assert c.acc[torch.device("cpu")] is acc and c.read() == dict.fromkeys(COUNTERS, 0)


def test_engagement_verdicts():
    assert decode_tokens([1, 5, 0, 3]) == 6
    ok = engagement([{"layer": 0, "calls": 4, "rows": 6}, {"layer": 1, "calls": 4, "rows": 6}], 6)
    assert ok["ok"] and ok["reason"] is None
    check_engagement({"sere": {"engagement": ok}})
    stock = engagement([{"layer": 0, "calls": 0, "rows": 0}], 6)
    assert not stock["ok"] and "stock routing" in stock["reason"]
    with pytest.raises(SereNotEngaged, match="no routing call saw a decode row"):
        check_engagement({"sere": {"engagement": stock}})
    short = engagement([{"layer": 0, "calls": 3, "rows": 6}, {"layer": 1, "calls": 2, "rows": 4}], 6)
    assert not short["ok"] and "layer 1" in short["reason"] and "4 decode rows" in short["reason"]
    more = [{"layer": 0, "calls": 5, "rows": 8}]
    assert not engagement(more, 6)["ok"] and engagement(more, 6, recomputed=True)["ok"]
    assert engagement([], 0)["ok"] and not engagement([], 3)["ok"]
    check_engagement({})                          # no SERE block: nothing to check

"""The vLLM plugin's SERE routing function under a "capture" on CPU (no vLLM needed): captured once while
vLLM's dummy capture runs publish no decode row, then replayed without Python on later steps whose decode
rows the runner wrapper writes into the persistent buffer — the same ids and counters as eager
(``harness.techniques.sere.graphs``; docs/vllm.md "SERE under CUDA graphs")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.engines.vllm import routing as vllm_routing
from harness.engines.vllm.routing import stock_topk
from harness.engines.vllm.sere import counters_summary, make_routing_function
from harness.kernels.fused_routing_reference import fused_routing_reference
from harness.techniques.sere.reroute import reroute
from harness.techniques.sere.graphs import RoutingCounters, capture_mode

E, TOPK, K, RHO, MAX_TOKENS = 16, 4, 2, 0.2, 64


class _Runner:
    """What ``DecodeRows.publish`` reads from vLLM's GPUModelRunner (host arrays of the step)."""

    def __init__(self, prompt_lens, computed, query_lens):
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.device = torch.device("cpu")
        self.max_num_tokens = MAX_TOKENS
        self.query_start_loc = SimpleNamespace(cpu=qsl)
        self.input_batch = SimpleNamespace(num_computed_tokens_cpu_tensor=torch.tensor(computed),
                                           num_prompt_tokens_cpu_tensor=torch.tensor(prompt_lens))


@pytest.fixture()
def decode_rows(monkeypatch):
    rows = vllm_routing.DecodeRows()
    monkeypatch.setattr(vllm_routing, "DECODE", rows)
    return rows


def _step(seed, runner_args):
    g = torch.Generator().manual_seed(seed)
    runner = _Runner(*runner_args)
    t = int(runner.query_start_loc.cpu[-1])
    return torch.randn(t, E, generator=g), runner


# (prompt lengths, computed tokens, tokens scheduled) per request: decode-only, mixed chunked prefill, prefill
STEPS = [([5, 7], [5, 9], [1, 1]), ([5, 30, 4], [8, 10, 0], [1, 12, 4]), ([6], [0], [6]), ([5, 7], [6, 10], [1, 1])]


def test_captured_routing_function_follows_the_published_rows(decode_rows):
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    sim = torch.rand(E, E, generator=g)
    counters = RoutingCounters(3, E)
    # the op's torch reference: make_fx traces torch ops (the Triton kernel is captured in real CUDA graphs,
    # which the device run checks: benchmarks/bench_vllm_routing.py)
    fn = make_routing_function(3, sim, K, RHO, None, stats=counters, op=fused_routing_reference)
    decode_rows.clear()                          # vLLM's profile run (eager, no decode row) comes first:
    fn(None, torch.zeros(MAX_TOKENS, E), TOPK, True)   # it allocates the counters and the mask buffer
    decode_rows.reserve("cpu", MAX_TOKENS)       # the capture_model wrapper's job
    decode_rows.steps.freeze()

    graphs = {}
    for seed, args in enumerate(STEPS):
        gating, runner = _step(seed, args)
        t = gating.shape[0]
        if t not in graphs:                      # one graph per token count, as vLLM captures per size
            decode_rows.clear()
            with capture_mode():
                graphs[t] = make_fx(lambda x: fn(None, x, TOPK, True))(torch.zeros(t, E))
            assert counters.read()["rows"] == sum(         # tracing ran on an all-False mask: it added zeros
                int(decode_rows_for(a).sum()) for a in STEPS[:seed])
        decode_rows.publish(runner, t, len(args[0]), None)          # the runner wrapper, before the forward
        mask = decode_rows.rows("cpu", t).clone()
        weights, ids = graphs[t](gating)                             # replay: no Python of the function
        want_w, stock = stock_topk(gating, TOPK, True)
        assert torch.equal(weights, want_w)
        assert torch.equal(ids, reroute(stock, sim, K, RHO, None, mask).to(torch.int32)), args
    decode = [int(decode_rows_for(args).sum()) for args in STEPS]
    summary = counters_summary({3: counters})
    layer = summary["per_layer"][0]
    assert layer["rows"] == sum(decode) == 2 + 1 + 0 + 2       # decode rows of each step
    assert layer["calls"] == sum(1 for n in decode if n)
    assert layer["moved_slots"] > 0


def decode_rows_for(args):
    prompt, computed, q = (torch.tensor(a) for a in args)
    req = torch.repeat_interleave(torch.arange(len(q)), q)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    offset = torch.arange(int(q.sum())) - qsl[req]
    return (computed[req] + offset) >= prompt[req]


def test_prefill_step_is_stock_and_counts_nothing_and_dummy_rows_are_false(decode_rows):
    """One launch of the op whatever the step (it computes the stock top-k too); a prefill-only step gives
    the stock ids and adds nothing to the counters."""
    calls = []

    def op(*a):
        calls.append(1)
        return fused_routing_reference(*a)

    counters = RoutingCounters(0, E)
    fn = make_routing_function(0, torch.rand(E, E), K, RHO, None, stats=counters, op=op)
    gating, runner = _step(1, STEPS[2])                       # prefill only
    decode_rows.publish(runner, gating.shape[0], 1, None)
    _, ids = fn(None, gating, TOPK, True)
    assert len(calls) == 1 and torch.equal(ids, stock_topk(gating, TOPK, True)[1].to(torch.int32))
    assert counters.read()["calls"] == 0 and counters.read()["rows"] == 0
    gating, runner = _step(2, STEPS[0])
    decode_rows.dummy += 1                                    # a dummy run publishes no decode row
    decode_rows.publish(runner, gating.shape[0], 2, None)
    decode_rows.dummy -= 1
    assert decode_rows.n_decode == 0 and not decode_rows.rows("cpu", 2).any()
    decode_rows.publish(runner, gating.shape[0], 2, None)
    assert decode_rows.n_decode == 2 and decode_rows.rows("cpu", 2).all()
    buf = decode_rows.steps.buffers[torch.device("cpu")]
    assert buf.numel() >= MAX_TOKENS and not buf[2:].any()


def test_state_allocated_during_a_capture_fails_loudly():
    from harness.techniques.sere.graphs import StepRows

    with capture_mode():
        with pytest.raises(RuntimeError, match="during a graph capture"):
            RoutingCounters(0, E).counter("cpu")
        with pytest.raises(RuntimeError, match="during a graph capture"):
            StepRows().buffer("cpu", 4)


def test_routing_techniques_ask_for_the_v1_model_runner(monkeypatch):
    """The decode rows come from the V1 GPU model runner's hooks; vLLM 0.32 picks Model Runner V2 wherever
    Triton is installed, so SERE / moe.top_k ask for V1 — unless the user chose (then the canary judges)."""
    from harness.engines.vllm.techniques import V1_RUNNER_ENV, plugin_env

    sere = SimpleNamespace(env=lambda: {"HARNESS_SERE_K": "2"})
    monkeypatch.delenv(V1_RUNNER_ENV, raising=False)
    assert plugin_env(sere)[V1_RUNNER_ENV] == "0"
    assert V1_RUNNER_ENV not in plugin_env(None)
    monkeypatch.setenv(V1_RUNNER_ENV, "1")
    assert V1_RUNNER_ENV not in plugin_env(sere)

"""The HF engine's hooks for the latency protocol (harness/latency/), on CPU with the tiny model: timings from an
injected clock are exact, ``prompt_length`` is the shape the generation reports, the warm-up returns its
generations, and a CUDA-graph capture inside a timed batch (the decoder's emulated capture) is caught by the
engine's own counter and re-timed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from harness.engines.base import Request
from harness.models.tiny import TinyModelSpec, ensure_tiny_model


class TickClock:
    """Every reading is ``tick`` seconds after the previous one."""

    def __init__(self, tick: float = 0.005):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from harness.engines.hf.engine import HFEngine

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("latency-model"))
    cfg = SimpleNamespace(device="cpu", dtype="float32", batch_size=2, attn_implementation="sdpa",
                          experts_implementation=None, cuda_graphs=False, warmup=1)
    eng = HFEngine(str(path), cfg, SimpleNamespace(max_new_tokens=5))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def batch():
    from harness.datasets.synthetic.rag_igbench import text_dense_image

    img = text_dense_image(random.Random(0), 96, 64)
    return [Request("a", [{"type": "image"}, {"type": "text", "text": "请描述"}], [img]),
            Request("b", [{"type": "text", "text": "What is the best food in the city park?"}])]


def test_timings_come_from_the_injected_clock(engine, batch):
    engine.clock = TickClock(0.005)  # t0, then one reading per generated token: 5 ms apart
    try:
        gens = engine.generate_batch(batch)
    finally:
        del engine.clock  # back to the class's perf_counter
    for g in gens:
        assert g.error is None and g.ttft_ms == pytest.approx(5.0)
        assert g.e2e_ms == pytest.approx(5.0 * g.output_tokens)
        if g.output_tokens > 1:
            assert g.tpot_ms == pytest.approx(5.0)


def test_prompt_length_warmup_and_counters_describe_the_shape_that_ran(engine, batch):
    warm = engine.warmup(batch)
    assert [g.uid for g in warm] == ["a", "b"] and all(g.output_tokens <= 2 for g in warm)
    assert engine.prompt_length(batch) == max(g.prompt_tokens for g in warm)
    assert engine.compile_counters() == {"cuda_graph_captures": 0}  # CPU: no decoder, nothing captured


def test_a_capture_inside_a_timed_batch_is_caught_by_the_engine_counter(engine, batch):
    from harness.engines.hf.graphs import StaticGreedyDecoder
    from harness.latency.runner import TimedBatches

    engine._graph_decoder = StaticGreedyDecoder(engine.model, engine.eos_ids, engine.pad_id, use_graphs="emulate")
    try:
        cfg = SimpleNamespace(warmup="per_shape", bucket=None, on_compile="retime", max_retime=2, repeats=1)
        timer = TimedBatches(engine, cfg, "baseline", warmup_rounds=0)  # no warm-up: the first batch captures
        out = timer.time_batch(batch, 0, 0)
        assert [e["action"] for e in timer.events] == ["retimed"]
        assert "cuda_graph_captures +1" in timer.events[0]["reasons"]
        assert engine.compile_counters()["cuda_graph_captures"] == 1  # the re-timing replayed that graph
        assert all(g.error is None and g.extra["timing"]["retimed"] == 1 for g in out)
        timer.time_batch(batch, 1, 0)  # warm now: a clean timing
        assert len(timer.events) == 1
    finally:
        engine._graph_decoder = None


def test_ignore_eos_decodes_every_token_past_an_end_of_sequence():
    """generation.ignore_eos must run exactly max_new_tokens steps, as vLLM's ``ignore_eos`` does, even when the
    model ends its answer early. Regression: ``eos_token_id = None`` in the generation config is filled back in
    from the model's defaults by transformers 5 (5.19 and 5.24 both stopped at the trained model's EOS after 2
    of 4 tokens on this prompt); an empty list really disables the stop."""
    from types import SimpleNamespace

    from harness.engines.base import Request
    from harness.engines.hf.engine import HFEngine
    from harness.models.trained import trained_checkpoint

    path, _ = trained_checkpoint()
    cfg = SimpleNamespace(device="cpu", dtype="float32", batch_size=2, attn_implementation="sdpa",
                          experts_implementation="auto", cuda_graphs=False)
    request = [Request(uid="0", content=[{"type": "text", "text": "describe the city at night"}])]
    out = {}
    for ignore in (False, True):
        eng = HFEngine(str(path), cfg, SimpleNamespace(max_new_tokens=4, ignore_eos=ignore), sere_cfg=None)
        try:
            out[ignore] = eng.generate(request)[0]
        finally:
            eng.close()
    assert out[False].output_tokens < 4  # the model ends this answer early (else the test proves nothing)
    assert out[True].output_tokens == 4 and out[True].text.startswith(out[False].text)

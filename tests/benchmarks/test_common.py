"""The benchmarks' shared helpers (benchmarks/_common.py): what their results rest on — the relative error, the JSON +
Markdown writer, the timers' fields on CPU, the stand-in similarity, and the Qwen3-30B-A3B-shaped model the decode
benchmarks build through harness.models.real_shapes. No timing assertions."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import _common as c  # noqa: E402


def test_rel_err_is_relative_frobenius_and_marks_nan():
    want = torch.tensor([3.0, 4.0])
    assert c.rel_err(want.clone(), want) == 0.0
    assert c.rel_err(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.5 / 5.0)
    assert c.rel_err(torch.tensor([0.5]), torch.zeros(1)) == pytest.approx(0.5 / 1e-30)   # a zero reference
    bad = torch.tensor([float("nan"), 4.0])
    assert math.isnan(c.rel_err(bad, want))
    assert c.rel_err(bad, want, nan=float("inf")) == float("inf")
    assert c.rel_err(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), want) == 0.0


def test_short_error_keeps_the_type_and_the_first_line_only():
    assert c.short_error(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert c.short_error(RuntimeError()) == "RuntimeError:"
    assert len(c.short_error(RuntimeError("x" * 1000))) == 300


def test_write_result_round_trip(tmp_path):
    out = tmp_path / "deep" / "bench.json"
    result = {"benchmark": "x", "rows": [{"B": 1, "p50_us": 1.5}], "path": tmp_path}
    c.write_result(result, out, lambda r: f"# {r['benchmark']}\n", indent=1)
    back = json.loads(out.read_text())
    assert back == {"benchmark": "x", "rows": [{"B": 1, "p50_us": 1.5}], "path": str(tmp_path)}  # str(): default
    assert out.read_text().startswith('{\n "benchmark"')          # the script's own indent
    assert out.with_suffix(".md").read_text() == "# x\n"
    c.write_result({"a": 1}, out, "text\n")                      # markdown as text; the files are replaced whole
    assert json.loads(out.read_text()) == {"a": 1} and out.with_suffix(".md").read_text() == "text\n"
    c.write_result({"b": 2}, tmp_path / "only.json")
    assert not (tmp_path / "only.md").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json", "bench.md"]     # no temp file left


def test_timer_on_cpu_returns_its_fields_and_calls_as_told():
    calls = []
    for n in (1, 2):
        calls.clear()
        res = c.Timer(cuda=False, cpu_calls=n)(lambda: calls.append(1))
        assert set(res) == {"p50_us", "p10_us", "p90_us"} and len(calls) == n
        assert 0 <= res["p10_us"] <= res["p50_us"] <= res["p90_us"]


def test_time_calls_and_the_decode_fields_on_cpu():
    calls = []
    times = c.time_calls(lambda: calls.append(1), 10, cuda=False)
    assert len(calls) == 10 and len(times.ms) == 10 and times.ms == sorted(times.ms) and times.wall_mean_ms >= 0
    assert times.quantile(0.1) == times.ms[1] and times.quantile(0.9) == times.ms[9]
    assert times.quantile(1.0) == times.ms[-1]
    fields = c.tpot_fields(times)
    assert list(fields) == ["tpot_ms", "p10_ms", "p90_ms", "wall_mean_ms", "steps"] and fields["steps"] == 10


def test_replay_times_on_cpu_warms_once_and_rewinds():
    log = []
    times, capture_s = c.replay_times(lambda: log.append("step"), 4, cuda=False, rewind=lambda: log.append("rewind"))
    assert capture_s is None and len(times.ms) == 4
    assert log == ["rewind", "step", "rewind"] + ["step"] * 4


def test_use_cuda_decides_the_device(monkeypatch, capsys):
    ap = argparse.ArgumentParser()
    c.add_device_args(ap)
    assert c.use_cuda(ap.parse_args(["--smoke"])) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert c.use_cuda(ap.parse_args([])) is None and "--smoke" in capsys.readouterr().out
    assert ap.parse_args(["--out", "x.json"]).out.name == "x.json"
    # setenv first, so that teardown restores the variable's absence too: use_cuda sets it in os.environ itself, and
    # on the GPU machine (no TRITON_INTERPRET) a leaked "1" sent this worker's later harness subprocesses into
    # Triton's interpreter with CUDA tensors
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert c.use_cuda(ap.parse_args(["--smoke"])) is False and "TRITON_INTERPRET" not in os.environ
    assert c.use_cuda(ap.parse_args(["--smoke"]), interpret=True) is False and os.environ["TRITON_INTERPRET"] == "1"


def test_similarity_stand_in():
    sim = c.random_similarity(8, seed=3)
    assert torch.equal(sim, c.random_similarity(8, seed=3)) and torch.allclose(sim, sim.T)
    assert torch.equal(sim.diagonal(), torch.ones(8)) and sim.min() >= 0 and sim.max() <= 1
    layers = c.random_similarities(3, 8, "cpu", seed=3)       # one generator across the layers
    assert torch.equal(layers[0], sim) and not torch.equal(layers[1], sim)


def test_the_decode_model_config_is_the_checkpoints():
    from harness.models.real_shapes import QWEN3_30B_A3B_TEXT

    full = c.qwen3_moe_config(smoke=False)
    assert c.text_shape(full) == {**QWEN3_30B_A3B_TEXT, "max_position_embeddings": 40960}
    assert full["rope_parameters"]["rope_theta"] == 1_000_000.0
    tiny = c.qwen3_moe_config(smoke=True)
    assert tiny["num_hidden_layers"] == 2 and tiny["vocab_size"] == c.TINY_TEXT["vocab_size"]


def test_tiny_model_builds_seeded_and_decodes_from_the_same_prefix():
    config = c.qwen3_moe_config(smoke=True)
    model, build_s = c.build_qwen3_moe(config, "cpu", torch.float32, "grouped_mm", seed=1)
    again, _ = c.build_qwen3_moe(config, "cpu", torch.float32, "grouped_mm", seed=1)
    assert build_s >= 0 and model.config.rope_parameters["rope_theta"] == 1_000_000.0
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(w, again.model.layers[0].mlp.experts.gate_up_proj)
    assert w.std().item() == pytest.approx(0.02, rel=0.1)
    c.set_impl(model, "grouped_mm")
    dec = c.Decoder(model, 2, config["vocab_size"], "cpu", seed=0)
    assert dec.prefill_finite and dec.ids.shape == (2, 1)
    first = [c.run_graph(dec, 2, 0, cuda=False) for _ in range(2)]
    assert all(list(r) == ["tpot_ms", "p10_ms", "p90_ms", "wall_mean_ms", "steps"] for r in first)
    dec.rewind()
    with torch.inference_mode():
        dec.step()
        one = dec.ids.clone()
        dec.rewind()
        dec.step()
    assert torch.equal(dec.ids, one)


def test_a_result_file_is_named_after_the_card_that_ran_it():
    assert c.card_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert c.card_slug("NVIDIA H200") == "h200"
    assert c.card_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert c.card_slug("cpu") == "cpu" and c.card_slug("") == "gpu"
    if not torch.cuda.is_available():
        assert c.card_slug() == "cpu"

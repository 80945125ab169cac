"""``vllm serve`` load mode (``load.endpoint``): one server per setting (SERE off, SERE on) started by the
harness on the embedded model; answers over the OpenAI chat API equal the offline greedy ones (stock: HF;
SERE: HF with the reference re-routing), timings follow ``vllm bench serve``'s definitions, the server's
workers report the techniques it was started with, a second engine pointed at the running server
(``load.endpoint=URL``) takes the server's techniques and refuses a config that names others, and the
harness stops its server and keeps its log."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from test_vllm_sere import K, LAYERS, RHO, _HFSere, artifacts  # noqa: F401 (artifacts: the same fixture)
from vllm_lane_helpers import engine_cfg, gen_cfg

QPS, N, MAX_NEW = 8.0, 6, 8


def _load(endpoint, **over):
    base = dict(qps=QPS, num_requests=N, burstiness=1.0, warmup=0, seed=3, endpoint=endpoint, server_timeout_s=900)
    base.update(over)
    return SimpleNamespace(**base)


def _sere_cfg(artifacts):
    return SimpleNamespace(k=K, rho=RHO, protect=0, similarity=artifacts.sim_path, protection=artifacts.prot_path)


@pytest.fixture(scope="module", params=["stock", "sere"])
def served(request, tiny_model_path, artifacts, tmp_path_factory):
    from harness.engines.vllm.engine import VLLMEngine

    run_dir = tmp_path_factory.mktemp(f"serve-{request.param}")
    sere = _sere_cfg(artifacts) if request.param == "sere" else None
    trace = run_dir / "trace.jsonl"
    with pytest.MonkeyPatch.context() as env:  # the user's key: the started server takes it, an attach sends it
        env.setenv("VLLM_API_KEY", f"test-key-{request.param}")
        env.setenv("VLLM_LOGGING_LEVEL", "INFO")   # the server's log file gets vLLM's start-up phase lines
        eng = VLLMEngine(tiny_model_path, engine_cfg(max_model_len=512), gen_cfg(MAX_NEW), max_images_per_prompt=2,
                         load_cfg=_load("auto"), sere_cfg=sere, sere_trace=str(trace) if sere else None,
                         run_dir=str(run_dir))
        yield SimpleNamespace(setting=request.param, engine=eng, run_dir=run_dir, sere_cfg=sere, trace=trace)
    eng.close()


@pytest.fixture(scope="module")
def hf_sere(hf_ref, artifacts):
    return _HFSere(hf_ref, artifacts)


def _one(engine, request):
    gens, _ = engine.run_load([request], _load("auto", qps=50.0, num_requests=1), timeout_s=300)
    assert gens[0].error is None, gens[0].error
    return gens[0]


def test_answers_are_the_offline_greedy_ones(served, hf_ref, hf_sere, requests_text_images):
    text, images = requests_text_images
    ref = hf_sere if served.setting == "sere" else hf_ref
    for r in (text[0], images[0], images[1]):  # one at a time: SERE's P is the decode batch's union
        g = _one(served.engine, r)
        want = ref.generate(r, MAX_NEW)
        assert g.extra["token_ids"] == want["ids"], r.uid
        assert g.output_tokens == len(want["ids"])        # the server's usage count = the ids streamed
        assert g.prompt_tokens == want["prompt_tokens"] and g.visual_tokens == want["visual_tokens"]
        assert g.text == hf_ref.processor.tokenizer.decode(want["ids"], skip_special_tokens=True)


def test_load_timings_as_vllm_bench_serve(served, requests_text_images):
    from harness.engines.vllm.serve_mode import CLIENT

    text, images = requests_text_images
    served.engine.warmup(text[:1])  # also restarts the server's SERE statistics
    served.trace.unlink(missing_ok=True)
    gens, info = served.engine.run_load(text + images, _load("auto"), timeout_s=300)
    assert info["completed"] == N and all(g.error is None for g in gens), [g.error for g in gens]
    assert info["client"] == CLIENT and info["server"]["started_by_harness"] is True
    # where the start-up went, read off this server's own log (vLLM's lines, harness.engines.vllm.server_startup)
    phases = info["server"]["startup_phases"]
    assert 0 < phases["engine_init_s"] <= info["server"]["startup_s"], phases
    for g in gens:
        itl = g.extra["itl_ms"]
        assert 0 < g.ttft_ms <= g.e2e_ms and len(itl) == g.extra["chunks"] - 1 and all(x >= 0 for x in itl)
        assert math.isclose(g.ttft_ms + sum(itl), g.e2e_ms, rel_tol=1e-6, abs_tol=1e-6)
        assert g.output_tokens == len(g.extra["token_ids"])
        if g.output_tokens > 1:
            assert math.isclose(g.tpot_ms, (g.e2e_ms - g.ttft_ms) / (g.output_tokens - 1), rel_tol=1e-9)
    sent = [g.extra["sent_at_s"] for g in gens]
    assert sent == sorted(sent)
    # where the TTFT went, from the server's own /metrics histograms over exactly these requests: the engine
    # core's queue and prefill lie inside the client's TTFT, and the rest (upload, rendering, images) is > 0
    ph = info["server_phases"]
    assert "error" not in ph and ph["missing"] == [] and ph["requests"] == N, ph
    assert ph["queue_ms"] >= 0 and ph["prefill_ms"] > 0 and ph["decode_ms"] > 0
    client_ttft = sum(g.ttft_ms for g in gens) / N
    assert ph["client_ttft_ms"] == pytest.approx(client_ttft)
    assert ph["queue_ms"] + ph["prefill_ms"] < ph["ttft_server_ms"] <= client_ttft
    assert ph["front_end_ms"] == pytest.approx(client_ttft - ph["queue_ms"] - ph["prefill_ms"]) and ph["front_end_ms"] > 0
    stats = served.engine.technique_stats()
    if served.setting == "stock":
        assert stats == {}
        return
    st = stats["sere"]  # read from the server's worker through POST /harness/stats
    assert st["k_primary"] == K and st["layers"] == len(LAYERS) and st["workers"] == 1
    for layer in st["per_layer"]:  # every decode token of the load, none of the prompts
        assert layer["tokens"] == sum(g.output_tokens - 1 for g in gens)
    calls = [json.loads(x) for x in served.trace.read_text().splitlines()]
    assert calls and not any(c["prefill_changed"] for c in calls)
    assert sum(c["moved"] for c in calls if c["decode_rows"]) > 0


def test_jpeg_images_are_served_with_the_same_visual_tokens(served, requests_text_images):
    """load.image_format=jpeg: the server decodes JPEG data URLs (what production clients send) into images of the
    same size, so the expanded prompt has the same visual tokens as with PNG; and the run records where the
    TTFT went, as every serve-mode run does."""
    _, images = requests_text_images
    png, _ = served.engine.run_load(images[:2], _load("auto", num_requests=2), timeout_s=300)
    jpeg, info = served.engine.run_load(images[:2], _load("auto", num_requests=2, image_format="jpeg",
                                                          jpeg_quality=85), timeout_s=300)
    assert all(g.error is None for g in png + jpeg), [g.error for g in png + jpeg]
    assert [g.visual_tokens for g in jpeg] == [g.visual_tokens for g in png] and all(g.visual_tokens for g in jpeg)
    assert [g.prompt_tokens for g in jpeg] == [g.prompt_tokens for g in png]
    assert info["server_phases"]["requests"] == 2


def test_the_servers_workers_report_its_techniques(served, artifacts):
    info = served.engine.describe()
    assert info["mode"] == "serve" and info["techniques_source"].startswith("harness")
    worker = info["server_report"]["workers"][0]
    if served.setting == "stock":
        assert worker["sere"] is None and not worker["factory_patched"] and "sere" not in info
    else:
        assert worker["sere"]["k_primary"] == K and worker["sere"]["rho"] == RHO
        assert worker["sere"]["similarity_path"] == artifacts.sim_path and worker["factory_patched"]
        assert info["sere"]["k"] == K


def test_a_running_server_is_measured_with_its_own_techniques(served, tiny_model_path, requests_text_images):
    from harness.engines.vllm.engine import VLLMEngine
    from harness.engines.vllm.serve import healthy

    url = served.engine._server.url
    text, _ = requests_text_images
    wrong = None if served.setting == "sere" else SimpleNamespace(k=2, rho=0.1, protect=0)
    with pytest.MonkeyPatch.context() as env:  # issue 26: without the server's key nothing is answered
        env.delenv("VLLM_API_KEY")
        with pytest.raises(PermissionError, match="401 Unauthorized: the server has an API key"):
            VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(MAX_NEW), load_cfg=_load(url), sere_cfg=served.sere_cfg)
    with pytest.raises(ValueError, match="sere.k: config"):
        VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(MAX_NEW), load_cfg=_load(url), sere_cfg=wrong)
    remote = VLLMEngine(tiny_model_path, engine_cfg(), gen_cfg(MAX_NEW), load_cfg=_load(url),
                        sere_cfg=served.sere_cfg)
    try:
        info = remote.describe()
        assert info["techniques_source"].startswith("server") and info["server"]["started_by_harness"] is False
        assert (info.get("sere") or {}).get("k") == (K if served.setting == "sere" else None)
        assert _one(remote, text[1]).extra["token_ids"] == _one(served.engine, text[1]).extra["token_ids"]
    finally:
        remote.close()
    assert healthy(url)  # closing an engine that found the server leaves it running


def test_the_harness_stops_its_server_and_keeps_the_log(served):
    from harness.engines.vllm.serve import LOG_NAME, healthy

    server = served.engine._server
    proc, url = server.proc, server.url
    served.engine.close()
    assert proc.poll() is not None and not healthy(url)
    log = (served.run_dir / LOG_NAME).read_text()
    assert log.startswith("$ ") and "serve" in log.splitlines()[0] and "VLLM_PLUGINS=" in log
    assert f"test-key-{served.setting}" not in log  # the server's key stays out of its log (issue 26)
    if served.setting == "sere":
        assert "HARNESS_SERE_K=2" in log

"""Parts of the ``vllm serve`` load mode that need neither vLLM nor a server (main venv): the server's flags and
environment, the chat request, the stream parser's timing points (``vllm bench serve``'s), the
config-vs-server technique check and the worker-report round trip."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from harness.engines.base import Request
from harness.engines.vllm import client, serve, serve_mode
from harness.engines.vllm.settings import MoeSettings, VisionZipSettings
from harness.engines.vllm.techniques import SereSetup


def test_engine_args_become_vllm_serve_flags():
    args = {"model": "/m", "dtype": "float32", "max_model_len": 512, "enforce_eager": True,
            "trust_remote_code": False, "limit_mm_per_prompt": {"image": 2, "video": 0}, "disable_log_stats": False,
            "hf_overrides": {"architectures": ["X"]}, "seed": 0, "video_pruning_rate": 0.5, "quantization": None}
    flags = serve.cli_args(args)
    assert flags == ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--no-trust-remote-code",
                     "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--hf-overrides",
                     '{"architectures": ["X"]}', "--seed", "0", "--video-pruning-rate", "0.5"]


def test_server_environment_carries_exactly_the_runs_techniques(monkeypatch):
    base = {"PATH": "/bin", "HARNESS_SERE_K": "4", "HARNESS_VZ_KEEP": "0.3"}  # stale: must not reach the server
    env = serve.server_env({"HARNESS_MOE_TOP_K": "2", "HARNESS_MOE_SCOPE": "decode"}, base=base)
    assert env["PATH"] == "/bin" and "HARNESS_SERE_K" not in env and "HARNESS_VZ_KEEP" not in env
    assert env["HARNESS_MOE_TOP_K"] == "2"
    plugins = env["VLLM_PLUGINS"].split(",")
    assert "moe_vlm_harness" in plugins and "moe_vlm_harness_endpoint" in plugins
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # a forked engine core died on CUDA (H200)
    assert serve.server_env({}, base={"VLLM_WORKER_MULTIPROC_METHOD": "fork"})["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    # a user's allowlist is kept and extended
    env = serve.server_env({}, base={"VLLM_PLUGINS": "mine"})
    assert env["VLLM_PLUGINS"] == "mine,moe_vlm_harness,moe_vlm_harness_endpoint"


def test_chat_message_keeps_part_order_and_lossless_images():
    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("L", (4, 4), 7)
    req = Request("r", [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"},
                        {"type": "image"}], [red, blue])
    (msg,) = client.chat_messages(req)
    assert msg["role"] == "user" and [p["type"] for p in msg["content"]] == ["text", "image_url", "text", "image_url"]
    url = msg["content"][3]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    back = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert back.mode == "RGB" and back.size == (4, 4) and back.getpixel((0, 0)) == (7, 7, 7)
    payload = client.chat_payload("m", [msg], 12, 3)
    assert payload["stream"] and payload["stream_options"] == {"include_usage": True} and payload["return_token_ids"]
    assert payload["temperature"] == 0 and payload["max_completion_tokens"] == 12 and payload["seed"] == 3


def test_sampled_load_requests_get_temperature_one_and_a_seed_each():
    """generation.do_sample: every request of a load samples with its own seed (a shared seed would make requests
    with agreeing logits draw the same tokens), and the seeds are the same on a re-run; greedy stays seed = run
    seed, temperature 0."""
    mode = serve_mode.ServeMode.__new__(serve_mode.ServeMode)
    mode._server = SimpleNamespace(model="m")
    mode.seed = 7
    mode.load_cfg = SimpleNamespace(image_format="png", jpeg_quality=90)
    req = Request("r", [{"type": "text", "text": "a"}])
    mode.gen_cfg = SimpleNamespace(max_new_tokens=5, do_sample=True)
    sampled = [mode._payload(req, index=i) for i in range(50)]
    assert all(p["temperature"] == 1.0 for p in sampled)
    assert len({p["seed"] for p in sampled}) == 50
    assert [p["seed"] for p in sampled] == [mode._payload(req, index=i)["seed"] for i in range(50)]
    assert {client.sample_seed(8, i) for i in range(50)}.isdisjoint({p["seed"] for p in sampled})
    mode.gen_cfg = SimpleNamespace(max_new_tokens=5, do_sample=False)
    greedy = [mode._payload(req, index=i) for i in range(3)]
    assert all(p["temperature"] == 0.0 and p["seed"] == 7 for p in greedy)


def test_images_go_as_png_by_default_and_as_jpeg_when_the_load_asks():
    """load.image_format: PNG data URLs carry the offline engine's exact pixels; JPEG (what production clients
    send) is smaller for a photo-like image and decodes to nearby pixels, not the same ones."""

    import numpy as np
    from PIL import Image

    yy, xx = np.mgrid[0:64, 0:64]  # photo-like: smooth shading with sensor-like noise on it
    smooth = np.stack([xx * 4, yy * 4, (xx + yy) * 2], -1).astype(float)
    pixels = np.clip(smooth + np.random.default_rng(0).normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
    req = Request("r", [{"type": "image"}, {"type": "text", "text": "a"}], [Image.fromarray(pixels)])
    mode = serve_mode.ServeMode.__new__(serve_mode.ServeMode)
    mode._server, mode.seed = SimpleNamespace(model="m"), 0
    mode.gen_cfg = SimpleNamespace(max_new_tokens=5, do_sample=False)

    def sent(image_format):
        mode.load_cfg = SimpleNamespace(image_format=image_format, jpeg_quality=90)
        url = mode._payload(req)["messages"][0]["content"][0]["image_url"]["url"]
        head, data = url.split(",", 1)
        raw = base64.b64decode(data)
        return head, len(raw), np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))

    png, jpeg = sent("png"), sent("jpeg")
    assert png[0] == "data:image/png;base64" and np.array_equal(png[2], pixels)
    assert jpeg[0] == "data:image/jpeg;base64" and jpeg[1] < png[1]
    assert not np.array_equal(jpeg[2], pixels) and np.abs(jpeg[2].astype(int) - pixels).mean() < 8
    with pytest.raises(ValueError, match="image_format 'webp'"):
        client.image_url(Image.fromarray(pixels), "webp")


class _Resp:
    def __init__(self, lines, status=200):
        self.status, self.lines = status, lines

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def text(self):
        return "bad request"

    @property
    def content(self):
        async def gen():
            for line in self.lines:
                await asyncio.sleep(0)
                yield line

        return gen()


class _Session:
    def __init__(self, resp):
        self.resp, self.posted = resp, None

    def post(self, url, json=None):
        self.posted = (url, json)
        return self.resp


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n"


def test_stream_parser_stamps_chunks_as_vllm_bench_serve():
    lines = [_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2, 3]}),
             b"\n", b": ping\n",
             _sse({"choices": [{"delta": {"content": "he"}, "token_ids": [10]}]}),
             _sse({"choices": [{"delta": {"content": "llo"}, "token_ids": [11, 12], "finish_reason": "length"}]}),
             _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
             b"data: [DONE]\n"]
    sess = _Session(_Resp(lines))
    r = asyncio.run(client.stream_chat(sess, "http://x/v1/chat/completions", {"a": 1}))
    assert sess.posted == ("http://x/v1/chat/completions", {"a": 1})
    # three chunks with choices (the role chunk first: TTFT), the usage message is not one
    assert len(r["chunks"]) == 3 and r["sent"] <= r["chunks"][0] <= r["chunks"][1] <= r["chunks"][2]
    assert r["ids"] == [10, 11, 12] and r["prompt_ids"] == [1, 2, 3] and r["text"] == "hello"
    assert r["finish_reason"] == "length" and r["output_tokens"] == 3 and r["prompt_tokens"] == 3
    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(client.stream_chat(_Session(_Resp([], status=400)), "http://x", {}))


def test_a_shapes_model_sends_its_exact_ids_to_the_completions_api_and_its_stream_is_read():
    """model=<arch>_shapes with load.endpoint=auto: the server has no tokenizer (--skip-tokenizer-init), so the
    request is the in-process engines' token-id prompt, as it is, to /v1/completions; its chunks carry ``text``
    and the prompt ids inside the first choice."""
    from harness.engines.vllm.shapes import VllmShapes
    from harness.models.real_shapes import shapes_config

    config = shapes_config("qwen3_30b_a3b", 2, {"vocab_size": 2048, "hidden_size": 64, "num_experts": 16,
                                               "num_experts_per_tok": 4})
    mode = serve_mode.ServeMode.__new__(serve_mode.ServeMode)
    mode.shapes = VllmShapes("qwen3_30b_a3b", config, Path("/nowhere"), temporary=False)
    mode._server = SimpleNamespace(model="/runs/vllm_shapes_model", url="http://h:1")
    mode.seed, mode.load_cfg, mode.ignore_eos = 3, None, True
    mode.gen_cfg = SimpleNamespace(max_new_tokens=6, do_sample=False)
    req = Request("r", [{"type": "synthetic_tokens", "n": 48, "seed": 5}])
    payload = mode._payload(req)
    assert mode._request_url == "http://h:1/v1/completions"
    assert payload["prompt"] == mode.shapes.prompt(req)["prompt_token_ids"] and len(payload["prompt"]) == 48
    assert payload["max_tokens"] == 6 and payload["ignore_eos"] is True and payload["temperature"] == 0.0
    assert payload["return_token_ids"] is True and "messages" not in payload
    lines = [_sse({"choices": [{"text": "", "token_ids": [7], "prompt_token_ids": payload["prompt"]}]}),
             _sse({"choices": [{"text": "", "token_ids": [8], "finish_reason": "length"}]}),
             _sse({"choices": [], "usage": {"prompt_tokens": 48, "completion_tokens": 2}}), b"data: [DONE]\n"]
    r = asyncio.run(client.stream_chat(_Session(_Resp(lines)), mode._request_url, payload))
    assert len(r["chunks"]) == 2 and r["ids"] == [7, 8] and r["prompt_ids"] == payload["prompt"]
    assert r["output_tokens"] == 2 and r["finish_reason"] == "length"


def test_config_must_name_the_servers_techniques():
    sere = SereSetup(k=2, rho=0.3, similarity_path="/s", protection_path=None, protect=None)
    vz, moe = VisionZipSettings(keep=0.5), MoeSettings(top_k=2)
    cfg_sere = SimpleNamespace(k=2, rho=0.3, protect=0)
    cfg_vz = SimpleNamespace(keep=0.5, layer=-1, min_per_image=1)
    cfg_moe = SimpleNamespace(top_k=2, scope="decode")
    assert serve_mode.config_mismatches(cfg_sere, cfg_vz, cfg_moe, sere, vz, moe) == []
    off = SimpleNamespace(k=None)
    assert serve_mode.config_mismatches(off, None, None, None, None, None) == []
    bad = serve_mode.config_mismatches(SimpleNamespace(k=2, rho=0.1, protect=0), None, None, sere, vz, None)
    assert bad == ["sere.rho: config 0.1, server 0.3", "visionzip.keep: config None, server 0.5"]
    assert serve_mode.config_mismatches(off, None, cfg_moe, None, None, None) == ["moe.top_k: config 2, server None"]


def test_worker_report_round_trip():
    from dataclasses import asdict

    sere = SereSetup(k=2, rho=0.3, similarity_path="/s", protection_path="/p", protect=3)
    vz, moe = VisionZipSettings(keep=0.5, layer=-2, min_per_image=2), MoeSettings(top_k=1, scope="all")
    state = serve_mode.expected_state(sere, vz, moe)
    assert state["sere"]["k_primary"] == 2 and state["visionzip"] == asdict(vz)
    back = serve_mode.settings_from_report(state)
    assert back == (sere, vz, moe)
    assert serve_mode.settings_from_report({"sere": None, "visionzip": None, "moe": None}) == (None, None, None)

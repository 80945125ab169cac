"""The ``vllm serve`` launcher and the harness endpoint, hardened (issue 26), without vLLM (main venv): the
server log carries only the variables the server needs, secrets masked; the ``/harness`` routes' rules (key,
no cross-site request, a reset only from an explicit JSON body); and the harness's own client sends the key
and the body. The same rules on a real FastAPI app with vLLM's middleware: tests/vllm/test_vllm_endpoint_auth.py."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

import pytest

from harness.engines.vllm import client, serve
from harness.engines.vllm.endpoint_guard import Refused, guard, server_keys, stats_reset
from harness.redact import MASK, mask_argv, mask_env, mask_setup

SETUP = ("module load cuda/12.4; export HF_HOME=/scratch/me/hf; export HF_TOKEN='hf_abc123' "
         "WANDB_API_KEY=w123; MY_PASSWORD=pw ./start; PLAIN=2")


# ------------------------------------------------------------------------------------------------ the log

def test_setup_exports_and_secret_assignments_are_masked():
    masked = mask_setup(SETUP)
    for secret in ("hf_abc123", "w123", "/scratch/me/hf", "pw"):
        assert secret not in masked
    assert "export HF_TOKEN=*** WANDB_API_KEY=***" in masked and "MY_PASSWORD=*** ./start" in masked
    assert masked.startswith("module load cuda/12.4;") and masked.endswith("PLAIN=2")  # the rest stays readable


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                  "GIT_AUTH", "GOOGLE_APPLICATION_CREDENTIALS", "hf_token", "VLLM_API_KEY"])
def test_secret_looking_names_are_masked(name):
    assert mask_env({name: "s3cr3t", "PATH": "/bin"}) == {name: MASK, "PATH": "/bin"}


def test_command_line_secrets_are_masked_and_other_flags_kept():
    argv = ["vllm", "serve", "/m", "--api-key", "k1", "--hf-token=t1", "--tokenizer", "/tok",
            "--max-num-batched-tokens", "512"]
    assert mask_argv(argv) == ["vllm", "serve", "/m", "--api-key", MASK, "--hf-token=" + MASK, "--tokenizer",
                               "/tok", "--max-num-batched-tokens", "512"]


def test_the_server_log_names_only_what_the_server_needs(tmp_path, monkeypatch):
    """The header ``VLLMServer.start`` writes: the technique variables and VLLM_PLUGINS, never the rest of the
    environment (before: every HARNESS_* variable, HARNESS_SLURM_SETUP's tokens included)."""
    base = {"PATH": "/bin", "HARNESS_SLURM_SETUP": SETUP, "HARNESS_SLURM_PARTITION": "gpu", "HF_TOKEN": "hf_x",
            "VLLM_API_KEY": "key123"}
    techniques = {"HARNESS_SERE_K": "2", "HARNESS_SERE_RHO": "0.1"}
    env = serve.server_env(techniques, base=base)
    header = serve.log_header(["python", "-m", "x", "serve", "/m", "--api-key", "key123"], env, techniques)
    first, second = header.splitlines()
    assert "key123" not in header and "hf_abc123" not in header and "hf_x" not in header
    assert "HARNESS_SLURM" not in header and "PATH=" not in header and "HF_TOKEN" not in header
    assert first.endswith("--api-key ***")
    assert second.startswith("# HARNESS_SERE_K=2 HARNESS_SERE_RHO=0.1 VLLM_PLUGINS=")


class _Proc:
    pid, returncode = 0, None

    def poll(self):
        return None


def test_start_gives_the_server_a_key_in_its_environment_only(tmp_path, monkeypatch):
    """``load.endpoint=auto``: a random key (or the user's VLLM_API_KEY) reaches the server through its
    environment, not its command line (``ps`` shows that to every user), nor the log, nor ``describe()``."""
    seen = {}

    def popen(cmd, stdout, stderr, env, start_new_session):
        seen.update(cmd=cmd, env=env)
        return _Proc()

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.VLLMServer, "wait_healthy", lambda self, timeout_s: None)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("HARNESS_SLURM_SETUP", SETUP)
    server = serve.VLLMServer.start("/m", {"dtype": "float32"}, {"HARNESS_MOE_TOP_K": "2"}, tmp_path, port=1)
    key = seen["env"]["VLLM_API_KEY"]
    assert len(key) >= 32 and server.api_key == key and key not in " ".join(seen["cmd"])
    log = (tmp_path / serve.LOG_NAME).read_text()
    assert key not in log and "hf_abc123" not in log and "HARNESS_SLURM_SETUP" not in log
    assert "HARNESS_MOE_TOP_K=2" in log
    described = json.dumps(server.describe())
    assert key not in described and server.describe()["api_key"] is True
    monkeypatch.setenv("VLLM_API_KEY", "mine")  # the user's own key is kept
    assert serve.VLLMServer.start("/m", {}, {}, tmp_path, port=1).api_key == "mine"


# ------------------------------------------------------------------------------------------- the routes

def test_server_keys_follow_vllms_rule():
    assert server_keys(SimpleNamespace(api_key=["a", "b"]), {"VLLM_API_KEY": "env"}) == ["a", "b"]
    assert server_keys(SimpleNamespace(api_key="a"), {}) == ["a"]
    assert server_keys(SimpleNamespace(api_key=None), {"VLLM_API_KEY": "env"}) == ["env"]
    assert server_keys(SimpleNamespace(api_key=[""]), {"VLLM_API_KEY": ""}) == []
    assert server_keys(None, {}) == []


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "Basic k"}, 401),
    ({"Authorization": "k"}, 401),
    ({"Authorization": "Bearer k"}, None),
    ({"authorization": "bearer k"}, None),
    ({"Authorization": "Bearer k", "Origin": "http://evil.example", "Host": "127.0.0.1:8000"}, 403),
    ({"Authorization": "Bearer k", "Origin": "null", "Host": "127.0.0.1:8000"}, 403),
    ({"Authorization": "Bearer k", "Sec-Fetch-Site": "cross-site"}, 403),
    ({"Authorization": "Bearer k", "Sec-Fetch-Site": "same-site"}, 403),
    ({"Authorization": "Bearer k", "Origin": "http://127.0.0.1:8000", "Host": "127.0.0.1:8000"}, None),
])
def test_every_route_needs_the_key_and_a_non_cross_site_caller(headers, status):
    if status is None:
        guard(headers, ["k"])
    else:
        with pytest.raises(Refused) as e:
            guard(headers, ["k"])
        assert e.value.status == status


def test_without_a_key_only_the_cross_site_rule_applies():
    guard({}, [])
    with pytest.raises(Refused):
        guard({"Origin": "http://evil.example", "Host": "127.0.0.1:8000"}, [])


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("headers,query,body,outcome", [
    (JSON, {}, b'{"reset": true}', True),
    ({"content-type": "application/json; charset=utf-8"}, {}, b'{"reset": true}', True),
    (JSON, {}, b'{"reset": false}', False),
    (JSON, {}, b"{}", False),
    ({}, {}, b"", False),                              # bodiless: reads, never resets
    ({}, {"reset": "true"}, b"", 400),                 # the old ?reset=true: refused, not silently ignored
    (JSON, {"reset": "true"}, b'{"reset": true}', 400),
    ({"Content-Type": "text/plain"}, {}, b'{"reset": true}', 415),  # what a cross-site form can send
    ({"Content-Type": "application/x-www-form-urlencoded"}, {}, b"reset=true", 415),
    ({}, {}, b'{"reset": true}', 415),
    (JSON, {}, b"reset", 400),
    (JSON, {}, b'{"reset": "true"}', 400),
    (JSON, {}, b'{"reset": 1}', 400),
    (JSON, {}, b'[true]', 400),
    (JSON, {}, b'{"reset": true, "x": 1}', 400),
])
def test_a_reset_needs_an_explicit_json_body(headers, query, body, outcome):
    if isinstance(outcome, bool):
        assert stats_reset(headers, query, body) is outcome
    else:
        with pytest.raises(Refused) as e:
            stats_reset(headers, query, body)
        assert e.value.status == outcome and "\n" not in e.value.detail


# ------------------------------------------------------------------------------------------- the client

def test_the_harness_sends_its_key_and_the_reset_body(monkeypatch):
    sent: list[urllib.request.Request] = []

    class _Resp:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b'{"sere": null, "moe": null}'

    def urlopen(req, timeout):
        sent.append(req)
        return _Resp()

    monkeypatch.setattr(serve.urllib.request, "urlopen", urlopen)
    server = serve.VLLMServer("http://127.0.0.1:1", api_key="k")
    server.stats(reset=True)
    server.stats()
    server.techniques()
    reset, read, tech = sent
    assert reset.full_url == "http://127.0.0.1:1/harness/stats" and reset.get_method() == "POST"
    assert json.loads(reset.data) == {"reset": True} and json.loads(read.data) == {"reset": False}
    assert reset.get_header("Content-type") == "application/json"
    assert all(r.get_header("Authorization") == "Bearer k" for r in sent)
    assert stats_reset({"Content-Type": "application/json"}, {}, reset.data) is True  # the endpoint agrees
    assert tech.get_method() == "GET"
    assert client.auth_headers(None) == {} and client.auth_headers("k") == {"Authorization": "Bearer k"}


def test_attach_takes_the_key_from_vllm_api_key(monkeypatch):
    monkeypatch.setattr(serve.VLLMServer, "wait_healthy", lambda self, timeout_s: None)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.VLLMServer.attach("http://h:1").api_key == "from-env"
    monkeypatch.delenv("VLLM_API_KEY")
    assert serve.VLLMServer.attach("http://h:1").api_key is None


@pytest.mark.parametrize("key,says", [(None, "VLLM_API_KEY is not set"), ("k", "is not the server's")])
def test_a_refused_key_says_what_to_do(monkeypatch, key, says):
    import urllib.error

    def urlopen(req, timeout):
        raise urllib.error.HTTPError(req.full_url, 401, "Unauthorized", {}, None)

    monkeypatch.setattr(serve.urllib.request, "urlopen", urlopen)
    with pytest.raises(PermissionError, match=f"401 Unauthorized: the server has an API key and .*{says}"):
        serve.VLLMServer("http://127.0.0.1:1", api_key=key).techniques()


def test_opencompass_gets_the_servers_key_through_its_environment_only():
    """``python -m harness.opencompass engine=vllm``: the generated OpenCompass config names ``key="ENV"``
    (OpenCompass then reads ``OPENAI_API_KEY``), never the key itself: the config lies in the run directory."""
    from harness.opencompass.vllm_route import model_entry

    oc = SimpleNamespace(max_out_len=None, model_abbr=None, max_seq_len=4096)
    cfg = SimpleNamespace(opencompass=oc, generation=SimpleNamespace(max_new_tokens=8),
                          engine=SimpleNamespace(batch_size=2), seed=0)
    server = SimpleNamespace(model="m", url="http://127.0.0.1:1", api_key="secret-key-1")
    entry = model_entry(cfg, server, "/m", "tiny")
    assert entry["key"] == "ENV" and "secret-key-1" not in repr(entry)

"""The harness endpoint's ``/harness`` routes on vLLM's own app stack (issue 26): vLLM's CORS and
authentication middleware as ``vllm serve`` installs them (``init_entrypoints_middleware``), the plugin's routes
attached and initialised as vLLM does, a recording engine client instead of workers. With a key every
``/harness`` route needs it (vLLM's middleware guards only ``/v1``); a reset needs the JSON body; a bodiless
POST, ``?reset=true``, a CORS-simple or a cross-site request never resets."""

from __future__ import annotations

import asyncio
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from harness.engines.vllm.endpoint import STATS_PATH, TECHNIQUES_PATH, HarnessEndpoint

KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Engine:
    """Records each ``collective_rpc`` (method, kwargs): a reset is one with ``reset=True``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.model_config = None

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, dict(kwargs or {})))
        return [{"method": method}]

    @property
    def resets(self) -> int:
        return sum(1 for _, kw in self.calls if kw.get("reset"))


def _app(api_key: list[str] | None, monkeypatch: pytest.MonkeyPatch,
         env_key: str | None = None) -> tuple[TestClient, _Engine]:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if env_key:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    # ``vllm serve``'s own arguments; CORS opened to every origin, the most permissive a user can choose
    argv = ["--model", "/m", "--allowed-origins", '["*"]'] + [a for k in api_key or [] for a in ("--api-key", k)]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    init_entrypoints_middleware(args, app, ())  # vLLM's CORS (every origin) + its /v1 key check
    plugin, engine = HarnessEndpoint(), _Engine()
    plugin.attach_router(app)
    asyncio.run(plugin.init_state(engine, app.state, args))
    return TestClient(app, base_url="http://127.0.0.1:8000"), engine


def test_with_a_key_every_harness_route_needs_it(monkeypatch):
    http, engine = _app([KEY], monkeypatch)
    assert http.get("/v1/models").status_code == 401  # vLLM's own guard
    for call in (lambda h: http.get(TECHNIQUES_PATH, headers=h),
                 lambda h: http.post(STATS_PATH, headers=h),
                 lambda h: http.post(STATS_PATH, headers=h, json={"reset": True})):
        assert call({}).status_code == 401
        assert call({"Authorization": "Bearer nope"}).status_code == 401
    assert engine.calls == []  # nothing reached the workers
    r = http.post(STATS_PATH, headers=AUTH, json={"reset": False})
    assert r.status_code == 200 and set(r.json()) == {"sere", "moe"} and engine.resets == 0
    assert http.get(TECHNIQUES_PATH, headers=AUTH).status_code == 200
    assert http.post(STATS_PATH, headers=AUTH, json={"reset": True}).status_code == 200 and engine.resets == 2


def test_the_key_can_come_from_vllm_api_key(monkeypatch):
    """``vllm serve`` without ``--api-key`` takes ``VLLM_API_KEY`` (what the harness's auto-started server gets):
    the endpoint then asks for that key too."""
    http, engine = _app(None, monkeypatch, env_key="env-key")
    assert http.get("/v1/models").status_code == 401 and http.get(TECHNIQUES_PATH).status_code == 401
    assert http.post(STATS_PATH, json={"reset": True}).status_code == 401 and engine.calls == []
    ok = {"Authorization": "Bearer env-key"}
    assert http.post(STATS_PATH, headers=ok, json={"reset": True}).status_code == 200 and engine.resets == 2


@pytest.mark.parametrize("api_key", [None, [KEY]])
def test_only_an_explicit_json_body_resets(api_key, monkeypatch):
    http, engine = _app(api_key, monkeypatch)
    h = AUTH if api_key else {}
    assert http.post(STATS_PATH, headers=h).status_code == 200                      # bodiless: reads
    assert http.post(STATS_PATH + "?reset=true", headers=h).status_code == 400      # the old form
    assert http.post(STATS_PATH, headers={**h, "Content-Type": "text/plain"},       # a CORS-simple request
                     content=b'{"reset": true}').status_code == 415
    assert http.post(STATS_PATH, headers={**h, "Content-Type": "application/x-www-form-urlencoded"},
                     content=b"reset=true").status_code == 415
    cross = {**h, "Origin": "http://evil.example"}
    pre = http.options(STATS_PATH, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200  # --allowed-origins '["*"]' lets any origin preflight ...
    assert http.post(STATS_PATH, headers=cross, json={"reset": True}).status_code == 403  # ... the endpoint refuses
    assert http.post(STATS_PATH, headers={**h, "Sec-Fetch-Site": "cross-site"}, json={"reset": True}).status_code == 403
    assert engine.resets == 0
    r = http.post(STATS_PATH, headers=h, json={"reset": True})
    assert r.status_code == 200 and engine.resets == 2  # SERE and moe statistics, both cleared

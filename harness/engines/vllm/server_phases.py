"""Where a served request's time goes, read from ``vllm serve``'s own Prometheus histograms (``GET /metrics``).

Why: the client's TTFT over HTTP (``harness.engines.vllm.client``) is one number that holds the request's upload,
the API server's parsing, image decoding and multimodal processing, the hand-over to the engine core, the wait for
a batch slot, and the GPU's encoder + prefill. A technique that shortens only the last part (VisionZip cuts the
language model's prefill) can vanish inside the rest, as it did for 30-image requests on the H200 (issue 23).
vLLM's engine core timestamps each request (``RequestStateStats``: queued → scheduled → first token → last token)
and exports the differences as histograms; a histogram's ``_sum`` and ``_count`` before and after a load run give
the run's mean per phase:

- ``queue_ms``: ``vllm:request_queue_time_seconds`` (queued in the engine core → first scheduled);
- ``prefill_ms``: ``vllm:request_prefill_time_seconds`` (first scheduled → first token: the vision encoder and the
  prefill, on the GPU, plus any waiting between the chunks of a chunked prefill);
- ``decode_ms``: ``vllm:request_decode_time_seconds`` (first token → last token);
- ``ttft_server_ms``: ``vllm:time_to_first_token_seconds`` (the request's arrival at the engine's input processor
  → the first token, as the API server's output loop sees it);
- ``e2e_server_ms``: ``vllm:e2e_request_latency_seconds``.

:func:`front_end_ms` turns these into the part of the client's TTFT spent before the engine core queued the
request (and on the way back): client TTFT − queue − prefill. These are means over the run's requests, not
percentiles: a histogram's buckets are too coarse for percentiles of a few dozen requests. The histograms are
observed by the API server's output loop, which may run a moment after the client read the last chunk, so
:func:`wait_for_requests` polls until the counts reach the run's requests. Parsing uses ``prometheus_client``
(a dependency of vLLM, so present wherever a server is driven); it is imported when a run asks for phases.

The in-process load mode (``AsyncLLM``) has no ``/metrics``; it reads the same engine-core timestamps from each
finished request's ``RequestStateStats`` (:func:`request_phases`, :func:`mean_request_phases`) and records the
same keys, so ``load.server_phases`` means the same in both load modes (in process, "front end" is the input
processing and the hand-over to the engine core).
"""

from __future__ import annotations

import time
from typing import Any, Callable

PHASES: dict[str, str] = {
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "decode_ms": "vllm:request_decode_time_seconds",
    "ttft_server_ms": "vllm:time_to_first_token_seconds",
    "e2e_server_ms": "vllm:e2e_request_latency_seconds",
}
# the histogram whose count says how many requests finished (observed once per finished request)
FINISHED = "vllm:e2e_request_latency_seconds"

Totals = dict[str, tuple[float, float]]  # histogram name -> (sum of observations, count)


def histogram_totals(text: str) -> Totals:
    """``_sum`` and ``_count`` of every histogram in a Prometheus exposition, added over label sets (a server
    serves one model; several engines of a data-parallel server add up)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        acc = out.setdefault(family.name, [0.0, 0.0])
        for sample in family.samples:
            if sample.name == family.name + "_sum":
                acc[0] += float(sample.value)
            elif sample.name == family.name + "_count":
                acc[1] += float(sample.value)
    return {name: (s, c) for name, (s, c) in out.items()}


def phase_means(before: Totals, after: Totals) -> dict[str, Any]:
    """Mean milliseconds per phase over the requests observed between two scrapes. A phase the server does not
    export is left out (``missing`` names it), so an older vLLM gives fewer phases rather than wrong ones."""
    out: dict[str, Any] = {"source": "vllm /metrics histograms (mean over the run's requests)", "missing": []}
    for key, name in PHASES.items():
        if name not in after:
            out["missing"].append(name)
            continue
        s0, c0 = before.get(name, (0.0, 0.0))
        s1, c1 = after[name]
        n = c1 - c0
        out[key] = 1000.0 * (s1 - s0) / n if n > 0 else None
    done = after.get(FINISHED, (0.0, 0.0))[1] - before.get(FINISHED, (0.0, 0.0))[1]
    out["requests"] = int(round(done))
    return out


def wait_for_requests(scrape: Callable[[], str], before: Totals, expected: int, timeout_s: float = 5.0,
                      poll_s: float = 0.05) -> Totals:
    """Scrape until ``expected`` more requests have finished than in ``before`` (or ``timeout_s``: the last scrape
    is returned, and :func:`phase_means`' ``requests`` then says how many it covers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = histogram_totals(scrape())
        done = after.get(FINISHED, (0.0, 0.0))[1] - before.get(FINISHED, (0.0, 0.0))[1]
        if done >= expected or time.monotonic() >= deadline:
            return after
        time.sleep(poll_s)


def request_phases(stats: Any) -> dict[str, float] | None:
    """One request's queue / prefill / decode (ms) from vLLM's ``RequestStateStats`` (``RequestOutput.metrics`` of
    a finished request when stats are on): the same engine-core timestamps the server's histograms are built from,
    for the in-process load mode (``AsyncLLM``), which has no ``/metrics``. None when a timestamp is missing."""
    ts = [getattr(stats, k, None) for k in ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")]
    if not all(isinstance(t, (int, float)) and t > 0 for t in ts):
        return None
    queued, scheduled, first, last = ts
    return {"queue_ms": 1000.0 * (scheduled - queued), "prefill_ms": 1000.0 * (first - scheduled),
            "decode_ms": 1000.0 * (last - first)}


def mean_request_phases(per_request: list[dict[str, float] | None]) -> dict[str, Any]:
    """The in-process counterpart of :func:`phase_means`: means of :func:`request_phases` over the requests that
    have them (``requests`` says how many)."""
    got = [p for p in per_request if p]
    out: dict[str, Any] = {"source": "AsyncLLM RequestStateStats (engine-core timestamps, mean over the run's "
                                     "requests)", "missing": [], "requests": len(got)}
    for key in ("queue_ms", "prefill_ms", "decode_ms"):
        out[key] = sum(p[key] for p in got) / len(got) if got else None
    return out


def with_client_ttft(phases: dict[str, Any], gens: list[Any]) -> dict[str, Any]:
    """``phases`` plus the client's mean TTFT over the load's answered requests and the front end it leaves
    (:func:`front_end_ms`): the part both load modes add the same way."""
    ttfts = [g.ttft_ms for g in gens if not g.error and g.ttft_ms is not None]
    phases["client_ttft_ms"] = sum(ttfts) / len(ttfts) if ttfts else None
    phases["front_end_ms"] = front_end_ms(phases["client_ttft_ms"], phases)
    return phases


def front_end_ms(client_ttft_ms: float | None, phases: dict[str, Any]) -> float | None:
    """Client TTFT − engine queue − prefill: the request's upload, the API server's parsing, image decoding and
    multimodal processing, the hand-over to the engine core and the first chunk's way back (means)."""
    if client_ttft_ms is None or phases.get("queue_ms") is None or phases.get("prefill_ms") is None:
        return None
    return client_ttft_ms - phases["queue_ms"] - phases["prefill_ms"]

"""The blocks of ``summary.json`` computed from a run's records after generation: ``latency`` (the measured
requests' TTFT/TPOT/ITL/E2E, with the measurement protocol's intervals) and ``visionzip`` (tokens in and kept, the
per-image and per-source keep rates, the importance time).

Why a module of its own: these are pure functions of the records (and the protocol's timer), which the run loop
(:mod:`harness.run.experiment`) calls once at the end; they hold the rules of what a block covers — never the
requests replayed from the generation cache for timings, every request for token counts — and are tested on
records alone, without a run.
"""

from __future__ import annotations

from typing import Any

from harness.latency.stats import repeat_summary
from harness.metrics.latency import latency_summary, summarize
from harness.techniques.visionzip.stats import keep_rate_by_source


def visionzip_summary(vz_cfg: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json`` ``visionzip``: tokens in/kept, per-image keep-rate distribution, per-source keep rate
    (the OCRBench+CCBench budget competition) and the time spent on importance. Requests without per-image
    counts (``kept_per_image`` None: vLLM with ``scope=request``, whose split stays in the worker) count in
    the totals, not in the per-image and per-source rates (``requests_with_per_image_counts``)."""
    per_request = []
    tokens_in = kept = n_requests = 0
    for r in records:
        v = r.get("visionzip")
        if not v:
            continue
        n_requests += 1
        tokens_in += sum(v["tokens_per_image"])
        # engines record the request's total; a block with only the per-image split (written before the total
        # was recorded) sums it
        kept += v["visual_tokens_after"] if "visual_tokens_after" in v else sum(v["kept_per_image"])
        if v.get("kept_per_image") is None:  # vLLM scope=request: the split between images stays in the worker
            continue
        sources = r["meta"].get("image_sources") or [r["meta"].get("source") or r["dataset"]] * len(
            v["tokens_per_image"])
        per_request.append((sources, v["tokens_per_image"], v["kept_per_image"]))
    image_rates = [k / t for _, ts, ks in per_request for t, k in zip(ts, ks) if t]
    return {
        "keep": vz_cfg.keep, "contextual": vz_cfg.contextual, "scope": vz_cfg.scope, "layer": vz_cfg.layer,
        "min_per_image": vz_cfg.min_per_image,
        # attention = VisionZip, else a trivial baseline at the same kept count (issue 31); seed: method=random's
        "method": vz_cfg.get("method", "attention") if hasattr(vz_cfg, "get") else getattr(vz_cfg, "method", "attention"),
        "seed": vz_cfg.get("seed", 0) if hasattr(vz_cfg, "get") else getattr(vz_cfg, "seed", 0),
        "requests": n_requests,
        "requests_with_per_image_counts": len(per_request),
        "visual_tokens_in": tokens_in, "visual_tokens_kept": kept,
        "keep_rate": kept / tokens_in if tokens_in else None,
        "image_keep_rate": summarize(image_rates),
        "by_source": keep_rate_by_source(per_request),
        # each request carries its share of its batch's importance time: the sum is the run's total
        "importance_ms_total": sum(r["visionzip"]["importance_ms"] or 0.0 for r in records
                                   if r.get("visionzip") and not r.get("cached")),
        # token counts cover every request (replayed ones carry their visionzip block from the cache); the
        # importance time only the requests generated in this attempt
        "importance_ms_requests": sum(1 for r in records if r.get("visionzip") and not r.get("cached")),
        "requests_replayed": sum(1 for r in records if r.get("visionzip") and r.get("cached")),
        "importance_ms_partial": any(r.get("visionzip") and r.get("cached") for r in records),
    }


def run_latency(records: list[dict[str, Any]], gen_s: float, timer: Any = None, latency_cfg: Any = None,
                seed: int = 0) -> dict[str, Any]:
    """``summary.json`` ``latency`` over the requests generated and timed in this run (never the cache's).

    ``partial`` is true when some requests were replayed from the generation cache; ``n_measured`` counts the
    timed requests, ``n_cached`` the replayed ones. With the measurement protocol's ``timer``
    (:class:`harness.latency.runner.TimedBatches`) the TTFT/TPOT/ITL/E2E distributions cover every timed pass
    minus the excluded batches, with their interval, spread and ``noisy`` flag (harness/latency/stats.py), and
    ``protocol`` says how they were taken; counts and throughput stay those of the first pass."""
    measured = [r for r in records if not r.get("cached")]
    n_cached = len(records) - len(measured)
    out = latency_summary(measured, duration_s=gen_s if measured else None)
    out.update({"partial": n_cached > 0, "n_measured": sum(1 for r in measured if not r.get("error")),
                "n_cached": n_cached})
    if timer is not None and timer.samples:
        stats = repeat_summary(timer.samples, confidence=float(getattr(latency_cfg, "confidence", 0.95)),
                               n_resamples=int(getattr(latency_cfg, "bootstrap_resamples", 2000)),
                               max_cv=getattr(latency_cfg, "max_cv", None), seed=seed)
        out.update(stats)
        out.update({"repeats": timer.repeats, "max_cv": getattr(latency_cfg, "max_cv", None),
                    "noisy": [m for m, block in stats.items() if block["noisy"]], "protocol": timer.protocol_block()})
    return out

"""Request latency metrics with the definitions of vLLM's ``vllm bench serve``.

* TTFT: time from sending the request to the first output token.
* E2E: time from sending the request to the last output token.
* TPOT (time per output token, excluding the first) = (E2E − TTFT) / (output tokens − 1); undefined for
  outputs of one token (or none), which vLLM leaves out of the TPOT distribution, and so do we (counted as
  ``tpot_undefined``).
* ITL: the gaps between consecutive output tokens (chunks) of a streamed request, pooled over requests.
* Output throughput = total output tokens / benchmark wall time.

Distributions report mean and the 50th/90th/99th percentiles with ``numpy.percentile``'s default linear
interpolation between closest ranks (numpy ``method="linear"``), as ``vllm bench serve`` computes them. Unlike
vLLM (which reports 0 for an empty list), an empty distribution has ``n = 0`` and None statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)


def _finite(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def tpot(ttft: float | None, e2e: float | None, n_output_tokens: int | None) -> float | None:
    """(E2E − TTFT) / (tokens − 1) in the unit of the inputs; None for ≤ 1 token, missing or negative times."""
    ttft, e2e, n = _finite(ttft), _finite(e2e), _finite(n_output_tokens)
    if ttft is None or e2e is None or n is None or n <= 1 or e2e < ttft:
        return None
    return (e2e - ttft) / (n - 1)


def request_latency(ttft_ms: float | None, e2e_ms: float | None, n_output_tokens: int | None,
                    itl_ms: Sequence[float] | None = None) -> dict[str, Any]:
    """One request's record for :func:`latency_summary`: ``ttft_ms``, ``e2e_ms``, ``tpot_ms``, ``itl_ms``,
    ``output_tokens`` (TPOT from :func:`tpot`, None for a one-token output)."""
    return {"ttft_ms": ttft_ms, "e2e_ms": e2e_ms, "tpot_ms": tpot(ttft_ms, e2e_ms, n_output_tokens),
            "itl_ms": list(itl_ms) if itl_ms is not None else None, "output_tokens": n_output_tokens}


def summarize(values: Iterable[Any], percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """``{"mean", "p50", "p90", "p99", "n"}`` of the finite values (None, NaN, inf dropped); None stats if n = 0."""
    xs = [x for x in (_finite(v) for v in values) if x is not None]
    out: dict[str, Any] = {"mean": None, **{f"p{p:g}": None for p in percentiles}, "n": len(xs)}
    if xs:
        import numpy as np

        with np.errstate(over="ignore"):  # a sum of huge values is inf, not an error
            out["mean"] = float(np.mean(xs))
            for p, q in zip(percentiles, np.percentile(xs, list(percentiles))):
                out[f"p{p:g}"] = float(q)
    return out


def latency_summary(records: Iterable[Mapping[str, Any]], duration_s: float | None = None) -> dict[str, Any]:
    """Distributions of TTFT, TPOT, ITL and E2E (ms) and output throughput over per-request records.

    A record has ``ttft_ms``, ``e2e_ms``, ``output_tokens``, optionally ``tpot_ms`` (else computed with
    :func:`tpot`) and ``itl_ms`` (a list); one with ``error`` failed: it is left out of every distribution
    and counted in ``failed``. Successful outputs of one token (or whose TPOT cannot be had: no token count
    and no ``tpot_ms``, inconsistent times) are left out of TPOT and counted in ``tpot_undefined``.
    ``output_tokens_per_s`` = total output tokens / ``duration_s`` (the benchmark's wall time, vLLM's
    definition) when given, else / the sum of E2E times (equal for requests sent one at a time;
    ``output_tokens_per_s_basis`` says which); None without successful requests. Never raises on empty or
    partial records.
    """
    rows = list(records)
    ok = [r for r in rows if not r.get("error")]
    tpots, undefined = [], 0
    for r in ok:
        n = _finite(r.get("output_tokens"))
        value = None if n is not None and n <= 1 else _finite(r.get("tpot_ms"))
        if value is None and n is not None and n > 1:
            value = tpot(r.get("ttft_ms"), r.get("e2e_ms"), n)
        if value is None:
            undefined += 1
        else:
            tpots.append(value)
    itls = [x for r in ok for x in (r.get("itl_ms") or [])]
    # finite inputs can still sum past the float range: such a total (or rate) is reported as unknown, not raised
    total_tokens = _finite(sum(_finite(r.get("output_tokens")) or 0.0 for r in ok))
    sum_e2e_s = _finite(sum(_finite(r.get("e2e_ms")) or 0.0 for r in ok) / 1000.0)
    duration = _finite(duration_s)
    if ok and total_tokens is not None and duration is not None and duration > 0:
        throughput, basis = _finite(total_tokens / duration), "duration"
    elif ok and total_tokens is not None and sum_e2e_s is not None and sum_e2e_s > 0:
        throughput, basis = _finite(total_tokens / sum_e2e_s), "sum_e2e"
    else:
        throughput, basis = None, None
    return {
        "ttft_ms": summarize(r.get("ttft_ms") for r in ok),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize(itls),
        "e2e_ms": summarize(r.get("e2e_ms") for r in ok),
        "output_tokens_per_s": throughput,
        "output_tokens_per_s_basis": basis,
        "total_output_tokens": int(total_tokens) if total_tokens is not None else None,
        "n_requests": len(rows),
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "tpot_undefined": undefined,
    }

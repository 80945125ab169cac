"""The latency protocol's rows of harness/run/validate.py's tables (``latency.*``; harness/latency/, docs/latency.md).
validate.py appends them to RULES / CROSS_RULES."""

from __future__ import annotations

from harness.config.checks import Check, CrossRule, Rule, _select, at_least, number, one_of, optional

VZ_BASELINES = ("random", "pool", "first")  # harness/latency/variants.py: what latency.paired_with can time


def _list_of(choices: tuple[str, ...]) -> Check:
    return Check(lambda v: v is not None and not isinstance(v, str) and all(x in choices for x in v),
                 "a list of " + ", ".join(choices) + " (may be empty)")


def paired_refusal(cfg) -> str | None:
    """Why ``latency.paired=true`` cannot run with this configuration (None: it can). The variants are switched
    inside one HF engine (harness/latency/variants.py): nothing else can be switched without reloading."""
    if cfg.engine.name != "hf":
        return (f"false with engine={cfg.engine.name} (paired timing switches the technique inside the HF engine; "
                "vLLM fixes its techniques at start-up, and its load mode times arrivals, not batches: compare runs "
                "with latency.repeats instead)")
    if cfg.get("offload") is not None and cfg.offload.get("policy") is not None:
        return ("false with offload.policy (the offloaded experts left the device and cannot be switched back; "
                "benchmarks interleave offload policies in one process)")
    moe = cfg.get("moe") or {}
    on = (cfg.visionzip.keep < 1.0, cfg.sere.k is not None, moe.get("top_k") is not None,
          bool(moe.get("routing")))
    if not any(on):
        return ("true only with a technique on (visionzip.keep < 1, sere.k, moe.top_k or moe.routing): "
                "there is nothing to time against the baseline")
    return None


def paired_with_refusal(cfg) -> str | None:
    if not list(_select(cfg, "latency.paired_with", []) or []):
        return None
    if not _select(cfg, "latency.paired", False):
        return "[] unless latency.paired=true (the trivial baselines are timed in the paired timing)"
    if cfg.visionzip.keep >= 1.0 or str(cfg.visionzip.get("method", "attention")) != "attention":
        return "[] unless VisionZip itself runs (visionzip.keep < 1, visionzip.method=attention): its budget is theirs"
    return None

LATENCY_RULES: tuple[Rule, ...] = (
    Rule("latency.repeats", at_least(1, "timed passes; answers from the first")),
    Rule("latency.warmup", one_of("per_shape", "first_batch")),
    Rule("latency.bucket", optional(at_least(1, "tokens"), "powers of two")),
    Rule("latency.on_compile", one_of("retime", "exclude", "keep")),
    Rule("latency.max_retime", at_least(0)),
    Rule("latency.max_cv", optional(number(0, lo_open=True), "never flag")),
    Rule("latency.confidence", number(0, 1, lo_open=True, hi_open=True)),
    Rule("latency.bootstrap_resamples", at_least(100)),
    Rule("latency.lock_timeout_s", optional(number(0, lo_open=True), "wait")),
    Rule("latency.paired", one_of(True, False)),
    Rule("latency.paired_rounds", at_least(2, "rounds of paired timing; an interval needs two")),
    Rule("latency.paired_with", _list_of(VZ_BASELINES)),
)
LATENCY_CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule("latency.repeats", lambda cfg: cfg.load.qps is not None and _select(cfg, "latency.repeats", 1) != 1,
              lambda cfg: False, "1 with load.qps (load mode times one stream of load.num_requests: raise that "
              "instead)"),
    CrossRule("latency.paired", lambda cfg: bool(_select(cfg, "latency.paired", False)),
              lambda cfg: paired_refusal(cfg) is None, lambda cfg: paired_refusal(cfg) or ""),
    CrossRule("latency.paired_with", lambda cfg: bool(list(_select(cfg, "latency.paired_with", []) or [])),
              lambda cfg: paired_with_refusal(cfg) is None, lambda cfg: paired_with_refusal(cfg) or ""),
)

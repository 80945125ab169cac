"""The latency protocol's rows of harness/run/validate.py's tables (``latency.*``; harness/latency/, docs/latency.md).
validate.py appends them to RULES / CROSS_RULES."""

from __future__ import annotations

from harness.config.checks import CrossRule, Rule, _select, at_least, number, one_of, optional

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
)
LATENCY_CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule("latency.repeats", lambda cfg: cfg.load.qps is not None and _select(cfg, "latency.repeats", 1) != 1,
              lambda cfg: False, "1 with load.qps (load mode times one stream of load.num_requests: raise that "
              "instead)"),
)

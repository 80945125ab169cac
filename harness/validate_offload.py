"""Expert offload's rows of harness/validate.py's tables (``offload.*``, ``offload.lease.*``,
``offload.prefetch.*``; issue 15, docs/offload.md). validate.py appends them to RULES / CROSS_RULES."""

from __future__ import annotations

import importlib.util
from typing import Any

from harness.offload.lease import GRACE_MODES, PREFETCH, SCORES  # no torch at import time
from harness.offload.policy import KNOWN_POLICIES, POLICY_MODULES  # stdlib-only module
from harness.offload.prefetch import STREAMS  # stdlib-only module
from harness.validate_checks import (BOOL, Check, CrossRule, Rule, _select, at_least, existing_file, number, one_of,
                                     optional)

def _offload_on(cfg: Any) -> bool:
    return _select(cfg, "offload.policy", None) is not None


def _offload_caches(cfg: Any) -> bool:
    """A policy that keeps a cache of ``capacity`` slots (every one but ``none``)."""
    return _offload_on(cfg) and cfg.offload.policy != "none"


OFFLOAD_RULES: tuple[Rule, ...] = (
    Rule("offload.policy", optional(one_of(*KNOWN_POLICIES), "off")),
    Rule("offload.capacity", optional(at_least(1, "experts per MoE layer; at most the model's experts"))),
    Rule("offload.capacity_gb", optional(number(0, lo_open=True, note="the whole cache"))),
    Rule("offload.gpu_budget_gb", optional(number(0, lo_open=True), "not enforced")),
    Rule("offload.warm_after_tokens", at_least(0)),
    Rule("offload.trace", optional(Check(existing_file, "an existing routing trace file (NAME.pt)"))),
    Rule("offload.resident_summary", optional(Check(existing_file, "an existing summary.json of a policy=none run"))),
)


OFFLOAD_CROSS_RULES = (
    CrossRule("offload.policy", _offload_on, lambda cfg: cfg.engine.name == "hf",
              lambda cfg: f"null with engine={cfg.engine.name} (expert offload is implemented in the HF engine)"),
    CrossRule("offload.policy", _offload_on,
              lambda cfg: importlib.util.find_spec(POLICY_MODULES[cfg.offload.policy]) is not None,
              lambda cfg: f"a policy whose module is installed ({POLICY_MODULES[cfg.offload.policy]} is missing)"),
    CrossRule("offload.capacity", _offload_caches,
              lambda cfg: (cfg.offload.capacity is None) != (cfg.offload.capacity_gb is None),
              lambda cfg: f"exactly one of offload.capacity / offload.capacity_gb with offload.policy="
              f"{cfg.offload.policy} (got capacity={cfg.offload.capacity}, capacity_gb={cfg.offload.capacity_gb})"),
    CrossRule("offload.trace", lambda cfg: _offload_on(cfg) and cfg.offload.policy == "oracle",
              lambda cfg: cfg.offload.trace is not None,
              "a routing trace of the same requests with offload.policy=oracle (record one with "
              "offload.policy=none offload.record_trace=PATH)"),
)


# offload.lease (the lease policy)


def _lease_on(cfg: Any) -> bool:
    return _offload_on(cfg) and cfg.offload.policy == "lease"


LEASE_RULES: tuple[Rule, ...] = (
    Rule("offload.threshold", number(0, 1, note="stability score at or above which a lease is long")),
    Rule("offload.lease.length", at_least(1, "tokens")),
    Rule("offload.lease.long_length", at_least(1, "tokens")),
    Rule("offload.lease.grace_ms", number(0, note="ms")),
    Rule("offload.lease.grace_tokens", at_least(0, "decode tokens")),
    Rule("offload.lease.grace_mode", one_of(*GRACE_MODES)),
    Rule("offload.lease.preemptible", BOOL),
    Rule("offload.lease.score", one_of(*SCORES)),
    Rule("offload.lease.predictor", optional(Check(existing_file, "an existing stability predictor artifact "
                                                                  "(NAME.pt)"))),
    Rule("offload.lease.prefetch", one_of(*PREFETCH)),
)
LEASE_CROSS_RULES = (
    CrossRule("offload.lease.long_length", _lease_on,
              lambda cfg: cfg.offload.lease.long_length >= cfg.offload.lease.length,
              lambda cfg: f"at least offload.lease.length={cfg.offload.lease.length}"),
    CrossRule("offload.lease.predictor", lambda cfg: _lease_on(cfg) and cfg.offload.lease.score == "predictor",
              lambda cfg: cfg.offload.lease.predictor is not None,
              "a stability predictor artifact with offload.lease.score=predictor (train one with "
              "python -m harness.offload.predictor train TRACE --out PATH)"),
)

# offload.prefetch (prefetch admission)

PREFETCH_RULES: tuple[Rule, ...] = (
    Rule("offload.prefetch.max_per_layer", at_least(0, "experts per target layer per pass; 0 = no limit")),
    Rule("offload.prefetch.max_inflight", at_least(0, "prefetch copies in flight; 0 = no limit")),
    Rule("offload.prefetch.protect_tokens", at_least(0, "decode tokens; 0 = no protection")),
    Rule("offload.prefetch.stream", one_of(*STREAMS)),
)

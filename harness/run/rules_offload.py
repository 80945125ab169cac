"""Expert offload's rows of harness/run/validate.py's tables (``offload.*``, ``offload.lease.*``,
``offload.prefetch.*``; issue 15, docs/offload.md). validate.py appends them to RULES / CROSS_RULES."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from harness.techniques.offload.lease import GRACE_MODES, PREFETCH, SCORES  # no torch at import time
from harness.techniques.offload.policy import KNOWN_POLICIES, POLICY_MODULES  # stdlib-only module
from harness.techniques.offload.prefetch import STREAMS  # stdlib-only module
from harness.config.checks import (BOOL, Check, CrossRule, Rule, _select, at_least, existing_file, number, one_of,
                                     optional)

def _offload_on(cfg: Any) -> bool:
    return _select(cfg, "offload.policy", None) is not None


def _offload_caches(cfg: Any) -> bool:
    """A policy that keeps a cache of ``capacity`` slots (every one but ``none``)."""
    return _offload_on(cfg) and cfg.offload.policy != "none"


def finite_above_zero(note: str = "") -> Check:
    """A number > 0 that is not infinite: ``capacity_gb=inf`` used to reach ``int(inf)`` (``OverflowError``) after
    the model loaded; ``gpu_budget_gb=inf`` a memory fraction of inf."""
    base = number(0, lo_open=True, note=note)
    return Check(lambda v: base.ok(v) and math.isfinite(v), lambda: "a finite " + base.text()[len("a "):])


#: pseudo file systems: a "file" there is a device or a kernel interface, never a trace (``/dev/full.pt``)
PSEUDO_ROOTS = ("/dev", "/proc", "/sys")


def trace_target_problem(value: Any) -> str | None:
    """Why ``offload.record_trace=value`` cannot be written as ``NAME.pt`` + ``NAME.json`` (None: it can).

    Checked without touching the disk: the nearest existing folder must be a writable directory outside the
    pseudo file systems (the recorder creates the missing folders below it), and each of the two files, where
    it exists, a regular file. Found after the run, ``record_trace=/dev/full`` wrote ``/dev/full.pt``."""
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        return "a non-empty path without NUL bytes"
    p = Path(value).expanduser()
    base = p.with_suffix("") if p.suffix in (".pt", ".json") else p
    targets = (base.with_suffix(".pt"), base.with_suffix(".json"))
    for t in targets:
        if t.exists() and not t.is_file():
            return f"a path whose {t.name} is not a directory or a device ({t} exists and is not a regular file)"
    folder = Path(os.path.abspath(targets[0].parent))
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    real = os.path.realpath(folder)
    if any(real == r or real.startswith(r + "/") for r in PSEUDO_ROOTS):
        return f"a path outside {', '.join(PSEUDO_ROOTS)} (the trace would be written into {real})"
    if not folder.is_dir():
        return f"a path below a directory ({folder} is not one)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"a path in a writable directory ({folder} is not writable)"
    return None


def _record_trace(cfg: Any) -> Any:
    return _select(cfg, "offload.record_trace", None)


def _not_without(key: str, why: str) -> CrossRule:
    """``key`` set while no offload policy uses it: refused rather than silently ignored."""
    return CrossRule(key, lambda cfg: not _offload_on(cfg) and _select(cfg, key, None) is not None,
                     lambda cfg: False, f"null without offload.policy ({why}; without a policy it was ignored)")


OFFLOAD_RULES: tuple[Rule, ...] = (
    Rule("offload.policy", optional(one_of(*KNOWN_POLICIES), "off")),
    Rule("offload.capacity", optional(at_least(1, "experts per MoE layer; at most the model's experts"))),
    Rule("offload.capacity_gb", optional(finite_above_zero("the whole cache"))),
    Rule("offload.gpu_budget_gb", optional(finite_above_zero(), "not enforced")),
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
    _not_without("offload.capacity", "a cache size is used by an offload policy, e.g. offload.policy=lru"),
    _not_without("offload.capacity_gb", "a cache size is used by an offload policy, e.g. offload.policy=lru"),
    _not_without("offload.record_trace", "offload records the trace: offload.policy=none records the model's own "
                                         "routing with every expert resident"),
    CrossRule("offload.record_trace", lambda cfg: _offload_on(cfg) and _record_trace(cfg) is not None,
              lambda cfg: trace_target_problem(_record_trace(cfg)) is None,
              lambda cfg: f"{trace_target_problem(_record_trace(cfg))}: the trace is written as NAME.pt + NAME.json"),
    CrossRule("offload.capacity", lambda cfg: cfg.offload.policy == "none" and cfg.offload.capacity is not None,
              lambda cfg: False, "null with offload.policy=none (every expert stays resident: no cache to size)"),
    CrossRule("offload.capacity_gb", lambda cfg: cfg.offload.policy == "none" and cfg.offload.capacity_gb is not None,
              lambda cfg: False, "null with offload.policy=none (every expert stays resident: no cache to size)"),
    CrossRule("offload.trace", lambda cfg: _offload_on(cfg) and cfg.offload.policy in ("oracle", "static_hot"),
              lambda cfg: cfg.offload.trace is not None,
              lambda cfg: f"a routing trace with offload.policy={cfg.offload.policy} (oracle: of the same requests; "
              "static_hot: its hot set, issue 31) (record one with "
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
              "python -m harness.techniques.offload.predictor train TRACE --out PATH)"),
)

# offload.prefetch (prefetch admission)

PREFETCH_RULES: tuple[Rule, ...] = (
    Rule("offload.prefetch.max_per_layer", at_least(0, "experts per target layer per pass; 0 = no limit")),
    Rule("offload.prefetch.max_inflight", at_least(0, "prefetch copies in flight; 0 = no limit")),
    Rule("offload.prefetch.protect_tokens", at_least(0, "decode tokens; 0 = no protection")),
    Rule("offload.prefetch.stream", one_of(*STREAMS)),
)

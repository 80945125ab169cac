"""The offload policy interface: what the expert cache asks a policy, and the registry of policies by name.

Why a separate, small module: the cache (:mod:`harness.techniques.offload.cache`) owns the mechanism (slots, the
expert→slot table, copies, events, accounting); a policy owns only *decisions*. Keeping the boundary this
narrow lets one policy run unchanged under the real model (HF engine), under a recorded routing trace with no
model at all (:func:`harness.techniques.offload.simulate.simulate`), and in tests on scripted traces.

Life cycle, per forward pass (a prefill, or one decode step of a batch):

1. ``begin_pass(clock, tokens, embeddings)`` — once, before layer 0 runs. ``tokens`` are the pass's input ids
   ``[B, S]`` and ``embeddings`` the matching input embeddings ``[B, S, H]`` (the output of the language
   model's embedding layer; in a decode step ``S == 1``: the current token of every row; for Qwen3-VL the ids are those the outer model received).
   Both are ``None``
   under a trace without a model, and ``embeddings`` is ``None`` unless ``needs_embeddings`` is true (so no
   one pays for a copy nobody reads).
2. For every MoE layer in order:
   a. ``choose_victims(layer, n, candidates, clock)`` — zero or more times, when the layer's pool is full and
      a load needs ``n`` slots. ``candidates`` are the experts resident in that layer that may be evicted
      right now: not needed by the current computation (for a demand load an earlier, unused prefetch may be
      among them; a prefetch never evicts an expert loaded in the same pass). Return exactly ``n`` distinct
      ids out of ``candidates`` (the cache raises otherwise).
   b. ``on_access(layer, experts, clock)`` — the sorted unique experts the layer computes now (all of them
      are resident when this is called; hits and misses are the cache's business). When a layer needs more
      experts than it has slots (a prefill, a large batch) it is computed in chunks and this is called once
      per chunk. The cache delivers it after the chunk's kernel was issued (``release``), before any later
      hook: bookkeeping runs while the GPU computes, never between the routing read and the kernel launch.
   c. ``prefetch(layer, clock, hidden)`` — after the layer's experts were scheduled: return ``(layer', expert)``
      pairs to load speculatively (``layer' > layer`` normally; loads run on the copy stream, evictions they
      need go through ``choose_victims`` of ``layer'``). ``hidden`` is the layer's MoE input ``[T, H]`` (None
      under a trace). ``ctx.gate(layer', hidden)`` applies layer ``layer'``'s router to it (``needs_gate``).
3. ``end_pass(clock)`` — after the last layer.

Clock: :class:`Clock` gives both the token clock (``tokens``: decode steps so far in the run, ``step``: decode
step within the current batch, ``pass_index``: forward passes so far) and the wall clock (``ms``: host
milliseconds since the cache was created, sampled once at the start of each pass; under a trace, ``ms`` is
simulated as ``tokens × ms_per_token``).
Leases and grace periods can therefore be expressed in tokens and in ms.

Mode (``mode`` class attribute): ``"cache"`` — the cache asks the policy as above; ``"resident"`` — every
expert is resident, the policy is never asked (``none``); ``"staging"`` — no cache: every needed expert is
copied on every access and forgotten after the layer (``staging``; ``choose_victims`` is never called).

Registry: :func:`register_policy` (a class decorator) and :func:`make_policy`. Built-in names are known
before their module is imported (:data:`POLICY_MODULES`), so validation can check a name without importing
torch-heavy code; ``lease`` lives in ``harness.techniques.offload.lease`` (another module, same registry).

Interface version: :data:`INTERFACE_VERSION`. Changes after version 1 are additive only (new optional hooks with
default implementations, new ``PolicyContext`` fields with defaults); they are listed in
``notes/offload-interface.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.registry import Registry, UnknownName

__all__ = ["INTERFACE_VERSION", "Clock", "Geometry", "PolicyContext", "OffloadPolicy", "POLICY_MODULES",
           "KNOWN_POLICIES", "register_policy", "policy_class", "make_policy"]

INTERFACE_VERSION = 1


@dataclass(frozen=True)
class Clock:
    """Where the run is, in tokens and in ms (see the module doc)."""

    pass_index: int  # forward passes so far in the run (prefills and decode steps, warm-up included)
    phase: str  # "prefill" | "decode"
    step: int  # decode step within the current batch: 0 for its prefill, 1.. for its decode steps
    tokens: int  # decode steps so far in the run (each step of a batch of B rows counts once)
    ms: float  # host wall-clock ms since the cache was created (simulated under a trace)
    batch_index: int = 0  # batches (generate calls) so far in the run, warm-up included


@dataclass(frozen=True)
class Geometry:
    """Shape of the expert store and of the cache."""

    num_layers: int  # MoE layers, indexed 0..num_layers-1 in forward order (not decoder-layer numbers)
    num_experts: int  # experts per MoE layer
    top_k: int  # router top-k
    capacity: int  # cache slots per MoE layer (== num_experts for mode "resident")
    expert_bytes: int  # bytes of one expert (gate_up + down) in the store's dtype
    layer_ids: tuple[int, ...] = ()  # the decoder-layer number of each MoE layer (for messages and traces)


@dataclass
class PolicyContext:
    """What a policy is built with."""

    geometry: Geometry
    params: dict[str, Any] = field(default_factory=dict)  # offload.params from the config (policy-specific)
    trace: Any = None  # harness.techniques.offload.trace_format.RoutingTrace for policies with needs_trace, else None
    # gate(layer, hidden [T, H]) -> top-k expert ids [T, k] (a torch LongTensor) of that MoE layer's router;
    # None under a trace without a model
    gate: Callable[[int, Any], Any] | None = None
    device: str = "cpu"  # where the cache lives ("cuda" or "cpu")


class OffloadPolicy:
    """Base class of every policy: every hook has a harmless default, so a policy overrides what it needs."""

    name: ClassVar[str] = ""
    mode: ClassVar[str] = "cache"  # "cache" | "resident" | "staging"
    needs_trace: ClassVar[bool] = False  # refused without offload.trace
    needs_embeddings: ClassVar[bool] = False  # begin_pass receives the input embeddings
    needs_gate: ClassVar[bool] = False  # uses ctx.gate (refused under a trace that cannot provide it)

    def __init__(self, ctx: PolicyContext):
        self.ctx = ctx
        self.geometry = ctx.geometry

    def begin_pass(self, clock: Clock, tokens: Any = None, embeddings: Any = None) -> None:
        """Once per forward pass, before layer 0."""

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        """``n`` distinct ids of ``candidates`` to evict from ``layer``. Default: the first ``n`` (arbitrary)."""
        return list(candidates[:n])

    def on_access(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """The sorted unique experts ``layer`` computes now (all resident by the time this is called)."""

    def prefetch(self, layer: int, clock: Clock, hidden: Any = None) -> Iterable[tuple[int, int]]:
        """``(layer', expert)`` pairs to load speculatively after ``layer`` was scheduled. Default: none."""
        return ()

    def on_prefetch_skipped(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """Prefetch guesses of ``layer`` (not resident) the cache did not load (``offload.prefetch`` admission:
        over the per-layer cap, too many copies in flight, or no unprotected slot). Added in interface v1
        (additive)."""

    def on_prefetch_issued(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """Prefetch guesses of ``layer`` the cache did load (their copies are in flight), after their victims
        were chosen. Added in interface v1 (additive): a policy that keeps state per resident expert (a lease)
        creates it here, for the loads that happened, instead of for every guess in :meth:`prefetch`."""

    def on_evict(self, layer: int, expert: int, clock: Clock) -> None:
        """``expert`` left ``layer``'s pool (a victim the policy chose)."""

    def end_pass(self, clock: Clock) -> None:
        """Once per forward pass, after the last layer."""

    def on_reset(self, clock: Clock) -> None:
        """Measurement starts (after the engine's warm-up): the cache's statistics were zeroed. Cache contents
        stay; ``clock.tokens`` restarts at 0. A trace-driven policy realigns its trace pointer here."""

    def stats(self) -> dict[str, Any]:
        """Policy-specific numbers for ``summary.json`` ``offload.policy_stats``."""
        return {}


#: offload.policy → the policy class (``"module:Class"``, imported on first use; the one registry of
#: :mod:`harness.registry`). A policy of the user's own registers with ``@register_policy("mine")`` in a
#: module imported before the run, or ``POLICIES.register("mine", "mypkg.policy:MyPolicy")``.
POLICIES: Registry = Registry("offload policy", "offload.policy", {
    "none": "harness.techniques.offload.policies:NonePolicy",
    "staging": "harness.techniques.offload.policies:StagingPolicy",
    "lru": "harness.techniques.offload.policies:LRUPolicy",
    "lru+gate": "harness.techniques.offload.policies:LRUGatePolicy",
    "oracle": "harness.techniques.offload.policies:OraclePolicy",
    "lfu": "harness.techniques.offload.policies:LFUPolicy",  # trivial baselines (issue 31)
    "static_hot": "harness.techniques.offload.policies:StaticHotPolicy",
    "lease": "harness.techniques.offload.lease:LeasePolicy",
})
#: the built-in policies and the module each lives in (the config check looks the module up without importing)
POLICY_MODULES: dict[str, str] = {name: target.partition(":")[0] for name, target in POLICIES.items()}
KNOWN_POLICIES: tuple[str, ...] = tuple(POLICY_MODULES)


def register_policy(name: str) -> Callable[[type[OffloadPolicy]], type[OffloadPolicy]]:
    """Class decorator: ``@register_policy("lru")``. Sets ``cls.name``; a second class under a name raises."""

    def deco(cls: type[OffloadPolicy]) -> type[OffloadPolicy]:
        current = POLICIES.get(name)
        if isinstance(current, type) and current is not cls:
            raise ValueError(f"offload policy {name!r} is already registered ({current.__qualname__})")
        if isinstance(current, str) and current != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"offload policy {name!r} is registered as {current}, not {cls.__module__}:{cls.__qualname__}")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def policy_class(name: str) -> type[OffloadPolicy]:
    """The class registered under ``name`` (importing its module on first use)."""
    try:
        return POLICIES.load(name)
    except UnknownName as e:
        raise ValueError(str(e)) from None


def make_policy(name: str, ctx: PolicyContext) -> OffloadPolicy:
    """Build policy ``name``; refuses a trace-needing policy without a trace."""
    cls = policy_class(name)
    if cls.needs_trace and ctx.trace is None:
        raise ValueError(f"offload.policy={name!r} needs a routing trace (offload.trace)")
    return cls(ctx)

"""The ``lease`` offload policy (seed 003's design) on the expert cache's policy interface.

Every access of a (layer, expert) grants or renews a **lease**: ``(expert, length in tokens, pre-emptible or
not)``. The lease length depends on a **stability score** of the (token, layer): score ≥ ``offload.threshold``
→ a long lease (``offload.lease.long_length`` tokens) that is *not* pre-emptible ("kept resident"); otherwise a
short pre-emptible one (``offload.lease.length``). Scores come from ``offload.lease.score``:

- ``predictor``: the stability MLP (:mod:`harness.techniques.offload.predictor`, artifact ``offload.lease.predictor``) on
  the current and previous 3 token embeddings (``begin_pass`` receives them); at B > 1 a layer's score is the
  maximum over the rows (an expert is kept when any row predicts its layer stable);
- ``recency``: the causal baseline, per expert: the share of the previous 5 decode steps that selected it at
  that layer (what a recency rule knows for free; what the predictor must beat);
- ``none``: every lease is a short one (leases + grace only).

States. The cache owns residency: **LOADED** (resident, copy complete), **LOADING** (a copy in flight),
**UNLOADED**. The policy adds the lease view of a resident expert (:meth:`LeasePolicy.lease_state`):
``leased`` (a live lease), ``grace`` (the lease expired with no holder and the grace period runs) and ``free``
(grace over: the seed unloads it asynchronously; here the slot is simply the first to be reused — nothing is
copied back, and a fixed slab frees no device memory by unloading).

Grace period: it follows the lease's last token and lasts ``offload.lease.grace_tokens`` tokens *and*
``grace_ms`` ms, the ms counted from the first decode step after the lease's last token (both must have
elapsed; set one to 0 to use the other alone); ``grace_mode = dynamic`` uses the seed's ``150 ms + 50 ms × utilisation`` with utilisation =
the layer's held experts (leased + grace) / its capacity, at the time the grace starts.

Eviction (the pool is full and a load needs a slot), in this order — this is where "pre-emption under memory
pressure" happens: ``free`` experts (least recently used first), then ``grace`` (earliest grace end first),
then pre-emptible leases (lowest score, then earliest lease end: a **pre-emption**), and only when nothing else
is left, non-pre-emptible leases (counted as ``forced``: the budget is smaller than what the leases ask for).
Never-leased (``untracked``) experts go before all of them; every remaining tie goes to the lowest id
(:meth:`LeasePolicy.victim_key` is the whole order as one key).

Prefetch (``offload.lease.prefetch = gate``): as ``lru+gate``, the next layer's router on the current hidden
state; a prefetched expert gets a short pre-emptible lease when the cache actually loads it
(``on_prefetch_issued``): a guess the cache refuses never holds a lease.

Cost (issue 27): this runs for every expert of every layer, so the recency score is a count kept as the
window moves (O(1) per expert), a renewed lease reuses its record, and ``choose_victims`` computes one key per
candidate; the cache delivers ``on_access`` after the layer's kernel was issued.

Clock: ``clock.tokens`` (decode steps of the run) for lease and grace tokens, ``clock.ms`` for grace ms.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from harness.techniques.offload.policies import rank_gate_guess
from harness.techniques.offload.policy import register_policy, Clock, OffloadPolicy, PolicyContext

__all__ = ["LeaseSettings", "LeasePolicy", "SCORES", "GRACE_MODES", "PREFETCH", "dynamic_grace_ms", "lease_params"]

SCORES = ("predictor", "recency", "none")
GRACE_MODES = ("fixed", "dynamic")
PREFETCH = ("gate", "none")
RECENCY_WINDOW = 5


@dataclass
class LeaseSettings:
    """The ``offload.lease.*`` keys (defaults = harness/config/schema.py ``OffloadLeaseConfig``) and the threshold."""

    length: int = 2
    long_length: int = 16
    grace_ms: float = 200.0
    grace_tokens: int = 0
    grace_mode: str = "fixed"
    preemptible: bool = True
    score: str = "recency"
    predictor: str | None = None
    prefetch: str = "gate"
    threshold: float = 0.5

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> LeaseSettings:
        """``ctx.params``: ``{"threshold": x, "lease": {...}}`` (the config), flat keys accepted too."""
        names = {f.name for f in fields(cls)}
        raw = {k: v for k, v in params.items() if k in names}
        raw.update({k: v for k, v in dict(params.get("lease") or {}).items() if k in names})
        unknown = set(dict(params.get("lease") or {})) - names
        if unknown:
            raise ValueError(f"unknown offload.lease keys: {sorted(unknown)}")
        s = cls(**raw)
        s.check()
        return s

    def check(self) -> None:
        if self.length < 1 or self.long_length < self.length:
            raise ValueError(f"offload.lease: need 1 <= length <= long_length, got {self.length}, {self.long_length}")
        if self.grace_ms < 0 or self.grace_tokens < 0:
            raise ValueError("offload.lease.grace_ms and grace_tokens must be >= 0")
        for name, value, allowed in (("grace_mode", self.grace_mode, GRACE_MODES), ("score", self.score, SCORES),
                                     ("prefetch", self.prefetch, PREFETCH)):
            if value not in allowed:
                raise ValueError(f"offload.lease.{name}={value!r}: expected one of {allowed}")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"offload.threshold={self.threshold!r}: expected a number in [0, 1]")
        if self.score == "predictor" and not self.predictor:
            raise ValueError("offload.lease.score=predictor needs offload.lease.predictor (an artifact path)")


def lease_params(cfg: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``offload`` config → ``ctx.params`` for the lease policy: ``threshold`` = ``offload.threshold`` and
    ``lease`` = ``offload.lease.*`` (the dedicated keys win over the same names in ``offload.params``)."""
    def get(obj: Any, key: str, default: Any = None) -> Any:
        return obj.get(key, default) if hasattr(obj, "get") else getattr(obj, key, default)

    out = dict(params)
    thr = get(cfg, "threshold")
    if thr is not None:
        out["threshold"] = float(thr)
    lease = get(cfg, "lease")
    if lease is not None:
        if hasattr(lease, "items"):
            items = dict(lease.items())
        else:
            items = {f.name: getattr(lease, f.name) for f in fields(lease)}
        out["lease"] = {**dict(out.get("lease") or {}), **items}
    return out


def dynamic_grace_ms(utilisation: float) -> float:
    """The seed's dynamic grace: 150 ms + 50 ms × memory utilisation (utilisation in [0, 1])."""
    return 150.0 + 50.0 * min(max(utilisation, 0.0), 1.0)


@dataclass
class _Lease:
    until: int  # last token (clock.tokens) the lease covers
    preemptible: bool
    score: float
    last_use: int  # access tick (recency among free experts)
    grace_tokens_end: int | None = None  # set when the grace starts
    grace_ms_end: float | None = None


@register_policy("lease")
class LeasePolicy(OffloadPolicy):
    """See the module doc."""

    needs_embeddings = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.s = LeaseSettings.from_params(ctx.params)
        nl = ctx.geometry.num_layers
        self.leases: list[dict[int, _Lease]] = [dict() for _ in range(nl)]
        self._expiring: dict[int, list[tuple[int, int]]] = {}  # token -> (layer, expert) whose lease ends there
        self._tick = 0
        self._last_tokens, self._last_ms = 0, 0.0
        self._layer_scores: list[float] | None = None  # this step's predictor score per layer
        self._recent: list[deque] = [deque() for _ in range(nl)]  # last RECENCY_WINDOW steps' expert sets
        self._recent_count: list[dict[int, int]] = [dict() for _ in range(nl)]  # expert -> steps of _recent naming it
        self._recent_pass = [-1] * nl
        self._scorer = None
        if self.s.score == "predictor":
            from harness.techniques.offload.predictor import OnlineScorer, load_predictor

            model = load_predictor(self.s.predictor)
            if model.spec.num_layers != nl:
                raise ValueError(f"predictor {self.s.predictor} has {model.spec.num_layers} outputs, the model "
                                 f"{nl} MoE layers")
            self._scorer = OnlineScorer(model.to(ctx.device))
        self._zero_stats()

    def _zero_stats(self) -> None:
        self.n = {"accesses": 0, "lease_hits": 0, "grace_hits": 0, "granted": 0, "long": 0, "renewed": 0,
                  "grace_started": 0, "evict_free": 0, "evict_grace": 0, "preempted": 0, "forced": 0,
                  "evict_untracked": 0, "scored": 0}
        self.score_sum = 0.0
        self.peak_held = 0
        self.peak_long = 0

    # -- scores -------------------------------------------------------------------------------------
    def begin_pass(self, clock: Clock, tokens: Any = None, embeddings: Any = None) -> None:
        self._layer_scores = None
        self._last_tokens, self._last_ms = clock.tokens, clock.ms
        if clock.phase != "decode":
            if self._scorer is not None:
                self._scorer.reset()
            for r in self._recent:
                r.clear()
            for c in self._recent_count:
                c.clear()
            return
        self._expire(clock)
        if self._scorer is not None and embeddings is not None:
            emb = embeddings[:, -1] if embeddings.dim() == 3 else embeddings
            scores = self._scorer.score(emb)  # [B, L]
            self._layer_scores = scores.max(0).values.tolist()  # one host read per decode step

    def score(self, layer: int, expert: int) -> float:
        """The stability score of ``expert`` at ``layer`` for the current step (0 when none is available)."""
        if self.s.score == "predictor":
            return self._layer_scores[layer] if self._layer_scores is not None else 0.0
        if self.s.score == "recency":  # counts kept as the window moves: O(1) per expert
            return self._recent_count[layer].get(expert, 0) / RECENCY_WINDOW
        return 0.0

    # -- lease state --------------------------------------------------------------------------------
    def lease_state(self, layer: int, expert: int, clock: Clock) -> str:
        """``leased`` | ``grace`` | ``free`` (resident, no claim) | ``untracked`` (never leased)."""
        rec = self.leases[layer].get(expert)
        if rec is None:
            return "untracked"
        if clock.tokens <= rec.until:
            return "leased"
        if self._in_grace(rec, clock):
            return "grace"
        return "free"

    def _in_grace(self, rec: _Lease, clock: Clock) -> bool:
        if rec.grace_tokens_end is None:  # expired this very step, before _expire saw it
            return True
        return clock.tokens <= rec.grace_tokens_end or clock.ms < rec.grace_ms_end

    def held(self, layer: int, clock: Clock) -> int:
        return sum(1 for e in self.leases[layer] if self.lease_state(layer, e, clock) in ("leased", "grace"))

    def _expire(self, clock: Clock) -> None:
        """Start the grace period of every lease whose last token has passed (and that was not renewed)."""
        for tok in [t for t in self._expiring if t < clock.tokens]:
            for layer, e in self._expiring.pop(tok):
                rec = self.leases[layer].get(e)
                if rec is None or rec.until != tok or rec.grace_tokens_end is not None:
                    continue
                cap = max(1, self.geometry.capacity)
                grace_ms = (dynamic_grace_ms(self.held(layer, clock) / cap) if self.s.grace_mode == "dynamic"
                            else self.s.grace_ms)
                rec.grace_tokens_end = tok + self.s.grace_tokens if self.s.grace_tokens else -1
                rec.grace_ms_end = clock.ms + grace_ms
                self.n["grace_started"] += 1

    def _grant(self, layer: int, e: int, clock: Clock, score: float, prefetched: bool = False) -> None:
        self._tick += 1
        long = not prefetched and clock.phase == "decode" and score >= self.s.threshold and self.s.score != "none"
        length = self.s.long_length if long else self.s.length
        until = clock.tokens + length
        rec = self.leases[layer].get(e)
        if rec is not None and clock.tokens <= rec.until:
            self.n["renewed"] += 1
            if rec.until >= until:  # a longer live lease is kept as it is
                rec.last_use = self._tick
                return
        if rec is None:
            self.leases[layer][e] = _Lease(until=until, preemptible=self.s.preemptible and not long, score=score,
                                           last_use=self._tick)
        else:  # a new lease on the same record (no allocation on the per-access path)
            rec.until, rec.preemptible, rec.score, rec.last_use = until, self.s.preemptible and not long, score, self._tick
            rec.grace_tokens_end = rec.grace_ms_end = None
        self._expiring.setdefault(until, []).append((layer, e))
        self.n["granted"] += 1
        self.n["long"] += long

    # -- policy hooks -------------------------------------------------------------------------------
    def on_access(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """Count lease/grace hits (decode), then grant or renew a lease per expert (its length from the score).
        The state test is :meth:`lease_state` inlined: this runs for every expert of every layer."""
        decode = clock.phase == "decode"
        if not decode:
            for e in experts:
                self._grant(layer, e, clock, 0.0)
            return
        leases, tok, ms = self.leases[layer], clock.tokens, clock.ms
        scored = self.s.score != "none"
        lease_hits = grace_hits = 0
        for e in experts:
            rec = leases.get(e)
            if rec is not None:
                if tok <= rec.until:
                    lease_hits += 1
                elif rec.grace_tokens_end is None or tok <= rec.grace_tokens_end or ms < rec.grace_ms_end:
                    grace_hits += 1
            sc = self.score(layer, e)
            if scored:
                self.score_sum += sc
            self._grant(layer, e, clock, sc)
        n = self.n
        n["accesses"] += len(experts)
        n["lease_hits"] += lease_hits
        n["grace_hits"] += grace_hits
        if scored:
            n["scored"] += len(experts)
        if decode:  # one set per (step, layer): a chunked layer calls on_access once per chunk
            recent, counts = self._recent[layer], self._recent_count[layer]
            if self._recent_pass[layer] == clock.pass_index and recent:
                new = frozenset(experts) - recent[-1]
                recent[-1] = recent[-1] | new
            else:
                if len(recent) == RECENCY_WINDOW:
                    for e in recent.popleft():
                        c = counts[e] - 1
                        if c:
                            counts[e] = c
                        else:
                            del counts[e]
                new = frozenset(experts)
                recent.append(new)
                self._recent_pass[layer] = clock.pass_index
            for e in new:
                counts[e] = counts.get(e, 0) + 1
            if layer == self.geometry.num_layers - 1:
                self._track_peaks(clock)

    def _track_peaks(self, clock: Clock) -> None:
        """Peak experts held (leased or in grace) and peak long leases, over all layers (once per decode step)."""
        tok, ms, held, long = clock.tokens, clock.ms, 0, 0
        for leases in self.leases:
            for r in leases.values():
                if tok <= r.until:
                    held += 1
                    if not r.preemptible:
                        long += 1
                elif r.grace_tokens_end is None or tok <= r.grace_tokens_end or ms < r.grace_ms_end:
                    held += 1
        self.peak_held = max(self.peak_held, held)
        self.peak_long = max(self.peak_long, long)

    def victim_key(self, layer: int, e: int, clock: Clock) -> tuple:
        """The eviction order of the module doc as one sort key (smallest goes first):
        ``(0, 0, -1, e)`` untracked; ``(1, 0, last_use, e)`` free (least recently used first);
        ``(2, grace_tokens_end, grace_ms_end, e)`` grace (earliest end first); ``(3, 0, score, until, e)``
        pre-emptible lease (lowest score, then earliest end); ``(3, 1, score, until, e)`` non-pre-emptible.
        The expert id breaks every remaining tie (lowest first)."""
        rec = self.leases[layer].get(e)
        if rec is None:
            return (0, 0, -1, e)
        tok = clock.tokens
        if tok <= rec.until:
            return (3, 0 if rec.preemptible else 1, rec.score, rec.until, e)
        gte = rec.grace_tokens_end
        if gte is None or tok <= gte or clock.ms < rec.grace_ms_end:  # grace: the one that ends first goes first
            return (2, gte if gte is not None else -1, rec.grace_ms_end if rec.grace_ms_end is not None else -math.inf, e)
        return (1, 0, rec.last_use, e)

    def choose_victims(self, layer: int, n: int, candidates: Sequence[int], clock: Clock) -> list[int]:
        """The ``n`` smallest :meth:`victim_key` of ``candidates`` (one key per candidate, no second pass)."""
        keys = (self.victim_key(layer, e, clock) for e in candidates)
        keyed = ([min(keys)] if len(candidates) else []) if n == 1 else sorted(keys)[:n]
        names = ("evict_untracked", "evict_free", "evict_grace")
        for k in keyed:
            if k[0] == 3:
                self.n["preempted" if k[1] == 0 else "forced"] += 1
            else:
                self.n[names[k[0]]] += 1
        return [k[-1] for k in keyed]

    def on_evict(self, layer: int, expert: int, clock: Clock) -> None:
        self.leases[layer].pop(expert, None)

    def prefetch(self, layer: int, clock: Clock, hidden: Any = None) -> Iterable[tuple[int, int]]:
        nxt = layer + 1
        if (self.s.prefetch != "gate" or nxt >= self.geometry.num_layers or hidden is None or self.ctx.gate is None
                or clock.phase != "decode"):
            return ()
        ids = self.ctx.gate(nxt, hidden)

        experts = rank_gate_guess(ids, self.geometry.num_experts)  # best first: the cache admits the first few
        return [(nxt, e) for e in experts]

    def on_prefetch_issued(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """A short pre-emptible lease for each prefetch the cache loaded (only those: a guess the cache refused
        never gets one, and no lease is created and dropped again per refused guess)."""
        leases = self.leases[layer]
        for e in experts:
            if e not in leases:
                self._grant(layer, e, clock, 0.0, prefetched=True)

    def on_prefetch_skipped(self, layer: int, experts: Sequence[int], clock: Clock) -> None:
        """The cache did not load these prefetch guesses (offload.prefetch admission): no lease for an expert
        that is not there (it is not resident, so its only lease is the prefetch grant)."""
        for e in experts:
            self.leases[layer].pop(e, None)

    def on_reset(self, clock: Clock) -> None:
        """Measurement starts and the token clock restarts at 0 (under a trace the ms clock too): re-base every
        lease and grace deadline so what remains of it is kept; counters are zeroed."""
        dt, dms = self._last_tokens - clock.tokens, self._last_ms - clock.ms
        for leases in self.leases:
            for rec in leases.values():
                rec.until -= dt
                if rec.grace_tokens_end is not None:
                    rec.grace_tokens_end = rec.grace_tokens_end - dt if rec.grace_tokens_end >= 0 else -1
                    rec.grace_ms_end -= dms
        self._expiring = {tok - dt: v for tok, v in self._expiring.items()}
        self._last_tokens, self._last_ms = clock.tokens, clock.ms
        self._zero_stats()

    def stats(self) -> dict[str, Any]:
        a = self.n["accesses"]
        eb = self.geometry.expert_bytes
        return {
            "threshold": self.s.threshold, "score": self.s.score, "length": self.s.length,
            "long_length": self.s.long_length, "grace_ms": self.s.grace_ms, "grace_tokens": self.s.grace_tokens,
            "grace_mode": self.s.grace_mode, "prefetch": self.s.prefetch,
            "lease_hit_rate": self.n["lease_hits"] / a if a else None,
            "grace_hit_rate": self.n["grace_hits"] / a if a else None,
            "mean_score": self.score_sum / self.n["scored"] if self.n["scored"] else None,
            "peak_held_experts": self.peak_held, "peak_held_bytes": self.peak_held * eb,
            "peak_long_leases": self.peak_long, **self.n,
        }

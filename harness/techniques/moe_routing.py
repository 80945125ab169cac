"""Trivial baselines of SERE (``moe.routing``, issue 31): what a dumb routing change gets at the same expert union.

SERE's quality claim is that re-routing a token's secondary slots onto *similar* experts the batch loads anyway
keeps quality that plain top-K loses. Two baselines tell whether the similarity matters:

* ``random_p`` — SERE with the similarity replaced by a die. ``P`` = the union over the step's (live) rows of
  each row's first ``k_primary`` experts (SERE's primary set, ``sere.k``). Each secondary slot
  ``j >= k_primary`` whose expert is outside ``P`` moves to a **uniformly random member of P**; slots inside
  ``P`` stay. Weights unchanged (SERE's rule: the slot's gate weight now multiplies the new expert). The
  expert union after the change is exactly ``P`` — SERE's union at ρ = 0, so the two compare at equal union.
  Draws come from a ``torch.Generator`` seeded with ``moe.seed`` on the routing's device; the member is
  ``sorted(P)[floor(u·|P|)]`` with ``u`` uniform, computed without reading ``|P|`` back to the host.
* ``top_p`` — dynamic routing by probability mass. Per token, the router's sorted top-k slots are kept while the
  cumulative router probability (float32 softmax over all experts) *before* the slot is below ``p``: at least
  one expert, at most ``k``, the fewest slots whose probabilities reach ``p``. Kept weights are renormalised to
  sum to 1; dropped slots get weight 0 and the row's first expert (the padded form of
  :func:`harness.techniques.moe_topk.pad_routing`: the same output and the same union as dropping them).
  ``p`` is the budget knob: pick it so that the union matches the technique's (the report lists both).

Both rewrite decode steps only (SERE's rule), on rows of the step (finished rows of a static batch do not
contribute to ``P``). Only torch is imported (lazily).
"""

from __future__ import annotations

from typing import Any

from harness.config.access import setting

__all__ = ["ROUTINGS", "RoutingSettings", "random_p", "routing_settings", "top_p"]

ROUTINGS = ("random_p", "top_p")


class RoutingSettings(tuple):
    """``(routing, k_primary, p, seed)`` of the ``moe`` group."""

    __slots__ = ()

    def __new__(cls, routing: str, k_primary: int, p: float, seed: int):
        return super().__new__(cls, (routing, k_primary, p, seed))

    routing = property(lambda self: self[0])
    k_primary = property(lambda self: self[1])
    p = property(lambda self: self[2])
    seed = property(lambda self: self[3])


def routing_settings(moe_cfg: Any) -> RoutingSettings | None:
    """The ``moe.routing`` baseline of a ``moe`` group, or None when off. Raises ``ValueError`` for a bad value."""
    routing = setting(moe_cfg, "routing")
    if routing is None:
        return None
    if routing not in ROUTINGS:
        raise ValueError(f"moe.routing={routing!r}: expected null or one of {', '.join(ROUTINGS)}")
    k_primary = setting(moe_cfg, "k_primary", 2)
    if isinstance(k_primary, bool) or not isinstance(k_primary, int) or k_primary < 1:
        raise ValueError(f"moe.k_primary={k_primary!r}: expected an int >= 1")
    p = float(setting(moe_cfg, "p", 0.5))
    if not 0.0 < p <= 1.0:
        raise ValueError(f"moe.p={p}: expected a number in (0, 1]")
    seed = int(setting(moe_cfg, "seed", 0) or 0)
    return RoutingSettings(str(routing), int(k_primary), p, seed)


def random_p(ids, k_primary: int, num_experts: int, generator=None, live=None):
    """``ids`` [T, k] (the router's sorted top-k) with every secondary slot outside P moved to a random member
    of P (module doc). ``live`` [T] bool: the rows that build P and are changed (None = all). Returns new ids
    (same dtype); the weights are the caller's, unchanged."""
    import torch

    t, k = ids.shape
    kp = min(int(k_primary), k)
    if kp >= k or t == 0:
        return ids
    rows = torch.ones(t, dtype=torch.bool, device=ids.device) if live is None else live.to(torch.bool)
    prim = torch.where(rows[:, None], ids[:, :kp].long(), num_experts)  # dead rows name the spare bin
    in_p = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device).index_fill_(0, prim.reshape(-1), True)
    in_p = in_p[:num_experts]
    members = torch.argsort((~in_p).to(torch.int8), stable=True)  # P's members first, increasing
    count = in_p.sum()
    u = torch.rand((t, k - kp), generator=generator, device=ids.device, dtype=torch.float64)
    pick = members[(u * count).floor().long().clamp(max=num_experts - 1)]
    sec = ids[:, kp:].long()
    move = rows[:, None] & ~in_p[sec.clamp(0, num_experts - 1)] & (count > 0)
    new_sec = torch.where(move, pick, sec).to(ids.dtype)
    return torch.cat([ids[:, :kp], new_sec], dim=1)


def top_p(logits, ids, p: float):
    """``(weights [T, k], ids [T, k])``: per row, the fewest of the router's sorted top-k slots whose float32
    softmax probabilities reach ``p`` (at least one), weights renormalised over them, cast to the logits'
    dtype; dropped slots padded with (the row's first expert, weight 0). Also returns nothing else: the
    number of kept slots per row is ``(weights > 0).sum(1)``."""
    import torch

    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids.long())
    before = probs.cumsum(dim=1) - probs  # mass of the slots before each slot
    keep = before < float(p)
    keep[:, 0] = True
    w = torch.where(keep, probs, torch.zeros_like(probs))
    w = w / w.sum(dim=1, keepdim=True)
    new_ids = torch.where(keep, ids, ids[:, :1].expand_as(ids))
    return w.to(logits.dtype), new_ids

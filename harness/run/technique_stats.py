"""SERE statistics kept per batch in the generation cache, so a resumed run's ``summary.json`` ``sere`` equals an
uninterrupted run's (issue 26; docs/crash-safety.md "SERE statistics across a resume").

The engine's SERE statistics (``engine.technique_stats()["sere"]``, harness/engines/hf/routing.py ``stats``) are
means over (step, layer) pairs of integer sums: union sizes, moved / critical / protected slots, per layer and
per number of live rows. Before, a resumed run reported the last attempt's only (``partial: true``). Now:

1. around each generated batch the run reads the statistics twice; the difference, as integer sums
   (:func:`counts`), is the batch's contribution. It is stored with each of the batch's cache entries under
   ``extra["sere_batch"]`` = ``{"id": <the batch's keys' hash>, "size": n, "counts": ...}``;
2. a resumed run collects the ``sere_batch`` of every replayed entry, adds each batch once (by id) to what the
   engine counted in this attempt, and recomputes the means (:func:`merge_replayed`) with the engine's formulas.

The batches of the remaining requests are the same as in an uninterrupted run when the earlier attempt stopped at
a batch boundary (the cache is written per batch; the remaining requests are batched from the first unfinished
one), so the integer sums — and therefore every mean — are equal. Where that cannot hold (an entry without
``sere_batch``, written by an older harness; a batch only partly replayed; statistics the engine does not give
per layer, e.g. vLLM's per-worker blocks), the block stays ``partial: true`` as before, with the counts.
Only the standard library is imported.
"""

from __future__ import annotations

import hashlib
from typing import Any


def _times(mean: Any, n: int) -> int:
    return int(round(mean * n)) if isinstance(mean, (int, float)) and n else 0


def counts(block: Any) -> dict[str, Any] | None:
    """The integer sums behind a SERE statistics block (None when it has no per-layer counts)."""
    if not isinstance(block, dict) or not isinstance(block.get("per_layer"), list) or not block["per_layer"]:
        return None
    layers = []
    for p in block["per_layer"]:
        s, slots = int(p.get("steps") or 0), int(p.get("secondary_slots") or 0)
        layers.append([int(p["layer"]), s, int(p.get("tokens") or 0), _times(p.get("expert_union_before"), s),
                       _times(p.get("expert_union_after"), s), _times(p.get("primary_union"), s),
                       int(p.get("moved_slots") or 0), slots, _times(p.get("critical_fraction"), slots),
                       int(p.get("protected_hits") or 0)])
    n_layers = max(int(block.get("layers") or len(layers)), 1)
    by_batch = {}
    for t, b in (block.get("by_batch_size") or {}).items():
        n = int(b.get("steps") or 0) * n_layers
        by_batch[str(t)] = [n, _times(b.get("expert_union_before"), n), _times(b.get("expert_union_after"), n)]
    return {"layers": layers, "outside": _times(block.get("outside_primary_fraction"), sum(l[7] for l in layers)),
            "by_batch": by_batch}


def _combine(a: dict[str, Any], b: dict[str, Any], sign: int) -> dict[str, Any]:
    la = {l[0]: l for l in a["layers"]}
    out_layers = []
    for l in b["layers"]:
        base = la.get(l[0], [l[0]] + [0] * (len(l) - 1))
        out_layers.append([l[0]] + [x + sign * y for x, y in zip(base[1:], l[1:])])
    seen = {l[0] for l in b["layers"]}
    out_layers += [l for l in a["layers"] if l[0] not in seen]
    by_batch = {t: list(v) for t, v in a["by_batch"].items()}
    for t, v in b["by_batch"].items():
        cur = by_batch.get(t, [0, 0, 0])
        by_batch[t] = [x + sign * y for x, y in zip(cur, v)]
    return {"layers": sorted(out_layers), "outside": a["outside"] + sign * b["outside"],
            "by_batch": {t: v for t, v in by_batch.items() if v[0]}}


def delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """``after − before`` (a batch's contribution); None when either is unknown."""
    if after is None or before is None:
        return None
    return _combine(after, before, -1)


def block_from(c: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A statistics block like ``template`` (its settings and the keys it alone knows) with every mean
    recomputed from the sums ``c``, by the formulas of the engine's ``stats()``."""
    per_layer, prev = [], {p["layer"]: p for p in template.get("per_layer") or []}
    for layer, s, tok, bef, aft, prim, moved, slots, crit, hits in c["layers"]:
        per_layer.append({**prev.get(layer, {}), "layer": layer, "steps": s, "tokens": tok,
                          "expert_union_before": bef / s if s else None, "expert_union_after": aft / s if s else None,
                          "primary_union": prim / s if s else None, "moved_slots": moved, "secondary_slots": slots,
                          "moved_fraction": moved / slots if slots else None,
                          "critical_fraction": crit / slots if slots else None, "protected_hits": hits})
    tot = lambda i: sum(l[i] for l in c["layers"])  # noqa: E731
    steps, slots = tot(1), tot(7)
    n_steps = max((l[1] for l in c["layers"]), default=0)
    n_tokens = max((l[2] for l in c["layers"]), default=0)
    mean = (lambda v: v / steps) if steps else (lambda v: None)
    before, after = mean(tot(3)), mean(tot(4))
    n_layers = max(int(template.get("layers") or len(c["layers"])), 1)
    return {**template, "steps": n_steps, "tokens_per_step": n_tokens / n_steps if n_steps else None,
            "expert_union_before": before, "expert_union_after": after,
            "experts_saved": before - after if steps else None, "primary_union": mean(tot(5)),
            "moved_fraction": tot(6) / slots if slots else None,
            "outside_primary_fraction": c["outside"] / slots if slots else None,
            "critical_fraction": tot(8) / slots if slots else None, "protected_hits": tot(9),
            "by_batch_size": {t: {"steps": n // n_layers, "expert_union_before": b / n, "expert_union_after": a / n}
                              for t, (n, b, a) in sorted(c["by_batch"].items(), key=lambda kv: int(kv[0]))},
            "per_layer": per_layer}


# ------------------------------------------------------------------------------------------ the run loop


def snapshot(engine: Any) -> dict[str, Any] | None:
    """The engine's SERE sums now (None: no SERE, or no per-layer statistics)."""
    stats = engine.technique_stats() if hasattr(engine, "technique_stats") else {}
    return counts((stats or {}).get("sere"))


def batch_record(before: dict[str, Any] | None, after: dict[str, Any] | None, keys: list[str],
                 calls: int = 1) -> dict[str, Any] | None:
    """What each cache entry of a generated batch carries (``extra["sere_batch"]``): the batch's sums for one
    pass. ``calls`` > 1 when the latency protocol re-timed the batch (``latency.on_compile=retime``): the same
    greedy batch ran ``calls`` times and counted as many times in the engine, once here."""
    d = delta(after, before)
    if d is None:
        return None
    if calls > 1:
        d = {"layers": [[l[0]] + [round(x / calls) for x in l[1:]] for l in d["layers"]],
             "outside": round(d["outside"] / calls),
             "by_batch": {t: [round(x / calls) for x in v] for t, v in d["by_batch"].items()}}
    return {"id": hashlib.sha256("\0".join(keys).encode()).hexdigest()[:16], "size": len(keys), "counts": d}


def merge_replayed(technique_stats: dict[str, Any], replayed: list[Any], n_generated: int,
                   generated: list[Any] | None = None) -> dict[str, Any]:
    """``summary.json``'s technique blocks. With ``generated`` (the run kept each generated batch's sums): the SERE
    block's sums are those batches' plus every replayed batch's, once each — the same sums an uninterrupted run
    gives (``partial: false``) — when every replayed request carried its batch's sums and every batch was
    replayed whole. Otherwise, and for the other blocks, the engine's counts of this attempt, ``partial`` when
    requests were replayed."""
    n_replayed = len(replayed)
    for name, block in technique_stats.items():
        if not isinstance(block, dict):
            continue
        block.update({"partial": n_replayed > 0, "requests_covered": n_generated, "requests_replayed": n_replayed})
        if name != "sere" or generated is None or counts(block) is None:
            continue
        batches: dict[str, tuple[int, dict[str, Any]]] = {}
        seen: dict[str, int] = {}
        whole = all(isinstance(r, dict) for r in generated)
        for rec in replayed:
            if not isinstance(rec, dict) or not isinstance(rec.get("counts"), dict) or "id" not in rec:
                whole = False  # written by an older harness, or without SERE sums
                break
            batches[rec["id"]] = (int(rec.get("size") or 0), rec["counts"])
            seen[rec["id"]] = seen.get(rec["id"], 0) + 1
        if not whole or any(seen[i] != size for i, (size, _) in batches.items()):  # a batch only partly replayed
            continue
        merged = {"layers": [], "outside": 0, "by_batch": {}}
        try:
            for c in [r["counts"] for r in generated] + [c for _, c in batches.values()]:
                merged = _combine(merged, c, +1)
        except (KeyError, TypeError, ValueError, IndexError):  # an entry of another shape: stay as counted
            continue
        technique_stats[name] = {**block_from(merged, block), "partial": False,
                                 "requests_covered": n_generated + n_replayed, "requests_replayed": n_replayed}
    return technique_stats

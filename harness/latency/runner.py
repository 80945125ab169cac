"""The timed loop, for any engine: warm-up per shape, verified timed batches, repeated passes.

:class:`TimedBatches` is what ``harness/run/experiment.py`` calls instead of ``engine.generate_batch`` for the batches it
times. It keeps every timing it took (``samples``: one per request and pass), every batch it did not trust
(``events``) and the shape keys it warmed, and hands ``summary.json`` its ``latency.protocol`` block. The
engine needs only ``generate_batch``; it may offer ``warmup(requests)`` (returning the warm-up generations makes
their shapes count as warmed), ``prompt_length(requests)`` (planned keys, so warm-up can cover every shape
before anything is timed) and ``compile_counters()`` (:mod:`harness.latency.watch`).

Why answers come from the first pass only: the later passes exist to time, and a greedy engine gives the same
tokens anyway; scoring one pass keeps quality numbers identical whatever ``latency.repeats`` is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness.latency.shapes import ShapeKey, key_json, observed_key, planned_key, warmup_plan
from harness.latency.watch import moved, reasons, snapshot

log = logging.getLogger(__name__)


def _get(cfg: Any, key: str, default: Any) -> Any:
    return getattr(cfg, key, default) if cfg is not None else default


class TimedBatches:
    """Warm up, time and verify the batches of one run (see the module doc)."""

    def __init__(self, engine: Any, latency_cfg: Any, technique: str = "baseline", *, warmup_rounds: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.mode = str(_get(latency_cfg, "warmup", "per_shape"))
        self.bucket = _get(latency_cfg, "bucket", None)
        self.on_compile = str(_get(latency_cfg, "on_compile", "retime"))
        self.max_retime = int(_get(latency_cfg, "max_retime", 2))
        self.repeats = int(_get(latency_cfg, "repeats", 1))
        self.technique = technique
        self.warmup_rounds = int(warmup_rounds)
        self.clock = clock
        # the first-seen check applies to engines that can be warmed and say what shape they ran or will run:
        # prompt_length(), or a warm-up that returns its generations (learned in warm_up). Others (vLLM: it
        # compiles and captures at start-up, in its engine-core process) are checked by their counters only.
        self.check_shapes = callable(getattr(engine, "warmup", None)) and callable(getattr(engine, "prompt_length",
                                                                                           None))
        self.seen: set[ShapeKey] = set()
        self.warmed: list[ShapeKey] = []
        self.warmup_batches = 0
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.pass_s: dict[int, float] = {}

    # -- warm-up ----------------------------------------------------------------------------------------
    def plan(self, batches: Sequence[list[Any]]) -> list[int]:
        """Indices of the batches to warm up (``per_shape``: one per planned key; ``first_batch``: the first)."""
        if not batches or self.warmup_rounds <= 0 or not callable(getattr(self.engine, "warmup", None)):
            return []
        if self.mode == "first_batch":
            return [0]
        length_of = getattr(self.engine, "prompt_length", None)
        keys = [planned_key(length_of if callable(length_of) else None, b, self.technique, self.bucket)
                for b in batches]
        return warmup_plan(batches, keys)

    def warm_up(self, batches: Sequence[list[Any]], chosen: Sequence[int] | None = None, bar: Any = None) -> None:
        """Run ``warmup_rounds`` untimed warm-ups of each chosen batch; the shapes they ran count as warmed."""
        chosen = self.plan(batches) if chosen is None else chosen
        for i in chosen:
            for _ in range(self.warmup_rounds):
                gens = self.engine.warmup(list(batches[i]))
                self.warmup_batches += 1
                if gens:  # the shape as it ran (VisionZip-pruned lengths included)
                    self.check_shapes = True
                    self._mark_seen(observed_key(gens, self.technique, self.bucket))
                else:  # the engine does not say: what was planned
                    length_of = getattr(self.engine, "prompt_length", None)
                    key = planned_key(length_of if callable(length_of) else None, list(batches[i]), self.technique,
                                      self.bucket)
                    if key is not None:
                        self._mark_seen(key)
                if bar is not None:
                    bar.update(1)

    def _mark_seen(self, key: ShapeKey) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.warmed.append(key)

    # -- timing ------------------------------------------------------------------------------------------
    def _timed_call(self, batch: list[Any]) -> tuple[list[Any], dict[str, int], ShapeKey, float]:
        before = snapshot(self.engine)
        t0 = self.clock()
        gens = self.engine.generate_batch(batch)
        wall = self.clock() - t0
        return gens, moved(before, snapshot(self.engine)), observed_key(gens, self.technique, self.bucket), wall

    def time_batch(self, batch: list[Any], pass_index: int = 0, batch_index: int = 0) -> list[Any]:
        """Generate ``batch``, verify its timing, re-time it when it compiled (``latency.on_compile``), record
        its timing samples; return the generations of the first call (the answers), carrying the timings kept."""
        gens, counter_moves, key, wall = self._timed_call(batch)
        first = gens
        why = self._why(counter_moves, key)
        attempts = 0
        while why and self.on_compile == "retime" and attempts < self.max_retime:
            self.events.append(self._event(pass_index, batch_index, batch, why, "retimed", key, gens))
            attempts += 1
            gens, counter_moves, key, wall = self._timed_call(batch)
            why = self._why(counter_moves, key)
        excluded = bool(why) and self.on_compile != "keep"
        if why:
            self.events.append(self._event(pass_index, batch_index, batch, why,
                                           "excluded" if excluded else "kept", key, gens))
        self.pass_s[pass_index] = self.pass_s.get(pass_index, 0.0) + (0.0 if excluded else wall)
        for g in gens:
            self.samples.append({"uid": g.uid, "pass": pass_index, "batch": batch_index, "ttft_ms": g.ttft_ms,
                                 "tpot_ms": g.tpot_ms, "e2e_ms": g.e2e_ms, "itl_ms": g.extra.get("itl_ms"),
                                 "output_tokens": g.output_tokens, "prompt_tokens": g.prompt_tokens,
                                 "error": g.error, "excluded": excluded,
                                 "retimed": attempts, "reasons": why or None})
        if attempts == 0 and not excluded:
            return first
        timing = {"retimed": attempts, "excluded": excluded, "reasons": why or None}
        by_uid = {g.uid: g for g in gens}
        out = []
        for g in first:  # the first call's answer, the kept call's timing
            t = by_uid.get(g.uid, g)
            out.append(dataclasses.replace(g, ttft_ms=t.ttft_ms, tpot_ms=t.tpot_ms, e2e_ms=t.e2e_ms,
                                           extra={**g.extra, "itl_ms": t.extra.get("itl_ms"), "timing": timing}))
        return out

    def _why(self, counter_moves: dict[str, int], key: ShapeKey) -> list[str]:
        first_seen = key if self.check_shapes and key not in self.seen else None
        self.seen.add(key)  # timed once, warm from now on (a re-timing of it is then clean)
        return reasons(counter_moves, first_seen)

    def _event(self, pass_index: int, batch_index: int, batch: list[Any], why: list[str], action: str,
               key: ShapeKey, gens: Sequence[Any] = ()) -> dict[str, Any]:
        log.info("latency: pass %d batch %d %s (%s)", pass_index + 1, batch_index, action, "; ".join(why))
        ok = [g for g in gens if not getattr(g, "error", None)]
        return {"pass": pass_index, "batch": batch_index, "uids": [r.uid for r in batch], "reasons": why,
                "action": action, "shape": key_json(key),
                # what the untrusted call measured (its first request): how much the first-time cost was
                "ttft_ms": ok[0].ttft_ms if ok else None, "e2e_ms": ok[0].e2e_ms if ok else None}

    # -- what summary.json records ---------------------------------------------------------------------
    def protocol_block(self) -> dict[str, Any]:
        """``summary.json`` ``latency.protocol``: how the figures were taken and what was not trusted."""
        excluded = {(s["pass"], s["uid"]) for s in self.samples if s["excluded"]}
        return {
            "warmup": self.mode, "warmup_rounds": self.warmup_rounds, "warmup_batches": self.warmup_batches,
            "shapes_warmed": [key_json(k) for k in self.warmed],
            "bucket": self.bucket, "on_compile": self.on_compile, "max_retime": self.max_retime,
            "detectors": ["engine counters", "torch.compile counters"]
                         + (["first-seen shape"] if self.check_shapes else []),
            "repeats": self.repeats, "passes_timed": len(self.pass_s),
            "pass_s": [round(self.pass_s[p], 4) for p in sorted(self.pass_s)],
            "batches_retimed": sum(1 for e in self.events if e["action"] == "retimed"),
            "batches_excluded": sum(1 for e in self.events if e["action"] == "excluded"),
            "batches_kept_dirty": sum(1 for e in self.events if e["action"] == "kept"),
            "samples_excluded": len(excluded),
            "events": self.events,
            **self._graph_states(),
        }

    def _graph_states(self) -> dict[str, Any]:
        """Decoder states the run's shapes need against what the engine keeps captured (``graph_states()``, HF on
        CUDA): with more (batch, prompt bucket) pairs than states, the static decoder evicts and recaptures
        graphs in turn, so every timed batch captures whatever the warm-up did (found on the H200)."""
        capacity = getattr(self.engine, "graph_states", None)
        capacity = capacity() if callable(capacity) else None
        if capacity is None:
            return {}
        needed = len({(k[0], k[1]) for k in self.seen if k is not None})
        return {"graph_states": int(capacity), "shapes_needing_states": needed}

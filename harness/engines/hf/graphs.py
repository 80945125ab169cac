"""Greedy decoding with a static KV cache and the decode step replayed from a CUDA graph (gpt-fast style).

Why: ``model.generate`` re-runs its Python loop and launches every kernel of a decode step one at a time
(attention, norms, the router, SERE's re-routing op, the fused MoE kernel: a few hundred launches per step
for a 48-layer model), and this engine's clock synchronises on every token. At decode batch sizes that
overhead is a large share of TPOT. With a static KV cache and fixed shapes the whole decode step (forward,
greedy argmax, feeding the token back, advancing positions) is captured once in a ``torch.cuda.CUDAGraph``
and replayed: one launch per token.

What matches ``generate`` (greedy; ``tests/engines/hf/test_hf_graphs.py`` compares token for token on the tiny
Qwen3-VL-MoE and a plain Qwen3-MoE causal LM, on CPU without graphs, and on CUDA with them):

- **prefill**: one eager call of the model's own ``forward`` on the whole left-padded prompt with
  ``logits_to_keep=1``, as ``generate`` calls it, so VisionZip's pruned inputs, pixel values, image features
  and deepstack take their normal path. Positions: ``inputs["position_ids"]`` when given (VisionZip's
  [4, B, L]), else what ``generate`` builds, ``model._prepare_position_ids_for_generation`` (same code in
  transformers 5.17 and 5.24: text row ``attention_mask.cumsum - 1``; Qwen3-VL adds the mRoPE rows from
  ``get_rope_index`` and sets ``rope_deltas``).
- **decode**: ``generate`` extends the position ids by ``last + 1`` per token in every row; the buffer
  starts at the prompt's last column + 1 and is incremented in place. For Qwen3-VL that is ``cache
  position + rope_deltas`` in the three mRoPE channels (the last prompt token is text: its channels equal
  the row's max position). The attention mask is the prompt's followed by ones (``generate`` appends a one
  per step; static-cache columns not yet written are masked by causality either way), so left padding is
  masked exactly as in ``generate``. A finished row is fed the pad token, as in ``generate``, so SERE's
  union P and its statistics see the same rows.
- **stop**: every row has produced an EOS id, or ``max_new_tokens`` tokens.

Stopping check: **one host read per step, one step behind** (the device "all rows done" flag). Reading the
flag of the step just replayed leaves the GPU idle for the host's wake-up plus the next launch on every token
(~0.17 ms of 3.7 ms at B=1 on an H200), so under real graph replay step s is launched right after step s-1
and the stop is decided from step s-2's flag (pinned copy + CUDA event, ``hf_stop.StopFlags``). If it says
all rows had stopped, the last launched step was extra: its token column, tick and replay are dropped and the
host waits for it (the GPU is idle when ``generate`` returns). At most one wasted step per batch, only when
all rows stop before ``max_new_tokens``: its K/V lands at prompt + steps - 1 < prompt + ``max_new_tokens``
<= the cache length, and the next prefill rewinds the cache and resets every buffer. Not with SERE (an
extra step would move its device counters and row flags: statistics unlike ``generate``'s) nor eagerly:
there the flag of the step just run is read. ``lookahead=True`` also enables it under ``"emulate"`` (tests).

Timing: a CUDA event after the prefill token and after every step, converted to the host ``perf_counter``
clock after the loop (a reference event recorded on the idle GPU next to a host timestamp), so token times
are the GPU's completion times, not the host's wake-up times. CPU: host timestamps.

Graphs: one per (batch size, cache length, position layout), in a small LRU (each holds its KV cache). The
cache holds prompt + ``reserve_new_tokens`` rounded up to ``cache_bucket``, and a batch reuses a state
whose cache fits within ``REUSE_SLACK`` x its need, so varying prompts rarely recapture. At the first
decode step of a state without a graph: ``warmup_steps`` eager steps on a side stream (Triton compilation
and autotuning, library workspaces, SERE's lazily built counters), then **everything they changed is put
back** (token/position/done buffers, cache write positions, SERE's device and Python counters), the step
is captured and replayed. So warm-up leaves no trace and the engine's 2-token warm-up batch already
captures the graph the timed batches replay. A graph is recaptured when what it baked in changes: forward
hooks on any module (SERE installed or removed), SERE's mode / k / rho / similarity / protection, the
attention or experts implementation. Other forward hooks see the warm-up steps and the capture call.

SERE statistics under replay: the hooks run in Python only while capturing, so on replay their device
counters advance inside the graph but the Python ints (``steps``, ``tokens``, ``secondary_slots``,
``by_batch`` step counts) do not. The capture measures what one step adds to those ints, and the decoder
adds it once per replay after the batch, so ``SereHandle.stats()`` equals the eager run's. ``reset_stats()``
drops the device counters the graph writes to: before replaying, the decoder re-attaches the captured
(zeroed) tensors to the handle — a reset means zero — instead of recapturing. That bookkeeping (snapshots,
restores, the per-step delta, the re-attachment) lives in :mod:`harness.engines.hf.graph_counters`; it reads
and writes ``hf_sere``'s per-layer fields (``steps``, ``tokens``, ``secondary_slots``, ``by_batch``, ``acc``,
``offsets``): the tests compare ``stats()`` with ``generate``'s, so a rename there fails loudly here.

``use_graphs="emulate"`` (tests, any device) runs this bookkeeping without CUDA: the "capture" runs the step
and rolls its device effects back, a "replay" runs the step and rolls back its Python-side SERE counting,
as a real replay never runs Python.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from harness.engines.hf.graph_counters import (attach_counters, captured_counters, counter_delta,
                                               device_counters, host_counters, restore_device_counters,
                                               restore_host_counters, restore_row_states, row_states,
                                               sere_handles, add_replayed_steps)
from harness.engines.hf.stop import StopFlags

__all__ = ["DecodeResult", "StaticGreedyDecoder", "unsupported_reason"]

WARMUP_STEPS = 2      # eager decode steps before a capture (compilation, autotuning, lazily built buffers)
CACHE_BUCKET = 128    # static cache lengths are multiples of this
MAX_STATES = 3        # (batch, cache length) states kept, each with its KV cache and graph
REUSE_SLACK = 1.5     # a state serves a batch whose cache need is up to this factor smaller


@dataclass
class DecodeResult:
    """New tokens per row (``generate``'s ``out[:, prompt_len:]``: rows that finished early continue with
    the pad id) and the ``perf_counter`` time at which each step's token was ready (index 0 = prefill)."""

    tokens: list[list[int]]
    times: list[float]
    mode: str                 # "eager" | "captured" (this batch captured the graph) | "replayed"
    replays: int = 0


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why greedy static decoding would differ from ``model.generate(do_sample=False)``, or None.

    The decoder applies no logits processor: a generation config that adds one (repetition penalty, n-gram
    blocking, suppressed or forced tokens, a minimum length) is refused rather than ignored."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return None
    checks = {"repetition_penalty": lambda v: v not in (None, 1.0),
              "no_repeat_ngram_size": bool, "encoder_no_repeat_ngram_size": bool, "bad_words_ids": bool,
              "suppress_tokens": bool, "begin_suppress_tokens": bool, "sequence_bias": bool,
              "min_new_tokens": bool, "min_length": bool,
              "forced_bos_token_id": lambda v: v is not None, "forced_eos_token_id": lambda v: v is not None,
              "exponential_decay_length_penalty": lambda v: v is not None}
    for name, bad in checks.items():
        value = getattr(gen, name, None)
        if bad(value):
            return f"generation_config.{name}={value!r} adds a logits processor the static decoder does not apply"
    return None


def _fingerprint(model: torch.nn.Module, handles: list) -> tuple:
    """What a captured decode step baked in that can change between batches (see the module doc)."""
    hooks = tuple((id(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
                  for m in model.modules() if m._forward_hooks or m._forward_pre_hooks)
    sere = tuple((id(h), h.mode, h.collect_stats, getattr(h, "stats_impl", None), h.k_primary, h.rho,
                  tuple((id(st.similarity), id(st.protected)) for st in h.layers)) for h in handles)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = (getattr(text, "_attn_implementation", None), getattr(text, "_experts_implementation", None))
    return hooks, sere, impl


# ---------------------------------------------------------------------------------------- the state


@dataclass
class _State:
    """Static buffers of one (batch, cache length, position layout): every graph input and output."""

    batch: int
    length: int
    cache: Any
    ids: torch.Tensor         # [B, 1] token fed to the next step
    pos: torch.Tensor         # [4, B, 1] (Qwen3-VL) or [B, 1] position ids of that token
    mask: torch.Tensor        # [B, C] attention mask: the prompt's, then ones
    done: torch.Tensor        # [B] bool: the row has produced EOS
    all_done: torch.Tensor    # [] bool
    out: torch.Tensor         # [B, C] generated tokens
    step: torch.Tensor        # [1] long: the column of ``out`` the next step writes
    eos: torch.Tensor         # [n] long EOS ids (built once: no host-to-device copy inside a capture)
    graph: Any = None
    fingerprint: tuple | None = None
    sere_per_step: list = field(default_factory=list)   # one step's Python-side SERE counting
    sere_counters: list = field(default_factory=list)   # the SERE device tensors the graph writes to
    keep_alive: list = field(default_factory=list)      # tensors the graph reads: never freed under it

    def buffers(self) -> list[torch.Tensor]:
        lengths = [layer.cumulative_length for layer in self.cache.layers
                   if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        return [self.ids, self.pos, self.done, self.all_done, self.step, *lengths]


def _rewind(cache) -> None:
    """Every static layer writes from position 0 again (in place: a graph keeps its addresses). Stale keys and
    values beyond the new prompt are finite and masked by causality until overwritten."""
    for layer in cache.layers:
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length.zero_()
        elif hasattr(layer, "cumulative_length"):
            layer.cumulative_length = 0


class _EmulatedGraph:
    """``use_graphs="emulate"``: a replay is the eager step minus its Python-side SERE counting."""

    def __init__(self, step, handles: list):
        self.step, self.handles = step, handles

    def replay(self) -> None:
        saved = host_counters(self.handles)
        self.step()
        restore_host_counters(self.handles, saved)


class StaticGreedyDecoder:
    """Greedy decoding of left-padded batches with a static KV cache; CUDA-graph replay on CUDA.

    ``use_graphs``: None = graphs on CUDA, the same static loop eagerly elsewhere; False = eager everywhere;
    "emulate" = the capture/replay bookkeeping without CUDA (tests).

    ``lookahead`` (module doc, "Stopping check"): None = on when real CUDA graphs are replayed and no SERE
    handle is installed; True = also under ``"emulate"`` (tests); False = off. Never with SERE handles, whose
    statistics an extra step would change, nor on the eager loop.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: Iterable[int], pad_id: int, *,
                 use_graphs: bool | str | None = None, warmup_steps: int = WARMUP_STEPS,
                 cache_bucket: int = CACHE_BUCKET, max_states: int = MAX_STATES, lookahead: bool | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(f"static greedy decoding: {reason}")
        self.model = model
        self.eos_ids = sorted({int(e) for e in eos_ids})
        self.pad_id = int(pad_id)
        self.use_graphs = use_graphs
        self.lookahead = lookahead
        # a context around every decode step (warm-up, capture, eager loop): hf_compile.decoding turns the
        # compiled regions on for the fixed-shape decode steps only (the prefill stays eager)
        self.step_context = contextlib.nullcontext
        self.warmup_steps = max(1, int(warmup_steps))
        self.cache_bucket = max(1, int(cache_bucket))
        self.max_states = max(1, int(max_states))
        self.states: OrderedDict[tuple, _State] = OrderedDict()
        self.captures = 0
        self._stream = None
        params = inspect.signature(model.forward).parameters
        self._forward_params = set(params) - {"labels"}
        # transformers 5.24 names the cache ``cache`` (``past_key_values`` deprecated); 5.17 ``past_key_values``
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    # -- public API -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every graph and static cache."""
        self.states.clear()

    @torch.inference_mode()
    def generate(self, inputs: dict[str, Any], max_new_tokens: int,
                 reserve_new_tokens: int | None = None) -> DecodeResult:
        """Greedy-decode one left-padded batch (``inputs``: the processor's output, or VisionZip's).

        ``reserve_new_tokens`` (>= ``max_new_tokens``) sizes the cache, so a short warm-up generation captures
        the graph that full-length batches replay."""
        model = self.model
        input_ids: torch.Tensor = inputs["input_ids"]
        device = input_ids.device
        graphs = "emulate" if self.use_graphs == "emulate" else \
            device.type == "cuda" and self.use_graphs in (None, True)
        batch, prompt_len = input_ids.shape
        max_new_tokens = max(1, int(max_new_tokens))
        mask = inputs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(input_ids)
        positions = inputs.get("position_ids")
        if positions is None:
            model_kwargs = {k: v for k, v in inputs.items() if k != "position_ids"}
            model_kwargs["attention_mask"] = mask
            positions = model._prepare_position_ids_for_generation(input_ids, model_kwargs)
        # the cache also holds the warm-up steps run before a capture (their writes are rolled back)
        need = prompt_len + max(max_new_tokens, int(reserve_new_tokens or 0), self.warmup_steps + 1 if graphs else 0)
        st = self._state(batch, need, tuple(positions.shape[:-1]), mask.dtype, device)
        clock = _Clock(device.type == "cuda")

        # prefill: the model's own forward with everything the processor (or VisionZip) produced
        _rewind(st.cache)
        kwargs = {k: v for k, v in inputs.items() if k in self._forward_params}
        kwargs.update(attention_mask=mask, position_ids=positions, use_cache=True, **self._logits_kw)
        kwargs[self._cache_kw] = st.cache
        first = model(**kwargs).logits[:, -1].argmax(-1)
        st.mask[:, :prompt_len].copy_(mask)
        st.mask[:, prompt_len:].fill_(1)
        st.out[:, 0].copy_(first)
        st.done.copy_((first[:, None] == st.eos[None, :]).any(-1))
        st.all_done.copy_(st.done.all())
        st.ids.copy_(first[:, None])
        st.pos.copy_(positions[..., -1:] + 1)
        st.step.fill_(1)
        clock.tick()

        handles = sere_handles(model) if graphs else []
        if st.graph is not None and st.fingerprint != _fingerprint(model, handles):
            self._drop_graph(st)
        mode = "replayed" if graphs and st.graph is not None else "eager"
        replays, steps = 0, 1
        # lookahead ("Stopping check"): graphs without SERE; None = real ones only. Never capture for a step
        # that would be dropped (a capture synchronises anyway): mode and captures stay as without lookahead
        ahead = bool(graphs) and not handles and self.lookahead is not False and \
            (graphs is True or self.lookahead is True) and not (st.graph is None and bool(st.all_done))
        flags = StopFlags(device) if ahead else None
        if ahead:
            flags.record(st.all_done)
        while steps < max_new_tokens and not (flags.done_before_last() if ahead else bool(st.all_done)):
            if graphs:
                if st.graph is not None and replays == 0 and not attach_counters(handles, st.sere_counters, batch):
                    self._drop_graph(st)
                if st.graph is None:
                    self._capture(st, handles, emulate=graphs == "emulate")
                    mode = "captured"
                st.graph.replay()
                replays += 1
            else:
                self._step(st)
            clock.tick()
            steps += 1
            if ahead:
                flags.record(st.all_done)
        if ahead and flags.done_before_last():   # every row had stopped: the last step launched was extra
            steps, replays = steps - 1, replays - 1
            clock.drop_last()
        times = clock.times()
        if replays:
            add_replayed_steps(handles, st.sere_per_step, replays)
        return DecodeResult(tokens=st.out[:, :steps].tolist(), times=times, mode=mode, replays=replays)

    # -- internals --------------------------------------------------------------------------------
    def _state(self, batch: int, need: int, pos_shape: tuple, mask_dtype, device) -> _State:
        """A state whose cache holds ``need`` positions: an existing one within REUSE_SLACK x, else a new one."""
        fits = [(key, s) for key, s in self.states.items()
                if key[0] == batch and key[2] == pos_shape and key[3] == str(device)
                and need <= s.length <= max(need * REUSE_SLACK, need + self.cache_bucket)]
        if fits:
            key, st = min(fits, key=lambda ks: ks[1].length)
            self.states.move_to_end(key)
            return st
        from transformers import StaticCache

        length = math.ceil(need / self.cache_bucket) * self.cache_bucket
        while len(self.states) >= self.max_states:
            self.states.popitem(last=False)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        long = dict(dtype=torch.long, device=device)
        st = _State(batch=batch, length=length, cache=StaticCache(config=self.model.config, max_cache_len=length),
                    ids=torch.zeros(batch, 1, **long), pos=torch.zeros(*pos_shape, 1, **long),
                    mask=torch.ones(batch, length, dtype=mask_dtype, device=device),
                    done=torch.zeros(batch, dtype=torch.bool, device=device),
                    all_done=torch.zeros((), dtype=torch.bool, device=device),
                    out=torch.full((batch, length), self.pad_id, **long), step=torch.zeros(1, **long),
                    eos=torch.tensor(self.eos_ids or [-1], **long))
        self.states[(batch, length, pos_shape, str(device))] = st
        return st

    def _step(self, st: _State) -> None:
        """One decode step: fixed shapes, no host synchronisation (what the graph captures)."""
        with self.step_context():
            self._step_body(st)

    def _step_body(self, st: _State) -> None:
        logits = self.model(input_ids=st.ids, attention_mask=st.mask, position_ids=st.pos, use_cache=True,
                            **{self._cache_kw: st.cache}, **self._logits_kw).logits[:, -1]
        nxt = logits.argmax(-1)
        nxt = torch.where(st.done, torch.full_like(nxt, self.pad_id), nxt)   # finished rows feed pad, as generate
        st.out.index_copy_(1, st.step, nxt[:, None])
        st.done.logical_or_((nxt[:, None] == st.eos[None, :]).any(-1))
        st.all_done.copy_(st.done.all())
        st.ids.copy_(nxt[:, None])
        st.pos.add_(1)
        st.step.add_(1)

    def _drop_graph(self, st: _State) -> None:
        st.graph, st.fingerprint, st.sere_per_step, st.sere_counters, st.keep_alive = None, None, [], [], []

    def _warm_up(self, st: _State, handles: list) -> None:
        """``warmup_steps`` eager steps (side stream on CUDA), then every effect they had is put back."""
        saved = [t.clone() for t in st.buffers()]
        host, dev, rows = host_counters(handles), device_counters(handles), row_states(handles)
        if st.ids.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for _ in range(self.warmup_steps):
                    self._step(st)
            torch.cuda.current_stream().wait_stream(self._stream)
        else:
            for _ in range(self.warmup_steps):
                self._step(st)
        for buf, value in zip(st.buffers(), saved, strict=True):
            buf.copy_(value)
        restore_device_counters(handles, dev)   # counters born in the warm-up exist now, zeroed
        restore_host_counters(handles, host)
        restore_row_states(handles, rows)

    def _capture(self, st: _State, handles: list, emulate: bool = False) -> None:
        """Warm up, then capture the next decode step (recorded, not run: the caller replays it next)."""
        self._warm_up(st, handles)
        before = host_counters(handles)
        if emulate:
            saved, dev, rows = [t.clone() for t in st.buffers()], device_counters(handles), row_states(handles)
            self._step(st)
            after = host_counters(handles)
            for buf, value in zip(st.buffers(), saved, strict=True):
                buf.copy_(value)
            restore_device_counters(handles, dev)
            restore_row_states(handles, rows)
            graph = _EmulatedGraph(lambda: self._step(st), handles)
        else:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step(st)
            after = host_counters(handles)
        restore_host_counters(handles, before)   # the capture ran the hooks, not a step
        st.sere_per_step = counter_delta(before, after)
        st.sere_counters = captured_counters(handles, st.batch)
        st.keep_alive = [s.offsets for h in handles for s in h.layers if s.offsets is not None]
        st.graph, st.fingerprint = graph, _fingerprint(self.model, handles)
        self.captures += 1


class _Clock:
    """Per-token completion times on the host ``perf_counter`` clock: CUDA events converted after the loop
    (no synchronisation for timing), host timestamps on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stamps: list = []
        if cuda:
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.ref_host = time.perf_counter()

    def drop_last(self) -> None:
        """Forget the last tick (a lookahead step past the stop); on CUDA wait for that step, so the GPU is
        idle when ``generate`` returns and the next batch's timing starts as it would without lookahead."""
        last = self.stamps.pop()
        if self.cuda:
            last.synchronize()

    def tick(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())

    def times(self) -> list[float]:
        if not self.cuda:
            return list(self.stamps)
        if self.stamps:
            self.stamps[-1].synchronize()
        return [self.ref_host + self.ref.elapsed_time(event) / 1e3 for event in self.stamps]

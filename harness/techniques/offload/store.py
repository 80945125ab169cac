"""Host expert store and device slots: the tensors and the copies behind :class:`harness.techniques.offload.cache.ExpertCache`.

Why one slab per weight kind: PyTorch's pinned (page-locked) allocator rounds every allocation up to a power of
two, so pinning each expert separately would nearly double host memory; one ``[L, E, 2I, H]`` and one
``[L, E, H, I]`` allocation are rounded once. Pinned only when CUDA is present (asynchronous H2D copies need
page-locked memory; a pageable source makes ``non_blocking`` copies synchronous); on CPU the slabs are plain
tensors and the "device" slots are CPU tensors too — the same tables, the same bookkeeping, real copies.

CUDA ordering (no copy ever overwrites a slot compute may still read, nothing is copied back):

- loads run on a dedicated copy stream (``set_streams("separate")``, the cache's default: demand loads on a
  high-priority copy stream, prefetches on their own low-priority one, so a demand copy is never queued behind
  a speculative copy in stream order); before writing any slot of layer ``l`` the copy stream waits on
  layer ``l``'s last *read event* (recorded on the compute stream right after the layer's kernel was issued);
- a load into a slot whose previous (evicted, unused) prefetch may still be copying waits on that copy's event
  first (``after``): with two copy streams, two writes of one slot are otherwise unordered;
- each load records a completion event; the compute stream waits on the events of the experts it needs
  (only those: unrelated copies never block compute);
- timing: an event pair around each load (copy-stream busy time → achieved GB/s) and around each wait that
  could block (stall time), read back lazily once completed (no extra synchronisation per step).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["ExpertStore", "Mover"]


class ExpertStore:
    """Every MoE layer's experts in host memory: ``gate_up [L, E, 2I, H]`` and ``down [L, E, H, I]``.

    Pinning (``pin=True``): the slabs are allocated as ordinary (pageable) memory and page-locked in place with
    ``cudaHostRegister`` — exactly their size, no rounding (``pin_memory=True`` goes through PyTorch's caching
    host allocator, which rounds an allocation up to a power of two: a 38.6 GB slab would take 64 GB). When
    registration fails, the allocator's ``pin_memory=True`` is the fallback (``pin_method`` says which ran).
    Filled layer by layer (:meth:`put`), so the caller can free each layer of the model as it is copied and
    host memory never holds two copies of all experts."""

    def __init__(self, num_layers: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype, pin: bool):
        self.gate_up = torch.empty((num_layers, num_experts, 2 * inter, hidden), dtype=dtype)
        self.down = torch.empty((num_layers, num_experts, hidden, inter), dtype=dtype)
        self.pin_method = None
        self._registered: list[int] = []
        if pin:
            self.pin_method = "cudaHostRegister"
            for t in (self.gate_up, self.down):
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                if int(err) != 0:
                    self.unpin()
                    self.pin_method = "pin_memory"
                    self.gate_up = self.gate_up.pin_memory()
                    self.down = self.down.pin_memory()
                    break
                self._registered.append(t.data_ptr())
        self.pinned = self.pin_method is not None and bool(self.gate_up.is_pinned())

    def put(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up[layer].copy_(gate_up.detach())
        self.down[layer].copy_(down.detach())

    def unpin(self) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []

    @property
    def expert_bytes(self) -> int:
        return (self.gate_up[0, 0].numel() + self.down[0, 0].numel()) * self.gate_up.element_size()

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


class Mover:
    """Device slots ``[L, C, ...]``, the device expert→slot table ``[L, E]`` and the copies (the cache's mover)."""

    def __init__(self, store: ExpertStore, capacity: int, device: torch.device | str):
        self.store = store
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        num_layers, num_experts = store.gate_up.shape[:2]
        self.gate_up = torch.empty((num_layers, capacity, *store.gate_up.shape[2:]), dtype=store.gate_up.dtype,
                                   device=self.device)
        self.down = torch.empty((num_layers, capacity, *store.down.shape[2:]), dtype=store.down.dtype,
                                device=self.device)
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.long, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.prefetch_stream = self.stream  # set_streams("separate") gives prefetches their own stream
        self.read_events: list[Any] = [None] * num_layers
        self._copies: list[tuple[str, Any, Any]] = []  # (phase, start, end) timing events
        self._stalls: list[tuple[str, Any, Any]] = []

    @property
    def device_bytes(self) -> int:
        return (self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()
                + self.table.numel() * self.table.element_size())

    def set_streams(self, mode: str) -> None:
        """``separate``: demand loads on a high-priority copy stream, prefetches on a low-priority one;
        ``shared``: one copy stream for both. Called by the cache before any load."""
        if not self.cuda:
            return
        if mode == "separate":
            # lower number = higher priority; out-of-range values are mapped to the nearest valid one
            self.stream = torch.cuda.Stream(self.device, priority=-1)
            self.prefetch_stream = torch.cuda.Stream(self.device, priority=0)
        else:
            self.stream = self.prefetch_stream = torch.cuda.Stream(self.device)

    # -- called by the cache ----------------------------------------------------------------------
    def load(self, cache: Any, layer: int, expert: int, slot: int, prefetch: bool, after: Any = None) -> Any:
        """Copy ``expert`` of ``layer`` into ``slot`` (after the copy ``after``, if any, into the same slot);
        returns the completion event (CUDA) or None (done)."""
        src_gu, src_dn = self.store.gate_up[layer, expert], self.store.down[layer, expert]
        if self.cuda:
            stream = self.prefetch_stream if prefetch else self.stream
            with torch.cuda.stream(stream):
                if self.read_events[layer] is not None:
                    stream.wait_event(self.read_events[layer])
                if after is not None:
                    stream.wait_event(after)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                self.gate_up[layer, slot].copy_(src_gu, non_blocking=True)
                self.down[layer, slot].copy_(src_dn, non_blocking=True)
                end.record(stream)
            self._copies.append((cache.phase, start, end))
            self.table[layer, expert] = slot
            return end
        t0 = time.perf_counter()
        self.gate_up[layer, slot].copy_(src_gu)
        self.down[layer, slot].copy_(src_dn)
        ms = (time.perf_counter() - t0) * 1e3
        cache.acct.copy_time(cache.phase, ms)
        if not prefetch:  # a synchronous demand copy is on the critical path
            cache.acct.stall(cache.phase, ms)
        self.table[layer, expert] = slot
        return None

    def done(self, handle: Any) -> bool:
        return handle is None or bool(handle.query())

    def wait(self, cache: Any, handles: list[Any]) -> None:
        """The compute stream waits on these loads (CUDA); the wait is timed when one is unfinished."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        blocking = any(not h.query() for h in handles)
        if blocking:
            a = torch.cuda.Event(enable_timing=True)
            a.record(compute)
        for h in handles:
            compute.wait_event(h)
        if blocking:
            b = torch.cuda.Event(enable_timing=True)
            b.record(compute)
            self._stalls.append((cache.phase, a, b))

    def record_read(self, layer: int) -> None:
        """Re-record the layer's one read event (created once, no timing): a later copy's ``wait_event`` waits
        on the most recent record, so no event is allocated per layer per pass."""
        if self.cuda:
            ev = self.read_events[layer]
            if ev is None:
                ev = self.read_events[layer] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))

    def unmap(self, layer: int, expert: int) -> None:
        self.table[layer, expert] = -1

    def end_pass(self, cache: Any) -> None:
        self._resolve(cache, block=False)

    def drain(self, cache: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._resolve(cache, block=True)

    def _resolve(self, cache: Any, block: bool) -> None:
        for name, sink in (("_copies", cache.acct.copy_time), ("_stalls", cache.acct.stall)):
            keep = []
            for phase, a, b in getattr(self, name):
                if block or b.query():
                    sink(phase, a.elapsed_time(b))
                else:
                    keep.append((phase, a, b))
            setattr(self, name, keep)

"""The static decoder's stop decision one step behind (``hf_graphs.StaticGreedyDecoder``, lookahead loop).

Why: reading the device "all rows done" flag right after each graph replay makes the host wait for that step,
so the GPU idles for the host's wake-up plus the next launch on every token (~0.17 ms of a 3.7 ms TPOT on an
H200 at B=1). With one step of lookahead the host launches step s as soon as step s-1 is launched and decides
from the flag of step s-2, which the GPU has finished by the time it runs step s-1: one host read per step,
never of the step in flight, so the GPU always has the next step queued.

How: after every step, ``record(all_done)`` copies the flag into a slot of a small pinned host buffer
(``non_blocking=True``: a device-to-host copy on the stream, no synchronisation) and records a CUDA event
behind it; ``done_before_last()`` waits for the event of the record before the last one and reads its slot.
Two slots suffice: the slot a record writes is the one the check just before it read. On CPU (and for
``use_graphs="emulate"``, which tests use to run this loop without CUDA) a record is a ``.clone()`` and no
event: the same decisions, so tests compare the lookahead loop with the plain one exactly.
"""

from __future__ import annotations

import torch

__all__ = ["StopFlags"]


class StopFlags:
    """One "all rows done" flag per recorded step; ``done_before_last`` answers for the step before the last."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.count = 0                       # records so far (record 0 = the prefill's flag)
        self._answer: tuple[int, bool] | None = None
        if self.cuda:
            self.host = torch.zeros(2, dtype=torch.bool, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
        else:
            self.snapshots: list[torch.Tensor | None] = [None, None]

    def record(self, all_done: torch.Tensor) -> None:
        """Snapshot the flag as the stream reaches this point (after the step just launched)."""
        slot = self.count % 2
        if self.cuda:
            self.host[slot].copy_(all_done, non_blocking=True)
            self.events[slot].record()
        else:
            self.snapshots[slot] = all_done.clone()
        self.count += 1

    def done_before_last(self) -> bool:
        """Whether every row had finished after the step before the last recorded one (False with fewer than
        two records): then the last recorded step was one too many. Waits only for that earlier step."""
        if self.count < 2:
            return False
        if self._answer is not None and self._answer[0] == self.count:
            return self._answer[1]
        slot = self.count % 2                # == (count - 2) % 2
        if self.cuda:
            self.events[slot].synchronize()
            done = bool(self.host[slot])
        else:
            done = bool(self.snapshots[slot])
        self._answer = (self.count, done)
        return done

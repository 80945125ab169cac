"""The next layer's gate guess read together with the current layer's routing: one device→host read per layer.

Why: the cache decides on the host, so every offloaded MoE layer already pays one device→host read of its
routing ids (a synchronisation). ``lru+gate`` and ``lease`` also apply layer ``l+1``'s router to layer ``l``'s
input and read *that* guess on the host — a second synchronisation, issued after layer ``l``'s kernel, which
made the host wait for the kernel and then do the prefetch decision with the GPU idle (results of issue 27:
the gate policies lost to plain LRU at 96 % hits). Here the guess is computed *before* the layer's kernel,
from the same input, and read in the same transfer as the layer's own ids; the policy's later
``ctx.gate(l+1, hidden)`` returns the host rows with no device work at all.

Use::

    reader = GateReader(router_of, num_layers)        # router_of(layer, hidden) -> ids [T, k] on the device
    ctx = PolicyContext(..., gate=reader)               # policies call ctx.gate as before
    rows = reader.read(layer, top_k_index, hidden)      # per layer, instead of top_k_index.tolist()

A call for another (layer, hidden) than the one read falls back to the router (a device tensor), so a policy
that asks for something else still gets a correct answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GateReader"]


class GateReader:
    """See the module doc. ``router(layer, hidden)`` → top-k ids ``[T, k]`` (device); None = no gate."""

    def __init__(self, router: Callable[[int, Any], Any] | None, num_layers: int):
        self.router = router
        self.num_layers = num_layers
        self._guess: tuple[int, Any, list[list[int]]] | None = None
        self.reads = 0  # device→host reads issued (one per read())
        self.fallbacks = 0  # ctx.gate calls the read could not answer

    def read(self, layer: int, top_k_index: Any, hidden: Any = None) -> list[list[int]]:
        """This layer's ids as host rows ``[T][k]``; with a router and a next layer, the next layer's guess on
        ``hidden`` is read in the same transfer and kept for :meth:`__call__`."""
        import torch

        ids = top_k_index.reshape(-1, top_k_index.shape[-1])
        k, n = ids.shape[-1], ids.numel()
        nxt = layer + 1
        self.reads += 1
        if self.router is None or hidden is None or nxt >= self.num_layers:
            self._guess = None
            return ids.tolist()
        guess = self.router(nxt, hidden)
        guess = guess.reshape(-1, guess.shape[-1])
        kg = guess.shape[-1]
        flat = torch.cat([ids.reshape(-1), guess.reshape(-1).to(ids.dtype)]).tolist()
        self._guess = (nxt, hidden, [flat[i:i + kg] for i in range(n, len(flat), kg)])
        return [flat[i:i + k] for i in range(0, n, k)]

    def __call__(self, layer: int, hidden: Any) -> Any:
        """``ctx.gate``: the rows read with the previous layer when they are for this ``(layer, hidden)``."""
        g = self._guess
        if g is not None and g[0] == layer and g[1] is hidden:
            return g[2]
        self.fallbacks += 1
        return self.router(layer, hidden)

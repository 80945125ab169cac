"""Predictive expert offload (issue 15): experts in host memory, a GPU expert cache, pluggable policies.

Design (docs/offload.md has the long form):

- **Store** (:mod:`harness.techniques.offload.store`): every MoE layer's experts copied into ONE host slab per weight kind
  (``gate_up [L, E, 2I, H]``, ``down [L, E, H, I]``), pinned when CUDA is present (one pinned allocation per
  kind: PyTorch's pinned allocator rounds each allocation up to a power of two, so per-expert pinning would
  nearly double host memory); plain memory on CPU with the same bookkeeping. The model's own expert
  parameters are replaced by empty tensors, so the device budget really binds.
- **Cache** (:mod:`harness.techniques.offload.cache`): per-layer pools of ``capacity`` slots (one device slab per weight
  kind, ``[L, C, 2I, H]`` / ``[L, C, H, I]``) and a device expert→slot table ``[L, E]`` (−1 = absent). Loads
  run on a dedicated copy stream with an event per load; a slot's last reader records an event the next copy
  into that slot waits on, so a slot is never overwritten while compute may read it; nothing is copied back.
  CPU: synchronous copies, same tables, same accounting.
- **Hook** (:mod:`harness.engines.hf.offload`): an experts implementation registered in transformers'
  ``ALL_EXPERTS_FUNCTIONS`` (``harness_offload_moe``) remaps ``top_k_index`` through the slot table and calls
  the project's fused MoE (Triton kernel on CUDA, float32 reference on CPU) on the layer's slot tensors: no
  new kernel, only remapped ids.
- **Policies** (:mod:`harness.techniques.offload.policy` = the interface and registry; :mod:`harness.techniques.offload.policies` =
  ``none``, ``staging``, ``lru``, ``lru+gate``, ``oracle``; ``lease`` in :mod:`harness.techniques.offload.lease`).
- **Accounting** (:mod:`harness.techniques.offload.accounting`): hit rates, bytes, prefetch precision/recall, stalls —
  a plain-Python module testable on a scripted trace (:mod:`harness.techniques.offload.simulate` replays a trace through
  the same cache bookkeeping with no tensors).

Heavy imports (torch, transformers) stay inside the modules that need them; importing this package is free.
"""

"""Plain-torch twin of :func:`harness.kernels.fused_moe.fused_moe` (the semantics the kernel must match).

For tokens ``hidden [T, H]`` routed to ``topk_ids [T, k]`` with gate weights ``topk_weights [T, k]``:

    out[t] = Σ_j  w[t, j] · down[e] · ( SiLU(gate[e] · x_t) ⊙ (up[e] · x_t) ),   e = topk_ids[t, j]

with the transformers weight layout ``gate_up_proj [E, 2I, H]`` (rows 0..I-1 = gate, I..2I-1 = up, as
``Qwen3MoeExperts`` splits them with ``chunk(2, dim=-1)``) and ``down_proj [E, H, I]``. Conventions:

- ids outside ``[0, E)`` (e.g. ``-1``, or expert-parallel sentinels ``>= E``) contribute nothing;
- a token may name the same expert in several slots (SERE re-routing produces that): the slots' weights
  add up, exactly as the slot-by-slot sum does;
- everything is computed in float32 (inputs upcast; bf16 → fp32 is exact) and returned in ``hidden.dtype``
  unless ``out_dtype`` says otherwise.

Implementation: one pass over the E experts with a dense per-token combine weight ``R[t, e]`` (the sum of
the token's slot weights naming e). It has no host synchronisation and no data-dependent shape, so it is
also a valid CPU / CUDA-graph fallback, but it computes every expert for every token (E× the work of a
grouped kernel): use it for tests, tiny models and correctness checks, never for timing.
"""

from __future__ import annotations

import torch

__all__ = ["check_fused_moe_args", "combine_weights", "fused_moe_reference"]


def check_fused_moe_args(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Shape/dtype/device checks shared by the reference and the kernel wrapper; returns (T, H, E, I, k).

    Reads no tensor values (no host synchronisation)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be [E, 2I, H] and down_proj [E, H, I], got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, h_w = gate_up_proj.shape
    inter = two_i // 2
    if two_i % 2 or h_w != hidden_size or tuple(down_proj.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"inconsistent shapes: hidden {tuple(hidden.shape)}, gate_up_proj "
                         f"{tuple(gate_up_proj.shape)} (expected [E, 2I, {hidden_size}]), down_proj "
                         f"{tuple(down_proj.shape)} (expected [{num_experts}, {hidden_size}, {inter}])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be an int32/int64 [T={num_tokens}, k] tensor, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be a float tensor shaped like topk_ids {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    for name, t in (("hidden", hidden), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    devices = {t.device for t in (hidden, gate_up_proj, down_proj, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return num_tokens, hidden_size, num_experts, inter, topk_ids.shape[1]


def combine_weights(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense float32 [T, E]: the sum of each token's slot weights per expert (invalid ids dropped)."""
    num_tokens = topk_ids.shape[0]
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    # Invalid slots go to a spare column E, dropped afterwards: no data-dependent shapes, no sync.
    index = torch.where(valid, topk_ids, torch.full_like(topk_ids, num_experts)).long()
    dense = torch.zeros(num_tokens, num_experts + 1, dtype=torch.float32, device=topk_ids.device)
    dense.scatter_add_(1, index, topk_weights.float())
    return dense[:, :num_experts]


def fused_moe_reference(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SiLU-gated MoE in float32 (see module doc); returns [T, H] in ``out_dtype`` (default hidden.dtype)."""
    num_tokens, hidden_size, num_experts, inter, _ = check_fused_moe_args(
        hidden, gate_up_proj, down_proj, topk_ids, topk_weights)
    out_dtype = hidden.dtype if out_dtype is None else out_dtype
    x = hidden.float()
    dense = combine_weights(topk_ids, topk_weights, num_experts)              # [T, E]
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    for e in range(num_experts):
        gate_up = x @ gate_up_proj[e].float().t()                              # [T, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.addcmul_(act @ down_proj[e].float().t(), dense[:, e:e + 1])
    return out.to(out_dtype)

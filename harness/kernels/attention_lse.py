"""Varlen (packed, full-attention-per-segment) attention that also returns its row log-sum-exp.

Why: VisionZip's importance is ``c_j = 1/H · Σ_h Σ_i exp(scale·q_i·k_j − lse^h_i)``. The scoring vision
block runs an attention over exactly these q, k anyway, and flash attention computes ``lse`` as a by-product;
handing it to :func:`harness.kernels.importance.attention_importance` skips the kernel's own LSE pass (one of
its two QKᵀ passes). This module is the one place that knows which torch op returns the LSE where:

* CUDA, fp16/bf16: ``aten._flash_attention_forward`` (varlen, one call for the whole packed batch,
  ``cum_seq_q = cum_seq_k = cu_seqlens``) — the same FlashAttention-2 kernel that
  ``F.scaled_dot_product_attention`` dispatches to for these inputs; its LSE is ``[heads, N]`` or, in older
  builds, padded ``[segments, heads, max_seqlen]`` (both layouts are normalised by :func:`packed_lse`).
  Should it refuse (head_dim, architecture), each segment goes through ``aten._scaled_dot_product_flash_attention``.
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` per segment (what SDPA runs on CPU without a
  mask; returns ``(output, logsumexp [B, H, L])`` in float32 for every input dtype).
* anything else (fp32 on CUDA: flash attention has no fp32 kernel): plain SDPA per segment and ``lse=None``;
  the caller then falls back to the importance kernel's own LSE pass.

Layout: q, k, v ``[N, heads, head_dim]`` (tokens packed, as the vision towers hold them), output
``[N, heads, head_dim]``, lse ``[heads, N]`` float32, natural log. Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["packed_lse", "varlen_attention_with_lse", "sdpa_with_lse", "lse_source"]


def _bounds(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(b) for b in cu_seqlens.reshape(-1).tolist()]
    return [int(b) for b in cu_seqlens]


def packed_lse(lse: torch.Tensor, bounds: list[int], heads: int) -> torch.Tensor:
    """A flash-attention LSE in either varlen layout → ``[heads, N]`` float32.

    ``[heads, N]`` (FlashAttention ≥ 2.4 varlen, vLLM's fork) is returned as is; ``[segments, heads, max_len]``
    (older padded layout) is unpadded segment by segment.
    """
    n = bounds[-1]
    if lse.dim() == 2 and tuple(lse.shape) == (heads, n):
        return lse.float()
    if lse.dim() == 3 and lse.shape[0] == len(bounds) - 1 and lse.shape[1] == heads:
        parts = [lse[i, :, : e - s] for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat(parts, dim=1).float() if parts else lse.new_empty((heads, 0), dtype=torch.float32)
    raise ValueError(f"unexpected flash-attention LSE shape {tuple(lse.shape)} for {heads} heads, N={n}")


def _per_segment(q, k, v, bounds, scale, op):
    outs, lses = [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D]
        if op is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        else:
            o, lse = op(qs, ks, vs, scale)
            lses.append(lse[0])
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs, dim=0) if outs else torch.empty_like(q)
    if op is None:
        return out, None
    return out, (torch.cat(lses, dim=1).float() if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32))


def _cpu_flash(qs, ks, vs, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, False, scale=scale)
    return out, lse


def _cuda_flash(qs, ks, vs, scale):
    got = torch.ops.aten._scaled_dot_product_flash_attention(qs, ks, vs, 0.0, False, False, scale=scale)
    return got[0], got[1]


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full (non-causal, unmasked) attention on ``[B, H, L, D]``: ``(output [B, H, L, D], lse [B, H, L] or None)``.

    The op SDPA itself dispatches to for such inputs where one returns the LSE; else plain SDPA and None.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    source = lse_source(q)
    if source == "cpu_flash":
        return _cpu_flash(q, k, v, scale)
    if source == "cuda_flash":
        try:
            return _cuda_flash(q, k, v, scale)
        except (RuntimeError, NotImplementedError):  # e.g. a head_dim or GPU the flash kernel refuses
            pass
    return F.scaled_dot_product_attention(q, k, v, scale=scale), None


def lse_source(q: torch.Tensor) -> str | None:
    """Which op would return the LSE for ``q`` (``"cuda_flash"``, ``"cpu_flash"``) or None (no reuse)."""
    if q.is_cuda:
        return "cuda_flash" if q.dtype in (torch.float16, torch.bfloat16) else None
    if q.device.type == "cpu":
        return "cpu_flash" if q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else None
    return None


def varlen_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | list[int],
    scale: float | None = None, max_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full attention within each ``cu_seqlens`` segment: ``(output [N, H, D], lse [H, N] float32 or None)``.

    ``lse`` is None where no op returns it (see the module doc); the output is then plain SDPA's.
    """
    if q.dim() != 3 or q.shape != k.shape or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k, v must be [N, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    bounds = _bounds(cu_seqlens)
    if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N={q.shape[0]}, got {bounds}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    source = lse_source(q)
    if source == "cpu_flash":
        return _per_segment(q, k, v, bounds, scale, _cpu_flash)
    if source == "cuda_flash":
        n_seg = len(bounds) - 1
        if max_seqlen is None:
            max_seqlen = max((e - s for s, e in zip(bounds[:-1], bounds[1:])), default=0)
        try:
            cu = (cu_seqlens.to(device=q.device, dtype=torch.int32) if isinstance(cu_seqlens, torch.Tensor)
                  else torch.tensor(bounds, dtype=torch.int32, device=q.device))
            got = torch.ops.aten._flash_attention_forward(
                q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, int(max_seqlen), int(max_seqlen),
                0.0, False, False, scale=scale)
            return got[0], packed_lse(got[1], bounds, q.shape[1])
        except (RuntimeError, ValueError, NotImplementedError):  # no varlen flash op here: one call per segment
            if n_seg == 0:
                raise
            return _per_segment(q, k, v, bounds, scale, _cuda_flash)
    return _per_segment(q, k, v, bounds, scale, None)

"""vLLM: the VisionZip scoring block's attention op hands over q, k, cu_seqlens and its log-sum-exp.

Why: the importance kernel's first pass recomputes each query row's softmax LSE; the scoring block's own
attention produces it. :func:`install` replaces the ``forward`` of that one ``MMEncoderAttention`` instance
(``visual.blocks[layer].attn.attn``) with one that computes the same attention through an op that returns
the LSE, and records what the importance needs in a :class:`Capture`:

* CUDA with vLLM's flash-attention backend: vLLM's own ``flash_attn_varlen_func(return_softmax_lse=True)``
  (the kernel the block runs anyway), else torch's varlen flash op (``harness.kernels.attention_lse``);
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` per segment — the op vLLM's SDPA path
  dispatches to there, so the block's output is unchanged bit for bit;
* anything else (fp32 on CUDA, FP8 attention): the stock forward runs and ``lse`` is None (the kernel's
  own LSE pass is the fallback).

Optionally (contextual tokens) a forward hook on the block's ``qkv`` projection keeps the keys *before* the
rotary embedding (VisionZip's contextual-merge metric, as the HF engine takes them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("harness.engines.vllm.lse_capture")

__all__ = ["Capture", "install"]


@dataclass
class Capture:
    """What the scoring block saw in its last call (reset by :meth:`take`)."""

    seen: dict[str, Any] = field(default_factory=dict)
    lse_calls: int = 0  # calls whose LSE came from the attention (tests, describe)
    fallback_calls: int = 0

    def take(self) -> dict[str, Any]:
        seen, self.seen = self.seen, {}
        if seen.get("error"):
            raise RuntimeError(f"VisionZip: {seen['error']}")
        if not seen or seen.get("q") is None or seen.get("cu") is None:
            raise RuntimeError("VisionZip: the scoring block's attention was not observed")
        return seen


def _vllm_flash_with_lse(op, q, k, v, cu, max_seqlen):
    """vLLM's varlen flash attention with its LSE, or None where it is not the backend / refuses."""
    if not (q.is_cuda and getattr(op, "is_flash_attn_backend", False)):
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

        from harness.kernels.attention_lse import packed_lse

        kwargs = {"fa_version": op._fa_version} if getattr(op, "_fa_version", None) is not None else {}
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                          max_seqlen_k=max_seqlen, softmax_scale=op.scale, causal=False,
                                          return_softmax_lse=True, **kwargs)
        return out, packed_lse(lse, [int(b) for b in cu.tolist()], q.shape[1])
    except Exception:  # noqa: BLE001 - another build of the op: torch's flash op instead
        logger.debug("vLLM flash_attn_varlen_func with return_softmax_lse failed", exc_info=True)
        return None


_REPORTED: list[str] = []


def _report_once(source: str) -> None:
    """One log line per process saying where the scoring block's LSE came from (a server's log is the only
    place a ``vllm serve`` run can show it: benchmarks/bench_vllm_serve.py reads it)."""
    if not _REPORTED:
        _REPORTED.append(source)
        logger.warning("harness VisionZip scoring-block LSE source: %s", source)


def install(op, qkv_module=None, want_keys: bool = False) -> Capture:
    """Make ``op`` (the scoring block's ``MMEncoderAttention``) record q, k, cu_seqlens, lse (and the
    pre-rotary keys from ``qkv_module``'s output when ``want_keys``) into the returned :class:`Capture`."""
    import torch

    from harness.kernels.attention_lse import varlen_attention_with_lse

    cap = Capture()
    stock = op.forward

    def forward(query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        if query.dim() != 4 or query.shape[0] != 1 or getattr(op, "fp8_enabled", False):
            cap.seen.clear()  # not the layout Qwen3-VL's vision tower uses: stock, nothing captured
            cap.fallback_calls += 1
            return stock(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         sequence_lengths=sequence_lengths)
        q3, k3, v3 = query[0], key[0], value[0]  # [N, H, D]
        if cu_seqlens is None:
            cu = torch.tensor([0, q3.shape[0]], dtype=torch.int32, device=q3.device)
        else:
            cu = (cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)).to(q3.device)
        if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != q3.shape[0]:
            # FlashInfer's ViT path passes rescaled/padded offsets: not segment bounds of the packed tokens
            cap.seen = {"error": f"the {getattr(op, 'attn_backend', '?')} ViT attention backend passes cu_seqlens "
                                 "that are not token offsets; VisionZip needs FLASH_ATTN, TRITON_ATTN or TORCH_SDPA "
                                 "(vLLM's mm_encoder_attn_backend)"}
            cap.fallback_calls += 1
            return stock(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         sequence_lengths=sequence_lengths)
        cap.seen.update(q=q3, k=k3, cu=cu, lse=None)
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        got = _vllm_flash_with_lse(op, q3, k3, v3, cu.to(torch.int32), longest)
        source = "vLLM flash_attn_varlen_func (vLLM's own attention LSE reused)" if got is not None else None
        if got is None:
            out, lse = varlen_attention_with_lse(q3, k3, v3, cu, scale=op.scale, max_seqlen=longest)
            got = (out, lse) if lse is not None else None
            source = "torch varlen flash op (LSE reused)" if got is not None else None
        _report_once(source or "none: stock attention, the importance kernel's own LSE pass")
        if got is None:
            cap.fallback_calls += 1
            return stock(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         sequence_lengths=sequence_lengths)
        out, lse = got
        cap.seen["lse"] = lse
        cap.lse_calls += 1
        return out.to(query.dtype).unsqueeze(0)

    op.forward = forward
    if want_keys and qkv_module is not None:
        heads = getattr(op, "num_heads")

        def keys_hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output  # [s, b=1, 3·H·D]
            s = x.shape[0]
            cap.seen["keys"] = x.reshape(s, 3, heads, -1)[:, 1].detach().clone()

        qkv_module.register_forward_hook(keys_hook)
    return cap

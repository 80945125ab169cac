"""HF engine: a decode-step forward for Qwen3-family attention — one packed QKV GEMM and one fused norm/RoPE region.

Why (issue 17, profile in ``results/benchmarks/run_path_breakdown_attn.json``): at B=1 on the H200 a decode step's
attention block launches, per layer, three small GEMMs for q/k/v (5–7 µs each where the bytes need ~1–4 µs), two
RMS norms, the RoPE kernels and the transposes, one at a time. This forward, used for one-token passes only,
reads q/k/v weights as one packed matrix in one GEMM and computes both head norms and RoPE in one function that
the compiled decode path (:mod:`harness.engines.hf.compiled`, ``region``) compiles once for every layer; a static
cache is written in one launch (``harness.kernels.decode_attention.static_cache_write``, transformers' update takes
five); the attention function (``config._attn_implementation``: the Triton decode kernel or SDPA) and ``o_proj``
are the model's own. Any other pass (prefill, q_len > 1) runs the model's original forward, untouched.

Packing: q/k/v weights are copied once into one ``[(Hq + 2·Hkv)·D, hidden]`` tensor and each projection's
``weight`` becomes a view of it (no second copy in memory); state dicts and the prefill see the same values.

The forward mirrors transformers' ``Qwen3*Attention.forward`` (5.17 and 5.24: same computation; the cache argument
is ``past_key_values`` in 5.17, ``cache`` in 5.24): q/k RMS norm per head, RoPE, ``cache.update``, the registered
attention function, ``o_proj``. Only classes known to compute exactly that are accepted (:data:`CLASSES`);
``tests/engines/hf/test_hf_decode_forward.py`` checks greedy tokens against the original forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from harness.engines.hf.compiled import region

CLASSES = ("Qwen3VLMoeTextAttention", "Qwen3MoeAttention", "Qwen3Attention", "Qwen3VLTextAttention")


def unsupported_reason(attn: torch.nn.Module) -> str | None:
    """Why ``attn`` cannot take the packed decode forward (None when it can)."""
    name = type(attn).__name__
    if name not in CLASSES:
        return f"{name} is not a Qwen3-family attention ({', '.join(CLASSES)})"
    for proj in ("q_proj", "k_proj", "v_proj"):
        if getattr(getattr(attn, proj), "bias", None) is not None:
            return f"{name}.{proj} has a bias"
    if getattr(attn, "sliding_window", None):
        return f"{name} uses a sliding window"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3*RMSNorm.forward`` with the weight as an argument (bit-identical: same ops in the same order)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@region
def qkv_heads(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
              cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """Packed projections [B, T, (Hq + 2·Hkv)·D] → q, k (normed, rotated) and v as [B, H, T, D]."""
    b, t = qkv.shape[:2]
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = _rms(q.view(b, t, q_heads, head_dim), q_weight, q_eps).transpose(1, 2)
    k = _rms(k.view(b, t, kv_heads, head_dim), k_weight, k_eps).transpose(1, 2)
    v = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def pack_qkv(attn: torch.nn.Module) -> torch.Tensor:
    """One packed weight; q/k/v ``weight``s become views of it. Returns the packed tensor (idempotent)."""
    packed = getattr(attn, "_harness_qkv", None)
    if packed is not None:
        return packed
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    with torch.no_grad():
        packed = torch.cat([p.weight.detach() for p in projs], dim=0).contiguous()
        row = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight.data = packed[row:row + n]
            row += n
    attn._harness_qkv = packed
    return packed


def decode_forward(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                   cache: Any = None, **kwargs):
    """One-token pass of a Qwen3-family attention (see the module doc)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    packed = attn._harness_qkv
    cfg = attn.config
    q_heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    cos, sin = position_embeddings
    q, k, v = qkv_heads(torch.nn.functional.linear(hidden_states, packed), attn.q_norm.weight, attn.k_norm.weight,
                        float(attn.q_norm.variance_epsilon), float(attn.k_norm.variance_epsilon), cos, sin,
                        q_heads, kv_heads, attn.head_dim)
    if cache is not None:
        k, v = _cache_update(cache, attn.layer_idx, k, v)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, _eager_attention(attn))
    out, weights = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return attn.o_proj(out), weights


def _cache_update(cache: Any, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
    """``cache.update`` — for an initialised static layer (transformers' ``StaticLayer``, same code in 5.17 and
    5.24: write at ``cumulative_length``, then add one) as one kernel launch plus the increment."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if type(layer).__name__ == "StaticLayer" and getattr(layer, "is_initialized", False) \
            and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) and k.shape[2] == 1:
        from harness.kernels.decode_attention import static_cache_write

        static_cache_write(k, v, layer.keys, layer.values, layer.cumulative_length)
        return layer.keys, layer.values
    return cache.update(k, v, layer_idx)


def _eager_attention(attn: torch.nn.Module):
    return getattr(sys.modules[type(attn).__module__], "eager_attention_forward")


def install(model: torch.nn.Module) -> int:
    """Give every supported text attention module of ``model`` the packed decode forward; returns how many."""
    n = 0
    for name, attn in model.named_modules():
        if "visual" in name or not hasattr(attn, "q_proj") or unsupported_reason(attn) is not None:
            continue
        if getattr(attn, "_harness_decode_forward", False):
            n += 1
            continue
        pack_qkv(attn)
        original = attn.forward

        def forward(hidden_states, position_embeddings=None, attention_mask=None, *args, _attn=attn,
                    _original=original, **kwargs):
            if hidden_states.shape[1] != 1 or _attn.training:
                return _original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
            cache = args[0] if args else kwargs.pop("cache", None)
            if cache is None:
                cache = kwargs.pop("past_key_values", None)
            else:
                kwargs.pop("past_key_values", None)
            return decode_forward(_attn, hidden_states, position_embeddings, attention_mask, cache, **kwargs)

        attn.forward = forward
        attn._harness_decode_forward = True
        attn._harness_original_forward = original
        n += 1
    return n


def uninstall(model: torch.nn.Module) -> None:
    """The original forwards back (the packed weight stays: the projections keep viewing it)."""
    for attn in model.modules():
        if getattr(attn, "_harness_decode_forward", False):
            attn.forward = attn._harness_original_forward
            del attn._harness_decode_forward, attn._harness_original_forward

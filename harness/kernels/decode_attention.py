"""Decode attention in Triton: one query per row against a static KV cache, grouped-query heads read once.

Why (issue 17): at decode, transformers' SDPA path with a mask (a static cache always has one) first
*materialises* the grouped K/V for every query head (``repeat_kv``: [B, Hkv, L, D] → [B, Hq, L, D], a copy of
``Hq/Hkv`` × the cache per layer and step), then runs a general masked kernel over the whole cache, then
transposes the output. At Qwen3-30B-A3B shapes (32 query heads over 4 KV heads) that copy alone moves 8× the
cache; on the H200 the attention block was 2.8 ms of a 6.2 ms step at B=1 and 12 ms of 29 ms at B=64
(``results/benchmarks/run_path.md``). This kernel reads each KV head once for its ``G = Hq/Hkv`` query heads,
skips cache blocks the mask fully hides (the unwritten tail of a static cache), and writes the
``[B, 1, Hq, D]`` layout the attention module's ``o_proj`` consumes.

Semantics (:func:`decode_attention_reference`, float32): ``out[b, 0, h] = softmax(scale · q[b, h] · K[b, h//G]ᵀ
+ bias[b]) · V[b, h//G]`` where the mask is SDPA's: boolean (True = attend) or additive float, shape
``[B or 1, 1, 1, L]``; ``None`` attends to every position. A row whose positions are all masked gives zeros
(SDPA would give NaN; such rows never occur in decoding, where the current token is always visible).

Pipeline (flash-decoding)::

    grid (B, Hkv, S): program = one KV head of one row, one of S contiguous chunks of the cache
        for each BLOCK_L block of its chunk: skip if the mask hides all of it; else
            scores [G, BLOCK_L] = q_group · Kᵀ (tl.dot, fp32 accumulate), online softmax, acc += p · V
        S = 1: normalise and store the output; S > 1: store (m, l, acc) partials (fp32)
    S > 1: combine, grid (B, Hkv): rescale the S partials to the common max and add them

S is chosen from the shapes only (about two programs per SM, never more than the cache's blocks), so grids are
fixed for a given (B, L): CUDA-graph capturable. ``torch.ops.harness.decode_attention`` wraps it as a custom op
with a fake implementation, so ``torch.compile`` treats it as one node.

Under the interpreter, bf16 tiles are upcast before ``tl.dot`` as in :mod:`harness.kernels.fused_moe` (the
interpreter multiplies raw bf16 bits). Imports: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels._triton import triton_runs

__all__ = ["decode_attention", "decode_attention_triton", "decode_attention_reference", "triton_available",
           "num_splits", "unsupported_reason", "static_cache_write", "static_cache_write_reference"]

BLOCK_L_GPU = 64
BLOCK_L_INTERPRETER = 16



def triton_available(device: torch.device | str) -> bool:
    """True on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` before triton's import)."""
    return triton_runs(device, _attn_kernel)


def _mask_row(mask: torch.Tensor | None) -> torch.Tensor | None:
    """SDPA's decode mask [B|1, 1, 1, L] as a [B|1, L] view (no copy), or None."""
    if mask is None:
        return None
    return mask[:, 0, 0, :]


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None) -> str | None:
    """Why these decode-attention inputs cannot take the kernel (None when they can)."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: need 4-D, K = V shape"
    b, hq, q_len, d = query.shape
    if q_len != 1:
        return f"{q_len} queries per row (decode has one)"
    if key.shape[0] != b or key.shape[3] != d or hq % key.shape[1]:
        return f"query {tuple(query.shape)} and key {tuple(key.shape)} do not form grouped-query attention"
    if d > 256:
        return f"head_dim {d} > 256"
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16) or key.dtype != query.dtype \
            or value.dtype != query.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype}: need one of fp32/bf16/fp16"
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != key.shape[2] \
                or mask.shape[0] not in (1, b):
            return f"mask {tuple(mask.shape)}: need [B or 1, 1, 1, {key.shape[2]}]"
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            return f"mask dtype {mask.dtype}: need bool or float"
    return None


def decode_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Float32 definition: [B, Hq, 1, D] queries, [B, Hkv, L, D] K/V → [B, 1, Hq, D] in ``query.dtype``."""
    b, hq, _, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    q = query.float().reshape(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhld->bhgl", q, key.float()) * scale
    row = _mask_row(mask)
    if row is not None:
        row = row.expand(b, length)
        if row.dtype == torch.bool:
            scores = scores.masked_fill(~row[:, None, None, :], float("-inf"))
        else:
            scores = scores + row.float()[:, None, None, :]
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)      # an all-masked row: zeros
    out = torch.einsum("bhgl,bhld->bhgd", probs, value.float())
    return out.reshape(b, 1, hq, d).to(query.dtype)


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, acc_ptr, ml_ptr,
    L, CHUNK, scale,
    sqb, sqh, sqd, skb, skh, skl, skd, svb, svh, svl, svd, smb, sml, sob, soh, sod,
    S,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    MASK_KIND: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One (row b, KV head hk, chunk s): online softmax over the chunk's unmasked blocks."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    b64 = b.to(tl.int64)
    q_ptrs = q_ptr + b64 * sqb + (hk * G + g)[:, None] * sqh + d[None, :] * sqd
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b64 * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b64 * svb + hk.to(tl.int64) * svh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for l0 in range(start, end, BLOCK_L):
        offs = l0 + tl.arange(0, BLOCK_L)
        l_ok = offs < end
        if MASK_KIND == 1:
            keep = tl.load(mask_ptr + b64 * smb + offs * sml, mask=l_ok, other=0) != 0
            valid = l_ok & keep
        elif MASK_KIND == 2:
            bias = tl.load(mask_ptr + b64 * smb + offs * sml, mask=l_ok, other=float("-inf")).to(tl.float32)
            valid = l_ok & (bias != float("-inf"))
        else:
            valid = l_ok
        if tl.sum(valid.to(tl.int32), 0) > 0:          # a block the mask hides entirely is not read
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs[:, None] * skl + d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs[:, None] * svl + d[None, :] * svd, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
            if MASK_KIND == 2:
                scores = scores + bias[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new

    if SPLIT:
        part = (b64 * tl.num_programs(1) + hk) * S + s
        tl.store(acc_ptr + (part * BLOCK_G + g)[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(ml_ptr + (part * BLOCK_G + g) * 2, m_i)
        tl.store(ml_ptr + (part * BLOCK_G + g) * 2 + 1, l_i)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b64 * sob + (hk * G + g)[:, None] * soh + d[None, :] * sod
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_combine_kernel(
    acc_ptr, ml_ptr, out_ptr, S, sob, soh, sod,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s over the S chunk partials of one (row, KV head)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    base = (b.to(tl.int64) * tl.num_programs(1) + hk) * S
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, S):
        m_all = tl.maximum(m_all, tl.load(ml_ptr + ((base + s) * BLOCK_G + g) * 2))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    num = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_G], dtype=tl.float32)
    for s in range(0, S):
        row = (base + s) * BLOCK_G + g
        w = tl.exp(tl.load(ml_ptr + row * 2) - m_safe)
        den += w * tl.load(ml_ptr + row * 2 + 1)
        num += w[:, None] * tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :])
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    o_ptrs = out_ptr + b.to(tl.int64) * sob + (hk * G + g)[:, None] * soh + d[None, :] * sod
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


MIN_BLOCKS_PER_SPLIT = 4


def num_splits(batch: int, kv_heads: int, length: int, block_l: int, device: torch.device) -> int:
    """Chunks per (row, KV head): about two programs per SM in all, at least :data:`MIN_BLOCKS_PER_SPLIT` blocks
    per chunk (a short cache is one chunk: the combine launch would cost more than the parallelism gains; on the
    H200 at B=1 and 128 positions the second launch was ~1.7 µs of a ~6 µs attention). Depends on the shapes
    only, so a captured graph's grid never changes."""
    blocks = triton.cdiv(length, block_l)
    if device.type != "cuda":
        return min(blocks, 2)              # the interpreter: still exercise the split path, cheaply
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(blocks, MIN_BLOCKS_PER_SPLIT), triton.cdiv(2 * sms, batch * kv_heads)))


def decode_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            mask: torch.Tensor | None, scale: float, *, splits: int | None = None) -> torch.Tensor:
    """The kernel (see the module doc): [B, Hq, 1, D] queries → [B, 1, Hq, D]. ``splits`` forces the chunk count."""
    reason = unsupported_reason(query, key, value, mask)
    if reason:
        raise ValueError(f"decode_attention: {reason}")
    if not triton_available(query.device):
        raise RuntimeError(f"Triton cannot run on {query.device} (use CUDA, or TRITON_INTERPRET=1)")
    b, hq, _, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    group = hq // hkv
    cuda = query.device.type == "cuda"
    block_l = BLOCK_L_GPU if cuda else BLOCK_L_INTERPRETER
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
    if b == 0:
        return out
    n_split = splits or num_splits(b, hkv, length, block_l, query.device)
    chunk = triton.cdiv(triton.cdiv(length, block_l), n_split) * block_l
    n_split = triton.cdiv(length, chunk)
    row = _mask_row(mask)
    if row is None:
        mask_kind, mask_arg, smb, sml = 0, query, 0, 0
    else:
        mask_kind = 1 if row.dtype == torch.bool else 2
        mask_arg = row
        smb = row.stride(0) if row.shape[0] > 1 else 0
        sml = row.stride(1)
    split = n_split > 1
    if split:
        acc = torch.empty((b * hkv * n_split * block_g, block_d), dtype=torch.float32, device=query.device)
        ml = torch.empty((b * hkv * n_split * block_g, 2), dtype=torch.float32, device=query.device)
    else:
        acc = ml = out
    upcast = query.dtype != torch.float32 and not cuda
    precision = "ieee" if query.dtype == torch.float32 or upcast else "tf32"
    so = out.view(b, hq, d)
    _attn_kernel[(b, hkv, n_split)](
        query, key, value, mask_arg, out, acc, ml,
        length, chunk, float(scale),
        query.stride(0), query.stride(1), query.stride(3),
        key.stride(0), key.stride(1), key.stride(2), key.stride(3),
        value.stride(0), value.stride(1), value.stride(2), value.stride(3),
        smb, sml, so.stride(0), so.stride(1), so.stride(2),
        n_split,
        G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_L=block_l,
        MASK_KIND=mask_kind, SPLIT=split, UPCAST=upcast, INPUT_PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    if split:
        _attn_combine_kernel[(b, hkv)](acc, ml, out, n_split, so.stride(0), so.stride(1), so.stride(2),
                                  G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, num_warps=4)
    return out


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, pos_ptr, H,
                        skb, skh, skd, svb, svh, svd, sKb, sKh, sKl, sKd, sVb, sVh, sVl, sVd,
                        D: tl.constexpr, BLOCK_D: tl.constexpr):
    """keys[b, h, pos] = k[b, h, 0] and values[b, h, pos] = v[b, h, 0]; pos read from the device."""
    b = (tl.program_id(0) // H).to(tl.int64)
    h = (tl.program_id(0) % H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    pos = tl.load(pos_ptr).to(tl.int64)
    k = tl.load(k_ptr + b * skb + h * skh + d * skd, mask=ok)
    v = tl.load(v_ptr + b * svb + h * svh + d * svd, mask=ok)
    tl.store(keys_ptr + b * sKb + h * sKh + pos * sKl + d * sKd, k, mask=ok)
    tl.store(values_ptr + b * sVb + h * sVh + pos * sVl + d * sVd, v, mask=ok)


def static_cache_write_reference(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 position: torch.Tensor) -> None:
    """transformers' ``StaticLayer.update`` for one token: write at ``position`` (a 0-d device tensor), then +1."""
    pos = position.view(1)
    keys.index_copy_(2, pos, key)
    values.index_copy_(2, pos, value)
    position.add_(1)


def static_cache_write(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       position: torch.Tensor) -> None:
    """One decode token's K/V into a static cache in one launch (transformers' update takes five: arange, add,
    two index_copy, add), then ``position += 1``. ``key``/``value`` [B, Hkv, 1, D]; ``keys``/``values``
    [B, Hkv, L, D]; ``position`` a 0-d int tensor on the device (the layer's ``cumulative_length``)."""
    b, h, t, d = key.shape
    if t != 1 or value.shape != key.shape or keys.shape[:2] != (b, h) or keys.shape[3] != d \
            or values.shape != keys.shape or position.numel() != 1:
        raise ValueError(f"static_cache_write: key {tuple(key.shape)}, cache {tuple(keys.shape)}, "
                         f"position {tuple(position.shape)}")
    if not triton_available(key.device):
        static_cache_write_reference(key, value, keys, values, position)
        return
    _cache_write_kernel[(b * h,)](
        key, value, keys, values, position, h,
        key.stride(0), key.stride(1), key.stride(3), value.stride(0), value.stride(1), value.stride(3),
        keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        D=d, BLOCK_D=triton.next_power_of_2(d), num_warps=1)
    position.add_(1)


@torch.library.custom_op("harness::decode_attention", mutates_args=())
def _decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    if triton_available(query.device):
        return decode_attention_triton(query, key, value, mask, scale)
    return decode_attention_reference(query, key, value, mask, scale)


@_decode_attention_op.register_fake
def _decode_attention_fake(query, key, value, mask, scale):
    b, hq, _, d = query.shape
    return query.new_empty((b, 1, hq, d))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Dispatcher: the custom op under ``torch.compile``, the Triton wrapper where Triton runs, else the
    float32 reference."""
    if torch.compiler.is_compiling():
        return torch.ops.harness.decode_attention(query, key, value, mask, scale)
    if triton_available(query.device):
        return decode_attention_triton(query, key, value, mask, scale)
    return decode_attention_reference(query, key, value, mask, scale)

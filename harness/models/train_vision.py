"""Vision-tower helpers of the embedded model's training (``harness.models.train_tiny``).

Why apart: they are about *how* the tower is trained, not about the recipe — two speed-ups that leave the
numbers unchanged (per-grid position caching, one packed attention call per block instead of one per image;
both checked against the original path at start-up, and undone if they differ) and the attention-focus loss's
probe, which reads the last block's q/k during the ordinary forward pass.
"""

from __future__ import annotations

import sys
from typing import Any


def _dedup_by_grid(fn, cacheable: bool):
    """Wrap a per-image function of ``grid_thw`` (positions, interpolation indices): run it once per distinct
    grid and concatenate the blocks in image order (the original loops over every image in Python)."""
    import torch

    cache: dict = {}

    def cat(blocks, n_rows):
        first = blocks[0]
        dim = next(d for d in range(first.dim()) if all(b.shape[d] == n for b, n in zip(blocks, n_rows)))
        return torch.cat(blocks, dim=dim)

    def wrapped(grid_thw, *args, **kwargs):
        rows = [tuple(int(v) for v in r) for r in grid_thw.tolist()]
        parts = {}
        for r in dict.fromkeys(rows):
            if cacheable and r in cache:
                parts[r] = cache[r]
                continue
            out = fn(torch.tensor([r], device=grid_thw.device, dtype=grid_thw.dtype), *args, **kwargs)
            parts[r] = out
            if cacheable:
                cache[r] = out
        sizes = [r[0] * r[1] * r[2] for r in rows]
        outs = [parts[r] for r in rows]
        if isinstance(outs[0], tuple):
            return tuple(cat(list(x), sizes) for x in zip(*outs))
        return cat(outs, sizes)

    return wrapped


def dedup_vision_positions(model) -> list[str]:
    """Per-distinct-grid versions of the vision tower's position helpers, whichever this transformers version
    has (module functions in ≥ 5.19, methods before). Returns what was wrapped. Training only."""
    import types

    mod = sys.modules[type(model.model.visual).__module__]
    done = []
    for name in ("get_vision_interpolation_indices_and_weights", "get_vision_position_ids"):
        if hasattr(mod, name):
            setattr(mod, name, _dedup_by_grid(getattr(mod, name), cacheable=True))
            done.append(name)
    visual = model.model.visual
    for name, cacheable in (("rot_pos_emb", True), ("fast_pos_embed_interpolate", False)):
        if hasattr(visual, name):
            orig = getattr(visual, name)
            setattr(visual, name, types.MethodType(lambda self, g, _f=_dedup_by_grid(orig, cacheable): _f(g), visual))
            done.append(name)
    return done


def pack_vision_attention(model) -> None:
    """Every vision block attends over all images of the batch in one masked SDPA call (block-diagonal mask
    from ``cu_seqlens``) instead of transformers' per-image loop — the same result, far fewer kernel launches
    for a batch of hundreds of small images. Training only; the saved model is stock."""
    import types

    import torch
    import torch.nn.functional as F

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        cu = cu_seqlens.long()
        seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), cu[1:] - cu[:-1])
        mask = (seg[:, None] == seg[None, :])[None, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=self.scaling)
        return self.proj(o[0].transpose(0, 1).reshape(n, -1))

    for block in model.model.visual.blocks:
        rotary = getattr(sys.modules[type(block.attn).__module__], "apply_rotary_pos_emb_vision")
        block.attn.forward = types.MethodType(forward, block.attn)


class FocusProbe:
    """Captures q/k of the last vision block during the forward pass and gives the attention-focus loss."""

    def __init__(self, model):
        self.attn = model.model.visual.blocks[-1].attn
        self.rotary = getattr(sys.modules[type(self.attn).__module__], "apply_rotary_pos_emb_vision")
        self.captured: dict[str, Any] = {}

        def pre_hook(module, args, kwargs):
            self.captured["cu"] = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
            self.captured["pe"] = kwargs.get("position_embeddings", args[2] if len(args) > 2 else None)

        def qkv_hook(module, args, output):
            self.captured["qkv"] = output

        self.handles = [self.attn.register_forward_pre_hook(pre_hook, with_kwargs=True),
                        self.attn.qkv.register_forward_hook(qkv_hook)]

    def received(self):
        """[N] attention each patch receives (column sums within its image, mean over heads) and segment ids."""
        import torch

        qkv = self.captured.pop("qkv")
        n = qkv.shape[0]
        q, k, _ = qkv.reshape(n, 3, self.attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = self.captured["pe"]
        q, k = self.rotary(q, k, cos, sin)
        cu = self.captured["cu"].long()
        seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), cu[1:] - cu[:-1])
        logits = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * self.attn.scaling
        logits = logits.masked_fill((seg[:, None] != seg[None, :])[None], float("-inf"))
        return torch.softmax(logits, dim=-1).sum(dim=1).mean(dim=0), seg, cu

    def loss(self, content):
        """Cross-entropy of the content mask (as a distribution per image) against the received attention."""
        import torch

        recv, seg, cu = self.received()
        sizes = (cu[1:] - cu[:-1]).float()
        r = recv / sizes[seg]  # each image's distribution sums to 1
        t = content.float()
        per = torch.zeros(len(sizes), device=r.device).index_add_(0, seg, t)
        t = t / per[seg].clamp(min=1)
        ce = torch.zeros(len(sizes), device=r.device).index_add_(0, seg, -t * torch.log(r + 1e-8))
        has = per > 0
        # mass on content patches (a readable figure): mean over images of sum of r over content patches
        mass = torch.zeros(len(sizes), device=r.device).index_add_(0, seg, r * content.float())
        return ce[has].mean(), mass[has].mean()

"""The pointer loss (training only, recipe v6): at the position that emits a multiple-choice answer, one head of the
last text layer is trained to attend to the correct option's word.

Why (docs/embedded_model_v4.md §6-7): with the option loss (v5) the letter is readable at every option word —
accuracy 1.0 — and still MCQ, and even the text-only ``mcq_hint`` lookup, stayed at chance: the answer position
never learns *which* option to read. This loss supervises exactly that step: the attention of head 0 of the last
layer, from the last prompt position (whose output is the answer letter) onto the correct option word's first
token. Its gradient reaches that head's query — and through it the earlier layers that must carry the attribute
read from the image (or the hint word) to the answer position; the other heads stay free.

How: an attention function registered with transformers' ``AttentionInterface`` (SDPA's output, SDPA's mask
function) that, in the probed layer only, also computes the softmax row of the probed queries; set on the text
config during training and reset before the checkpoint is saved, so inference is unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "harness_train_pointer"
_STATE: dict[str, Any] = {"rows": None, "layer": None, "weights": None}
_REGISTERED = False


def pointer_targets(example: dict) -> np.ndarray:
    """[2] int32 (query position, key position) of a multiple-choice training example — the last prompt position
    and the correct option word's first token — or [0] where the example has no option naming its answer."""
    options, ids, n = example.get("options"), example["ids"], example["n_prompt"]
    if options is None or len(options) == 0 or n >= len(ids):
        return np.zeros(0, dtype=np.int32)
    hit = np.nonzero(options[:, 1] == ids[n])[0]  # the option whose letter is the answer's first token
    if len(hit) != 1:
        return np.zeros(0, dtype=np.int32)
    return np.asarray([n - 1, options[hit[0], 0]], dtype=np.int32)


def _forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
             **kwargs):
    """SDPA, plus the probed rows' attention of head 0 when ``module`` is the probed layer."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
    rows = _STATE["rows"]
    if rows is not None and getattr(module, "layer_idx", None) == _STATE["layer"]:
        b, qpos = rows  # [n], [n]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q = query[b, 0, qpos].float()  # head 0: [n, D]
        k = key[b, 0].float()  # head 0's KV head (GQA: query head 0 reads KV head 0): [n, L, D]
        logits = torch.einsum("nd,nld->nl", q, k) * scale
        keep = torch.arange(k.shape[1], device=k.device)[None, :] <= qpos[:, None]  # causal
        if attention_mask is not None:
            m = attention_mask[b, 0, qpos]  # [n, L]: bool (attend) or additive float
            keep = keep & (m if m.dtype == torch.bool else m > -1e4)
        _STATE["weights"] = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return out


def install(model, layer: int = -1) -> str:
    """Switch the text decoder to the probing attention, probing text layer ``layer`` (negative: from the end);
    returns the implementation to restore."""
    global _REGISTERED
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not _REGISTERED:
        AttentionInterface.register(NAME, _forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _REGISTERED = True
    cfg = model.config.text_config
    n = cfg.num_hidden_layers
    if not -n <= layer < n:
        raise ValueError(f"pointer layer {layer} outside the {n} text layers")
    before = cfg._attn_implementation
    if before != "sdpa":
        raise ValueError(f"the pointer loss needs the text model on sdpa, not {before!r}")
    cfg._attn_implementation = NAME
    _STATE["layer"] = layer % n
    return before


def uninstall(model, before: str) -> None:
    model.config.text_config._attn_implementation = before
    _STATE.update(rows=None, weights=None)


def arm(batch: dict) -> bool:
    """Probe this batch's pointer rows (``batch["ptr"]``: [n, 3] = row, query position, key position) in the next
    forward pass; False (nothing probed) when the batch has none."""
    ptr = batch.get("ptr")
    if ptr is None or ptr.shape[0] == 0:
        _STATE["rows"] = None
        return False
    _STATE["rows"] = (ptr[:, 0], ptr[:, 1])
    return True


def loss(batch: dict):
    """(−log attention on the correct option word, mean attention there) of the armed rows."""
    import torch

    weights = _STATE.pop("weights", None)
    _STATE["weights"] = None
    _STATE["rows"] = None
    if weights is None:
        raise RuntimeError("the probed layer did not run: was the pointer attention installed?")
    ptr = batch["ptr"]
    on = weights[torch.arange(len(ptr), device=weights.device), ptr[:, 2].to(weights.device)]
    return -torch.log(on + 1e-6).mean(), float(on.mean())

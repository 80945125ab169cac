"""VisionZip in vLLM (per-image fixed ratio): the processor and model subclasses of vLLM's Qwen3-VL-MoE that
prune each image's visual tokens.

:func:`harness.engines.vllm.plugin.register` registers the architecture :data:`VZ_ARCH` (resolved lazily
through this module's ``__getattr__``, so importing it does not import vLLM) when ``HARNESS_VZ_KEEP`` < 1;
the engine selects it with ``hf_overrides={"architectures": [VZ_ARCH]}``. What the classes do:
:func:`_visionzip_classes`; the conventions: docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

from harness.engines.vllm import lse_capture
from harness.engines.vllm.settings import ENV_VZ_KEEP, VZ_ARCH, VisionZipSettings

_VZ_CLASSES: dict[str, Any] = {}


def _visionzip_classes() -> dict[str, Any]:
    """Build (once) the processor and model subclasses of vLLM's Qwen3-VL-MoE that prune images.

    - Processor: each image's placeholder run is cut to ``kept(n)`` tokens when vLLM applies its prompt
      updates (so the scheduler, the KV cache and ``prompt_token_ids`` see the pruned length).
    - Model: the scoring vision block's attention op (``blocks[layer].attn.attn``, vLLM's
      ``MMEncoderAttention``) hands over q and k *after* the rotary embedding (what the attention consumes,
      as the HF side scores them) and its own log-sum-exp (:mod:`harness.engines.vllm.lse_capture`: the
      importance kernel then skips its LSE pass); ``_postprocess_image_embeds_evs`` — the hook Qwen3-VL calls on
      every image embedding — scores patches (``harness.kernels.importance.compute_importance``, column sums
      averaged over heads), merges them per LLM token (``merge_unit_scores``), selects per image
      (``select_tokens(scope="image")``), gathers the kept rows (main and deepstack channels are one row in
      vLLM, so deepstack is pruned alike) and appends 5 position channels ``[t, h, w, full+1, 0]``: the
      kept token's original (t, h, w) in the image grid (``full`` = max(H'-1, W'-1), kept for reference).
    - Positions (the HF VisionZip convention: kept tokens at their original (t, h, w), text after an image
      at its *unpruned* position, decode continuing from the unpruned maximum): ``get_mrope_input_positions``
      lays the text out as if nothing were pruned (text positions do not depend on which tokens are kept),
      and ``recompute_mrope_positions`` — which vLLM's runner calls with the embeddings of each step when
      multimodal pruning is on — strips the channels and writes base + (t, h, w) for the kept tokens.
      (vLLM's EVS helper ``evs.recompute_mrope_positions`` is not used: it compacts the text after a pruned
      item, and it mislocates the second of two items that arrive in one chunk.)
    The model runner calls it because the engine turns vLLM's multimodal pruning on
    (``video_pruning_rate > 0``; videos are refused anyway with ``limit_mm_per_prompt={"video": 0}``).
    """
    if _VZ_CLASSES:
        return _VZ_CLASSES
    import torch
    from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder, Qwen3VLMultiModalProcessor
    from vllm.model_executor.models.qwen3_vl_moe import (
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLMoeProcessingInfo,
    )
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing import PromptReplacement

    from harness.kernels.importance import compute_importance
    from harness.techniques.visionzip.pruning import merge_unit_scores, select_tokens

    def settings() -> VisionZipSettings:
        st = VisionZipSettings.from_env()
        if st is None:
            raise RuntimeError(f"{VZ_ARCH} needs {ENV_VZ_KEEP} < 1 in the environment")
        return st

    class HarnessVisionZipProcessor(Qwen3VLMultiModalProcessor):
        def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
            st = settings()
            updates = list(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs))
            for i, upd in enumerate(updates):
                if upd.modality != "image":
                    continue
                full = upd.replacement

                def replacement(item_idx: int, full=full):
                    ids = full(item_idx) if callable(full) else full
                    return list(ids)[: st.kept(len(ids))]

                updates[i] = PromptReplacement(modality="image", target=upd.target, replacement=replacement)
            return updates

    @MULTIMODAL_REGISTRY.register_processor(HarnessVisionZipProcessor, info=Qwen3VLMoeProcessingInfo,
                                            dummy_inputs=Qwen3VLDummyInputsBuilder)
    class HarnessVisionZipQwen3VLMoe(Qwen3VLMoeForConditionalGeneration):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._vz = settings()
            self._vz_seen: dict[str, Any] = {}
            blocks = self.visual.blocks
            if not -len(blocks) <= self._vz.layer < len(blocks):
                raise ValueError(f"visionzip.layer={self._vz.layer} out of range for {len(blocks)} blocks")
            op = blocks[self._vz.layer].attn.attn
            self._vz_scale = float(getattr(op, "scale", 0.0) or 0.0) or None
            # q, k, cu_seqlens and the attention's own LSE (harness.engines.vllm.lse_capture)
            self._vz_capture = lse_capture.install(op)

        def _vz_select(self, grid_thw) -> list:
            seen = self._vz_capture.take()
            q, k, cu = seen["q"], seen["k"], seen["cu"]
            scores = compute_importance(q.contiguous(), k.contiguous(), cu.to(q.device), scale=self._vz_scale,
                                        lse=seen.get("lse"))
            merge = int(self.visual.spatial_merge_size)
            unit = merge_unit_scores(scores.float(), grid_thw, merge)
            return select_tokens(unit, self._vz.keep, scope="image", min_per_image=self._vz.min_per_image)

        def _postprocess_image_embeds_evs(self, image_embeds_split, image_input):
            grid = image_input["image_grid_thw"]
            kept = self._vz_select(grid)
            merge = int(self.visual.spatial_merge_size)
            out = []
            for emb, idx, (t, h, w) in zip(image_embeds_split, kept, grid.tolist(), strict=True):
                hh, ww = h // merge, w // merge
                if emb.shape[0] != t * hh * ww or idx.numel() != self._vz.kept(emb.shape[0]):
                    raise RuntimeError(f"VisionZip: {emb.shape[0]} tokens, {idx.numel()} kept, grid {(t, h, w)}")
                idx = idx.to(emb.device)
                local = idx % (hh * ww)
                pos = torch.stack([idx // (hh * ww), local // ww, local % ww,
                                   torch.full_like(idx, max(t - 1, hh - 1, ww - 1) + 1), torch.zeros_like(idx)],
                                  dim=1).to(emb.dtype)
                out.append(torch.cat([emb[idx], pos], dim=1))
            return tuple(out)

        def get_mrope_input_positions(self, input_tokens, mm_features):
            """Initial positions for the pruned layout (Qwen3-VL's own assumes ``h*w`` tokens per image):
            text before the first image exact, text after each image at its unpruned position, visual
            tokens provisional (row-major) until ``recompute_mrope_positions`` writes the kept ones."""
            merge = int(self.config.vision_config.spatial_merge_size)
            parts, st, cur = [], 0, 0
            for feat in sorted(mm_features, key=lambda f: f.mm_position.offset):
                if feat.modality != "image":
                    raise NotImplementedError("VisionZip in vLLM: images only")
                offset, length = int(feat.mm_position.offset), int(feat.mm_position.length)
                t, h, w = (int(x) for x in feat.data["image_grid_thw"].data.tolist())
                hh, ww = h // merge, w // merge
                text = offset - st
                parts.append(torch.arange(text).expand(3, text) + cur)
                base = cur + text
                idx = torch.arange(length)
                parts.append(torch.stack([idx // (hh * ww), (idx % (hh * ww)) // ww, idx % ww]) + base)
                cur = base + max(t - 1, hh - 1, ww - 1) + 1
                st = offset + length
            tail = len(input_tokens) - st
            parts.append(torch.arange(tail).expand(3, tail) + cur)
            positions = torch.cat(parts, dim=1).long()
            return positions, int(positions.max()) + 1 - len(input_tokens)

        def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions,
                                      num_computed_tokens):
            """Write the kept tokens' positions (base + their original (t, h, w)) into the request's mRoPE
            positions; text positions are already right (``get_mrope_input_positions``: they do not depend
            on which tokens are kept). The embeddings of this step arrive in placeholder order, the first
            one possibly the tail of an image that an earlier chunk began."""
            embeds = [mm[:, :-5] for mm in multimodal_embeddings]
            if not multimodal_embeddings:
                return embeds, mrope_positions, int(mrope_positions.max()) + 1 - mrope_positions.shape[-1]
            ids = torch.as_tensor(input_ids, device="cpu").to(torch.long).reshape(-1)
            is_img = ids.eq(int(self.config.image_token_id))
            edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), is_img.long(),
                                          torch.zeros(1, dtype=torch.long)]))
            starts, ends = (edges == 1).nonzero().reshape(-1).tolist(), (edges == -1).nonzero().reshape(-1).tolist()
            positions = mrope_positions.clone()
            run = next(i for i, e in enumerate(ends) if e > num_computed_tokens)
            for j, mm in enumerate(multimodal_embeddings):
                start, end = starts[run + j], ends[run + j]
                first = start + (max(0, num_computed_tokens - start) if j == 0 else 0)
                n = mm.shape[0]
                if first + n > end:
                    raise RuntimeError(f"VisionZip: {n} embeddings do not fit placeholder run [{start}, {end})")
                rel = mm[:, -5:-2].round().long().to(positions.device).permute(1, 0)  # [3, n] (t, h, w)
                base = positions[:, start - 1].max() + 1  # the <|vision_start|> token's position + 1
                positions[:3, first:first + n] = rel + base
            delta = int(positions.max()) + 1 - positions.shape[-1]
            return embeds, positions, delta

    HarnessVisionZipQwen3VLMoe.__name__ = HarnessVisionZipQwen3VLMoe.__qualname__ = VZ_ARCH
    _VZ_CLASSES.update(processor=HarnessVisionZipProcessor, model=HarnessVisionZipQwen3VLMoe)
    return _VZ_CLASSES


def __getattr__(name: str):  # PEP 562: "harness.engines.vllm.visionzip:<VZ_ARCH>" resolves lazily (imports vLLM)
    if name == VZ_ARCH:
        return _visionzip_classes()["model"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""vLLM: VisionZip with ONE budget per request (``visionzip.scope=request``), through the plugin.

Why this shape: vLLM fixes each multimodal item's placeholder length when the prompt is processed, before
the vision tower runs, so per-image counts that depend on all images of a request cannot be placeholders.
The *total* can (``harness.techniques.visionzip.bundle``): the span from the first image's
``<|vision_start|>`` to the last image's ``<|vision_end|>`` becomes one multimodal item — a **bundle** — of
length ``K + T`` (``K`` = the request's budget, ``T`` = the span's structural and text tokens), as vLLM's
own EVS video path lumps a video's pruned frames into one item (``tokens_per_frame = [total, 0, …]``,
``PromptUpdateDetails.from_seq``). Pieces, each a subclass of vLLM's Qwen3-VL-MoE classes (no vLLM file
copied):

* **Processor** (:meth:`BundleProcessor.apply`): vLLM's processing as usual (N image items), then the N
  items are folded into one: ``pixel_values`` concatenated, ``image_grid_thw`` [N, 3], ``span_ids`` (the
  unpruned span's token ids: where the text between images sits); the prompt's span becomes
  :meth:`SpanLayout.provisional_ids` (``K`` visual ids, then the span's other tokens); one placeholder
  over the whole span, every position an embedding (``is_embed=None``, the ``from_seq`` convention); one
  hash from the images' hashes, the span and the settings (the encoder cache and prefix caching key the
  *request's* bundle, whose rows depend on all its images).
* **Profiling** (:class:`BundleInfo`, :meth:`BundleProcessor.get_dummy_mm_inputs`): the largest bundle —
  ``limit`` images of the largest size (capped by ``max_model_len``), plus ``HARNESS_VZ_SPAN_TEXT`` tokens of
  text between images (:data:`~harness.engines.vllm.settings.ENV_VZ_SPAN_TEXT`) — is what ``get_mm_max_tokens_per_item`` reports and what the encoder profile runs,
  so the encoder cache and compute budget hold any bundle (a longer one is refused with a clear error).
* **Model** (:meth:`BundleModel.embed_multimodal`): the vision tower on all images of the batch's bundles
  at once; the scoring block's attention hands over q, k and its LSE (``harness.engines.vllm.lse_capture``);
  ``compute_importance`` → ``merge_unit_scores`` → ``select_tokens(scope="request")`` per bundle (the HF
  engine's functions), ``compress_image`` for contextual tokens (main and deepstack channels are one row in
  vLLM and the merge is linear per channel, so they merge alike); rows assembled in span order — kept
  visual rows, text rows from ``embed_input_ids`` with zero deepstack — and 8 exact integer channels
  appended: the row's relative mRoPE position (t, h, w) and its row index in the bundle.
* **Positions**: :meth:`BundleModel.get_mrope_input_positions` lays the prompt out as the HF engine does
  (text after the span at its *unpruned* position: ``base + SpanLayout.extent()``), the span provisional;
  :meth:`BundleModel.recompute_mrope_positions` — called by vLLM's runner with each step's slice of the
  bundle when multimodal pruning is on — writes ``base +`` each row's original position, also when chunked
  prefill cuts the bundle anywhere (the row index says where a slice starts).

The processor cache is bypassed for requests with images (it would hand already-sent image items over as
None, which cannot be folded); the engine also sets ``mm_processor_cache_gb=0`` (no memory spent on it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from harness.engines import compat
from harness.engines.vllm import lse_capture
from harness.engines.vllm.settings import ENV_VZ_SCOPE, ENV_VZ_SPAN_TEXT, VZ_REQUEST_ARCH, VisionZipSettings
from harness.techniques.visionzip.baselines import baseline_scores, pool_counts, pool_image
from harness.techniques.visionzip.bundle import decode_ints, encode_ints, SpanLayout
from harness.techniques.visionzip.pruning import compress_image, merge_unit_scores, merge_units, select_tokens

POS_CHANNELS = 8  # (t, h, w, row) × (hi, lo)

__all__ = ["VZ_REQUEST_ARCH", "request_scope_classes", "bundle_hash", "fitting_image_tokens"]


def bundle_hash(image_hashes, span_ids, settings: VisionZipSettings) -> str:
    """The bundle's identity: its images (in order), the span around them and the selection settings."""
    fields = [list(image_hashes), list(span_ids), settings.keep, settings.layer, settings.min_per_image,
              settings.contextual]
    if settings.method != "attention":  # issue 31's baselines: the attention runs' hashes stay as they were
        fields += [settings.method, settings.seed]
    blob = json.dumps(fields, separators=(",", ":"))
    return "vzreq-" + hashlib.sha256(blob.encode()).hexdigest()


def fitting_image_tokens(tokens: int, total, span_text: int, max_model_len: int) -> int:
    """The most visual tokens (≤ ``tokens``) one image may have so that its bundle — ``total([t])`` kept tokens,
    ``<|vision_start|>`` / ``<|vision_end|>`` and ``span_text`` tokens of text — fits ``max_model_len``.

    Why: vLLM profiles the encoder with the largest image its processor allows. Qwen3-VL's own pixel range allows
    16,384 tokens per image, more than a bundle of an 8,192-token model holds even at keep 0.5, so the profile's
    dummy bundle was refused and the server never started (session 14, H200: "needs 8194 tokens, more than the
    8192"). Capping the largest image here keeps the profile, the encoder cache and the dummy inputs consistent; a
    request whose single image would not fit ``max_model_len`` could not be served anyway."""
    lo, hi = 0, int(tokens)
    while lo < hi:  # total() is non-decreasing in t: the largest t that fits, by bisection
        mid = (lo + hi + 1) // 2
        if int(total([mid])) + 2 + int(span_text) <= int(max_model_len):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unbatch(x) -> list:
    """A batched field: one tensor per item (vLLM stacks equal shapes, lists the rest)."""
    import torch

    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return list(x.unbind(0))
    return [t for t in x]


_CLASSES: dict[str, Any] = {}


def request_scope_classes() -> dict[str, Any]:
    """Build (once) the processor, info, dummy builder and model of the ``scope=request`` architecture."""
    if _CLASSES:
        return _CLASSES

    compat.install()  # vLLM's qwen3_vl imports need the torchvision-free shims (no-op where torchvision loads)
    import torch
    from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder, Qwen3VLMultiModalProcessor
    from vllm.model_executor.models.qwen3_vl_moe import (
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLMoeProcessingInfo,
    )
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import (
        MultiModalFieldConfig,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    from harness.kernels.importance import compute_importance

    def settings() -> VisionZipSettings:
        st = VisionZipSettings.from_env()
        if st is None or st.scope != "request":
            raise RuntimeError(f"{VZ_REQUEST_ARCH} needs HARNESS_VZ_KEEP < 1 and {ENV_VZ_SCOPE}=request")
        return st

    class BundleInfo(Qwen3VLMoeProcessingInfo):
        def get_image_size_with_most_features(self, max_pixels: int | None = None):
            """vLLM's largest image, capped so that its bundle fits ``max_model_len`` (:func:`fitting_image_tokens`):
            what the encoder profile's dummy image, ``get_max_image_tokens`` and the cache sizing all read."""
            size = super().get_image_size_with_most_features(max_pixels)
            vision = self.get_hf_config().vision_config
            unit = int(vision.patch_size) * int(vision.spatial_merge_size)
            tokens = (int(size.width) // unit) * (int(size.height) // unit)
            st = settings()
            cap = fitting_image_tokens(tokens, st.total, st.span_text, int(self.ctx.model_config.max_model_len))
            if cap >= tokens or cap < 1:
                return size
            return super().get_image_size_with_most_features(cap * unit * unit)

        def bundle_images(self) -> int:
            """Images of the largest bundle: the prompt limit, capped so that they fit ``max_model_len``."""
            limit = int(self.allowed_mm_limits.get("image", 1) or 1)
            per = max(1, int(self.get_max_image_tokens()))
            return max(1, min(limit, int(self.ctx.model_config.max_model_len) // per))

        def max_bundle_tokens(self) -> int:
            st = settings()
            n = self.bundle_images()
            size = int(self.get_max_image_tokens())
            longest = st.total([size] * n) + 2 * n + st.span_text
            return min(int(self.ctx.model_config.max_model_len), longest)

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            out = dict(super().get_mm_max_tokens_per_item(seq_len, mm_counts))
            out["image"] = self.max_bundle_tokens()
            return out

    class BundleProcessor(Qwen3VLMultiModalProcessor):
        def get_dummy_mm_inputs(self, mm_counts, *, cache=None, scheduler_config=None):
            counts = dict(mm_counts)
            if counts.get("image", 0) >= 1:  # the encoder profile asks for one item: the largest bundle
                counts["image"] = max(int(counts["image"]), self.info.bundle_images())
            return super().get_dummy_mm_inputs(counts, cache=cache, scheduler_config=scheduler_config)

        def apply(self, inputs, timing_ctx):
            if getattr(inputs, "cache", None) is not None and inputs.mm_data_items.get_all_counts().get("image"):
                # the processor cache hands already-sent image items over as None: they could not be folded
                # (the bundle item itself is new and always sent with its data)
                inputs = dataclasses.replace(inputs, cache=None)
            out = super().apply(inputs, timing_ctx)
            items = list((out.get("mm_kwargs") or {}).get("image", []) or [])
            if not items:
                return out
            return self._bundle(out, items)

        def _bundle(self, out, items):
            st = settings()
            cfg = self.info.get_hf_config()
            merge = int(cfg.vision_config.spatial_merge_size)
            if any(item is None for item in items):
                raise RuntimeError("VisionZip scope=request: an image item arrived cached (None) and cannot be "
                                   "folded into its request's bundle; run with mm_processor_cache_gb=0")
            places = sorted(zip(out["mm_placeholders"]["image"], items, out["mm_hashes"]["image"]),
                            key=lambda p: p[0].offset)
            prompt = list(out["prompt_token_ids"])
            grids = [item["image_grid_thw"].data.reshape(-1, 3)[0] for _, item, _ in places]
            runs = [(int(p.offset), int(p.length)) for p, _, _ in places]
            offset, layout = SpanLayout.from_prompt(prompt, runs, [g.tolist() for g in grids], merge,
                                                    int(cfg.image_token_id), int(cfg.vision_start_token_id),
                                                    int(cfg.vision_end_token_id))
            total = st.total(layout.sizes)
            length = layout.length(total)
            if length > self.info.max_bundle_tokens():
                raise ValueError(f"VisionZip scope=request: this request's image span needs {length} tokens, more "
                                 f"than the {self.info.max_bundle_tokens()} the encoder cache was sized for "
                                 f"(raise {ENV_VZ_SPAN_TEXT}, now {st.span_text}, or max_model_len)")
            pixel = torch.cat([item["pixel_values"].data for _, item, _ in places], dim=0)
            batched = MultiModalFieldConfig.batched("image").field
            on_cpu = MultiModalFieldConfig.batched("image", keep_on_cpu=True).field
            bundle = MultiModalKwargsItem({
                "pixel_values": MultiModalFieldElem(data=pixel, field=batched),
                "image_grid_thw": MultiModalFieldElem(data=torch.stack(grids).long(), field=on_cpu),
                "span_ids": MultiModalFieldElem(data=torch.tensor(layout.ids, dtype=torch.long), field=on_cpu),
            })
            end = offset + len(layout.ids)
            out["prompt_token_ids"] = prompt[:offset] + layout.provisional_ids(total) + prompt[end:]
            out["mm_kwargs"] = MultiModalKwargsItems({**{k: v for k, v in out["mm_kwargs"].items() if k != "image"},
                                                      "image": [bundle]})
            out["mm_hashes"] = {**out["mm_hashes"],
                                "image": [bundle_hash([h for _, _, h in places], layout.ids, st)]}
            out["mm_placeholders"] = {**out["mm_placeholders"],
                                      "image": [PlaceholderRange(offset=offset, length=length)]}
            return out

    @MULTIMODAL_REGISTRY.register_processor(BundleProcessor, info=BundleInfo,
                                            dummy_inputs=Qwen3VLDummyInputsBuilder)
    class BundleModel(Qwen3VLMoeForConditionalGeneration):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._vz = settings()
            blocks = self.visual.blocks
            if not -len(blocks) <= self._vz.layer < len(blocks):
                raise ValueError(f"visionzip.layer={self._vz.layer} out of range for {len(blocks)} blocks")
            block = blocks[self._vz.layer].attn
            self._vz_op = block.attn
            self._vz_capture = lse_capture.install(block.attn, block.qkv, want_keys=self._vz.contextual > 0)
            self._vz_stats: list[dict[str, Any]] = []  # per bundle encoded (kept per image), for statistics

        # ------------------------------------------------------------------------------ encoder side

        def _vz_scores(self, grid):
            seen = self._vz_capture.take()
            if self._vz.method != "attention":  # a trivial baseline (issue 31): nothing scored by attention
                return [None] * int(grid.shape[0]), None, False
            q, k, cu = seen["q"], seen["k"], seen["cu"]
            scores = compute_importance(q.contiguous(), k.contiguous(), cu, scale=self._vz_op.scale,
                                        lse=seen.get("lse"))
            merge = int(self.visual.spatial_merge_size)
            unit = merge_unit_scores(scores.float(), grid, merge)
            keys = merge_units(seen["keys"], grid, merge) if self._vz.contextual > 0 else None
            return unit, keys, seen.get("lse") is not None

        def embed_multimodal(self, **kwargs):
            pixels = _unbatch(kwargs.get("pixel_values"))
            if not pixels:
                return None
            grids = [g.reshape(-1, 3).long().cpu() for g in _unbatch(kwargs.get("image_grid_thw"))]
            spans = [s.reshape(-1).long().cpu() for s in _unbatch(kwargs.get("span_ids"))]
            if not len(pixels) == len(grids) == len(spans):
                raise RuntimeError(f"VisionZip: {len(pixels)} bundles, {len(grids)} grids, {len(spans)} spans")
            all_grid = torch.cat(grids, dim=0)
            device = self.visual.device if hasattr(self.visual, "device") else pixels[0].device
            pv = torch.cat([p.reshape(-1, p.shape[-1]) for p in pixels], dim=0).to(device).type(self.visual.dtype)
            embeds = self.visual(pv, grid_thw=all_grid)  # on the host, as vLLM keeps image_grid_thw
            merge = int(self.visual.spatial_merge_size)
            sizes = (all_grid.prod(-1) // (merge * merge)).tolist()
            per_image = list(embeds.split(sizes))
            unit, keys, lse_used = self._vz_scores(all_grid)
            out, j = [], 0
            for grid, span in zip(grids, spans):
                n = grid.shape[0]
                out.append(self._vz_bundle(span, grid, per_image[j:j + n], unit[j:j + n],
                                           keys[j:j + n] if keys is not None else None, lse_used))
                j += n
            return tuple(out)

        def _vz_bundle(self, span, grid, images, scores, keys, lse_used):
            cfg = self.config
            merge = int(self.visual.spatial_merge_size)
            layout = SpanLayout(tuple(span.tolist()), tuple(tuple(int(x) for x in g) for g in grid.tolist()),
                                merge, int(cfg.image_token_id))
            method = self._vz.method
            if method == "pool":  # issue 31: each image average-pooled to its share of the request's budget
                counts = pool_counts(layout.sizes, self._vz.keep, "request", self._vz.min_per_image)
                pooled = [pool_image(emb, int(g[0]) * int(g[1]) // merge, int(g[2]) // merge, k)
                          for emb, g, k in zip(images, grid.tolist(), counts)]
                kept = [idx for idx, _ in pooled]
            else:
                if method != "attention":  # random | first: the same top-k on the baseline's scores (HF's)
                    scores = baseline_scores(method, layout.sizes, self._vz.seed)
                kept = select_tokens(scores, self._vz.keep, scope="request", min_per_image=self._vz.min_per_image)
            rows_per_image, idx_per_image = [], []
            for emb, sc, kp, i in zip(images, scores, kept, range(len(images))):
                kp = kp.to(emb.device)
                if method == "pool":
                    idx, rows = kp, pooled[i][1]
                elif self._vz.contextual > 0:
                    idx, rows = compress_image(emb, keys[i].to(emb.device), sc.to(emb.device), kp, self._vz.contextual)
                else:
                    idx, rows = kp, emb[kp]
                idx_per_image.append(idx.cpu())
                rows_per_image.append(rows)
            cols = layout.kept_columns(idx_per_image)
            pos = layout.positions()[:, cols]  # [3, L] relative to the span start
            ids = torch.tensor(layout.ids, dtype=torch.long)[cols]
            is_img = ids.eq(int(cfg.image_token_id))
            dev, dtype = images[0].device, images[0].dtype
            width = images[0].shape[-1]
            rows = torch.zeros(cols.numel(), width, dtype=dtype, device=dev)
            if bool((~is_img).any()):
                text = self.get_language_model().embed_input_ids(ids[~is_img].to(dev))
                rows[(~is_img).to(dev), : text.shape[-1]] = text.to(dtype)
            rows[is_img.to(dev)] = torch.cat(rows_per_image, dim=0).to(dtype)
            ints = torch.cat([pos.T, torch.arange(cols.numel()).unsqueeze(1)], dim=1)
            self._vz_stats.append({"tokens_per_image": layout.sizes,
                                   "kept_per_image": [int(i.numel()) for i in idx_per_image],
                                   "lse_reused": bool(lse_used)})
            del self._vz_stats[:-256]
            return torch.cat([rows, encode_ints(ints, dtype).to(dev)], dim=1)

        # ------------------------------------------------------------------------------ positions

        def get_mrope_input_positions(self, input_tokens, mm_features):
            """Text before the span exact, the span provisional (``recompute_mrope_positions`` writes it),
            text after the span at its unpruned position (``base + extent``), as the HF engine lays it out."""
            merge = int(self.config.vision_config.spatial_merge_size)
            parts, st, cur = [], 0, 0
            for feat in sorted(mm_features, key=lambda f: f.mm_position.offset):
                if feat.modality != "image":
                    raise NotImplementedError("VisionZip in vLLM: images only")
                offset, length = int(feat.mm_position.offset), int(feat.mm_position.length)
                grid = feat.data["image_grid_thw"].data.reshape(-1, 3)
                span = feat.data["span_ids"].data.reshape(-1)
                layout = SpanLayout(tuple(int(t) for t in span.tolist()),
                                    tuple(tuple(int(x) for x in g) for g in grid.tolist()), merge,
                                    int(self.config.image_token_id))
                text = offset - st
                parts.append(torch.arange(text).expand(3, text) + cur)
                base = cur + text
                parts.append(torch.arange(length).expand(3, length) + base)  # provisional
                cur = base + layout.extent()
                st = offset + length
            tail = len(input_tokens) - st
            parts.append(torch.arange(tail).expand(3, tail) + cur)
            positions = torch.cat(parts, dim=1).long()
            return positions, int(positions.max()) + 1 - len(input_tokens)

        def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
            """Write ``base +`` each bundle row's original position. A request holds one bundle, which
            starts at its first ``<|vision_start|>``; each slice carries its rows' indices in the bundle."""
            embeds = [mm[:, :-POS_CHANNELS] for mm in multimodal_embeddings]
            if not multimodal_embeddings:
                return embeds, mrope_positions, int(mrope_positions.max()) + 1 - mrope_positions.shape[-1]
            ids = torch.as_tensor(input_ids, device="cpu").to(torch.long).reshape(-1)
            starts = ids.eq(int(self.config.vision_start_token_id)).nonzero().reshape(-1)
            if starts.numel() == 0:
                raise RuntimeError("VisionZip: a bundle slice arrived for a prompt without <|vision_start|>")
            offset = int(starts[0])
            positions = mrope_positions.clone()
            base = int(positions[:, offset - 1].max()) + 1 if offset > 0 else 0
            expected = max(0, int(num_computed_tokens) - offset)
            for j, mm in enumerate(multimodal_embeddings):
                got = decode_ints(mm[:, -POS_CHANNELS:].cpu())  # [n, 4]: t, h, w, row
                rows = got[:, 3]
                if j == 0 and int(rows[0]) != expected:
                    raise RuntimeError(f"VisionZip: bundle slice starts at row {int(rows[0])}, expected {expected}")
                positions[:3, offset + rows] = (got[:, :3].T + base).to(positions.dtype)
            return embeds, positions, int(positions.max()) + 1 - positions.shape[-1]

    BundleModel.__name__ = BundleModel.__qualname__ = VZ_REQUEST_ARCH
    _CLASSES.update(processor=BundleProcessor, info=BundleInfo, model=BundleModel)
    return _CLASSES


def __getattr__(name: str):  # PEP 562: "<this module>:<VZ_REQUEST_ARCH>" resolves lazily (imports vLLM)
    if name == VZ_REQUEST_ARCH:
        return request_scope_classes()["model"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
